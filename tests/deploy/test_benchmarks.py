"""Every benchmark in benchmarks/ runs, in its short mode, on every CI run: one that no
longer starts, or whose count target fails (one decision per tree, reads per scan
against the lower bound, scrapes answered) or whose timed ratio is missed by more than
twice its goal (benchmarks/harness.py, Target), fails here instead of rotting until the
next full `make bench`. Absolute times (p99 in ms, % of one core) are reported, never
failed: CI's 2 shared cores move them (benchmarks/harness.py, Target).

Each runs as `benchmarks/run_all.py --short` runs it: in a child process of its own, under
a subreaper that sweeps what it left (benchmarks/run_all.py, run_one).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.run_all import BENCHMARKS, SHORT_LIMIT, run_one  # noqa: E402
from tests.support.ci import INITIAL_PIDNS  # noqa: E402

pytestmark = pytest.mark.slow

#: The benchmarks that measure the kernel's process-events connector, which answers a
#: listener in the initial PID namespace only (.ci/run runs these outside its namespace).
KERNEL_EVENTS = {"procevents_cost", "event_latency"}


def params() -> list[object]:
    return [pytest.param(name, marks=[getattr(pytest.mark, INITIAL_PIDNS)])
            if name in KERNEL_EVENTS else name for name in BENCHMARKS]


@pytest.mark.parametrize("name", params())
def test_the_benchmark_runs_short_and_meets_its_ratio_and_count_targets(
        name: str, tmp_path: Path) -> None:
    result, why = run_one(name, SHORT_LIMIT, tmp_path / f"{name}.json", short=True)
    assert result is not None, f"benchmarks/{name}.py --short {why}"
    assert result.short and result.targets, f"{name}: no target measured"
    failed = [f"{t.name}: {t.measured} (goal {t.goal})" for t in result.failed()]
    assert not failed, f"{name} --short: " + "; ".join(failed)


def test_every_benchmark_file_is_run_by_run_all() -> None:
    """A benchmark added to benchmarks/ but not to run_all.py is run by nobody (as
    procevents_cost was): none is left out."""
    files = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    assert files - {"__init__", "harness", "run_all"} == set(BENCHMARKS)
