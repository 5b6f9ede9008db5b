"""Trees as large as the host allows (issue 43): a reap holds one pidfd per member, so the
open-file limit bounds what it can reap. The entry points raise the soft limit to the
hard one at start; a tree beyond what is left is refused by name (`tree-too-large`)
before any signal, never member by member (`member-unknown`) half-way through.

Real trees: a C fan-out (tests/support/fanout.py) of sleeping children below an orphaned
`sh`, reaped by `gpuguard reap --apply` (the real Reaper) over the fake NVML, in a child
process whose RLIMIT_NOFILE the test sets.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuguard.engine.reap.freezing import DESCRIPTOR_RESERVE
from gpuguard.host.descriptors import open_count
from tests.live.test_remediator_reaper import DriverLikeNvml, nvml, plan_for, reap, sent
from tests.support.fakenvml import FakeGpuWorld
from tests.support.fanout import build_fanout
from tests.support.proctree import Trees, alive, descendants_of, stat_fields, wait_for
from tests.support.remediator_harness import (
    GIB,
    Harness,
    account,
    alert,
    payload,
    spawn_orphan,
    start_time_of,
    write_config,
)
from tests.support.servers import REPO, ServerProcess, child_env

#: root sh -> (fan-out -> N pause()ing children) + the GPU holder; the launcher is killed.
__all__ = ["nvml"]  # the fixture, imported for its name

FANNED = ('sh -c "{fanout} {n} {{dir}}/fanned & {{holder}} --pidfile {{dir}}/holder & wait" '
          "& echo $! > {{dir}}/root; wait")


@pytest.fixture(scope="session")
def fanout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fanout(tmp_path_factory.mktemp("fanout"))


def spawn_wide_orphan(trees: Trees, world: FakeGpuWorld, fanout: Path,
                      processes: int) -> tuple[int, list[int]]:
    """An orphan tree of exactly `processes` processes: (root, every member)."""
    tree = trees.spawn(FANNED.format(fanout=fanout, n=processes - 3))
    holder, root, fanned = tree.pid("holder"), tree.pid("root"), tree.pid("fanned", timeout=60)
    world.add_process(0, holder, 2 * GIB)
    tree.kill_launcher()
    members = [root, *descendants_of(root)]
    assert len(members) == processes and fanned in members, len(members)
    return root, members


def reap_under(world: FakeGpuWorld, lib: Path, config: Path, root: int, soft: int,
               hard: int, *, apply: bool = True) -> tuple[int, dict]:
    """`gpuguard reap ROOT --apply` (or its dry run) in a child whose RLIMIT_NOFILE is
    (soft, hard)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    proc = subprocess.run(
        [sys.executable, "-m", "gpuguard.console", "reap", str(root), "--config", str(config),
         "--json", "--allow-pid-namespace",
         *(["--apply", "--start-time", str(start_time_of(root))] if apply else [])],
        cwd=REPO, env=world.subprocess_env(lib, child_env(NO_COLOR="1")), capture_output=True,
        text=True, timeout=300, preexec_fn=limit)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def states(pids: list[int]) -> set[str]:
    return {str(fields["state"]) for fields in map(stat_fields, pids) if fields is not None}


def test_a_1100_process_tree_is_reaped_under_a_1024_soft_limit(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        fanout: Path) -> None:
    """The default soft limit (1,024) is below the tree; the hard one is not: `reap
    --apply` raises the soft limit at start and reaps all 1,100 (before: member-unknown)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-file limit here is {hard}: too low for this tree")
    root, members = spawn_wide_orphan(trees, fake_gpu, fanout, 1100)
    config = write_config(tmp_path, worker_timeout_seconds=120)
    code, doc = reap_under(fake_gpu, fake_nvml_lib, config, root, 1024, min(hard, 65536),
                           apply=False)  # a dry run holds every member too
    assert (code, doc["outcome"]) == (0, "dry-run"), (doc["reason"], doc["detail"])
    code, doc = reap_under(fake_gpu, fake_nvml_lib, config, root, 1024, min(hard, 65536))
    assert (code, doc["outcome"]) == (0, "reaped"), (doc["reason"], doc["detail"])
    assert len(doc["members"]) == 1100
    wait_for(lambda: not any(alive(p) for p in members), timeout=30, what="every member gone")


def test_a_tree_beyond_the_limit_is_refused_by_name_and_nothing_is_signalled(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
        fanout: Path) -> None:
    """300 members under a hard limit of 256: `tree-too-large` with the member count and the
    limit, before any signal (every member still sleeping), audited (before:
    member-unknown)."""
    root, members = spawn_wide_orphan(trees, fake_gpu, fanout, 300)
    config = write_config(tmp_path)
    code, doc = reap_under(fake_gpu, fake_nvml_lib, config, root, 256, 256)
    assert (code, doc["outcome"], doc["reason"]) == (6, "aborted", "tree-too-large"), doc
    assert "300 member(s)" in doc["detail"] and "soft limit 256" in doc["detail"], doc["detail"]
    assert doc["signals"] == []
    assert states(members) == {"S"} and all(alive(p) for p in members)
    audit = Path(tmp_path / "audit.jsonl").read_text().splitlines()
    final = json.loads(audit[-1])
    assert (final["phase"], final["outcome_reason"]) == ("final", "tree-too-large"), final
    assert not any(json.loads(line)["phase"] == "intent" for line in audit)


@pytest.mark.parametrize("module", ["gpuguard.exporter", "gpuguard.remediator"])
def test_each_daemon_raises_its_soft_open_file_limit_to_the_hard_one(
        module: str, tmp_path: Path, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    config = write_config(tmp_path)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    args = ["--config", str(config)]
    if module == "gpuguard.remediator":
        args += ["--token-file", str(token), "--allow-pid-namespace"]
    server = ServerProcess(module, args, env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                           command=["prlimit", "--nofile=512:4096", "--", sys.executable,
                                    "-m", module])
    try:
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line
    finally:
        server.stop()


def test_a_tree_that_outgrows_the_budget_while_frozen_is_continued_not_killed(
        trees: Trees, fake_gpu: FakeGpuWorld, nvml: DriverLikeNvml) -> None:
    """The plan names the root only; its child joins during the freeze, one past the
    budget (the soft limit set here so that exactly one descriptor is left): the reap
    ends `tree-too-large`, what it stopped is continued, and nothing is terminated."""
    orphan = spawn_orphan(trees, fake_gpu)
    plan = plan_for(orphan, nvml)
    only_root = dataclasses.replace(plan, members=plan.members[:1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_count() + DESCRIPTOR_RESERVE + 1, hard))
    try:
        result = reap(only_root, nvml)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (result.outcome, result.reason) == ("aborted", "tree-too-large"), result
    assert f"child {orphan.holder} of member {orphan.root}" in result.detail
    assert not any(sig in ("SIGTERM", "SIGKILL") for _, sig in sent(result))
    assert ("SIGCONT" in {sig for _, sig in sent(result)}) and orphan.all_alive()
    wait_for(lambda: states(orphan.members) == {"S"}, what="the tree continued")


def test_the_remediator_audits_a_tree_too_large_and_signals_nothing(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        fanout: Path) -> None:
    """The daemon's path: an alert for a 300-process tree where this process may hold 50
    more descriptors. The decision and the final audit record say `tree-too-large` with
    the count and the limit; no intent record, no signal, every member still sleeping."""
    root, members = spawn_wide_orphan(trees, fake_gpu, fanout, 300)
    h = harness()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_count() + DESCRIPTOR_RESERVE + 50, hard))
    try:
        assert account(h.post(payload(alert(root, start_time_of(root)))))["status"] == "accepted"
        h.settle()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    records = [r for r in h.audit() if r["key"]["root_pid"] == root]
    assert [r["phase"] for r in records] == ["final"], records
    (final,) = records
    assert (final["outcome"], final["outcome_reason"]) == ("aborted", "tree-too-large"), final
    assert "300 member(s)" in final["outcome_detail"] and final["signals"] == []
    assert states(members) == {"S"} and all(alive(p) for p in members)
    latest = [d for d in h.decisions(root) if d["source"] == "worker"][0]  # newest first
    assert (latest["action"], latest["reason"]) == ("ignore", "tree-too-large"), latest
