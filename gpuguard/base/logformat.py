"""Log lines as the Prometheus ecosystem writes them: logfmt (the default) or JSON, UTC.

node_exporter, dcgm-exporter, Prometheus and Alertmanager log `time=... level=... msg=...`
with UTC timestamps; log pipelines built for them parse gpuguard's lines the same way.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
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


#: The format configure() set: what announce() and failure() write in.
_format = "logfmt"


def configure(level: str = "info", fmt: str = "logfmt", *, stream: Any = None) -> None:
    """Route the root logger to stderr (or `stream`) in `fmt` at `level`, replacing any
    handler set before (a second call, as in tests, does not double every line).

    Under json every line a daemon writes is a JSON object, on both streams: Python's
    warnings and the tracebacks of uncaught exceptions (any thread) go through the log
    too, each one record, instead of their usual free text on stderr."""
    global _format
    _format = fmt
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_PYTHON_LEVEL[level])
    if fmt == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_thread_uncaught
        sys.unraisablehook = _log_unraisable


def current_format() -> str:
    """What configure() set (logfmt until it runs): for the daemon's helper processes."""
    return _format


_crash_log = logging.getLogger("gpuguard.uncaught")


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    _crash_log.critical("uncaught exception: %s", value, exc_info=(kind, value, tb))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return  # as threading's own hook: a thread's SystemExit is silent
    name = args.thread.name if args.thread is not None else "?"
    value = args.exc_value if args.exc_value is not None else args.exc_type()
    _crash_log.critical("uncaught exception in thread %s: %s", name, value,
                        exc_info=(args.exc_type, value, args.exc_traceback))


def _log_unraisable(unraisable: Any) -> None:
    _crash_log.error("%s: %r", unraisable.err_msg or "exception ignored",
                     unraisable.object, exc_info=(unraisable.exc_type, unraisable.exc_value,
                                                  unraisable.exc_traceback))


def _record(logger: str, level: int, message: str) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, level, "(gpuguard)", 0, message,
                                                (), None)


def announce(logger: str, message: str) -> str:
    """The line a daemon prints on stdout once it serves (`listening on HOST:PORT`, which
    supervisors and tests wait for): the bare text, or under json a record like every
    other line."""
    if _format != "json":
        return message
    return JsonFormatter().format(_record(logger, logging.INFO, message))


def failure(program: str, message: str) -> str:
    """A start-up failure's one line for stderr: `PROGRAM: MESSAGE`, or under json a
    record (level error) whose msg is that line."""
    line = f"{program}: {message}"
    if _format != "json":
        return line
    return JsonFormatter().format(_record(program, logging.ERROR, line))
