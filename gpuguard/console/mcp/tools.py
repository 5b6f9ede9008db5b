"""What `gpuguard mcp`'s tools answer, without the MCP SDK: their arguments, checked
strictly, and the documents of `status --json`, `explain --json` and `fleet --json`.

The SDK's own argument validation is pydantic's lax mode (the string "5" passes as the
pid 5, and "yes" or 1 as `confirm: true`) and its messages run over several lines; for a
tool that can kill, each argument is checked here instead, exactly (a JSON integer is an
integer, a JSON boolean a boolean), and a bad one is refused in one line. app.py
registers the tools with the schemas written here and calls check_call() on every call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.config import Config
from gpuguard.console.alert_state import orphan_alerts
from gpuguard.console.config_file import load
from gpuguard.console.contract import EXIT_NO_PROCESS, EXIT_USAGE, START_TIME_WORDS, Failure
from gpuguard.console.evidence import exporter_clocks
from gpuguard.console.explain import explain_json, explain_pid
from gpuguard.console.fleet import collect
from gpuguard.console.fleet.sources import FleetOptions
from gpuguard.console.render import nvml_down_line
from gpuguard.console.status import new_scanner, status_json

#: The largest pid_t: the kernel's pid_max never exceeds it.
PID_MAX = 2**31 - 1
#: How much of a bad value a refusal (and the log) repeats: arguments are the client's.
SHOWN_CHARS = 60

STATUS = "gpu_status"
EXPLAIN = "gpu_explain"
REAP = "gpu_reap"
FLEET = "gpu_fleet"


class ToolRefusal(Exception):
    """A call that ends as an MCP tool error (isError): `message` is the one line the
    model reads, `code` a stable word for it, `document` the structured content (the
    refused reap's gpuguard.reap/v1 document, say) when there is one."""

    def __init__(self, code: str, message: str, document: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.document = document

    def structured(self) -> dict[str, Any]:
        """The error's structured content: the document, with an `error` key added."""
        return {**(self.document or {}), "error": {"code": self.code, "message": self.message}}


@dataclass(frozen=True)
class ServeSettings:
    """What `gpuguard mcp` was started with; every call reads the config file again, as
    each console command does, so that a changed policy applies to the next call."""

    config_path: str | None
    hostname: str
    allow_pid_namespace: bool
    #: The running exporter asked for its clocks at each gpu_status ("" asks none).
    exporter_url: str = ""
    #: Where gpu_fleet looks (`--prometheus`, `--alertmanager`...); None: not offered.
    fleet: FleetOptions | None = None

    def config(self) -> Config:
        try:
            return load(self.config_path)
        except Failure as failure:
            raise ToolRefusal("config-error", failure.message) from None


def shown(value: object) -> str:
    """A client's value as JSON, cut to SHOWN_CHARS."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def invalid(message: str) -> ToolRefusal:
    return ToolRefusal("invalid-argument", message)


def pid_value(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= PID_MAX:
        raise invalid(f"{name}: must be a process id, an integer from 1 to {PID_MAX}; got "
                      f"{shown(value)}")
    return value


def start_time_value(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(f"{name}: must be {START_TIME_WORDS} (an integer of 0 or more, as "
                      f"gpu_status and a dry run show it) or null; got {shown(value)}")
    return value


def confirm_value(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid(f"{name}: must be true or false (a JSON boolean); got {shown(value)}")
    return value


@dataclass(frozen=True)
class Argument:
    """One tool argument: its JSON schema (as tools/list shows it) and its check."""

    schema: dict[str, Any]
    check: Callable[[str, object], object]
    required: bool = True


PID_SCHEMA = {"type": "integer", "minimum": 1, "maximum": PID_MAX}

ARGUMENTS: dict[str, dict[str, Argument]] = {
    STATUS: {},
    FLEET: {},
    EXPLAIN: {
        "pid": Argument({**PID_SCHEMA, "description": "the process to explain (any pid, a GPU "
                                                      "holder or not)"}, pid_value),
    },
    REAP: {
        "root_pid": Argument(
            {**PID_SCHEMA, "description": "the root of the orphan tree, as gpu_status lists "
                                          "it (trees[].root_pid)"}, pid_value),
        "root_start_time": Argument(
            {"type": ["integer", "null"], "minimum": 0, "default": None,
             "description": f"the root's start time ({START_TIME_WORDS}; gpu_status's "
                            "trees[].root_start_time, or a dry run's key.root_start_time). "
                            "Required with confirm=true: a pid alone names whichever process "
                            "holds it now"},
            start_time_value, required=False),
        "confirm": Argument(
            {"type": "boolean", "default": False,
             "description": "false (the default): a dry run that signals nothing and writes "
                            "nothing. true: reap the tree, as `gpuguard reap --apply`"},
            confirm_value, required=False),
    },
}


def check_call(tool: object, arguments: object) -> dict[str, Any]:
    """The call's arguments, checked against ARGUMENTS (an unknown tool is left to the SDK,
    which answers it); ToolRefusal for a missing, unknown or ill-typed one."""
    spec = ARGUMENTS.get(tool) if isinstance(tool, str) else None
    if spec is None:
        return {}
    given = {} if arguments is None else arguments
    if not isinstance(given, Mapping):
        raise invalid(f"arguments: must be an object; got {shown(given)}")
    unknown = sorted(str(k) for k in given if k not in spec)
    if unknown:
        takes = ", ".join(spec) or "no arguments"
        raise invalid(f"unknown argument {', '.join(shown(k) for k in unknown)}: {tool} takes "
                      f"{takes}")
    out: dict[str, Any] = {}
    for name, arg in spec.items():
        if name not in given:
            if arg.required:
                raise invalid(f"{name}: required")
            continue
        out[name] = arg.check(name, given[name])
    return out


def plain(doc: dict[str, Any]) -> dict[str, Any]:
    """The document exactly as `--json` prints it (enums as their strings)."""
    loaded: dict[str, Any] = json.loads(json.dumps(doc))
    return loaded


def failure_refusal(failure: Failure) -> ToolRefusal:
    """A console Failure (one line and an exit code) as the tool error it becomes."""
    code = {EXIT_NO_PROCESS: "no-such-process", EXIT_USAGE: "usage"}.get(failure.code, "error")
    return ToolRefusal(code, failure.message)


def status_document(settings: ServeSettings) -> dict[str, Any]:
    """`gpuguard status --json`'s document; NVML down is an error carrying it."""
    config = settings.config()
    scanner = new_scanner(config)
    try:
        snap = scanner.scan_once()
        clocks = exporter_clocks(settings.exporter_url)
        alerts = orphan_alerts(config, settings.hostname, snap)
    finally:
        scanner.nvml.close()
    doc = plain(status_json(snap, settings.hostname, alerts, clocks=clocks))
    if not snap.reading.up:
        raise ToolRefusal("nvml-down", nvml_down_line(snap.reading), doc)
    return doc


def explain_document(settings: ServeSettings, pid: int) -> dict[str, Any]:
    """`gpuguard explain PID --json`'s document."""
    config = settings.config()
    try:
        return plain(explain_json(explain_pid(pid, config, settings.hostname)))
    except Failure as failure:
        raise failure_refusal(failure) from None


def fleet_document(settings: ServeSettings) -> dict[str, Any]:
    """`gpuguard fleet --json`'s document; Prometheus not answering is an error carrying it."""
    if settings.fleet is None or not settings.fleet.prometheus:
        raise ToolRefusal("fleet-not-configured", "gpu_fleet needs the Prometheus that scrapes "
                                                  "the exporters: start the server with "
                                                  "`gpuguard mcp --prometheus URL`")
    config = settings.config()
    try:
        got = collect(settings.fleet, config)
    except Failure as failure:
        raise failure_refusal(failure) from None
    doc = plain(got.document)
    if got.unanswered is not None:
        raise ToolRefusal("prometheus-down", got.unanswered, doc)
    return doc
