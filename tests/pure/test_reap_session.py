"""One reap session for every program that reaps on a decision (issue 51): the plan, the
write-ahead journal, the confirmation, the reaper, told() and final_decision() are put
together once, in gpuguard/engine/reap/session.py, and the remediator's worker and
`gpuguard reap` (MCP's gpu_reap through it) hand it only what is theirs. Checked on the
source with `ast`: a caller that assembled a session of its own again (called a
reaper's `.reap(`, built a ReapPlan, settled a result with told() or final_decision())
fails here; so does one that asks the Platform flag whether there is a thaw guardian
instead of engine/platforms.py's table. The behaviour itself is the live tests'
(tests/live/test_remediator_*.py, test_console*.py, test_reap*.py, test_mcp.py)."""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

from gpuguard.console import reap as console_reap
from gpuguard.engine.reap.thaw_guardian import ThawGuardian
from gpuguard.host.platform import BACKENDS, LINUX, WINDOWS
from gpuguard.remediator import worker

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "gpuguard"
SESSION = "gpuguard/engine/reap/session.py"

#: Where a reap is run on no decision, or is the reaper's own machinery: the reap
#: skeleton and its parts, Windows' reaper, `gpuguard run`'s teardown of its own tree.
OWN_REAPS = ("gpuguard/engine/reap/", "gpuguard/engine/windows/", "gpuguard/launch/teardown/")

#: The steps of a session, as the calls that make them.
STEPS = {"reap": "a reaper's .reap(", "ReapPlan": "ReapPlan(", "told": "told(",
         "final_decision": "final_decision("}


@functools.cache
def sources() -> dict[str, ast.Module]:
    """Every module of the package (its own folders, not the data links), parsed, by path."""
    found: dict[str, ast.Module] = {}
    for folder, _dirs, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                found[path.relative_to(REPO).as_posix()] = ast.parse(path.read_text())
    return found


def session_steps(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, step) of each call in `tree` that makes one of a session's STEPS."""
    steps = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = (func.attr if isinstance(func, ast.Attribute)
                else func.id if isinstance(func, ast.Name) else None)
        if name == "reap" and not isinstance(func, ast.Attribute):
            continue  # a bare reap(...) is no reaper's method
        if name in STEPS:
            steps.append((node.lineno, STEPS[name]))
    return steps


def test_the_finder_sees_each_step_of_a_session() -> None:
    text = ("plan = ReapPlan(key=k)\n"
            "result = told(self._reaper.reap(plan, journal=j))\n"
            "final = settlement.final_decision(d, result, k)\n"
            "reap(x)\n")
    assert session_steps(ast.parse(text)) == [(1, "ReapPlan("), (2, "told("),
                                   (3, "final_decision("), (2, "a reaper's .reap(")]


def test_only_the_session_assembles_a_reap_on_a_decision() -> None:
    found = {path: steps for path, tree in sources().items()
             if not path.startswith(OWN_REAPS) or path == SESSION
             if (steps := session_steps(tree))}
    outside = {path: steps for path, steps in found.items() if path != SESSION}
    assert outside == {}, ("a reap session assembled outside engine/reap/session.py: "
                           "build a ReapSession instead")
    assert {step for _line, step in found[SESSION]} == set(STEPS.values())


def test_the_worker_and_the_console_reap_through_the_one_session() -> None:
    from gpuguard.engine.reap import session  # (new in issue 51: imported where tested)

    assert worker.ReapSession is session.ReapSession
    assert console_reap.ReapSession is session.ReapSession


def flag_reads(tree: ast.Module) -> list[int]:
    """Lines that read a Platform's `thaw_guardian` flag."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "thaw_guardian"]


def test_no_program_asks_the_platform_flag_for_a_thaw_guardian() -> None:
    """engine/platforms.py's table says whether a platform's reaps have one; the flag's
    home (gpuguard/host/) is the only place that spells it."""
    assert flag_reads(ast.parse("g = ThawGuardian() if PLATFORM.thaw_guardian else None")) == [1]
    readers = {path: lines for path, tree in sources().items()
               if not path.startswith("gpuguard/host/") if (lines := flag_reads(tree))}
    assert readers == {}


def test_every_platform_has_its_guardian_answer() -> None:
    """The table answers for every back-end: Linux's reaps have a thaw guardian (pidfds
    it can hold), Windows' none (a suspend counts, and the handles die with the reaper)."""
    from gpuguard.engine import platforms

    assert set(platforms.GUARDIANS) == set(BACKENDS)
    assert isinstance(platforms.platform_guardian(BACKENDS[LINUX]), ThawGuardian)
    assert platforms.platform_guardian(BACKENDS[WINDOWS]) is None
