"""The MCP server itself, on the official SDK (PyPI `mcp`, its MCPServer), over stdio only.

Only `gpuguard mcp` imports this module (server.py, once it has found the SDK): the
rest of the console never needs the extra. Four tools, each the document of a console
command: gpu_status (`status --json`), gpu_explain (`explain PID --json`), gpu_fleet
(`fleet --json`) and gpu_reap (`reap`, a dry run unless confirm). One call runs at a
time; gpu_reap runs in the main thread, where `reap --apply`'s signal handling works
(reap.py). Every call is logged on stderr in one line (stdout is the protocol: the SDK
points fd 1 at stderr while it serves, so a stray write cannot corrupt it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import anyio.to_thread
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, ContentBlock, TextContent, ToolAnnotations
from pydantic import BaseModel, WithJsonSchema
from typing_extensions import TypedDict

from gpuguard.base import build
from gpuguard.console.mcp.reap import reap_document, reap_summary
from gpuguard.console.mcp.tools import (
    ARGUMENTS,
    EXPLAIN,
    FLEET,
    REAP,
    SHOWN_CHARS,
    STATUS,
    ServeSettings,
    ToolRefusal,
    check_call,
    explain_document,
    fleet_document,
    shown,
    status_document,
)

log = logging.getLogger("gpuguard.mcp")

#: How much of a call's arguments and of its answer one log line repeats.
LOGGED_CHARS = 400

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True,
                            open_world_hint=False)
#: gpu_fleet reads, and reads the world beyond this host (Prometheus, Alertmanager).
FLEET_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False,
                                  idempotent_hint=True, open_world_hint=True)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True,
                              idempotent_hint=False, open_world_hint=False)

INSTRUCTIONS = (
    "gpuguard finds GPU-holding process trees whose launcher is gone (orphans). gpu_status "
    "lists the trees with verdicts; gpu_explain says why one process gets its verdict, rule "
    "by rule; gpu_fleet lists the orphan trees on every host from Prometheus and "
    "Alertmanager, with each tree's alert (firing, pending, silenced by whom, inhibited); "
    "gpu_reap, on this host only, is a dry run unless confirm=true, and a confirmed reap "
    "goes through the same rules, policy, identity checks and audit log as "
    "`gpuguard reap --apply`: protected, unknown and normal trees are refused. Pass the "
    "root_start_time a dry run shows."
)

# The arguments as tools/list shows them: ARGUMENTS' schemas (tools.py checks them).
PidArg = Annotated[int, WithJsonSchema(ARGUMENTS[EXPLAIN]["pid"].schema)]
RootPidArg = Annotated[int, WithJsonSchema(ARGUMENTS[REAP]["root_pid"].schema)]
StartTimeArg = Annotated[int | None, WithJsonSchema(ARGUMENTS[REAP]["root_start_time"].schema)]
ConfirmArg = Annotated[bool, WithJsonSchema(ARGUMENTS[REAP]["confirm"].schema)]


class StatusDocument(TypedDict):
    """gpuguard.status/v1, as `gpuguard status --json` prints it (keys are only added)."""

    schema: str
    hostname: str
    taken_at: float
    nvml: dict[str, Any]
    errors: list[dict[str, Any]]
    gpus: list[dict[str, Any]]
    trees: list[dict[str, Any]]
    accounting: dict[str, Any]
    clocks: dict[str, Any]


class ExplainDocument(TypedDict):
    """gpuguard.explain/v1, as `gpuguard explain PID --json` prints it."""

    schema: str
    pid: int
    start_time: int
    gpu_holder: bool
    verdict: str
    reason: str
    rule: str
    evidence: dict[str, Any]
    root_pid: int | None
    root_start_time: int | None
    chain: list[dict[str, Any]]


class FleetDocument(TypedDict):
    """gpuguard.fleet/v1, as `gpuguard fleet --json` prints it (keys are only added)."""

    schema: str
    taken_at: float
    sources: dict[str, Any]
    errors: list[str]
    hosts: list[dict[str, Any]]
    trees: list[dict[str, Any]]
    stray_alerts: list[dict[str, Any]]


class ReapDocument(TypedDict):
    """gpuguard.reap/v1, as `gpuguard reap --json` prints it."""

    schema: str
    key: dict[str, Any]
    apply: bool
    decision: dict[str, Any]
    outcome: str
    reason: str
    detail: str
    members: list[dict[str, Any]]
    signals: list[dict[str, Any]]
    audit_log: str | None


def answer(work: Callable[[], dict[str, Any]],
           summary: Callable[[dict[str, Any]], str] | None = None) -> CallToolResult:
    """The document as structured content (and as JSON text, for clients that read only
    text), or a ToolRefusal as a tool error whose text is its one line."""
    try:
        doc = work()
    except ToolRefusal as refusal:
        return refused(refusal)
    content: list[ContentBlock] = [TextContent(type="text", text=json.dumps(doc))]
    if summary is not None:
        content.insert(0, TextContent(type="text", text=summary(doc)))
    return CallToolResult(content=content, structured_content=doc)


def refused(refusal: ToolRefusal) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=refusal.message)],
                          structured_content=refusal.structured(), is_error=True)


def client_name(ctx: Context[Any, Any]) -> str | None:
    """The client's name and version from its initialize request, when it sent one."""
    params = ctx.session.client_params
    info = params.client_info if params is not None else None
    return f"{info.name} {info.version}" if info is not None else None


def register_tools(server: MCPServer[Any], settings: ServeSettings) -> None:
    one_at_a_time = anyio.Lock()

    @server.tool(name=STATUS, title="GPU status", annotations=READ_ONLY)
    async def gpu_status() -> Annotated[CallToolResult, StatusDocument]:
        """One scan, as the exporter sees it: the GPUs and every process tree holding GPU
        memory, each with its verdict (normal, orphan, protected, unknown), reason, rule,
        members and holders. How long a tree has been orphaned and a holder idle come from
        the running exporter's latest scan where one answers (clocks.source "exporter");
        otherwise this one scan counts idle from now (clocks.source "own-scan", idle 0).
        The same document as `gpuguard status --json` (schema gpuguard.status/v1); an
        error when NVML is unavailable."""
        async with one_at_a_time:
            return await anyio.to_thread.run_sync(answer, lambda: status_document(settings))

    @server.tool(name=EXPLAIN, title="Explain a process's verdict", annotations=READ_ONLY)
    async def gpu_explain(pid: PidArg) -> Annotated[CallToolResult, ExplainDocument]:
        """Why a process is what it is, rule by rule: its chain of ancestors to the tree's
        root, the rule that decided, its evidence, and each session leader's state. The same
        document as `gpuguard explain PID --json` (schema gpuguard.explain/v1); an error for a
        pid that does not exist."""
        async with one_at_a_time:
            return await anyio.to_thread.run_sync(
                answer, lambda: explain_document(settings, pid))

    @server.tool(name=FLEET, title="Orphan trees across the fleet", annotations=FLEET_READ_ONLY)
    async def gpu_fleet() -> Annotated[CallToolResult, FleetDocument]:
        """Where are orphans now, on every host: each orphan tree the exporters report to
        Prometheus (host, root pid and start time, user, reason, age, GPU memory, idle
        seconds), whether its alert is firing, pending, silenced (by whom, until when) or
        inhibited in Alertmanager, and per host whether its exporter and remediator are up
        and the remediator's mode. Read-only. The same document as `gpuguard fleet --json`
        (schema gpuguard.fleet/v1); an error when the server was started without
        --prometheus, or when Prometheus does not answer. To act on a tree, explain or reap
        it on its own host."""
        async with one_at_a_time:
            return await anyio.to_thread.run_sync(answer, lambda: fleet_document(settings))

    @server.tool(name=REAP, title="Reap an orphan tree", annotations=DESTRUCTIVE)
    async def gpu_reap(root_pid: RootPidArg, ctx: Context[Any, Any],
                       root_start_time: StartTimeArg = None,
                       confirm: ConfirmArg = False) -> Annotated[CallToolResult, ReapDocument]:
        """Reap one orphan tree by its root. Without confirm: a dry run that says which
        processes would be signalled and why, and changes nothing. With confirm=true and the
        root's root_start_time: exactly `gpuguard reap --apply` (identity by pid and start
        time, a fresh classification that must say orphan, the policy's guards, freeze,
        SIGTERM, SIGKILL, and the audit log). Refused (an error with the reason): trees the
        rules protect or cannot judge, normal trees, a root that is not a tree's root, a
        start time that names another process, and what the policy or this server's rights
        do not allow. The document is gpuguard.reap/v1, as `gpuguard reap --json` prints."""
        client = client_name(ctx)
        async with one_at_a_time:
            # In this (the main) thread: the reap's stop signals must reach it (mcp/reap.py).
            return answer(lambda: reap_document(settings, root_pid, root_start_time, confirm,
                                                client),
                          reap_summary)


def result_line(result: HandlerResult) -> str:
    """What a tools/call answered, for the log: ok (and a reap's outcome) or the error."""
    if isinstance(result, BaseModel):
        result = result.model_dump(by_alias=True, mode="json")
    if not isinstance(result, dict):
        return "no result"
    structured = result.get("structuredContent")
    if result.get("isError"):
        texts = [c.get("text", "") for c in result.get("content") or () if isinstance(c, dict)]
        return "error: " + (texts[0] if texts else "(no text)")[:LOGGED_CHARS]
    outcome = structured.get("outcome") if isinstance(structured, dict) else None
    return f"ok ({outcome})" if isinstance(outcome, str) else "ok"


class CallLog:
    """Middleware: one log line per tools/call (tool, arguments, outcome, duration), and
    the strict argument check, so that a bad call is refused in one line before the SDK's
    lax validation sees it."""

    async def __call__(self, ctx: ServerRequestContext[Any, Any],
                       call_next: CallNext) -> HandlerResult:
        if ctx.method != "tools/call":
            return await call_next(ctx)
        params = ctx.params or {}
        tool, arguments = params.get("name"), params.get("arguments")
        started = time.monotonic()
        try:
            check_call(tool, arguments)
        except ToolRefusal as refusal:
            result: HandlerResult = refused(refusal)
        else:
            try:
                result = await call_next(ctx)
            except BaseException as exc:
                self.write(tool, arguments, f"protocol error: {type(exc).__name__}", started)
                raise
        self.write(tool, arguments, result_line(result), started)
        return result

    @staticmethod
    def write(tool: object, arguments: object, outcome: str, started: float) -> None:
        name = tool if isinstance(tool, str) and len(tool) <= SHOWN_CHARS else shown(tool)
        given = json.dumps(arguments, default=str)
        if len(given) > LOGGED_CHARS:
            given = given[:LOGGED_CHARS] + "..."
        log.info("tool call: %s %s -> %s (%.0f ms)", name, given, outcome,
                 (time.monotonic() - started) * 1000)


def build_server(settings: ServeSettings) -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer(
        "gpuguard", title="gpuguard", version=build.version(), instructions=INSTRUCTIONS,
        middleware=[CallLog()], log_level="WARNING")
    register_tools(server, settings)
    return server


def serve(settings: ServeSettings) -> None:
    """Serve MCP on stdin and stdout until the client closes stdin."""
    build_server(settings).run(transport="stdio")
