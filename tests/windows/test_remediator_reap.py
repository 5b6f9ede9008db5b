"""The remediator on Windows: an Alertmanager webhook for an orphaned chain reaps it.

The remediator runs as a Windows process (`python -m gpuguard.remediator`), answers on
127.0.0.1, and is sent the webhook Alertmanager would send for the exporter's orphan
(root_pid, root_start_time in integer ms, reason parent-gone). Windows cannot say how a
launcher went, so the default policy refuses `parent-gone` (audited, nothing touched);
a policy that names it in `remediate.reasons` reaps the whole tree, audited.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.support.fakenvml import FakeGpuWorld
from tests.support.remediator_harness import TOKEN, alert, payload
from tests.support.winchain import Chain, Chains, gone, wait_gone
from tests.support.wine import WinePrefix, WinProcess, poll, windows_path

HOST = "gpu-win-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GIB = 2**30


class WinRemediator:
    """One `python -m gpuguard.remediator` in the prefix, over the test's fake GPU world."""

    def __init__(self, wine: WinePrefix, tmp: Path, world: FakeGpuWorld,
                 **remediate: Any) -> None:
        self.tmp = tmp
        self.audit_path = tmp / "audit.jsonl"
        section = {
            "mode": "enforce",
            "min_age_seconds": 0,
            "rate_limit": {"max_reaps": 100, "per_seconds": 3600},
            "state_dir": windows_path(tmp / "state"),
            "audit_log": windows_path(self.audit_path),
            # Under Wine every process is the one account's: let the policy judge it.
            "allow_root_owned": True,
            "users": {"allow": ["*"], "deny": []},
            **remediate,
        }
        config = tmp / "gpuguard.yml"
        config.write_text(yaml.safe_dump({"remediate": section}))
        token = tmp / "token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        self.proc: WinProcess = wine.spawn(
            ["-m", "gpuguard.remediator", "--listen", "127.0.0.1:0", "--hostname", HOST,
             "--config", windows_path(config), "--token-file", windows_path(token),
             "--log-level", "DEBUG"], state=world.path)
        self.url = f"http://127.0.0.1:{self.proc.listening_port()}"

    def post(self, body: Any) -> requests.Response:
        return requests.post(f"{self.url}/alerts", json=body, headers=AUTH, timeout=30)

    def idle(self) -> bool:
        resp = requests.get(f"{self.url}/state", headers=AUTH, timeout=30)
        resp.raise_for_status()
        state = resp.json()
        return state["in_flight"] is None and not state["pending"]

    def finals(self, root: int) -> list[dict[str, Any]]:
        """The final audit records of the tree rooted at `root` (a last line still being
        written is read on the next look)."""
        if not self.audit_path.exists():
            return []
        *complete, _partial = self.audit_path.read_text().split("\n")
        records = [json.loads(line) for line in complete if line.strip()]
        return [r for r in records
                if r["key"]["root_pid"] == root and r["phase"] == "final"]


@pytest.fixture
def remediators(wine: WinePrefix, tmp_path: Path,
                world: FakeGpuWorld) -> Iterator[Any]:
    def make(name: str, **remediate: Any) -> WinRemediator:
        tmp = tmp_path / name
        tmp.mkdir()
        return WinRemediator(wine, tmp, world, **remediate)

    yield make


def orphaned(wine: WinePrefix, chains: Chains, world: FakeGpuWorld) -> Chain:
    """launcher -> worker -> leaf (the GPU holder), then the launcher killed hard."""
    chain = chains.start(depth=2)
    world.add_process(0, chain.leaf.pid, 2 * GIB)
    wine.terminate(chain.levels[0].pid)
    return chain


def webhook(chain: Chain) -> dict[str, Any]:
    root = chain.root_after_launcher
    return payload(alert(root.pid, round(root.create_time * 1000), hostname=HOST,
                         reason="parent-gone", comm="python.exe", user=root.username))


def test_a_policy_that_opts_in_reaps_the_whole_tree(
        wine: WinePrefix, chains: Chains, world: FakeGpuWorld, remediators: Any) -> None:
    server = remediators("opt-in", reasons=["launcher-killed", "session-ended",
                                            "parent-gone"])
    chain = orphaned(wine, chains, world)
    members = chain.levels[1:]
    started = time.monotonic()
    resp = server.post(webhook(chain))
    assert resp.status_code == 200, resp.text
    assert resp.json()["accounts"][0]["status"] == "accepted", resp.json()
    took = wait_gone(wine, members, timeout=30, what="the orphan tree to be reaped "
                                                    f"({server.proc.describe()})")
    print(f"\nWindows reap: the tree gone {took:.2f} s after the poll began, "
          f"{time.monotonic() - started:.2f} s after the POST")
    (record,) = poll(lambda: server.finals(chain.root_after_launcher.pid), timeout=30,
                     what="the final audit record")
    assert record["outcome"] == "reaped", record
    assert record["decision"]["action"] == "reap", record
    assert record["key"]["root_start_time"] == round(chain.root_after_launcher.create_time
                                                     * 1000), record
    assert {m["pid"] for m in record["tree"]["members"]} == {m.pid for m in members}, record
    assert record["survivors"] == [], record
    # Windows' kill path: every member held by handle, suspended whole, then terminated.
    assert record["kill_path"] == "handle", record
    sent = [(s["signal"], s["pid"]) for s in record["signals"] if s["result"] == "sent"]
    for member in members:
        assert ("SUSPEND", member.pid) in sent and ("TERMINATE", member.pid) in sent, sent
    last_suspend = max(i for i, (sig, _) in enumerate(sent) if sig == "SUSPEND")
    first_terminate = min(i for i, (sig, _) in enumerate(sent) if sig == "TERMINATE")
    assert last_suspend < first_terminate, sent


def test_the_default_policy_refuses_parent_gone(
        wine: WinePrefix, chains: Chains, world: FakeGpuWorld, remediators: Any) -> None:
    server = remediators("default")
    chain = orphaned(wine, chains, world)
    resp = server.post(webhook(chain))
    assert resp.status_code == 200, resp.text
    (record,) = poll(lambda: server.finals(chain.root_after_launcher.pid), timeout=30,
                     what=f"the refusal's audit record ({server.proc.describe()})")
    assert record["decision"]["action"] == "ignore", record
    assert record["decision"]["reason"] == "reason-not-allowed", record
    assert "parent-gone" in record["decision"]["detail"], record
    poll(server.idle, timeout=30, what="the remediator to be idle")
    assert not gone(wine, chain.levels[1:]), "the default policy killed a parent-gone tree"
    rows = wine.table()
    assert all(level.pid in rows for level in chain.levels[1:])
