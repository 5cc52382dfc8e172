"""Logging set-up shared by the supervisor and its children (kube2iam's text/json formats).

Nothing on the request path logs: only the control process's events, audits and errors.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

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
    """Every process of the agent (supervisor, workers, control, the socket keeper's own
    small writer, the webhook) logs one record per line in ``log_format``; so do a crash (an
    uncaught exception: its traceback inside the record in json) and a Python warning."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format.lower() == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level.lower(), logging.INFO))
    for noisy in ("urllib3", "botocore", "kubernetes", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(True)         # a library's warning: a record, not a bare line
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("kiamfast").critical("uncaught %s: %s", kind.__name__, value,
                                           exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("kiamfast").critical(
        "uncaught %s in thread %s: %s", args.exc_type.__name__, name, args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
