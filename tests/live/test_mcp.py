"""`gpuguard mcp` as a real subprocess, driven over stdio by the MCP SDK's own client (and
once by hand, byte for byte), against real process trees and the fake NVML."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.config.remediate import Remediate
from tests.support.ci import require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, descendants_of, stat_fields, wait_for
from tests.support.remediator_harness import (
    GIB,
    STUBBORN,
    Run,
    spawn_orphan,
    start_time_of,
    write_config,
)
from tests.support.servers import REPO, Exporter, child_env, find

try:
    import anyio
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp_types import CallToolResult

    NO_SDK: str | None = None
except ImportError as exc:  # the optional extra: gpuguard[mcp]
    NO_SDK = f"the MCP SDK is not installed ({exc}): pip install -e '.[mcp]'"

TOOLS = ("gpu_status", "gpu_explain", "gpu_reap", "gpu_fleet")
# The console tests' trees (tests/live/test_console.py).
ATTACHED = "{holder} --pidfile {dir}/worker & wait"
JUPYTER = "{holder} --pidfile {dir}/worker jupyter-kernel & wait"  # protect-pattern
CHAIN_KIDS = ("sh -c '{holder} --pidfile {dir}/worker --children 2 & echo $$ > {dir}/sh; wait'"
              " & wait")
NO_PID = 4000000  # above pid_max: never a process
#: The SDK's argument checks without gpuguard's: none of these may reach a tool.
BAD_PIDS = [0, -1, "5", 1.5, True, None, 2**31, [5]]

Scenario = Callable[["ClientSession"], Awaitable[None]]


@dataclass
class Server:
    """`python -m gpuguard mcp --config CONFIG` over the fake GPU world, one session per
    run(); its stderr (the call log) collects in `log`."""

    env: dict[str, str]
    log: Path
    extra: list[str] = field(default_factory=list)  # more of `gpuguard mcp`'s options

    def argv(self, config: Path) -> list[str]:
        # The fake NVML reports this namespace's pids (CI runs the suite in its own namespace).
        return ["-m", "gpuguard", "mcp", "--config", str(config), "--allow-pid-namespace",
                *self.extra]

    def run(self, config: Path, scenario: Scenario) -> None:
        params = StdioServerParameters(command=sys.executable, args=self.argv(config),
                                       env=self.env, cwd=str(REPO))

        async def main() -> None:
            with anyio.fail_after(120), self.log.open("a") as errlog:
                async with stdio_client(params, errlog=errlog) as (read, write), \
                        ClientSession(read, write) as session:
                    await session.initialize()
                    await scenario(session)

        anyio.run(main)

    def calls(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if "tool call: " in line]


@pytest.fixture
def server(tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> Server:
    require(NO_SDK is None, NO_SDK or "")
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))
    return Server(env, tmp_path / "mcp-server.log")


def held_tree(trees: Trees, fake_gpu: FakeGpuWorld, script: str, *,
              kill_launcher: bool) -> int:
    tree = trees.spawn(script)
    worker = tree.pid("worker")
    fake_gpu.add_process(0, worker, GIB)
    if kill_launcher:
        tree.kill_launcher()
    return worker


def config_file(tmp_path: Path, *, audit_dir: Path | None = None, **remediate: Any) -> Path:
    """The shared test policy in dry-run mode (a confirmed reap reaps regardless)."""
    extra = {"audit_log": str(audit_dir / "audit.jsonl")} if audit_dir is not None else {}
    return write_config(tmp_path, **{"mode": "dry-run", **extra, **remediate})


def audit_path(config: Path) -> Path:
    return Path(yaml.safe_load(config.read_text())["remediate"]["audit_log"])


def audit_records(config: Path) -> list[dict[str, Any]]:
    path = audit_path(config)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def call(session: ClientSession, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    return await session.call_tool(tool, arguments)


def ok(result: CallToolResult) -> dict[str, Any]:
    """A successful call's document: structured, and the same as its JSON text."""
    assert not result.is_error, result.content
    doc = result.structured_content
    assert isinstance(doc, dict)
    assert json.loads(result.content[-1].text) == doc  # type: ignore[union-attr]
    return doc


def error(result: CallToolResult) -> tuple[str, dict[str, Any]]:
    """A tool error's one line and structured content; never a traceback."""
    assert result.is_error, result.structured_content
    (block,) = result.content
    text = block.text  # type: ignore[union-attr]
    assert "\n" not in text and "Traceback" not in text and "Error executing" not in text
    structured = result.structured_content
    assert isinstance(structured, dict) and structured["error"]["message"] == text
    return text, structured


def untouched(pids: list[int]) -> bool:
    """Alive and never stopped (a dry run or a refusal sends no signal at all)."""
    return all(alive(p) and (stat_fields(p) or {}).get("state") in ("S", "R") for p in pids)


# -- what the server offers ---------------------------------------------------------------


def test_lists_the_four_tools_with_their_annotations_and_schemas(tmp_path: Path,
                                                                  server: Server) -> None:
    listed: dict[str, Any] = {}

    async def scenario(session: ClientSession) -> None:
        result = await session.list_tools()
        listed.update({t.name: t for t in result.tools})

    server.run(config_file(tmp_path), scenario)
    assert sorted(listed) == sorted(TOOLS)
    hints = {name: listed[name].annotations.model_dump(by_alias=True) for name in TOOLS}
    for name in ("gpu_status", "gpu_explain", "gpu_fleet"):
        assert hints[name]["readOnlyHint"] is True and hints[name]["destructiveHint"] is False
    assert hints["gpu_fleet"]["openWorldHint"] is True  # it asks Prometheus, Alertmanager
    assert (hints["gpu_reap"]["readOnlyHint"], hints["gpu_reap"]["destructiveHint"],
            hints["gpu_reap"]["idempotentHint"], hints["gpu_reap"]["openWorldHint"]) == (
        False, True, False, False)

    status, explain, reap, fleet = (listed[n].input_schema for n in TOOLS)
    assert fleet["properties"] == {} and not fleet.get("required")
    assert status["properties"] == {} and not status.get("required")
    assert explain["required"] == ["pid"]
    assert explain["properties"]["pid"]["type"] == "integer"
    assert explain["properties"]["pid"]["minimum"] == 1
    assert reap["required"] == ["root_pid"]
    assert set(reap["properties"]) == {"root_pid", "root_start_time", "confirm"}
    assert reap["properties"]["confirm"]["type"] == "boolean"
    assert reap["properties"]["confirm"]["default"] is False
    assert reap["properties"]["root_start_time"]["type"] == ["integer", "null"]
    for name, schema_keys in (("gpu_status", {"schema", "trees", "gpus", "nvml"}),
                              ("gpu_explain", {"schema", "verdict", "rule", "chain"}),
                              ("gpu_reap", {"schema", "outcome", "members", "audit_log"}),
                              ("gpu_fleet", {"schema", "trees", "hosts", "sources"})):
        output = listed[name].output_schema
        assert output["type"] == "object" and schema_keys <= set(output["properties"])
    assert "dry run" in listed["gpu_reap"].description


# -- the read-only tools ------------------------------------------------------------------


def test_gpu_fleet_says_what_it_needs_and_when_prometheus_is_down(tmp_path: Path,
                                                                  server: Server) -> None:
    """Without --prometheus, one line saying how to start it; with a Prometheus that does
    not answer, the error carries the gpuguard.fleet/v1 document that says so. The view
    itself, against a real Prometheus and Alertmanager: tests/e2e/test_fleet.py."""
    config = config_file(tmp_path)
    got: dict[str, Any] = {}

    async def scenario(session: ClientSession) -> None:
        got["result"] = await call(session, "gpu_fleet", {})

    server.run(config, scenario)
    text, structured = error(got["result"])
    assert structured["error"]["code"] == "fleet-not-configured"
    assert "--prometheus URL" in text

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    server.extra = ["--prometheus", dead]
    server.run(config, scenario)
    text, structured = error(got["result"])
    assert structured["error"]["code"] == "prometheus-down" and dead in text
    assert structured["schema"] == "gpuguard.fleet/v1" and structured["trees"] == []
    assert "gpu_fleet {} -> error: Prometheus did not answer" in server.calls()[-1]


def test_gpu_status_reads_the_running_exporters_clocks(trees: Trees, fake_gpu: FakeGpuWorld,
                                                     fake_nvml_lib: Path, tmp_path: Path,
                                                     server: Server) -> None:
    """An agent asking right after a job stopped is told the exporter's idle seconds and
    orphan age (and that they are the exporter's), not one scan's 0."""
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=3 * GIB)
    exporter = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()))
    got: dict[str, Any] = {}

    async def scenario(session: ClientSession) -> None:
        got.update(ok(await call(session, "gpu_status", {})))

    try:
        wait_for(lambda: any(v >= 2 for _, v in find(
            exporter.scrape(), "gpuguard_gpu_process_idle_seconds", pid=str(orphan.holder))),
            timeout=20, what="the exporter's idle clock at 2 s")
        server.env["GPUGUARD_EXPORTER_URL"] = exporter.url
        server.run(config_file(tmp_path), scenario)
    finally:
        exporter.stop()
    assert got["clocks"]["source"] == "exporter"
    (tree,) = (t for t in got["trees"] if t["root_pid"] == orphan.root)
    assert tree["orphan_age_seconds"] >= 2
    (holder,) = tree["holders"]
    assert holder["idle_seconds"] >= 2 and holder["idle_source"] == "exporter"


def test_gpu_status_is_the_status_json_document(tmp_path: Path, trees: Trees,
                                                fake_gpu: FakeGpuWorld, gpuguard: Run,
                                                server: Server) -> None:
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=3 * GIB)
    normal = held_tree(trees, fake_gpu, ATTACHED, kill_launcher=False)
    config = config_file(tmp_path)
    got: dict[str, Any] = {}

    async def scenario(session: ClientSession) -> None:
        got.update(ok(await call(session, "gpu_status", {})))

    server.run(config, scenario)
    cli = json.loads(gpuguard("status", "--json", "--config", str(config)).stdout)
    assert got["schema"] == cli["schema"] == "gpuguard.status/v1"
    assert set(got) == set(cli) and got["hostname"] == cli["hostname"]
    assert got["nvml"] == cli["nvml"] and got["gpus"] == cli["gpus"]

    def trees_of(doc: dict[str, Any]) -> dict[int, tuple[Any, ...]]:
        return {t["root_pid"]: (sorted(t), t["root_start_time"], t["verdict"], t["reason"],
                                t["rule"], [m["pid"] for m in t["members"]],
                                [h["pid"] for h in t["holders"]], t["gpu_bytes"])
                for t in doc["trees"]}

    assert trees_of(got) == trees_of(cli)
    by_root = {t["root_pid"]: t for t in got["trees"]}
    named = by_root[orphan.root]
    assert (named["verdict"], named["reason"], named["root_start_time"]) == (
        "orphan", "launcher-unrecorded", orphan.root_start)
    assert [h["pid"] for h in named["holders"]] == [orphan.holder]
    assert any(normal in [m["pid"] for m in t["members"]] and t["verdict"] == "normal"
               for t in got["trees"])
    (line,) = server.calls()
    assert "gpu_status {} -> ok" in line


def test_gpu_explain_the_holder_and_refuse_what_is_not_a_pid(tmp_path: Path, trees: Trees,
                                                             fake_gpu: FakeGpuWorld,
                                                             gpuguard: Run,
                                                             server: Server) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    config = config_file(tmp_path)
    got: dict[str, Any] = {}
    refusals: list[tuple[Any, str, dict[str, Any]]] = []

    async def scenario(session: ClientSession) -> None:
        got.update(ok(await call(session, "gpu_explain", {"pid": orphan.holder})))
        missing = await call(session, "gpu_explain", {"pid": NO_PID})
        refusals.append((NO_PID, *error(missing)))
        for bad in BAD_PIDS:
            refusals.append((bad, *error(await call(session, "gpu_explain", {"pid": bad}))))
        refusals.append(("absent", *error(await call(session, "gpu_explain", {}))))
        refusals.append(("extra", *error(await call(session, "gpu_explain",
                                                    {"pid": orphan.holder, "force": True}))))

    server.run(config, scenario)
    cli = json.loads(gpuguard("explain", str(orphan.holder), "--json", "--config",
                              str(config)).stdout)
    stable = ("schema", "pid", "start_time", "gpu_holder", "verdict", "reason", "rule",
              "rule_name", "evidence", "root_pid", "root_start_time", "sessions")
    assert {k: got[k] for k in stable} == {k: cli[k] for k in stable}
    assert set(got) == set(cli)
    assert [(c["role"], c["pid"]) for c in got["chain"]] == [(c["role"], c["pid"])
                                                             for c in cli["chain"]]
    assert (got["verdict"], got["root_pid"]) == ("orphan", orphan.root)

    (_, text, structured), *bad = refusals
    assert text == f"no such process: {NO_PID}"
    assert structured["error"]["code"] == "no-such-process"
    for value, text, structured in bad:
        assert structured["error"]["code"] == "invalid-argument", (value, text)
    by_value = {repr(v): t for v, t, _ in bad}
    assert by_value["0"].startswith("pid: must be a process id") and by_value["0"].endswith(
        "got 0")
    assert by_value["'5'"].endswith('got "5"')  # a string is not a pid, even "5"
    assert by_value["True"].endswith("got true")
    assert by_value["'absent'"] == "pid: required"
    assert by_value["'extra'"] == 'unknown argument "force": gpu_explain takes pid'
    assert len(server.calls()) == 2 + len(BAD_PIDS) + 2  # every call, one line each
    assert all("Traceback" not in line for line in server.log.read_text().splitlines())


# -- gpu_reap -----------------------------------------------------------------------------


@pytest.mark.parametrize("audit_dir", ["existing", "missing"])
def test_a_dry_run_changes_nothing(tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
                                   server: Server, audit_dir: str) -> None:
    tree = trees.spawn(CHAIN_KIDS)
    worker, sh = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, 3 * GIB)
    tree.kill_launcher()
    members = [sh, *descendants_of(sh)]
    assert len(members) == 4  # sh, the holder and its two children
    # An existing directory is where `gpuguard reap` (no --apply) would write its record.
    directory = tmp_path / "audit"
    if audit_dir == "existing":
        directory.mkdir(mode=0o700)
    config = config_file(tmp_path, audit_dir=directory)
    got: list[CallToolResult] = []

    async def scenario(session: ClientSession) -> None:
        got.append(await call(session, "gpu_reap", {"root_pid": sh}))
        got.append(await call(session, "gpu_reap", {"root_pid": sh, "confirm": False,
                                                    "root_start_time": start_time_of(sh)}))

    server.run(config, scenario)
    for result in got:
        doc = ok(result)
        assert (doc["schema"], doc["outcome"], doc["apply"]) == ("gpuguard.reap/v1",
                                                                 "dry-run", False)
        assert doc["signals"] == [] and doc["audit_log"] is None
        assert sorted(m["pid"] for m in doc["members"]) == sorted(members)
        assert doc["key"]["root_start_time"] == start_time_of(sh)
        summary = result.content[0].text  # type: ignore[union-attr]
        assert summary.startswith("dry run, nothing signalled: 4 processes of tree")
        assert f"root_start_time={start_time_of(sh)} and confirm=true" in summary
    assert untouched(members)
    assert not audit_path(config).exists()
    assert directory.is_dir() == (audit_dir == "existing")  # no directory created
    assert all("-> ok (dry-run)" in line for line in server.calls())


def test_confirm_refuses_a_protected_tree(tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
                                          server: Server) -> None:
    root = held_tree(trees, fake_gpu, JUPYTER, kill_launcher=True)  # root = the holder
    config = config_file(tmp_path)
    got: list[tuple[str, dict[str, Any]]] = []

    async def scenario(session: ClientSession) -> None:
        got.append(error(await call(session, "gpu_reap", {
            "root_pid": root, "root_start_time": start_time_of(root), "confirm": True})))

    server.run(config, scenario)
    ((text, doc),) = got
    assert text.startswith("refused: not-orphan:protected: classifier says protected "
                           "(protect-pattern)")
    assert "--force" not in text  # an MCP client has none to pass
    assert (doc["outcome"], doc["reason"], doc["error"]["code"]) == (
        "refused", "not-orphan:protected", "refused")
    assert untouched([root])
    # Audited as `reap --apply` audits a refusal.
    (record,) = audit_records(config)
    assert record["decision"]["reason"] == "not-orphan:protected" and record["signals"] == []
    assert record["manual"]["command"] == "gpuguard mcp gpu_reap"


def test_confirm_meets_the_brakes_a_person_meets(tmp_path: Path, trees: Trees,
                                                fake_gpu: FakeGpuWorld, server: Server) -> None:
    """Issue 47: an agent reaped under `rate_limit.max_reaps: 0` and a tree orphaned 0.8 s
    earlier under min_age_seconds. Both brakes now hold for gpu_reap, which cannot lift
    them; nothing is signalled and each refusal is audited."""
    off = held_tree(trees, fake_gpu, ATTACHED, kill_launcher=True)
    young = held_tree(trees, fake_gpu, ATTACHED, kill_launcher=True)
    got: list[tuple[str, dict[str, Any]]] = []

    def scenario_for(root: int) -> Scenario:
        async def scenario(session: ClientSession) -> None:
            got.append(error(await call(session, "gpu_reap", {
                "root_pid": root, "root_start_time": start_time_of(root), "confirm": True})))
        return scenario

    (tmp_path / "off").mkdir()
    (tmp_path / "young").mkdir()
    server.run(config_file(tmp_path / "off", rate_limit={"max_reaps": 0, "per_seconds": 3600}),
               scenario_for(off))
    server.run(config_file(tmp_path / "young", min_age_seconds=300), scenario_for(young))
    (off_text, off_doc), (young_text, young_doc) = got
    assert off_doc["reason"] == "rate-limited" and "reaping is off" in off_text
    assert young_doc["reason"] == "too-young" and "no record" in young_text
    assert off_doc["error"]["code"] == young_doc["error"]["code"] == "refused"
    assert untouched([off, young])


#: The launcher leaves by itself (`exit 0`) with its job still running below it.
LEAVES = 'sh -c "{holder} --pidfile {dir}/worker" & echo $! > {dir}/root; exit 0'


def test_confirm_refuses_a_launcher_no_one_heard_die_under_the_default_reasons(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, server: Server) -> None:
    """gpuguard mcp hears no exits: the launcher that exited by itself reads
    launcher-unrecorded (as `gpuguard reap` does), which remediate.reasons' default does
    not name; an agent has no --force, so nothing is signalled."""
    tree = trees.spawn(LEAVES)
    worker, root = tree.pid("worker"), tree.pid("root")
    fake_gpu.add_process(0, worker, GIB)
    tree.launcher.wait(timeout=10)
    config = config_file(tmp_path, reasons=[str(r) for r in Remediate().reasons])
    got: list[tuple[str, dict[str, Any]]] = []

    async def scenario(session: ClientSession) -> None:
        got.append(error(await call(session, "gpu_reap", {
            "root_pid": root, "root_start_time": start_time_of(root), "confirm": True})))

    server.run(config, scenario)
    ((text, doc),) = got
    assert text.startswith("refused: reason-not-allowed: orphan reason launcher-unrecorded")
    assert "--force" not in text
    assert untouched([root, worker])
    (record,) = audit_records(config)
    assert record["decision"]["reason"] == "reason-not-allowed" and record["signals"] == []


def test_identity_checks_refuse(tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
                                server: Server) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    config = config_file(tmp_path)
    got: list[tuple[str, dict[str, Any]]] = []
    holder_start = start_time_of(orphan.holder)

    async def scenario(session: ClientSession) -> None:
        for arguments in (
            {"root_pid": orphan.root, "root_start_time": 1, "confirm": True},  # pid reuse
            {"root_pid": orphan.root, "confirm": True},  # a pid alone
            {"root_pid": orphan.holder, "root_start_time": holder_start, "confirm": True},
            {"root_pid": NO_PID, "root_start_time": 1, "confirm": True},
            {"root_pid": orphan.root, "root_start_time": orphan.root_start, "confirm": "true"},
        ):
            got.append(error(await call(session, "gpu_reap", arguments)))

    server.run(config, scenario)
    replaced, alone, member, missing, stringly = got
    assert replaced[0] == (f"refused: root-replaced: pid {orphan.root} now has start_time "
                           f"{orphan.root_start}, root_start_time names 1")
    assert alone[0].startswith("confirm=true needs root_start_time")
    assert member[0] == (f"refused: tree-not-found: pid {orphan.holder} roots no GPU-holding "
                         "tree now")  # a member is not a root
    assert missing[0] == f"no such process: {NO_PID}"
    assert stringly[0] == 'confirm: must be true or false (a JSON boolean); got "true"'
    assert orphan.all_alive() and untouched(orphan.members)
    reasons = [r["decision"]["reason"] for r in audit_records(config) if r["phase"] == "final"]
    assert reasons == ["root-replaced", "tree-not-found"]  # what got as far as --apply does


def test_a_confirmed_reap_kills_the_whole_tree_and_audits_it(tmp_path: Path, trees: Trees,
                                                             fake_gpu: FakeGpuWorld,
                                                             server: Server) -> None:
    tree = trees.spawn(CHAIN_KIDS)
    worker, sh = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, 3 * GIB)
    tree.kill_launcher()
    members = [sh, *descendants_of(sh)]
    assert len(members) == 4
    config = config_file(tmp_path)
    got: list[CallToolResult] = []

    async def scenario(session: ClientSession) -> None:
        dry = ok(await call(session, "gpu_reap", {"root_pid": sh}))
        got.append(await call(session, "gpu_reap", {
            "root_pid": sh, "root_start_time": dry["key"]["root_start_time"],
            "confirm": True}))
        status = ok(await call(session, "gpu_status", {}))
        assert sh not in [t["root_pid"] for t in status["trees"]]

    server.run(config, scenario)
    (result,) = got
    doc = ok(result)
    assert (doc["outcome"], doc["apply"]) == ("reaped", True)
    assert doc["kill_path"] in ("pidfd", "pid")
    assert {s["signal"] for s in doc["signals"]} >= {"SIGSTOP", "SIGTERM"}
    assert doc["audit_log"] == str(audit_path(config))
    assert result.content[0].text.startswith(f"reaped: tree {sh}")  # type: ignore[union-attr]
    wait_for(lambda: not any(alive(p) for p in members), what="the whole tree to be gone")

    def finished() -> list[dict[str, Any]]:
        return [r for r in audit_records(config) if r["phase"] == "final"]

    wait_for(finished, what="the final audit record")
    intent, final = audit_records(config)
    assert (intent["phase"], final["phase"]) == ("intent", "final")
    assert sorted(m["pid"] for m in intent["tree"]["members"]) == sorted(members)
    assert (final["outcome"], final["mode"], final["key"]["root_pid"]) == ("reaped",
                                                                           "enforce", sh)
    manual = final["manual"]
    assert manual["command"] == "gpuguard mcp gpu_reap" and manual["apply"] is True
    assert manual["by"] and manual["client"].startswith("mcp ")  # the SDK client's name
    assert [line.split(" -> ")[1].split(" (")[0] for line in server.calls()] == [
        "ok", "ok", "ok"]


# -- the wire -----------------------------------------------------------------------------


class Wire:
    """A client by hand: JSON-RPC lines out, and every byte that comes back read as lines
    of JSON-RPC (anything else fails the test), with a deadline."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc, self.stdin, self.fd = proc, proc.stdin, proc.stdout.fileno()
        self.buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        self.stdin.write(json.dumps(message).encode() + b"\n")
        self.stdin.flush()

    def answers(self, *, ids: list[int], timeout: float = 60) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while sorted(a.get("id", -1) for a in got) != ids:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {got}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(self.fd, 65536)
            assert chunk, f"the server closed stdout; got {got}"
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            got += [json.loads(line) for line in lines]  # protocol bytes only
        return got


def test_stdout_carries_only_the_protocol(tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
                                          server: Server) -> None:
    orphan = spawn_orphan(trees, fake_gpu)
    requests = [
        {"method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "by-hand", "version": "1"}}},
        {"method": "notifications/initialized"},
        {"method": "tools/list"},
        {"method": "tools/call", "params": {"name": "gpu_status", "arguments": {}}},
        {"method": "tools/call", "params": {"name": "gpu_explain",
                                            "arguments": {"pid": orphan.holder}}},
        {"method": "tools/call", "params": {"name": "gpu_explain", "arguments": {"pid": -1}}},
        {"method": "tools/call", "params": {"name": "gpu_reap",
                                            "arguments": {"root_pid": orphan.root}}},
    ]
    errlog = tmp_path / "stderr.log"
    with errlog.open("w") as err:  # a file: a pipe nobody reads could fill up
        proc = subprocess.Popen([sys.executable, *server.argv(config_file(tmp_path))],
                                cwd=REPO, env=server.env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err)
    try:
        wire = Wire(proc)
        for n, request in enumerate(requests):
            wire.send({"jsonrpc": "2.0", **request}
                      | ({} if request["method"].startswith("notifications/") else {"id": n}))
        answers = wire.answers(ids=[0, 2, 3, 4, 5, 6])
        assert proc.stdin is not None
        proc.stdin.close()  # all answered: now the client goes
        assert proc.wait(timeout=30) == 0  # a clean exit
        assert proc.stdout is not None and proc.stdout.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(a["jsonrpc"] == "2.0" and "result" in a for a in answers), answers
    results = {a["id"]: a["result"] for a in answers}
    assert [r.get("isError") for r in (results[3], results[4], results[5], results[6])] == [
        False, False, True, False]
    assert results[6]["structuredContent"]["outcome"] == "dry-run"
    calls = [line.replace('\\"', '"') for line in errlog.read_text().splitlines()
             if "tool call: " in line]  # logfmt escapes the quotes of msg="..."
    # One line per call (in the order they finished: pipelined calls run as they come).
    assert sorted(c.split("tool call: ")[1].split(" ")[0] for c in calls) == [
        "gpu_explain", "gpu_explain", "gpu_reap", "gpu_status"]
    assert any('gpu_explain {"pid": -1} -> error: pid: must be a process id' in c for c in calls)
    assert any(f'gpu_reap {{"root_pid": {orphan.root}}} -> ok (dry-run)' in c for c in calls)
    assert orphan.all_alive()


def initialize(wire: Wire) -> None:
    wire.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "by-hand", "version": "1"}}})
    wire.answers(ids=[0])
    wire.send({"jsonrpc": "2.0", "method": "notifications/initialized"})


def test_sigterm_during_a_confirmed_reap_continues_the_tree_and_audits_it(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, server: Server) -> None:
    orphan = spawn_orphan(trees, fake_gpu, STUBBORN)  # its holder ignores SIGTERM
    config = config_file(tmp_path, term_timeout_seconds=30)
    proc = subprocess.Popen([sys.executable, *server.argv(config)], cwd=REPO, env=server.env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        wire = Wire(proc)
        initialize(wire)
        wire.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "gpu_reap", "arguments": {"root_pid": orphan.root, "confirm": True,
                                              "root_start_time": orphan.root_start}}})
        # The root died of its SIGTERM: the reap now waits for the holder, up to 30 s.
        wait_for(lambda: not alive(orphan.root), what="the root to die of SIGTERM")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # it ends as `reap --apply` does
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert untouched([orphan.holder])  # continued, not left stopped
    intent, final = audit_records(config)
    assert (intent["phase"], final["phase"]) == ("intent", "final")
    assert (final["outcome_reason"], final["manual"]["command"]) == ("interrupted",
                                                                     "gpuguard mcp gpu_reap")
    assert {(s["pid"], s["signal"]) for s in final["signals"]} >= {(orphan.holder, "SIGCONT")}


# -- without the extra --------------------------------------------------------------------

#: `gpuguard ARGS` in a Python that cannot import the SDK (None in sys.modules).
WITHOUT_SDK = ("import sys; sys.modules['mcp'] = None; from gpuguard.console.cli import main; "
               "sys.exit(main(sys.argv[1:]))")


def without_sdk(env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    def gpuguard(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", WITHOUT_SDK, *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60, stdin=subprocess.PIPE)

    return gpuguard


def test_without_the_sdk_one_line_and_exit_2_and_the_console_still_works(
        tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    gpuguard = without_sdk(fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1")))
    proc = gpuguard("mcp", "--config", str(config_file(tmp_path)))
    assert (proc.returncode, proc.stdout) == (2, "")
    (line,) = proc.stderr.splitlines()
    assert line.startswith("gpuguard: mcp needs the MCP Python SDK 2.x (")
    assert line.endswith(": pip install 'mcp>=2.3,<3' 'anyio>=4' (gpuguard's mcp extra)")
    proc = gpuguard("status", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["schema"] == "gpuguard.status/v1"


def test_help_and_config_errors_need_no_sdk_and_the_console_imports_none(
        tmp_path: Path) -> None:
    gpuguard = without_sdk(child_env())
    bad = tmp_path / "bad.yml"
    bad.write_text("remediate:\n  mode: yolo\n")
    proc = gpuguard("mcp", "--config", str(bad))
    assert proc.returncode == 2 and proc.stderr == (
        f"gpuguard: config error: {bad}: remediate.mode: must be one of dry-run, enforce, got "
        "'yolo'\n")
    proc = gpuguard("mcp", "--help")
    assert proc.returncode == 0 and "stdin and stdout only (no HTTP transport)" in proc.stdout
    loaded = subprocess.run([sys.executable, "-c", "import sys, gpuguard.console; "
                             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mcp'))"],
                            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]"  # the console imports no part of the SDK
