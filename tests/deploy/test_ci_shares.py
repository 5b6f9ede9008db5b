"""`--live-share K/N` (tests/conftest.py): .ci/run gives each compat interpreter one share of
tests/live; together the shares run every live test once, the rest of the selection runs
whole in each, and a bad share is refused."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Four live files and a pure one.
LIVE = ("tests/live/test_idle.py", "tests/live/test_idle_reap.py", "tests/live/test_json_logs.py",
        "tests/live/test_lifecycle.py")
PURE = "tests/pure/test_compat.py"


def collected(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-o", "addopts=", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def ids(run: subprocess.CompletedProcess[str]) -> set[str]:
    assert run.returncode == 0, run.stdout + run.stderr
    return {line for line in run.stdout.splitlines() if line.startswith("tests/")}


def files(tests: set[str]) -> set[str]:
    return {test.split("::")[0] for test in tests}


def test_the_two_shares_run_every_live_test_once_and_the_rest_whole() -> None:
    whole = ids(collected(*LIVE, PURE))
    first = ids(collected(*LIVE, PURE, "--live-share", "1/2"))
    second = ids(collected(*LIVE, PURE, "--live-share", "2/2"))
    pure = {test for test in whole if test.startswith(PURE)}
    assert pure and first & second == pure  # the rest of the selection runs in each
    assert first | second == whole
    assert files(first - pure).isdisjoint(files(second - pure))  # whole files
    assert files(first - pure) | files(second - pure) == set(LIVE)
    # Dealt by tests: the shares differ by no more than the biggest file holds.
    per_file = Counter(test.split("::")[0] for test in whole - pure)
    assert abs(len(first - pure) - len(second - pure)) <= max(per_file.values())


def test_a_share_that_does_not_exist_is_a_usage_error() -> None:
    run = collected(LIVE[0], "--live-share", "3/2")
    assert run.returncode == 4, run.stdout + run.stderr
    assert re.search(r"--live-share 3/2: give K/N with 1 <= K <= N", run.stderr), run.stderr


def test_a_share_in_other_digits_is_a_usage_error_not_an_internal_one() -> None:
    # str.isdigit() holds for "²", which int() refuses: the check must be int()'s own.
    run = collected(LIVE[0], "--live-share", "²/2")
    assert run.returncode == 4, run.stdout + run.stderr
    assert "--live-share ²/2: give K/N with 1 <= K <= N" in run.stderr, run.stderr
