"""Logging set-up shared by the supervisor and its children (kube2iam's text/json formats).

Nothing on the request path logs: only the control process's events, audits and errors.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
           "warn": logging.WARNING, "warning": logging.WARNING, "error": logging.ERROR,
           "fatal": logging.CRITICAL, "panic": logging.CRITICAL}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, logrus-style keys (level, msg, time) plus extra fields."""

    _skip = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        doc = {"level": record.levelname.lower(), "msg": record.getMessage(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created)),
               "logger": record.name}
        for key, value in vars(record).items():
            if key not in self._skip and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...` with extra fields appended."""

    _skip = JsonFormatter._skip

    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items()
                         if k not in self._skip and not k.startswith("_"))
        line = (f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(record.created))} "
                f"{record.levelname.lower():5} {record.name}: {record.getMessage()}")
        if extra:
            line += " " + extra
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup(*, log_format: str = "text", level: str = "info", process: str = "") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format.lower() == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level.lower(), logging.INFO))
    for noisy in ("urllib3", "botocore", "kubernetes", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
