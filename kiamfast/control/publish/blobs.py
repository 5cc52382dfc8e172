"""The aux blobs workers serve from the table: /metrics (the control process's part), the
namespace denials' texts, /debug/store and /healthz.

What pods write (roles, annotations) sizes these texts: a text that does not fit its slot is
logged (at 1, 10, 100 and every 1,000th time), counted, and replaced by the smaller form;
it never ends the process.
"""
from __future__ import annotations

import logging
from typing import Any

import orjson

from kiamfast import table as tbl

log = logging.getLogger("kiamfast.control")


class AuxPublisher:
    def __init__(self, table: Any) -> None:
        self.table = table
        self.failures = 0

    def metrics(self, text: bytes, fallback: bytes) -> None:
        if not self._write(tbl.AUX_METRICS, text, "metrics"):
            self._write(tbl.AUX_METRICS, fallback, "metrics")

    def denials(self, denials: dict[str, tuple[str, str]]) -> None:
        if self.table.layout["aux_count"] > tbl.AUX_DENIALS:
            if not self._write(tbl.AUX_DENIALS, orjson.dumps(denials), "denials"):
                self._write(tbl.AUX_DENIALS, b"{}", "")

    def debug_store(self, store: dict[str, Any]) -> None:
        if not self._write(tbl.AUX_DEBUG_STORE, orjson.dumps(store,
                                                             option=orjson.OPT_SORT_KEYS),
                           "/debug/store"):
            self._write(tbl.AUX_DEBUG_STORE, b'{"error":"too large"}', "")

    def health(self, body: dict[str, Any] | None, error: str) -> None:
        """kube2iam's /healthz: the body when healthy, else the error (workers answer 500)."""
        if body is not None:
            self.table.write_aux(tbl.AUX_HEALTH, orjson.dumps(body) + b"\n")
            self.table.write_aux(tbl.AUX_HEALTH_ERROR, b"")
        else:
            self.table.write_aux(tbl.AUX_HEALTH, b"")
            self.table.write_aux(tbl.AUX_HEALTH_ERROR, error.encode()[:4096])

    def _write(self, index: int, data: bytes, what: str) -> bool:
        try:
            self.table.write_aux(index, data)
            return True
        except tbl.ValueTooLarge:
            self.failures += 1
            if what and (self.failures in (1, 10, 100) or self.failures % 1000 == 0):
                log.error("%s text of %d bytes does not fit its %d-byte slot; publishing a "
                          "shorter one (%d times so far)", what, len(data),
                          self.table.layout["aux_size"], self.failures)
            return False
