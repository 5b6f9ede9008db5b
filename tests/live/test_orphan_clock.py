"""Orphan ages that outlive an exporter restart (issue 50): with --state-dir, each orphan
root's first sighting is kept in DIR/orphans.json next to the launcher memory, so an
upgrade's restart does not set gpuguard_orphan_tree_age_seconds back to 0 (which resolved
every firing GPUOrphanTree and fired it again six minutes later). A real exporter over a
real tree and the fake NVML, stopped and started again."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuguard.engine.scan.orphan_clock import MAX_ENTRIES, ORPHAN_CLOCK_FILE, OrphanClock
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, wait_for
from tests.support.remediator_harness import start_time_of
from tests.support.servers import Exporter, child_env, find

GIB = 2**30
#: How old the tree is let grow before the restart (seconds on the exporter's boot clock).
AGE_BEFORE = 2.0


@pytest.fixture
def exporter_for(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> Iterator[Callable[...,
                                                                                  Exporter]]:
    started: list[Exporter] = []

    def start(*args: str) -> Exporter:
        exp = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()), args=args)
        started.append(exp)
        return exp

    yield start
    for exp in started:
        exp.stop()


def orphan_age(exp: Exporter, root: int) -> float | None:
    rows = find(exp.scrape(), "gpuguard_orphan_tree_age_seconds", root_pid=str(root))
    return rows[0][1] if rows else None


def test_a_restart_keeps_each_orphan_s_age(trees: Trees, fake_gpu: FakeGpuWorld,
                                           exporter_for: Callable[..., Exporter],
                                           tmp_path: Path) -> None:
    tree = trees.spawn(CHAIN)
    worker, root = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, GIB)
    tree.kill_launcher()
    state = tmp_path / "state"
    state.mkdir()
    exp = exporter_for("--state-dir", str(state))
    wait_for(lambda: (orphan_age(exp, root) or 0) > AGE_BEFORE, timeout=20,
             what=f"the orphan's age past {AGE_BEFORE}s")
    before = orphan_age(exp, root)
    assert before is not None
    exp.stop()

    again = exporter_for("--state-dir", str(state))
    # Its first scan that publishes the tree gives the age it had, and more: never 0.
    after = wait_for(lambda: orphan_age(again, root), timeout=20, what="the orphan series")
    assert after >= before, (before, after)
    saved = json.loads((state / ORPHAN_CLOCK_FILE).read_text())
    assert [row[:2] for row in saved["roots"]] == [[root, start_time_of(root)]], saved

    # Gone, then forgotten on disk too (a complete scan no longer sees it).
    tree.kill(worker)
    tree.kill(root)
    fake_gpu.remove_process(worker)
    wait_for(lambda: orphan_age(again, root) is None, what="the series to go")
    wait_for(lambda: json.loads((state / ORPHAN_CLOCK_FILE).read_text())["roots"] == [],
             what="the entry to leave orphans.json")


def test_without_a_state_dir_a_restart_starts_again(trees: Trees, fake_gpu: FakeGpuWorld,
                                                    exporter_for: Callable[..., Exporter]
                                                    ) -> None:
    """In memory only (no --state-dir): the old behaviour, said in docs/exporter.md."""
    tree = trees.spawn(CHAIN)
    worker, root = tree.pid("worker"), tree.pid("sh")
    fake_gpu.add_process(0, worker, GIB)
    tree.kill_launcher()
    exp = exporter_for()
    wait_for(lambda: (orphan_age(exp, root) or 0) > AGE_BEFORE, timeout=20,
             what=f"the orphan's age past {AGE_BEFORE}s")
    exp.stop()
    again = exporter_for()
    assert wait_for(lambda: orphan_age(again, root), timeout=20,
                    what="the orphan series") < AGE_BEFORE


def test_the_clock_file_is_this_boot_s_bounded_and_survives_a_bad_scan(tmp_path: Path) -> None:
    path = str(tmp_path / ORPHAN_CLOCK_FILE)
    clock = OrphanClock(path, boot="boot-a")
    assert clock.ages([(10, 100)], 50.0) == {(10, 100): 0.0}
    # A scan NVML could not finish sees nothing: nobody is forgotten.
    assert clock.ages([], 60.0, complete=False) == {}
    assert OrphanClock(path, boot="boot-a").ages([(10, 100)], 80.0) == {(10, 100): 30.0}
    # Another boot's pids and boot clock mean nothing here.
    assert OrphanClock(path, boot="boot-b").ages([(10, 100)], 5.0) == {(10, 100): 0.0}
    # Bounded: at most MAX_ENTRIES roots are kept (and written).
    many = OrphanClock(str(tmp_path / "many.json"), boot="boot-a")
    many.ages([(pid, 1) for pid in range(MAX_ENTRIES + 10)], 1.0)
    assert len(many) == MAX_ENTRIES
    rows = json.loads((tmp_path / "many.json").read_text())["roots"]
    assert len(rows) == MAX_ENTRIES
    # A damaged file starts empty, not with a guess.
    (tmp_path / "bad.json").write_text("{not json")
    assert len(OrphanClock(str(tmp_path / "bad.json"), boot="boot-a")) == 0
