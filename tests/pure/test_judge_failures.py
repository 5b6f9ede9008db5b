"""One process that cannot be read or judged makes its own tree `unknown`, never the scan
(issue 48): classify() over a synthetic table whose answers for one process raise, as a
parser meeting a hostile environment did (ValueError past Python's int() digit limit).

Two orphan trees, side by side: bash 100 -> 200 -> holder 300, and bash 400 -> 500 ->
holder 600; both shells were killed.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpuguard.orphans.classify import classify
from gpuguard.orphans.process import ProcInfo
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.verdicts import Tree
from gpuguard.orphans.vocabulary import Reason, Verdict
from tests.support.proctable import SyntheticView, holder, init, leader, proc

HOSTILE = "Exceeds the limit (4300 digits) for integer string conversion"


class Faulty(SyntheticView):
    """A table whose answers to `method` about `pid` raise what a parser would."""

    def __init__(self, *args: Any, method: str, pid: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.method, self.pid = method, pid

    def _raise_for(self, method: str, pid: int) -> None:
        if (method, pid) == (self.method, self.pid):
            raise ValueError(HOSTILE)

    def cmdline(self, info: ProcInfo) -> str | None:
        self._raise_for("cmdline", info.pid)
        return super().cmdline(info)

    def keep_marker(self, info: ProcInfo) -> bool | None:
        self._raise_for("keep_marker", info.pid)
        return super().keep_marker(info)

    def children(self, pid: int) -> tuple[int, ...] | None:
        self._raise_for("children", pid)
        return super().children(pid)


def two_orphans(method: str, pid: int) -> Faulty:
    view = Faulty([
        init(),
        leader(100, ppid=1, comm="bash"), proc(200, ppid=100, sid=100),
        proc(300, ppid=200, sid=100),
        leader(400, ppid=1, comm="bash"), proc(500, ppid=400, sid=400),
        proc(600, ppid=500, sid=400),
    ], method=method, pid=pid)
    view.exit(100)
    view.exit(400)
    return view


def judged(view: SyntheticView) -> dict[int, Tree]:
    return {t.root_pid: t for t in classify([holder(300), holder(600)], view, Rules())}


def test_both_trees_are_orphans_when_nothing_fails() -> None:
    trees = judged(two_orphans("none", 0))
    assert {pid: t.verdict for pid, t in trees.items()} == {200: "orphan", 500: "orphan"}


@pytest.mark.parametrize(("method", "pid", "root", "reason"), [
    # the holder's chain rules fail (its command line, its root candidate's keep marker):
    # the holder is unknown (unreadable), a tree of its own
    ("cmdline", 600, 600, Reason.UNREADABLE),
    ("keep_marker", 500, 600, Reason.UNREADABLE),
    # a member's protections fail in the member judgement: its tree is member-unknown
    ("keep_marker", 600, 500, Reason.MEMBER_UNKNOWN),
    # the member walk fails: the tree is member-unknown at its root
    ("children", 500, 500, Reason.MEMBER_UNKNOWN),
])
def test_one_process_that_cannot_be_judged_is_unknown_alone(
        method: str, pid: int, root: int, reason: Reason) -> None:
    trees = judged(two_orphans(method, pid))
    assert trees[200].verdict == Verdict.ORPHAN, trees[200].evidence  # the neighbour stands
    assert (trees[root].verdict, trees[root].reason) == (Verdict.UNKNOWN, reason), \
        trees[root].evidence
    assert "could not be judged" in trees[root].evidence.detail
    assert HOSTILE in trees[root].evidence.detail
    # the evidence names the member that failed, or the holder whose chain did
    assert {pid, root} & set(trees[root].evidence.pids)
