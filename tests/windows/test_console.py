"""The console on Windows: `gpuguard status` and `explain` name the orphan, `gpuguard reap`
verifies it the remediator's way; a dry run touches nothing, --apply reaps the tree."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.support.fakenvml import FakeGpuWorld
from tests.support.winchain import Chain, Chains, wait_gone
from tests.support.wine import WinePrefix, windows_path

GIB = 2**30


def orphaned(wine: WinePrefix, chains: Chains, world: FakeGpuWorld) -> Chain:
    chain = chains.start(depth=2)
    world.add_process(0, chain.leaf.pid, GIB)
    wine.terminate(chain.levels[0].pid)
    return chain


def config(tmp: Path) -> str:
    """A config whose audit log and state are the test's (Windows paths), and the opt-in
    to the Windows reason a killed launcher gives (docs/windows.md): `gpuguard reap`
    follows remediate.reasons as an alert does."""
    path = tmp / "gpuguard.yml"
    path.write_text(yaml.safe_dump({"remediate": {
        "reasons": ["launcher-killed", "parent-gone"],
        # A manual reap needs the remediator's record of the tree's age unless this is 0
        # (docs/console.md, Reaping by hand): no remediator runs beside these tests.
        "min_age_seconds": 0,
        "state_dir": windows_path(tmp / "state"),
        "audit_log": windows_path(tmp / "audit.jsonl"),
        "allow_root_owned": True,  # under Wine every process is the one account's
        "users": {"allow": ["*"], "deny": []},
    }}))
    return windows_path(path)


def test_status_explain_and_a_dry_run_reap(wine: WinePrefix, chains: Chains,
                                           world: FakeGpuWorld, tmp_path: Path) -> None:
    chain = orphaned(wine, chains, world)
    root = chain.root_after_launcher
    start = round(root.create_time * 1000)

    status = wine.python("-m", "gpuguard", "status", "--json", state=world.path)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    trees = [t for t in doc["trees"] if t["root_pid"] == root.pid]
    assert len(trees) == 1, doc["trees"]
    assert trees[0]["root_start_time"] == start, trees[0]
    assert trees[0]["verdict"] == "orphan" and trees[0]["reason"] == "parent-gone", trees[0]
    assert trees[0]["root_user"] == root.username, trees[0]

    explain = wine.python("-m", "gpuguard", "explain", str(chain.leaf.pid), state=world.path)
    assert explain.returncode == 0, explain.stderr
    assert "parent-gone" in explain.stdout and str(root.pid) in explain.stdout, explain.stdout

    reap = wine.python("-m", "gpuguard", "reap", "--json", "--config", config(tmp_path),
                       "--start-time", str(start), str(root.pid), state=world.path)
    answer = json.loads(reap.stdout)
    assert (reap.returncode, answer["outcome"]) == (0, "dry-run"), (answer, reap.stderr)
    assert {m["pid"] for m in answer["members"]} == {root.pid, chain.leaf.pid}, answer
    assert set(wine.table()) >= {root.pid, chain.leaf.pid}  # a dry run touches nothing


def test_reap_apply_ends_the_tree(wine: WinePrefix, chains: Chains, world: FakeGpuWorld,
                                  tmp_path: Path) -> None:
    chain = orphaned(wine, chains, world)
    root = chain.root_after_launcher
    start = round(root.create_time * 1000)
    reap = wine.python("-m", "gpuguard", "reap", "--json", "--apply", "--config",
                       config(tmp_path), "--start-time", str(start), str(root.pid),
                       state=world.path)
    answer = json.loads(reap.stdout) if reap.stdout.strip() else {}
    assert (reap.returncode, answer.get("outcome")) == (0, "reaped"), (answer, reap.stderr)
    assert answer["survivors"] == [], answer
    wait_gone(wine, chain.levels[1:], timeout=10, what="the reaped tree")
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    finals = [r for r in records if r["phase"] == "final"]
    assert finals and finals[-1]["outcome"] == "reaped" and "manual" in finals[-1], finals
