"""Log lines as the Prometheus ecosystem writes them: logfmt (the default) or JSON, UTC.

node_exporter, dcgm-exporter, Prometheus and Alertmanager log `time=... level=... msg=...`
with UTC timestamps; log pipelines built for them parse gpuguard's lines the same way.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

FORMATS = ("logfmt", "json")
LEVELS = ("debug", "info", "warn", "error")
_PYTHON_LEVEL = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
                 "warning": logging.WARNING, "error": logging.ERROR}
_NAME = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warn",
         logging.ERROR: "error", logging.CRITICAL: "error"}


def level_name(text: str) -> str:
    """An argparse type: a level in node_exporter's words (warning and upper case accepted,
    as the old --log-level took them)."""
    value = text.strip().lower()
    if value not in _PYTHON_LEVEL:
        raise ValueError(f"not one of {', '.join(LEVELS)}")
    return "warn" if value == "warning" else value


def utc_time(created: float) -> str:
    """RFC 3339 in UTC with milliseconds, as Go's slog and go-kit print it."""
    whole = int(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + \
        f".{int((created - whole) * 1000):03d}Z"


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' ="\\\n\t') and value.isprintable():
        return value
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class _Formatter(logging.Formatter):
    def fields(self, record: logging.LogRecord) -> dict[str, str]:
        out = {"time": utc_time(record.created), "level": _NAME.get(record.levelno, "info"),
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["err"] = self.formatException(record.exc_info)
        return out


class LogfmtFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={_logfmt_value(v)}" for k, v in self.fields(record).items())


class JsonFormatter(_Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(self.fields(record), ensure_ascii=False)


def configure(level: str = "info", fmt: str = "logfmt", *, stream: Any = None) -> None:
    """Route the root logger to stderr (or `stream`) in `fmt` at `level`, replacing any
    handler set before (a second call, as in tests, does not double every line)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_PYTHON_LEVEL[level])
