"""The `gpuguard` console as a real subprocess over real trees and the fake NVML."""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuguard.engine.scan.attribution import attribute
from gpuguard.host.procfs import cgroup_paths
from tests.support.fakenvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeGpuWorld
from tests.support.proctree import Trees, alive, descendants_of, stat_fields, wait_for
from tests.support.remediator_harness import (
    GIB,
    HOST,
    Run,
    alert,
    payload,
    spawn_orphan,
    start_time_of,
    write_config,
)
from tests.support.servers import Exporter, child_env, find
from tests.support.slowpeer import Reply

ATTACHED = "{holder} --pidfile {dir}/worker & wait"
NOHUP = "nohup {holder} --pidfile {dir}/worker >/dev/null 2>&1 & wait"
JUPYTER = "{holder} --pidfile {dir}/worker jupyter-kernel & wait"
# A parent that never waits: its exited child stays a zombie, pid in DIR/worker.
ZOMBIE = (f"{shlex.quote(sys.executable)} -c \"import os, sys, time; p = os.fork(); "
          f"p or os._exit(0); open(sys.argv[1], 'w').write(str(p)); time.sleep(3600)\" "
          "{dir}/worker & wait")

def orphan_tree(trees: Trees, fake_gpu: FakeGpuWorld) -> tuple[int, int]:
    """(sh, worker) of an orphan holding 3 GiB: the launching bash is dead (the console,
    which hears no exits itself, reads launcher-unrecorded)."""
    orphan = spawn_orphan(trees, fake_gpu, gpu_bytes=3 * GIB)
    return orphan.root, orphan.holder


def held_tree(trees: Trees, fake_gpu: FakeGpuWorld, script: str, *, kill_launcher: bool,
              used: int = GIB) -> int:
    tree = trees.spawn(script)
    worker = tree.pid("worker")
    fake_gpu.add_process(0, worker, used)
    if kill_launcher:
        tree.kill_launcher()
    return worker


# -- status ---------------------------------------------------------------------------------


def test_status_json_schema_with_orphan_and_normal_tree(trees: Trees, fake_gpu: FakeGpuWorld,
                                                        gpuguard: Run) -> None:
    sh, worker = orphan_tree(trees, fake_gpu)
    normal = held_tree(trees, fake_gpu, ATTACHED, kill_launcher=False)
    proc = gpuguard("status", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "gpuguard.status/v1"
    assert isinstance(doc["hostname"], str) and isinstance(doc["taken_at"], float)
    assert doc["nvml"] == {"up": True, "driver_version": "550.54.15", "errors": [],
                           "backends": [{"name": "nvml", "up": True, "detail": None}]}
    gpu, = doc["gpus"]
    assert (gpu["vendor"], gpu["driver_version"]) == ("nvidia", "550.54.15")
    assert set(gpu) == {"index", "uuid", "name", "memory_total_bytes", "memory_used_bytes",
                        "utilization_ratio", "temperature_celsius", "power_watts", "vendor",
                        "driver_version"}
    assert gpu["index"] == 0 and gpu["memory_total_bytes"] == 80 * GIB
    by_root = {t["root_pid"]: t for t in doc["trees"]}
    tree_keys = {"root_pid", "root_start_time", "root_comm", "root_user", "root_age_seconds",
                 "orphan_since", "verdict", "reason", "rule", "evidence", "gpu_bytes",
                 "processes", "holders", "members"}
    for tree in doc["trees"]:
        assert tree_keys <= set(tree)
        assert set(tree["evidence"]) == {"rule", "detail", "pids"}
        assert all(isinstance(p, int) for p in tree["evidence"]["pids"])
        for holder in tree["holders"]:
            assert set(holder) == {"pid", "gpu", "uuid", "used_bytes", "kind", "container_id",
                                   "pod_uid", "suspect", "sm_busy", "idle_seconds",
                                   "idle_source"}
            # Where the test runner runs (a container under some CI), and no miner.
            where = attribute(cgroup_paths(Path(f"/proc/{holder['pid']}/cgroup").read_text()))
            assert (holder["container_id"], holder["pod_uid"], holder["suspect"]) == (
                where.container_id or None, where.pod_uid or None, None)
        for member in tree["members"]:
            assert set(member) == {"pid", "ppid", "sid", "pgid", "start_time", "state", "uid",
                                   "user", "comm"}
            assert all(isinstance(member[k], int)
                       for k in ("pid", "ppid", "sid", "pgid", "start_time", "uid"))
        assert tree["members"][0]["pid"] == tree["root_pid"]  # root first
    orphan = by_root[sh]
    assert (orphan["verdict"], orphan["reason"], orphan["rule"]) == (
        "orphan", "launcher-unrecorded", "6")
    assert orphan["root_comm"] == "sh" and orphan["orphan_since"] is None
    assert orphan["root_start_time"] == stat_fields(sh)["start_time"]
    assert isinstance(orphan["root_age_seconds"], float) and orphan["processes"] == 2
    assert orphan["gpu_bytes"] == 3 * GIB
    assert [h["pid"] for h in orphan["holders"]] == [worker]
    assert [m["pid"] for m in orphan["members"]] == [sh, worker]
    normal_tree, = (t for t in doc["trees"] if t["verdict"] != "orphan")
    assert (normal_tree["verdict"], normal_tree["rule"]) == ("normal", "7")
    assert normal_tree["processes"] is None
    assert normal in [m["pid"] for m in normal_tree["members"]]


def test_status_and_explain_show_each_holders_sm_use(trees: Trees, fake_gpu: FakeGpuWorld,
                                                     gpuguard: Run) -> None:
    """One scan: a busy holder reads sm_busy true, an idle one false, both idle_seconds 0
    (counted from this command's own read); a GPU NVML cannot sample for processes reads
    null, never idle."""
    sh, worker = orphan_tree(trees, fake_gpu)
    normal = held_tree(trees, fake_gpu, ATTACHED, kill_launcher=False)
    fake_gpu.set_busy(0, normal)
    doc = json.loads(gpuguard("status", "--json").stdout)
    use = {h["pid"]: (h["sm_busy"], h["idle_seconds"]) for t in doc["trees"]
           for h in t["holders"]}
    assert use == {worker: (False, 0.0), normal: (True, 0.0)}
    explained = json.loads(gpuguard("explain", str(normal), "--json").stdout)
    assert [(h["sm_busy"], h["idle_seconds"]) for h in explained["holdings"]] == [(True, 0.0)]
    text = gpuguard("explain", str(worker)).stdout
    assert "no SM use in NVML's samples" in text
    row, = (line for line in gpuguard("status").stdout.splitlines()
            if line.lstrip().startswith(f"{normal} "))
    assert row.rstrip().endswith("busy")
    fake_gpu.set_not_supported(0, "processes_utilization")
    fake_gpu.set_not_supported(0, "process_utilization")
    doc = json.loads(gpuguard("status", "--json").stdout)
    assert {(h["sm_busy"], h["idle_seconds"]) for t in doc["trees"] for h in t["holders"]} == {
        (None, None)}
    explained = json.loads(gpuguard("explain", str(worker), "--json").stdout)
    assert [(h["sm_busy"], h["idle_seconds"]) for h in explained["holdings"]] == [(None, None)]


def test_status_table_names_the_orphan_without_colour_when_piped(
        trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    sh, worker = orphan_tree(trees, fake_gpu)
    proc = gpuguard("status")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout
    row, = (line for line in proc.stdout.splitlines() if line.lstrip().startswith(f"{sh} "))
    assert "orphan" in row and "launcher-unrecorded (6)" in row
    assert any(str(worker) in line and "3.0 GiB" in line for line in proc.stdout.splitlines())
    assert "NVIDIA Fake H100" in proc.stdout


def test_status_without_a_driver_says_so_and_exits_3(fake_gpu: FakeGpuWorld,
                                                      gpuguard: Run) -> None:
    fake_gpu.set_init_error(NVML_ERROR_DRIVER_NOT_LOADED)
    proc = gpuguard("status")
    assert proc.returncode == 3
    assert proc.stderr == ""
    line, = proc.stdout.splitlines()
    assert line.startswith("gpuguard: NVML unavailable (nvml_init:")
    doc = json.loads(gpuguard("status", "--json").stdout)
    assert doc["nvml"]["up"] is False and doc["gpus"] == [] and doc["trees"] == []
    assert doc["nvml"]["errors"][0]["stage"] == "nvml_init"


# -- explain --------------------------------------------------------------------------------


def explain(gpuguard: Run, pid: int, *extra: str) -> dict:
    proc = gpuguard("explain", str(pid), "--json", *extra)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "gpuguard.explain/v1" and doc["pid"] == pid
    return doc


def test_explain_orphan_names_rule_6_and_the_chain(trees: Trees, fake_gpu: FakeGpuWorld,
                                                    gpuguard: Run) -> None:
    sh, worker = orphan_tree(trees, fake_gpu)
    doc = explain(gpuguard, worker)
    assert (doc["verdict"], doc["reason"], doc["rule"]) == ("orphan", "launcher-unrecorded", "6")
    assert doc["gpu_holder"] is True and doc["note"] is None
    assert doc["root_pid"] == sh and sh in doc["evidence"]["pids"]
    assert [(c["role"], c["pid"]) for c in doc["chain"][:2]] == [("holder", worker),
                                                                 ("root", sh)]
    assert all(c["role"] == "above-root" for c in doc["chain"][2:])
    leader = {s["sid"]: s["leader"] for s in doc["sessions"]}
    assert leader[doc["chain"][0]["sid"]] == "gone"
    text = gpuguard("explain", str(worker)).stdout
    assert "decided by rule 6" in text and f"root: {sh} (sh" in text


@pytest.mark.parametrize(
    ("script", "kill_launcher", "verdict", "reason", "rule"),
    [
        (NOHUP, True, "protected", "ignores-sighup", "4"),
        (JUPYTER, True, "protected", "protect-pattern", "3"),
        (ATTACHED, False, "normal", "attached|detached", "7"),
        (ZOMBIE, False, "unknown", "exiting", "1"),
    ],
    ids=["nohup", "protect-pattern", "normal", "zombie"],
)
def test_explain_names_the_deciding_rule(trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run,
                                         script: str, kill_launcher: bool, verdict: str,
                                         reason: str, rule: str) -> None:
    worker = held_tree(trees, fake_gpu, script, kill_launcher=kill_launcher)
    if verdict == "unknown":
        wait_for(lambda: (stat_fields(worker) or {}).get("state") == "Z", what="a zombie")
    doc = explain(gpuguard, worker)
    assert (doc["verdict"], doc["rule"]) == (verdict, rule)
    assert doc["reason"] in reason.split("|")  # attached or detached: depends on the host
    assert doc["evidence"]["detail"]


def test_explain_a_non_holder_says_so(trees: Trees, fake_gpu: FakeGpuWorld,
                                      gpuguard: Run) -> None:
    tree = trees.spawn(ATTACHED)
    worker = tree.pid("worker")  # no GPU memory in the fake world
    doc = explain(gpuguard, worker)
    assert doc["gpu_holder"] is False and doc["holdings"] == []
    assert "as if it were a holder" in doc["note"]
    assert doc["rule"] == "7"


def test_explain_no_such_process_exits_4(gpuguard: Run) -> None:
    proc = gpuguard("explain", "4000000")  # above pid_max: never a process
    assert proc.returncode == 4
    assert proc.stderr.strip() == "gpuguard: no such process: 4000000"


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, gpuguard: Run) -> None:
    bad = tmp_path / "gpuguard.yml"
    bad.write_text("remediate:\n  mode: yolo\n")
    for args in (("status",), ("explain", "1")):
        proc = gpuguard(*args, "--config", str(bad))
        assert proc.returncode == 2
        assert proc.stderr.strip() == (f"gpuguard: config error: {bad}: remediate.mode: must be "
                                       "one of dry-run, enforce, got 'yolo'")


# -- policy check ---------------------------------------------------------------------------


def dry_run_config(tmp_path: Path, **remediate: Any) -> Path:
    """The shared test policy in dry-run mode (a manual --apply reaps regardless)."""
    return write_config(tmp_path, **{"mode": "dry-run", **remediate})


def body(*alerts: dict[str, Any]) -> str:
    return json.dumps(payload(*alerts))


def policy_check(gpuguard: Run, config: Path, body: str) -> dict:
    proc = gpuguard("policy", "check", "--config", str(config), "--json", "--hostname", HOST,
                    "-", stdin=body)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "gpuguard.policy-check/v1"
    return doc


def test_policy_check_accepts_an_orphan_and_never_signals(tmp_path: Path, trees: Trees,
                                                          fake_gpu: FakeGpuWorld,
                                                          gpuguard: Run) -> None:
    sh, worker = orphan_tree(trees, fake_gpu)
    delivery = body(alert(sh, start_time_of(sh)))
    doc = policy_check(gpuguard, dry_run_config(tmp_path), delivery)
    checked, = doc["alerts"]
    assert checked["intake"]["action"] == "accept"
    assert checked["decision"] == {"action": "dry-run", "reason": "launcher-unrecorded",
                                   "detail": checked["decision"]["detail"]}
    assert checked["live"]["verdict"] == "orphan"
    assert [m["pid"] for m in checked["live"]["members"]] == [sh, worker]
    assert checked["then"] is None
    enforce = policy_check(gpuguard, dry_run_config(tmp_path, mode="enforce"), delivery)
    assert enforce["alerts"][0]["decision"]["action"] == "reap"
    # The shipped default min age: defer now, and the re-check would reap.
    young = policy_check(gpuguard, dry_run_config(tmp_path, min_age_seconds=300), delivery)
    assert young["alerts"][0]["decision"]["action"] == "defer"
    assert young["alerts"][0]["then"]["action"] == "dry-run"
    text = gpuguard("policy", "check", "--config", str(dry_run_config(tmp_path)), "--hostname",
                    HOST, "-", stdin=delivery).stdout
    assert "decision dry-run (launcher-unrecorded)" in text
    for pid in (sh, worker):
        assert stat_fields(pid)["state"] in ("S", "R")  # alive and never stopped


def test_policy_check_with_require_idle_decides_as_a_fresh_remediator(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """A freshly started remediator's watch has seen nothing for long: not-idle; where
    NVML cannot sample processes: idle-unknown. Never a reap either way."""
    sh, worker = orphan_tree(trees, fake_gpu)
    delivery = body(alert(sh, start_time_of(sh)))
    config = dry_run_config(tmp_path, mode="enforce", require_idle_seconds=600)
    checked, = policy_check(gpuguard, config, delivery)["alerts"]
    assert (checked["decision"]["action"], checked["decision"]["reason"]) == ("ignore",
                                                                              "not-idle")
    assert "watched for only 0s" in checked["decision"]["detail"]
    fake_gpu.set_not_supported(0, "processes_utilization")
    fake_gpu.set_not_supported(0, "process_utilization")
    checked, = policy_check(gpuguard, config, delivery)["alerts"]
    assert checked["decision"]["reason"] == "idle-unknown"
    assert alive(sh) and alive(worker)


def test_policy_check_says_the_policy_and_watches_for_an_idle_reason(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """remediate.idle_reasons alone (no require_idle_seconds) starts the watch a fresh
    remediator would keep: not-idle, naming the reason's key, never a reap; and the
    policy in force and its risky combinations are said, as config check says them."""
    sh, worker = orphan_tree(trees, fake_gpu)
    delivery = body(alert(sh, start_time_of(sh), reason="launcher-unrecorded"))
    config = dry_run_config(tmp_path, mode="enforce", reasons=["launcher-killed"],
                            idle_reasons={"launcher-unrecorded": "10m"})
    doc = policy_check(gpuguard, config, delivery)
    checked, = doc["alerts"]
    assert (checked["decision"]["action"], checked["decision"]["reason"]) == ("ignore",
                                                                              "not-idle")
    assert "remediate.idle_reasons.launcher-unrecorded is 600s" in \
        checked["decision"]["detail"], checked["decision"]
    assert "when idle: launcher-unrecorded 10m" in doc["policy"], doc["policy"]
    assert doc["remediate"]["idle_reasons"] == {"launcher-unrecorded": 600.0}
    assert any("min_age_seconds is 0" in w for w in doc["warnings"]), doc["warnings"]
    text = gpuguard("policy", "check", "--config", str(config), "--hostname", HOST, "-",
                    stdin=delivery).stdout
    # (rich wraps long lines at the terminal's width: the lines' beginnings)
    assert "policy: enforce; alerts GPUOrphanTree;" in text, text
    assert "warning: remediate.min_age_seconds" in text, text
    assert alive(sh) and alive(worker)


def test_policy_check_ignores_what_the_remediator_ignores(tmp_path: Path, trees: Trees,
                                                          fake_gpu: FakeGpuWorld,
                                                          gpuguard: Run) -> None:
    sh, _ = orphan_tree(trees, fake_gpu)
    protected = held_tree(trees, fake_gpu, NOHUP, kill_launcher=True)
    sh_start = start_time_of(sh)
    delivery = body(
        alert(sh, sh_start, status="resolved"),
        alert(sh, sh_start, hostname="some-other-node"),
        alert(sh, sh_start, alertname="GPUHot"),
        alert(sh, 1),  # same pid, another process: pid reuse
        alert(protected, start_time_of(protected)),  # the live check disagrees: protected
    )
    doc = policy_check(gpuguard, dry_run_config(tmp_path), delivery)
    got = [(a["decision"] or a["intake"])["reason"] for a in doc["alerts"]]
    assert got == ["not-firing", "other-host", "alertname-not-listed", "root-replaced",
                   "not-orphan:protected"]
    assert all((a["decision"] or a["intake"])["action"] == "ignore" for a in doc["alerts"])
    assert alive(sh) and alive(protected)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "not JSON"),
        (json.dumps({"version": "3", "alerts": []}), 'version: must be "4"'),
        (json.dumps({"version": "4", "alerts": [{"status": "odd", "labels": {}}]}),
         "alerts[0].status"),
    ],
    ids=["not-json", "wrong-version", "bad-status"],
)
def test_policy_check_malformed_payload_exits_5(tmp_path: Path, gpuguard: Run, text: str,
                                                needle: str) -> None:
    proc = gpuguard("policy", "check", "--config", str(dry_run_config(tmp_path)), "-",
                    stdin=text)
    assert proc.returncode == 5
    line, = proc.stderr.splitlines()
    assert line.startswith("gpuguard: malformed payload: stdin: ") and needle in line


def test_policy_check_invalid_config_exits_2(tmp_path: Path, gpuguard: Run) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("remediate:\n  reasons: [whatever]\n")
    proc = gpuguard("policy", "check", "--config", str(bad), "-", stdin=body())
    assert proc.returncode == 2
    assert proc.stderr == (f"gpuguard: config error: {bad}: remediate.reasons: 'whatever' is "
                           "not one of launcher-killed, session-ended, launcher-exited, "
                           "launcher-unrecorded, parent-exited, session-orphaned, "
                           "parent-gone, parent-reused\n")


# -- reap -----------------------------------------------------------------------------------

CHAIN_KIDS = ("sh -c '{holder} --pidfile {dir}/worker --children 2 & echo $$ > {dir}/sh; wait'"
              " & wait")


def audit_records(config: Path) -> list[dict]:
    path = Path(yaml.safe_load(config.read_text())["remediate"]["audit_log"])
    return [json.loads(line) for line in path.read_text().splitlines()]


def reap(gpuguard: Run, root: int, config: Path, *flags: str) -> tuple[int, dict, str]:
    # The fake NVML reports this namespace's pids (CI runs the suite in its own namespace).
    proc = gpuguard("reap", str(root), "--config", str(config), "--json",
                    "--allow-pid-namespace", *flags)
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "gpuguard.reap/v1" and doc["exit_code"] == proc.returncode
    return proc.returncode, doc, proc.stderr


def test_reap_dry_run_then_apply(tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
                                 gpuguard: Run) -> None:
    tree = trees.spawn(CHAIN_KIDS)
    worker, sh = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, 3 * GIB)
    tree.kill_launcher()
    members = [sh, *descendants_of(sh)]
    assert len(members) == 4  # sh, the holder and its two children
    config = dry_run_config(tmp_path)  # --apply reaps regardless

    code, doc, _ = reap(gpuguard, sh, config)
    assert code == 0 and doc["outcome"] == "dry-run" and doc["signals"] == []
    assert sorted(m["pid"] for m in doc["members"]) == sorted(members)
    assert all(alive(pid) for pid in members)

    code, doc, _ = reap(gpuguard, sh, config, "--apply", "--start-time",
                        str(start_time_of(sh)))
    assert code == 0, doc
    assert doc["outcome"] == "reaped" and doc["kill_path"] in ("pidfd", "pid")
    assert not any(alive(pid) for pid in members)
    assert {s["signal"] for s in doc["signals"]} >= {"SIGSTOP", "SIGTERM"}

    dry, intent, applied = audit_records(config)
    assert (dry["phase"], intent["phase"], applied["phase"]) == ("final", "intent", "final")
    assert sorted(m["pid"] for m in intent["tree"]["members"]) == sorted(members)
    assert intent["signals"] == [] and intent["manual"]["apply"] is True
    assert dry["outcome"] == "dry-run" and dry["mode"] == "dry-run"
    assert applied["outcome"] == "reaped" and applied["mode"] == "enforce"
    assert applied["key"]["root_pid"] == sh
    assert applied["manual"]["by"] and applied["manual"]["apply"] is True
    assert sorted(m["pid"] for m in applied["tree"]["members"]) == sorted(members)


def test_reap_refuses_a_non_orphan_unless_forced(tmp_path: Path, trees: Trees,
                                                 fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    protected = held_tree(trees, fake_gpu, NOHUP, kill_launcher=True)  # root = the holder
    config = dry_run_config(tmp_path)
    code, doc, _ = reap(gpuguard, protected, config, "--apply", "--start-time",
                        str(start_time_of(protected)))
    assert code == 6 and doc["outcome"] == "refused"
    assert doc["reason"] == "not-orphan:protected" and alive(protected)
    code, doc, err = reap(gpuguard, protected, config, "--force")
    assert code == 0 and doc["outcome"] == "dry-run" and doc["forced"] is True
    assert "WARNING: --force" in err and "protected" in err and alive(protected)
    assert [r["decision"]["reason"] for r in audit_records(config)][0] == "not-orphan:protected"


def test_reap_guards_and_identity(tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
                                  gpuguard: Run) -> None:
    sh, worker = orphan_tree(trees, fake_gpu)
    denied = dry_run_config(tmp_path, users={"allow": ["*"], "deny": [getpass.getuser()]})
    code, doc, _ = reap(gpuguard, sh, denied, "--apply", "--force", "--start-time",
                        str(start_time_of(sh)))
    assert code == 6 and doc["outcome"] == "aborted" and doc["reason"] == "user-denied"
    config = dry_run_config(tmp_path)
    code, doc, _ = reap(gpuguard, sh, config, "--apply", "--start-time", "1")
    assert code == 6 and doc["reason"] == "root-replaced"
    assert alive(sh) and alive(worker)
    proc = gpuguard("reap", "4000000", "--config", str(config))
    assert proc.returncode == 4 and proc.stderr == "gpuguard: no such process: 4000000\n"


# -- Alertmanager's word (remediate.alertmanager) --------------------------------------------


def test_reap_apply_refuses_a_silenced_tree_unless_forced(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    from tests.support.promstack import Alertmanager, missing_binaries

    if (why := missing_binaries()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    am = Alertmanager(tmp_path / "am", {"route": {"receiver": "null"},
                                        "receivers": [{"name": "null"}]})
    try:
        sh, worker = orphan_tree(trees, fake_gpu)
        labels = {"alertname": "GPUOrphanTree", "hostname": socket.gethostname(),
                  "root_pid": str(sh), "root_start_time": str(start_time_of(sh))}
        am.post_alert({**labels, "remediate": "true"})
        sid = am.silence(labels)
        config = dry_run_config(tmp_path, alertmanager={"url": am.url})

        status = json.loads(gpuguard("status", "--json", "--config", str(config)).stdout)
        (tree,) = [t for t in status["trees"] if t["root_pid"] == sh]
        assert tree["alert"]["state"] == "silenced" and tree["alert"]["silenced_by"] == [sid]
        explained = json.loads(gpuguard("explain", str(worker), "--json", "--config",
                                        str(config)).stdout)
        assert explained["alert"]["state"] == "silenced"
        assert explained["tree"]["verdict"] == "orphan"

        started = str(start_time_of(sh))
        code, doc, _ = reap(gpuguard, sh, config, "--apply", "--start-time", started)
        assert code == 6 and doc["reason"] == "silenced" and sid in doc["detail"]
        assert alive(sh) and alive(worker) and doc["signals"] == []
        code, doc, _ = reap(gpuguard, sh, config, "--apply", "--force", "--start-time",
                            started)
        assert code == 0 and doc["outcome"] == "reaped" and doc["alert"]["state"] == "silenced"
        assert not alive(sh) and not alive(worker)
    finally:
        am.stop()


# -- the contract and the shared verification, without processes ----------------------------


def test_every_exit_code_is_listed_once_in_the_help() -> None:
    from gpuguard.console import contract

    codes = {v for k, v in vars(contract).items() if k.startswith("EXIT_") and isinstance(v, int)}
    listed = [int(line.split()[0]) for line in contract.EXIT_TABLE.splitlines()[1:-1]]
    assert sorted(listed) == sorted(codes) and len(listed) == len(set(listed))


def test_manual_refusal_is_decides_verification_with_a_hint() -> None:
    from gpuguard.config.remediate import Remediate
    from gpuguard.console.reap import refusal
    from gpuguard.engine.decision.policy import verify_live
    from gpuguard.engine.decision.tree import LiveTree, Member, TreeKey

    key = TreeKey(HOST, 4242, 99)
    root = Member(pid=4242, ppid=1, start_time=99, uid=1000, user="alice", comm="sh")
    guarded = LiveTree(root=root, tree_found=True, verdict="protected",
                       reason="member-protected", detail="4243 ignores SIGHUP", members=(root,))
    policy = Remediate()
    refused = refusal(key, guarded, False, policy)
    assert refused is not None and refused.reason == "member-protected"
    assert refused.detail == f"{verify_live(key, guarded).detail}; pass --force to reap it anyway"
    assert refusal(key, guarded, True, policy) is None
    # The policy's reasons, as for an alert: a launcher no one heard die is not reaped by
    # default, unless a person forces it.
    unheard = dataclasses.replace(guarded, verdict="orphan", reason="launcher-unrecorded")
    refused = refusal(key, unheard, False, policy)
    assert refused is not None and refused.reason == "reason-not-allowed"
    assert refused.detail.endswith("pass --force to reap it anyway")
    assert refusal(key, unheard, True, policy) is None
    assert refusal(key, dataclasses.replace(unheard, reason="launcher-killed"), False,
                   policy) is None
    gone = refusal(key, LiveTree(root=root), True, policy)
    assert gone is not None and gone.reason == "tree-not-found" and "status` lists" in gone.detail


# -- status: accounting ---------------------------------------------------------------------


def test_status_marks_suspects_and_reconciles_each_gpu(tmp_path: Path, trees: Trees,
                                                       fake_gpu: FakeGpuWorld,
                                                       gpuguard: Run) -> None:
    fake_gpu.update_gpu(0, memory_used=6 * GIB, memory_reserved=GIB)
    fake_gpu.add_gpu(1, memory_used=2 * GIB)
    miner = held_tree(trees, fake_gpu, "exec -a xmrig {holder} --pidfile {dir}/worker & wait",
                      kill_launcher=False, used=2 * GIB)
    worker = held_tree(trees, fake_gpu, ATTACHED, kill_launcher=False, used=GIB)
    fake_gpu.add_process(1, worker, None)  # cannot be sized on GPU 1
    config = tmp_path / "gpuguard.yml"
    # "*" is not root's (CI runs as root): root's quota must be named.
    config.write_text('quotas:\n  users: {"*": 2GiB, root: 2GiB}\n')

    proc = gpuguard("status", "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row, = (line for line in lines if line.lstrip().startswith(f"{miner} "))
    assert "[suspect: cmdline-pattern]" in row
    assert not any("suspect" in line for line in lines if line.lstrip().startswith(f"{worker} "))
    assert any(f"suspect: pid {miner}" in line and "'xmrig'" in line for line in lines)
    # GPU 0: 6 GiB used (the reserved GiB apart), 3 GiB held by two processes; GPU 1 unknown.
    gpu0, = (line.split() for line in lines if line.split()[:2] == ["0", "6.0"])
    assert gpu0 == ["0", "6.0", "GiB", "3.0", "GiB", "(2", "proc)", "3.0", "GiB"]
    gpu1, = (line for line in lines if line.split()[:2] == ["1", "2.0"])
    assert f"? (usage of pid {worker} unavailable)" in gpu1
    assert any("GPU memory by user:" in line and "quota 2.0 GiB, over" in line
               for line in lines)

    doc = json.loads(gpuguard("status", "--json", "--config", str(config)).stdout)
    acc = doc["accounting"]
    assert [(s["pid"], s["why"]) for s in acc["suspects"]] == [(miner, "cmdline-pattern")]
    assert [(g["index"], g["unattributed_bytes"]) for g in acc["gpus"]] == [(0, 3 * GIB),
                                                                           (1, None)]
    assert acc["gpus"][1]["why_unknown"] == f"usage of pid {worker} unavailable"
    (user,) = acc["users"]
    assert (user["used_bytes"], user["quota_bytes"]) == (3 * GIB, 2 * GIB)
    holders = {h["pid"]: h for t in doc["trees"] for h in t["holders"]}
    assert holders[miner]["suspect"]["why"] == "cmdline-pattern"
    assert holders[worker]["suspect"] is None


# -- status and the running exporter's clocks ---------------------------------------------


def test_status_shows_the_running_exporters_orphan_age_and_idle_seconds(
        trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, gpuguard: Run) -> None:
    """A console scan alone says IDLE 0s for a holder the exporter has watched idle for
    seconds; with the exporter running, status shows the exporter's orphan age and idle
    seconds and says they are the exporter's, at its scan."""
    sh, worker = orphan_tree(trees, fake_gpu)
    exporter = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()))
    try:
        def watched_two_seconds() -> bool:
            samples = exporter.scrape()
            idle = find(samples, "gpuguard_gpu_process_idle_seconds", pid=str(worker))
            age = find(samples, "gpuguard_orphan_tree_age_seconds", root_pid=str(sh))
            return bool(idle and age and idle[0][1] >= 2 and age[0][1] >= 2)

        wait_for(watched_two_seconds, timeout=20, what="the exporter's clocks at 2 s")
        proc = gpuguard("status", "--json", "--exporter-url", exporter.url)
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        clocks = doc["clocks"]
        assert (clocks["source"], clocks["exporter_url"]) == ("exporter", exporter.url)
        assert doc["taken_at"] - 10 < clocks["exporter_scan_at"] <= doc["taken_at"]
        assert "from the exporter's scan at" in clocks["detail"]
        (tree,) = (t for t in doc["trees"] if t["root_pid"] == sh)
        assert tree["orphan_age_seconds"] >= 2
        assert tree["orphan_since"] == pytest.approx(
            clocks["exporter_scan_at"] - tree["orphan_age_seconds"])
        (holder,) = tree["holders"]
        assert holder["idle_seconds"] >= 2 and holder["idle_source"] == "exporter"
        text = gpuguard("status", "--exporter-url", exporter.url).stdout
        assert "from the exporter's scan at" in text and "(exporter)" in text
        (row,) = (line for line in text.splitlines() if line.lstrip().startswith(f"{worker} "))
        assert not row.rstrip().endswith(" 0s"), row
    finally:
        exporter.stop()
    # No exporter (its port closed now): the command's own scan, and it says so.
    doc = json.loads(gpuguard("status", "--json", "--exporter-url", exporter.url).stdout)
    assert doc["clocks"]["source"] == "own-scan" and doc["clocks"]["exporter_scan_at"] is None
    assert "this command's own scan" in doc["clocks"]["detail"]
    assert exporter.url in doc["clocks"]["detail"]
    (tree,) = (t for t in doc["trees"] if t["root_pid"] == sh)
    assert tree["orphan_age_seconds"] is None and tree["orphan_since"] is None
    assert [(h["idle_seconds"], h["idle_source"]) for h in tree["holders"]] == [
        (0.0, "own-scan")]
    text = gpuguard("status", "--exporter-url", exporter.url).stdout
    assert "this command's own scan, idle counted from now" in text


def test_a_dripping_exporter_holds_status_for_one_bound_only(peer: Any) -> None:
    """`status` asks the exporter for its clocks under one absolute bound
    (EXPORTER_TIMEOUT_SECONDS), not a per-read timeout: an answer dripped one byte every
    0.3 s (anything on 127.0.0.1:9877 may answer so) would otherwise hold the command
    for as long as it drips."""
    from gpuguard.console.evidence import exporter_clocks

    body = b"gpuguard_last_scan_timestamp_seconds 1\n" * 4
    server = peer(lambda n: Reply(body=body, drip="body", every=0.3))
    started = time.monotonic()
    clocks = exporter_clocks(server.url, timeout=1.0)
    elapsed = time.monotonic() - started
    assert clocks.source == "own-scan" and clocks.why_not is not None, clocks
    assert elapsed < 1.0 + 1.0, elapsed  # one bound, plus headroom for a loaded machine
