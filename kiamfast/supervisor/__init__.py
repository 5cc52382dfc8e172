"""The `kiamfast` main process (docs/architecture.md, "Node start and stop")."""
from kiamfast.supervisor.commands import worker_settings
from kiamfast.supervisor.statefiles import (TOKEN_KEY_BYTES, load_token_key, lock_table,
                                            open_table, table_layout)
from kiamfast.supervisor.supervisor import Supervisor, run

__all__ = ["TOKEN_KEY_BYTES", "Supervisor", "load_token_key", "lock_table", "open_table",
           "run", "table_layout", "worker_settings"]
