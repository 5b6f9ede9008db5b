"""One reap skeleton (issue 51): the order of a reap's phases and the thaw on every way
out are written once (gpuguard/engine/reap/skeleton.py), and each platform's reaper only
supplies its steps. Two copies of the skeleton drift: a fix to one platform's thaw, or a
step moved in one, would leave the other as it was. Read with `ast` and by inspection of
the classes; nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuguard.engine.reap.reaper import Reaper
from gpuguard.engine.reap.skeleton import ReaperCore
from gpuguard.engine.windows.reaper import WindowsReaper

PACKAGE = Path(__file__).resolve().parents[2] / "gpuguard"
SKELETON = PACKAGE / "engine" / "reap" / "skeleton.py"
#: The skeleton's phases: what no platform may write again.
PHASES = ("reap", "_prepare", "_freeze_and_judge", "_kill", "_interrupted")


def _names(node: ast.expr) -> set[str]:
    """The exception names a handler's type spells (one, or a tuple of them)."""
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, ast.Name | ast.Attribute)}


def catches_interrupted(path: Path) -> list[str]:
    """The functions of `path` with an `except Interrupted` handler: a reap's way out
    when it is stopped, which only the skeleton has."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if any(isinstance(h, ast.ExceptHandler) and h.type is not None
                   and "Interrupted" in _names(h.type)
                   for inner in ast.walk(node) if isinstance(inner, ast.Try)
                   for h in inner.handlers):
                found.append(node.name)
    return found


def test_the_finder_sees_an_interrupted_handler(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def reap():\n    try:\n        go()\n    except Interrupted as s:\n"
                   "        thaw()\n\ndef other():\n    try:\n        go()\n"
                   "    except (ValueError, InterruptedError):\n        pass\n")
    assert catches_interrupted(src) == ["reap"]


def test_the_freeze_thaw_skeleton_is_written_once() -> None:
    """Every reap that thaws when it is interrupted is the skeleton's (the console's own
    handler, around a reaper, sends nothing itself)."""
    reaps = {str(path.relative_to(PACKAGE)): names
             for path in sorted(PACKAGE.rglob("*.py")) if path.parts[-2:] != ("console",
                                                                               "reap.py")
             if (names := catches_interrupted(path))}
    assert reaps == {str(SKELETON.relative_to(PACKAGE)): ["reap"]}


@pytest.mark.parametrize("platform", [Reaper, WindowsReaper])
def test_each_platform_supplies_steps_and_keeps_the_skeletons_phases(
        platform: type[ReaperCore]) -> None:
    assert issubclass(platform, ReaperCore)
    redefined = [name for name in PHASES if name in vars(platform)]
    assert redefined == [], f"{platform.__name__} writes the skeleton's phases again"
    assert all(getattr(platform, name) is getattr(ReaperCore, name) for name in PHASES)
    assert not platform.__abstractmethods__, platform.__abstractmethods__
