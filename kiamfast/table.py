"""The shared IP → pod → credentials table (public API).

The implementation is Cython (ext/_table.pyx); this module is the only name the rest of
kiamfast and its tests import.  One process writes (the control process), any number read
(the server workers).  See docs/architecture.md for the layout and the statuses.
"""

from kiamfast._table import (
    BUSY,
    C_API_LOOKUP,
    COUNTERS_PER_WORKER,
    CRED_EMPTY,
    CRED_ERROR,
    CRED_PENDING,
    CRED_READY,
    DENIED,
    ERROR,
    EXPIRED,
    LAYOUT_VERSION,
    MAX_PARTS,
    MISMATCH,
    MISS,
    NO_ROLE,
    PART_DOCUMENT,
    PART_EXT_DOCUMENT,
    PART_INFO,
    PART_KEY,
    PART_LISTING,
    PART_NAMES,
    PENDING,
    POD_DENIED,
    POD_NO_ROLE,
    POD_ROLE,
    POD_UNDECIDED,
    READY,
    STATUS_NAMES,
    TOO_SMALL,
    UID_MAX,
    UNDECIDED,
    UNSURE,
    UNVERIFIED,
    Table,
    TableError,
    TableFull,
    TableLayoutError,
    ValueTooLarge,
    ip_key,
    key_ip,
)

# Aux blob indices the control process publishes for the workers.
AUX_METRICS = 0       # Prometheus text of the control process
AUX_DEBUG_STORE = 1   # /debug/store JSON
AUX_HEALTH = 2        # /healthz JSON ({"hostIP":..,"instanceId":..}); empty = unhealthy
AUX_HEALTH_ERROR = 3  # last health-check error text
AUX_DENIALS = 4       # JSON {pod uid: [role ARN, namespace]} of pods denied by their namespace
AUX_COUNT = 5

DEFAULT_PATH = "/dev/shm/kiamfast-table"


def files_beside(path: str) -> tuple[str, str]:
    """The files an agent keeps beside its table at ``path``: the writers' lock (the
    supervisor's, supervisor/statefiles.py) and the sandboxes the runtime last listed (the
    control process's, control/cri/kept_sandboxes.py).  Whoever removes a table removes them too."""
    return f"{path}.lock", f"{path}.sandboxes"

# Size of each aux blob: the largest is the control process's metrics text, whose size is
# bounded by kiamfast.control.iam.metrics.METRICS_TEXT_MAX (tests/control/test_outside_input.py
# checks that it fits).
AUX_SIZE = 1 << 20

__all__ = [
    "BUSY",
    "C_API_LOOKUP",
    "COUNTERS_PER_WORKER",
    "CRED_EMPTY",
    "CRED_ERROR",
    "CRED_PENDING",
    "CRED_READY",
    "DENIED",
    "ERROR",
    "EXPIRED",
    "LAYOUT_VERSION",
    "MAX_PARTS",
    "MISMATCH",
    "MISS",
    "NO_ROLE",
    "PART_DOCUMENT",
    "PART_EXT_DOCUMENT",
    "PART_INFO",
    "PART_KEY",
    "PART_LISTING",
    "PART_NAMES",
    "PENDING",
    "POD_DENIED",
    "POD_NO_ROLE",
    "POD_ROLE",
    "POD_UNDECIDED",
    "READY",
    "STATUS_NAMES",
    "TOO_SMALL",
    "UID_MAX",
    "UNDECIDED",
    "UNSURE",
    "UNVERIFIED",
    "Table",
    "TableError",
    "TableFull",
    "TableLayoutError",
    "ValueTooLarge",
    "ip_key",
    "key_ip",
    "AUX_METRICS",
    "AUX_DEBUG_STORE",
    "AUX_HEALTH",
    "AUX_HEALTH_ERROR",
    "AUX_DENIALS",
    "AUX_COUNT",
    "DEFAULT_PATH",
    "files_beside",
    "AUX_SIZE",
]
