"""Missing evidence never permits a kill (issues 24, 43): real processes, the real remediator
in enforce mode, the console.

- A GPUGUARD_KEEP=1 job that overwrites its environment (setproctitle does; the holder's
  --erase-environ does the same with ctypes) is not read as unmarked, and `gpuguard keep`
  marks it where it cannot erase the mark.
- A launcher's exit, once established, outlives its record in the listener's bounded
  store and a restart of the remediator (marked initial_pidns: the real connector).
- A launcher that exited by itself is not reaped under the default reasons on any path:
  the daemon without a listener (session-ended), `gpuguard reap` (launcher-unrecorded, or
  what the remediator recorded); gpu_reap's is in test_mcp.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate
from gpuguard.console.contract import EXIT_REFUSED
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.marks import ensure_marks_dir
from gpuguard.host.procfs import ProcessView
from gpuguard.host.registrar import start_registrar
from gpuguard.orphans.classify import classify
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import Reason
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import SMALL_EXIT_STORE, Trees, exit_burst, stat_fields, wait_for
from tests.support.remediator_harness import (
    FakeClock,
    Harness,
    Orphan,
    Run,
    account,
    alert,
    payload,
    spawn_orphan,
    write_config,
)

#: bash (killed) -> sh (the adopted root) -> a GPUGUARD_KEEP=1 holder that then erases its
#: environment: /proc/PID/environ is all zeros, getenv() still answers.
ERASED_KEEP = ('sh -c "GPUGUARD_KEEP=1 {holder} --erase-environ --pidfile {dir}/holder" & '
               'echo $! > {dir}/root; wait')
#: The same chain, the launcher leaving by itself (`exit 0`): launcher-exited.
LEAVES = 'sh -c "{holder} --pidfile {dir}/holder" & echo $! > {dir}/root; exit 0'


def final_of(h: Harness, root: int, after: int = 0) -> dict:
    """The final audit record of the `after`-th delivery for `root` (0: the first)."""
    def finals() -> list[dict]:
        return [r for r in h.audit() if r["key"]["root_pid"] == root and r["phase"] == "final"]

    wait_for(lambda: len(finals()) > after, what=f"final record {after + 1} of {root}")
    return finals()[after]


def deliver(h: Harness, root: int, root_start: int, *, nth: int = 0) -> dict:
    answer = account(h.post(payload(alert(root, root_start))))
    assert answer["status"] == "accepted", answer
    h.settle()
    return final_of(h, root, nth)


def one_tree(root: int, *, rules: Rules | None = None, events: ProcessEvents | None = None):
    from gpuguard.gpu.nvml import Nvml

    counters = Counters()
    nvml = Nvml(counters=counters)
    try:
        holders = nvml.read().holders
    finally:
        nvml.close()
    view = ProcessView(counters=counters, events=events)
    (tree,) = [t for t in classify(holders, view, rules or Rules()) if t.root_pid == root]
    return tree


def environ_of(pid: int) -> bytes:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return fh.read()


# -- markers the process erased -----------------------------------------------------------


def test_an_erased_keep_marker_is_not_read_as_none_and_refuses_the_reap(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    orphan = spawn_orphan(trees, fake_gpu, ERASED_KEEP)
    assert set(environ_of(orphan.holder)) == {0}  # erased as setproctitle does
    tree = one_tree(orphan.root)
    assert (tree.verdict, tree.reason) == ("unknown", Reason.MEMBER_UNKNOWN), tree.evidence
    assert orphan.holder in tree.evidence.pids and "setproctitle" in tree.evidence.detail
    record = deliver(harness(), orphan.root, orphan.root_start)
    assert record["decision"]["reason"] == Reason.MEMBER_UNKNOWN, record["decision"]
    assert record["signals"] == [] and orphan.all_alive()


def test_gpuguard_keep_marks_a_process_where_it_cannot_erase_the_mark(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        gpuguard: Run, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    marks = tmp_path / "run" / "marks"
    marks.parent.mkdir()
    assert ensure_marks_dir(str(marks)) is None  # what the daemons do at start
    assert marks.stat().st_mode & 0o7777 == 0o755  # only the daemons write there
    orphan = spawn_orphan(trees, fake_gpu, ERASED_KEEP)
    absent = gpuguard("keep", str(orphan.holder), "--marks-dir", str(marks))
    assert absent.returncode == 2 and "no gpuguard registrar listens" in absent.stderr
    assert absent.stderr.count("\n") == 1, absent.stderr  # one line
    registrar, problem = start_registrar(str(marks))  # what the exporter serves
    assert registrar is not None, problem
    request.addfinalizer(registrar.stop)
    done = gpuguard("keep", str(orphan.holder), "--marks-dir", str(marks))
    assert done.returncode == 0, done.stderr
    assert f"kept: {orphan.holder}" in done.stdout
    rules = Rules(marks_dir=str(marks))
    tree = one_tree(orphan.root, rules=rules)
    assert (tree.verdict, tree.reason) == ("protected", Reason.MEMBER_PROTECTED), tree.evidence
    h = harness(classify={"marks_dir": str(marks)})
    record = deliver(h, orphan.root, orphan.root_start)
    assert record["decision"]["reason"] == Reason.MEMBER_PROTECTED, record["decision"]
    assert record["signals"] == [] and orphan.all_alive()

    # A mark names one identity: a wrong start time is refused, nothing is written.
    stale = gpuguard("keep", str(orphan.root), "--start-time", str(orphan.root_start + 1),
                     "--marks-dir", str(marks))
    assert stale.returncode == 4 and "now names another process" in stale.stderr
    assert sorted(p.name for p in marks.iterdir()) == [
        f"keep-{orphan.holder}-{one_start(orphan.holder)}"]
    removed = gpuguard("keep", "--remove", str(orphan.holder), "--marks-dir", str(marks))
    assert removed.returncode == 0 and "no longer kept" in removed.stdout
    again = one_tree(orphan.root, rules=rules)
    assert (again.verdict, again.reason) == ("unknown", Reason.MEMBER_UNKNOWN)


def one_start(pid: int) -> int:
    from tests.support.remediator_harness import start_time_of

    return start_time_of(pid)


def test_a_mark_from_another_user_is_ignored_not_unknown(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """The daemons trust a registration only from root, their own user or the process's
    owner: a file another uid wrote at this process's name protects nothing, and since
    the registrar writes over it, it blocks nothing either: it is no mark (the tree
    stays an orphan), not "cannot tell" blamed on the environment (issue 36: it read
    unknown, detail "cannot read environ"). tests/live/test_mark_squatting.py has the
    same with two real users."""
    if os.geteuid() != 0:
        pytest.skip("needs root: writes a file as another uid")
    marks = tmp_path / "run" / "marks"
    marks.parent.mkdir()
    assert ensure_marks_dir(str(marks)) is None
    orphan = spawn_orphan(trees, fake_gpu)
    name = f"keep-{orphan.root}-{orphan.root_start}"
    (marks / name).write_text(Path("/proc/sys/kernel/random/boot_id").read_text())
    os.chown(marks / name, 54321, 54321)  # as if uid 54321 had written it
    tree = one_tree(orphan.root, rules=Rules(marks_dir=str(marks)))
    assert (tree.verdict, tree.root_pid) == ("orphan", orphan.root), tree.evidence
    os.chown(marks / name, 0, 0)  # the same file, root's: trusted
    tree = one_tree(orphan.root, rules=Rules(marks_dir=str(marks)))
    assert (tree.verdict, tree.reason) == ("protected", Reason.KEEP_MARKER)


# -- launcher evidence that outlives its record and a restart ------------------------------


def listener(**options: object) -> ProcessEvents:
    events = ProcessEvents(**options)  # type: ignore[arg-type]
    events.start()
    require(events.available, f"process-events connector unavailable "
            f"({events.unavailable_reason}); {RUN_INITIAL_PIDNS}")
    return events


def evict(events: ProcessEvents, trees: Trees, pid: int) -> None:
    """Push `pid`'s exit record out of the listener's (small) general ring with other
    exits (the remediator's chain watch keeps it apart since issue 48: the restart below
    is what leaves only the launcher memory to answer)."""
    exit_burst(trees)
    wait_for(lambda: pid not in {e.pid for e in events.records()}
             and events.evictions()["count"] > 0,
             what=f"the record of {pid} to be evicted")


@pytest.mark.initial_pidns
def test_the_remediator_never_reaps_a_launcher_exited_tree_once_its_record_is_gone(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """launcher-exited is not reaped by default; the record leaves the general ring
    (forced: a small store and a burst of exits), the remediator restarts (its memory
    lives in state_dir): still launcher-exited. Before, the same tree read session-ended
    after either, and was reaped."""
    events = listener(max_records=SMALL_EXIT_STORE)
    orphan = spawn_orphan(trees, fake_gpu, LEAVES, orphan=False)
    leader = orphan.tree.launcher.pid
    orphan.tree.launcher.wait(timeout=10)
    wait_for(lambda: events.exit_of(leader, after=0), what="the exit event")
    clock = FakeClock()
    h = harness(events=events, clock=clock)
    first = deliver(h, orphan.root, orphan.root_start)
    assert first["decision"]["reason"] == "reason-not-allowed", first["decision"]
    assert "launcher-exited" in first["decision"]["detail"]

    evict(events, trees, leader)
    clock.now += 61  # past the refusal's re-check window: inspected again
    answer = account(h.post(payload(alert(orphan.root, orphan.root_start))))
    assert answer["status"] == "accepted", answer
    h.settle()
    # recent_decisions is newest first: the re-inspection's, then the first delivery's
    # (taking the last of them checked the first decision twice).
    again, earlier = [d for d in h.decisions(orphan.root) if d["source"] == "worker"]
    assert again["fingerprint"] != earlier["fingerprint"], (again, earlier)
    assert again["reason"] == "reason-not-allowed" and "launcher-exited" in again["detail"]
    assert h.service.counts()["refusals_repeated"] == 1  # the same refusal: counted

    h.service.stop()  # a rollout: the listener and the store go with it
    restarted = harness(events=listener())
    after = deliver(restarted, orphan.root, orphan.root_start, nth=1)
    assert after["decision"]["reason"] == "reason-not-allowed", after["decision"]
    assert "launcher-exited" in after["decision"]["detail"]
    assert all(r["signals"] == [] for r in (first, after)) and orphan.all_alive()


# -- a launcher that exited by itself, on every path (issue 43) ------------------------------

#: The product's default `remediate.reasons` (the harness's test policy opts in to more).
DEFAULT_REASONS = [str(r) for r in Remediate().reasons]


def left_by_itself(trees: Trees, fake_gpu: FakeGpuWorld) -> Orphan:
    orphan = spawn_orphan(trees, fake_gpu, LEAVES, orphan=False)
    orphan.tree.launcher.wait(timeout=10)
    return orphan


def console_refuses(gpuguard: Run, config: Path, orphan: Orphan, reason: str) -> dict:
    """`gpuguard explain` reads `reason`, and `gpuguard reap --apply` refuses the tree for
    it (remediate.reasons), leaving it alive: the reap's JSON document."""
    explained = json.loads(gpuguard("explain", str(orphan.holder), "--json", "--config",
                                    str(config)).stdout)
    assert (explained["verdict"], explained["reason"]) == ("orphan", reason)
    proc = gpuguard("reap", str(orphan.root), "--config", str(config), "--json",
                    "--allow-pid-namespace", "--apply", "--start-time", str(orphan.root_start))
    doc = json.loads(proc.stdout)
    assert proc.returncode == EXIT_REFUSED, doc
    assert doc["reason"] == "reason-not-allowed" and reason in doc["detail"]
    assert orphan.all_alive()
    return dict(doc)


def test_the_daemon_without_a_listener_refuses_it_under_the_default_reasons(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """No listener (a container, a child PID namespace, an old kernel): the launcher's
    death reads session-ended, evidence of nothing; the default reasons do not reap it."""
    orphan = left_by_itself(trees, fake_gpu)
    h = harness(reasons=DEFAULT_REASONS)
    final = deliver(h, orphan.root, orphan.root_start)
    assert final["decision"]["reason"] == "reason-not-allowed", final["decision"]
    assert "session-ended" in final["decision"]["detail"]
    assert final["signals"] == [] and orphan.all_alive()


def test_gpuguard_reap_reads_launcher_unrecorded_and_refuses_under_the_default_reasons(
        tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld, gpuguard: Run) -> None:
    """The console hears no exits: an exit it has no record of is one it missed
    (launcher-unrecorded), never session-ended, and `--apply` follows remediate.reasons
    as an alert does (only --force overrides it)."""
    orphan = left_by_itself(trees, fake_gpu)
    doc = console_refuses(gpuguard, write_config(tmp_path, reasons=DEFAULT_REASONS), orphan,
                          "launcher-unrecorded")
    assert "--force" in doc["detail"] and doc["signals"] == []
    assert all((stat_fields(p) or {}).get("state") in ("S", "R") for p in orphan.members)


@pytest.mark.initial_pidns
def test_the_console_judges_on_what_the_remediator_recorded(
        harness: Callable[..., Harness], tmp_path: Path, trees: Trees, fake_gpu: FakeGpuWorld,
        gpuguard: Run) -> None:
    """The remediator heard the launcher exit (launcher-exited, kept in its launcher memory
    in remediate.state_dir): `gpuguard explain` and `gpuguard reap`, which hear nothing,
    give the same reason, and refuse the reap as the daemon does."""
    events = listener()
    orphan = spawn_orphan(trees, fake_gpu, LEAVES, orphan=False)
    leader = orphan.tree.launcher.pid
    orphan.tree.launcher.wait(timeout=10)
    wait_for(lambda: events.exit_of(leader, after=0), what="the exit event")
    h = harness(events=events, reasons=DEFAULT_REASONS)
    final = deliver(h, orphan.root, orphan.root_start)
    assert final["decision"]["reason"] == "reason-not-allowed"
    assert "launcher-exited" in final["decision"]["detail"]
    config = tmp_path / "gpuguard.yml"  # the harness's, naming its state_dir
    console_refuses(gpuguard, config, orphan, "launcher-exited")


def test_a_registration_that_cannot_be_read_is_named_not_the_environment(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """A keep registration that cannot be read (here a marks_dir that is a symbolic link
    to itself: every lookup fails with ELOOP) makes the member unknown, and the detail
    names the registration: the environment was read (issue 36: such a refusal blamed an
    unreadable environment)."""
    from gpuguard.orphans.members import judge_member

    loop = tmp_path / "marks"
    loop.symlink_to(loop)
    orphan = spawn_orphan(trees, fake_gpu)
    view = ProcessView(counters=Counters())
    info = view.fresh_stat(orphan.root)
    assert info is not None and view.keep_marker(info) is False  # read: no GPUGUARD_KEEP
    judged = judge_member(info, view, Rules(marks_dir=str(loop)))
    assert judged is not None and judged.reason == Reason.MEMBER_UNKNOWN
    assert "registration" in judged.evidence.detail, judged.evidence.detail
    assert "environ" not in judged.evidence.detail, judged.evidence.detail
