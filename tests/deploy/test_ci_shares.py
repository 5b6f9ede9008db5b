"""`--live-share K/N` (tests/conftest.py): .ci/run gives each compat interpreter one share of
tests/live; together the shares must run every live test once, and a bad share is refused."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def collected(*args: str, where: str = "tests/live") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-o", "addopts=", where, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def ids(run: subprocess.CompletedProcess[str]) -> set[str]:
    assert run.returncode == 0, run.stdout + run.stderr
    return {line for line in run.stdout.splitlines() if line.startswith("tests/live/")}


def test_the_two_shares_run_every_live_test_once_and_split_by_file() -> None:
    first, second = ids(collected("--live-share", "1/2")), ids(collected("--live-share", "2/2"))
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests/live").glob("test_*.py"))
    assert first and second and not first & second
    in_first = {test.split("::")[0] for test in first}
    assert in_first.isdisjoint({test.split("::")[0] for test in second})  # by whole file
    assert in_first == set(files[0::2])
    whole = ids(collected())
    assert first | second == whole


def test_a_share_that_does_not_exist_is_a_usage_error() -> None:
    run = collected("--live-share", "3/2", where="tests/live/test_idle.py")
    assert run.returncode == 4, run.stdout + run.stderr
    assert re.search(r"--live-share 3/2: give K/N with 1 <= K <= N", run.stderr), run.stderr
