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

from benchmarks.harness import Result  # noqa: E402
from benchmarks.run_all import BENCHMARKS, SHORT_LIMIT, run_one  # noqa: E402
from tests.support.ci import INITIAL_PIDNS  # noqa: E402
from tests.support.promstack import require_binaries  # noqa: E402

pytestmark = pytest.mark.slow

#: The benchmarks that measure the kernel's process-events connector, which answers a
#: listener in the initial PID namespace only (.ci/run runs these outside its namespace).
KERNEL_EVENTS = {"procevents_cost", "event_latency"}
#: The benchmarks run by a test of their own below, which asserts more of what they say
#: (each short run once: fleet_pull's takes about 90 s).
OWN_TEST = {"fleet_pull"}


def params() -> list[object]:
    return [pytest.param(name, marks=[getattr(pytest.mark, INITIAL_PIDNS)])
            if name in KERNEL_EVENTS else name for name in BENCHMARKS if name not in OWN_TEST]


def short_run(name: str, tmp_path: Path) -> Result:
    """benchmarks/NAME.py --short, as run_all runs it; it met its ratio and count targets."""
    result, why = run_one(name, SHORT_LIMIT, tmp_path / f"{name}.json", short=True)
    assert result is not None, f"benchmarks/{name}.py --short {why}"
    assert result.short and result.targets, f"{name}: no target measured"
    failed = [f"{t.name}: {t.measured} (goal {t.goal})" for t in result.failed()]
    assert not failed, f"{name} --short: " + "; ".join(failed)
    return result


@pytest.mark.parametrize("name", params())
def test_the_benchmark_runs_short_and_meets_its_ratio_and_count_targets(
        name: str, tmp_path: Path) -> None:
    short_run(name, tmp_path)


def number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_the_fleet_benchmark_measures_both_servers_and_alertmanagers_cost_per_alert(
        tmp_path: Path) -> None:
    """Issue 54: benchmarks/fleet_pull.py --short sweeps Alertmanager and Prometheus at
    1,000 and 10,000 firing alerts, with a real remediator among each server's pollers;
    Alertmanager carries fewer polls/s at 10x the alerts (a poll walks every alert it
    holds). Its shape and that growth, never its numbers (2 shared cores move them)."""
    require_binaries()
    result = short_run("fleet_pull", tmp_path)
    summary, steps = result.tables
    assert summary.title.startswith("What one server carries")
    rows = {(r[0], r[1]): dict(zip(summary.columns, r, strict=True)) for r in summary.rows}
    assert set(rows) == {(s, n) for s in ("alertmanager", "prometheus")
                         for n in ("1,000", "10,000")}
    carried = {key: number(row["polls/s carried"]) for key, row in rows.items()}
    assert carried["alertmanager", "10,000"] < carried["alertmanager", "1,000"], carried
    assert carried["prometheus", "1,000"] > 0 and carried["alertmanager", "1,000"] > 0, carried
    for row in rows.values():
        assert row["goal 333 polls/s"] in ("met", "not met")
        assert row["% of one core per 100 polls/s"].endswith("%")
    # Every step names its server, alerts, rate and loss; the remediator's columns are
    # filled for both servers (one remediator pulls from each), its /healthz a status and
    # code.
    assert steps.columns[:3] == ["server", "firing alerts", "rate polls/s"]
    for row in steps.rows:
        cells = dict(zip(steps.columns, row, strict=True))
        lost, polls = (int(x) for x in cells["real remediator: lost / polls"].split(" / "))
        assert 0 <= lost <= polls and polls > 0, row
        assert cells["its /healthz"].split()[0] in ("200", "503"), row
    assert {r[1] for r in steps.rows if r[0] == "alertmanager"} == {"1,000", "10,000"}
    names = {t.name for t in result.targets}
    assert any(n.startswith("Alertmanager CPU per answer") for n in names), names
    assert any(n.startswith("the real remediator's lost polls") for n in names), names


def test_every_benchmark_file_is_run_by_run_all() -> None:
    """A benchmark added to benchmarks/ but not to run_all.py is run by nobody (as
    procevents_cost was): none is left out."""
    files = {p.stem for p in (REPO / "benchmarks").glob("*.py")}
    assert files - {"__init__", "harness", "run_all"} == set(BENCHMARKS)
