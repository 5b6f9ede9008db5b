"""procevents: the kernel's exit events, decoded, stored in bounds, and read from a real kernel.

The kernel tests spawn real processes and kill them. They are marked `initial_pidns`:
the kernel acknowledges a subscription from the initial PID namespace only, and a socket
in a child namespace hears events only while some listener outside has subscribed, so
.ci/run runs them outside the namespace it gives the rest of the suite. Where they cannot
run they skip, saying how to run them; under CI=true, where the suite runs as root, a
missing connector is a failure.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.host.events import listener as procevents
from gpuguard.host.events.connector import PROC_EVENT_EXIT, PROC_EVENT_NONE, decode
from gpuguard.host.events.exit_store import Exit, ExitStore, split_exit_code
from gpuguard.host.events.listener import KINDS, EventCounts, ProcessEvents
from gpuguard.host.events.watched import WatchedExits
from tests.support.ci import RUN_INITIAL_PIDNS, require
from tests.support.proctree import Trees, children_of, wait_for

REPO = Path(__file__).resolve().parents[2]
BURST = 5000
kernel = pytest.mark.initial_pidns


# -- decoding and the store: no kernel needed ------------------------------------------


def datagram(what: int, payload: bytes, *, ack: int = 0, stamp: int = 123) -> bytes:
    """One message as the kernel sends it: nlmsghdr, cn_msg, proc_event (40 bytes)."""
    event = struct.pack("=IIQ", what, 2, stamp) + payload.ljust(24, b"\0")
    cn = struct.pack("=IIIIHH", 1, 1, 7, ack, len(event), 0) + event
    return struct.pack("=IHHII", 16 + len(cn), 3, 0, 0, 0) + cn


def test_decode_reads_exit_and_ack_at_the_kernel_offsets() -> None:
    exit_fields = (4242, 4242, 15, 17, 100, 100)
    data = datagram(PROC_EVENT_EXIT, struct.pack("=iiIIii", *exit_fields), stamp=99)
    assert len(data) == 76  # what the kernel sends (checked on 6.18)
    ack = datagram(PROC_EVENT_NONE, struct.pack("=I", errno.EPERM), ack=6)
    events = list(decode(data + ack))
    assert [(e.what, e.timestamp_ns, e.data) for e in events] == [
        (PROC_EVENT_EXIT, 99, exit_fields), (PROC_EVENT_NONE, 123, (errno.EPERM,))]
    assert events[1].ack == 6
    assert list(decode(data[:60])) == []  # a truncated message is skipped, not misread
    thread = datagram(PROC_EVENT_EXIT, struct.pack("=iiIIii", 4243, 4242, 0, 2**32 - 1, 0, 0))
    assert next(decode(thread)).data[:2] == (4243, 4242)


def test_exit_code_splits_into_signal_or_status() -> None:
    assert split_exit_code(15) == (15, None)
    assert split_exit_code(9) == (9, None)
    assert split_exit_code(3 << 8) == (None, 3)
    assert split_exit_code(0) == (None, 0)
    assert split_exit_code(0x80 | 11) == (11, None)  # SIGSEGV with a core dump


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(pid: int, at: float, *, parent: int = 1) -> Exit:
    return Exit(pid, 0, None, 0, parent, at)


def test_store_is_bounded_by_count_oldest_first() -> None:
    clock = FakeClock()
    store = ExitStore(max_records=3, retention=600, clock=clock)
    store.add(*(record(pid, 1000.0) for pid in (10, 11, 12, 13, 14)))
    assert len(store) == 3
    assert [r.pid for r in store.records()] == [12, 13, 14]
    assert store.exit_of(10, after=0) is None and store.exit_of(14, after=0) is not None


def test_store_is_bounded_by_age() -> None:
    clock = FakeClock(1000.0)
    store = ExitStore(max_records=100, retention=10, clock=clock)
    store.add(record(20, 1000.0))
    clock.now = 1005.0
    store.add(record(21, 1005.0))
    assert store.exit_of(20, after=0) is not None
    clock.now = 1010.5
    assert store.exit_of(20, after=0) is None  # older than retention: gone
    assert [r.pid for r in store.records()] == [21]
    clock.now = 2000.0
    assert len(store.records()) == 0


def test_store_answers_the_latest_exit_at_or_after_the_start_time() -> None:
    store = ExitStore(max_records=100, retention=600, clock=FakeClock(1100.0))
    store.add(record(30, 1010.0, parent=5))
    store.add(record(30, 1050.0, parent=6))  # the pid, reused, exited again
    latest = store.exit_of(30, after=1020.0)
    assert latest is not None and latest.parent_pid == 6
    assert store.exit_of(30, after=1000.0) == latest  # the most recent, not the first
    assert store.exit_of(30, after=1050.0) == latest  # at or after
    assert store.exit_of(30, after=1060.0) is None  # a process started after both exits
    store.add(*(record(pid, 1090.0) for pid in range(40, 140)))  # the reused pid's
    assert store.exit_of(30, after=0) is None  # records are evicted, dict entry with them


def test_store_ring_wraps_and_never_matches_a_pid_straddling_two_slots() -> None:
    store = ExitStore(max_records=4, retention=600, clock=FakeClock(1100.0))
    straddler = 0x66554433  # its bytes sit across the two pids below (little-endian)
    store.add(record(straddler, 1000.0))
    store.add(record(0x44332211, 1001.0), record(0x08776655, 1002.0))
    found = store.exit_of(straddler, after=0)
    assert found is not None and found.at == 1000.0  # the aligned one, not the straddle
    store.add(*(record(pid, 1003.0 + pid) for pid in (7, 8, 7)))  # wraps: 6 into 4 slots
    assert len(store) == 4
    assert [r.pid for r in store.records()] == [0x08776655, 7, 8, 7]
    assert store.exit_of(straddler, after=0) is None  # evicted; the straddle never matches
    latest = store.exit_of(7, after=0)
    assert latest is not None and latest.at == 1010.0
    assert store.exit_of(0x44332211, after=0) is None


def _resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_store_is_resident_only_where_records_reach() -> None:
    """The default store reserves 1.3 MiB, but a host that sees few exits must not keep
    it resident: the exporter beside nvitop-exporter (benchmarks/nvitop_footprint.py)."""
    before = _resident_kib()
    store = ExitStore(max_records=65536, retention=600, clock=FakeClock(1100.0))
    store.add(*(record(pid, 1000.0 + pid) for pid in range(1, 101)))
    assert _resident_kib() - before < 256  # 100 records touch a few pages, not 1.3 MiB
    assert store.exit_of(100, after=0) is not None and len(store) == 100
    store.add_rows([(pid, 0, 1, 1100.0) for pid in range(200, 65736)])  # fill it: bounded
    assert len(store) == 65536 and store.exit_of(65735, after=0) is not None
    assert store.exit_of(100, after=0) is None  # evicted by count, as before


def test_store_counts_what_it_evicts_by_cause() -> None:
    """Eviction is what makes a launcher's exit unanswerable: counted, by cause, so that
    gpuguard_process_events_evicted_total shows it."""
    clock = FakeClock(1000.0)
    store = ExitStore(max_records=3, retention=10, clock=clock)
    store.add(*(record(pid, 1000.0) for pid in (10, 11, 12, 13, 14)))
    assert store.evicted == {"count": 2, "age": 0}
    clock.now = 1011.0
    assert store.records() == []
    assert store.evicted == {"count": 2, "age": 3}


def test_evictions_reach_the_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from gpuguard.engine.reading_metrics import event_metrics

    events = ProcessEvents(max_records=1)
    events._store.add(record(1, time.time()), record(2, time.time()))
    registry = CollectorRegistry()

    class Events:
        def collect(self):  # noqa: ANN202
            return event_metrics(events)

    registry.register(Events())
    value = registry.get_sample_value
    evicted = "gpuguard_process_events_evicted_total"
    assert value(evicted, {"store": "general", "cause": "count"}) == 1
    assert value(evicted, {"store": "general", "cause": "age"}) == 0
    assert value(evicted, {"store": "watched", "cause": "count"}) == 0
    assert value("gpuguard_process_events_watched_pids") == 0
    events._watched.max_records = 1
    events.watch({7, 8})
    events._record([(7, 9, 1, time.time()), (8, 9, 1, time.time())])
    assert value(evicted, {"store": "watched", "cause": "count"}) == 1
    assert value("gpuguard_process_events_watched_pids") == 2


# -- the watched store: exits of the holders' chains, kept apart (issue 48) -----------------


def test_watched_exits_outlast_a_storm_of_other_exits_in_the_ring() -> None:
    """The issue's storm in miniature: the ring holds 8 records, the launcher (pid 50) is
    watched; 1,000 other exits later the ring has lost it, the listener has not."""
    clock = FakeClock(1000.0)
    events = ProcessEvents(max_records=8, clock=clock)
    events.available = True  # the store alone: no socket needed
    events.watch({50, 51})
    events._record([(50, 9, 1, 1000.0)])  # SIGKILLed
    events._record([(pid, 0, 1, 1000.0) for pid in range(1000, 2000)])
    assert 50 not in {e.pid for e in events.records()} and events.evictions()["count"] > 0
    kept = events.exit_of(50, after=999.0)
    assert kept is not None and kept.signal == 9 and kept.parent_pid == 1
    assert events.exit_of(50, after=1001.0) is None  # a process started after it died
    assert events.exit_of(1500, after=0) is None  # not watched: the ring's to keep, and gone
    assert events.watched_evictions() == 0


def test_watched_exits_do_not_age_out_while_watched_and_do_after() -> None:
    """While a live process's session id names the pid, its exit is the leader's whatever
    its age; once no chain names it, it ages out with the ring's retention."""
    clock = FakeClock(1000.0)
    store = WatchedExits(retention=10, clock=clock)
    store.publish({60})
    store.add_rows([(60, 9, 1, 1000.0)])
    clock.now = 5000.0
    assert store.exit_of(60, after=0) is not None  # watched: kept past the retention
    store.publish({61})  # the tree is gone: 60 is released
    assert store.exit_of(60, after=0) is None and len(store) == 0  # and it was old
    store.publish({62})
    store.add_rows([(62, 0, 1, 5000.0)])
    store.publish(set())
    clock.now = 5005.0
    assert store.exit_of(62, after=0) is not None  # released, within the retention
    clock.now = 5011.0
    assert store.exit_of(62, after=0) is None


def test_publishing_takes_in_what_the_ring_still_holds_of_newly_watched_pids() -> None:
    """A launcher that died before the scan that first saw its tree: its record, still in
    the ring, is kept from that publish on."""
    clock = FakeClock(1000.0)
    ring = ExitStore(max_records=4, retention=600, clock=clock)
    ring.add(record(70, 990.0))
    store = WatchedExits(retention=600, clock=clock)
    store.publish({70, 71}, ring)
    ring.add(*(record(pid, 995.0) for pid in range(100, 110)))  # the ring forgets 70
    kept = store.exit_of(70, after=0)
    assert kept is not None and kept.at == 990.0 and store.exit_of(71, after=0) is None
    store.add_rows([(70, 9, 1, 998.0)])  # a later exit of the same pid replaces it
    assert (found := store.exit_of(70, after=0)) is not None and found.at == 998.0
    store.add_rows([(70, 0, 1, 990.0)])  # never an older one
    assert (found := store.exit_of(70, after=0)) is not None and found.at == 998.0


def test_watched_store_is_bounded_and_counts_only_the_loss_of_watched_records() -> None:
    clock = FakeClock(1000.0)
    store = WatchedExits(retention=600, clock=clock, max_records=3)
    store.publish({1, 80, 81})
    assert store.pids == frozenset({80, 81})  # never PID 1 (nor 0)
    store.add_rows([(80, 9, 1, 1000.0), (81, 9, 1, 1000.0)])
    store.publish({82, 83, 84})  # 80 and 81 released
    store.add_rows([(82, 9, 1, 1001.0), (83, 9, 1, 1001.0)])
    assert len(store) == 3 and store.evicted == 0  # released ones made room, uncounted
    assert store.exit_of(80, after=0) is None and store.exit_of(81, after=0) is not None
    store.add_rows([(84, 9, 1, 1002.0)])  # the last released one makes room
    assert len(store) == 3 and store.evicted == 0 and store.exit_of(81, after=0) is None
    store.add_rows([(82, 9, 1, 1003.0)])  # a later exit of a held pid takes no room
    store.publish({82, 83, 84, 85})
    store.add_rows([(85, 9, 1, 1004.0)])  # a set larger than the store: evidence lost
    assert len(store) == 3 and store.evicted == 1 and store.exit_of(83, after=0) is None


def test_a_full_watched_store_makes_room_from_the_uid_holding_the_most() -> None:
    """The review of issue 48: one user's many watched exits (chains of session leaders
    that died) must not push out another user's launcher record, the oldest of all. Each
    pid is charged to the uid its publisher named; room comes from whoever holds most."""
    clock = FakeClock(1000.0)
    store = WatchedExits(retention=600, clock=clock, max_records=4)
    store.publish({90: 1000, **{pid: 2000 for pid in range(100, 110)}})
    store.add_rows([(90, 9, 1, 1000.0)])  # the victim's launcher, SIGKILLed first
    store.add_rows([(pid, 9, 1, 1001.0) for pid in range(100, 110)])
    assert len(store) == 4 and store.evicted == 7
    kept = store.exit_of(90, after=0)
    assert kept is not None and kept.signal == 9  # not the oldest of all any more
    assert [p for p in range(100, 110) if store.exit_of(p, after=0)] == [107, 108, 109]
    # Charges follow the latest publish: uid 1000's second record makes it the largest.
    store.publish({90: 1000, 91: 1000, 107: 2000, 108: 2000, 109: 2000})
    store.add_rows([(91, 9, 1, 1002.0)])
    assert store.exit_of(90, after=0) is not None and store.exit_of(107, after=0) is None
    store.publish({90: 1000, 91: 1000, 92: 1000, 108: 2000, 109: 2000})
    store.add_rows([(92, 9, 1, 1003.0)])  # now uid 1000 holds the most: its oldest goes
    assert store.exit_of(90, after=0) is None and store.exit_of(108, after=0) is not None
    assert store.evicted == 9
    # Released records still go first, uncounted; a plain set charges no one in particular.
    store.publish({93})
    store.add_rows([(93, 9, 1, 1004.0)])
    assert store.evicted == 9 and store.exit_of(93, after=0) is not None


def test_event_counts_are_a_fixed_set() -> None:
    counts = EventCounts()
    counts.add("exit", 2)
    assert counts.snapshot() == {"exit": 2, "other": 0, "dropped": 0}
    assert tuple(counts.snapshot()) == KINDS
    with pytest.raises(KeyError):
        counts.add("fork")


def test_unavailable_connector_warns_once_and_answers_none(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refused(*_args: object) -> socket.socket:
        raise OSError(errno.EPROTONOSUPPORT, os.strerror(errno.EPROTONOSUPPORT))

    monkeypatch.setattr(procevents, "in_host_pid_namespace", lambda: True)
    monkeypatch.setattr(procevents.socket, "socket", refused)
    events = ProcessEvents()
    with caplog.at_level(logging.WARNING, logger="gpuguard.host.procevents"):
        events.start()  # never raises
    assert not events.available and not events.alive()
    assert "EPROTONOSUPPORT" in events.unavailable_reason
    assert len([r for r in caplog.records if r.name == "gpuguard.host.procevents"]) == 1
    assert events.exit_of(os.getpid(), after=0) is None and events.records() == []
    assert events.counts() == dict.fromkeys(KINDS, 0)
    events.stop()


def test_child_pid_namespace_is_refused_unless_allowed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    opened: list[object] = []
    monkeypatch.setattr(procevents, "in_host_pid_namespace", lambda: False)
    monkeypatch.setattr(procevents.socket, "socket", lambda *a: opened.append(a))
    events = ProcessEvents()
    with caplog.at_level(logging.WARNING, logger="gpuguard.host.procevents"):
        events.start()
    assert not events.available and "PID namespace" in events.unavailable_reason
    assert opened == []  # refused before touching the kernel
    events.stop()


# -- the real kernel ----------------------------------------------------------------------


def start_or_skip(**options: object) -> ProcessEvents:
    events = ProcessEvents(allow_pid_namespace=True, **options)  # type: ignore[arg-type]
    events.start()
    require(events.available, f"process-events connector unavailable "
            f"({events.unavailable_reason}); {RUN_INITIAL_PIDNS}")
    return events


@pytest.fixture
def events() -> Iterator[ProcessEvents]:
    listener = start_or_skip()
    try:
        yield listener
    finally:
        listener.stop()


def my_host_pid(events: ProcessEvents) -> int:
    assert events.initial_pid_namespace and events.host_pid is not None
    assert events.host_pid == os.getpid()
    return events.host_pid


def child_exit(events: ProcessEvents, child: subprocess.Popen[bytes], *, after: float,
               timeout: float = 10.0) -> Exit:
    """The recorded exit of our child; reaps it.

    The child is reaped only once its exit is recorded: the kernel builds the event after
    telling the parent, and a parent that reaps first leaves the event's parent fields 0.
    """
    found = wait_for(lambda: events.exit_of(child.pid, after=after), timeout=timeout,
                     what=f"exit of {child.pid}")
    assert isinstance(found, Exit)
    child.wait(timeout=10)
    return found


def spawn_shell(trees: Trees, script: str) -> subprocess.Popen[bytes]:
    """`sh -c SCRIPT` as our direct child (bash execs it), in its own session for cleanup."""
    return trees.spawn(f"exec sh -c '{script}'").launcher


@kernel
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_shell_is_recorded_with_its_signal(
        events: ProcessEvents, trees: Trees, sig: signal.Signals) -> None:
    after = time.time()
    shell = spawn_shell(trees, "sleep 1000")
    wait_for(lambda: children_of(shell.pid), what="sh to start sleep")  # sh is running
    shell.send_signal(sig)
    died = child_exit(events, shell, after=after)
    assert shell.returncode == -sig
    assert (died.signal, died.status) == (int(sig), None)
    assert died.exit_code & 0x7F == int(sig)
    assert died.parent_pid == my_host_pid(events)
    assert after <= died.at <= time.time() + 0.01


@kernel
def test_shell_exiting_by_itself_is_recorded_with_its_status(
        events: ProcessEvents, trees: Trees) -> None:
    after = time.time()
    shell = spawn_shell(trees, "exit 3")
    died = child_exit(events, shell, after=after)
    assert shell.returncode == 3
    assert (died.status, died.signal, died.exit_code) == (3, None, 3 << 8)
    assert died.parent_pid == my_host_pid(events)
    assert events.exit_of(died.pid, after=after) == died
    # A process that started after this exit (the pid reused) is not answered with it.
    assert events.exit_of(died.pid, after=died.at + 0.001) is None
    assert events.exit_of(died.pid, after=time.time() + 1) is None
    counts = events.counts()
    assert tuple(counts) == KINDS and counts["exit"] >= 1


@kernel
def test_listener_keeps_its_store_bounds_on_real_events(trees: Trees) -> None:
    clock = FakeClock(time.time())
    listener = start_or_skip(max_records=3, retention=30.0, clock=clock)
    try:
        base = listener.counts()["exit"]
        shell = spawn_shell(trees, "for i in $(seq 20); do /bin/true; done")
        assert shell.wait(timeout=30) == 0
        wait_for(lambda: listener.counts()["exit"] - base >= 20, what="20 exits to be read")
        held = listener.records()
        assert 1 <= len(held) <= 3  # the count bound, whatever else exited meanwhile
        clock.now += 31.0  # everything held is now older than retention
        assert not set(held) & set(listener.records())
        assert all(listener.exit_of(r.pid, after=0) is None for r in held)
    finally:
        listener.stop()


@kernel
def test_burst_of_exits_is_recorded_or_counted_as_dropped(
        events: ProcessEvents, trees: Trees) -> None:
    after = time.time()
    dropped_before = events.counts()["dropped"]
    shell = spawn_shell(trees, f"for i in $(seq {BURST}); do /bin/true; done")
    sh = child_exit(events, shell, after=after, timeout=120)
    assert shell.returncode == 0

    def burst() -> tuple[int, int]:
        # The sh reaps each child at once, so a few events lose the parent (None) to the
        # race; every child exited between `after` and the sh's own exit.
        recorded = sum(1 for e in events.records()
                       if e.parent_pid in (sh.pid, None) and e.status == 0
                       and after <= e.at <= sh.at)
        return recorded, events.counts()["dropped"] - dropped_before

    # The sh's exit came after every child's and was read after theirs: all are in.
    recorded, dropped = burst()
    assert recorded + dropped >= BURST, f"{recorded} recorded + {dropped} dropped < {BURST}"
    assert recorded >= BURST // 2, f"only {recorded} of {BURST} recorded ({dropped} dropped)"
    if recorded < BURST:
        assert dropped > 0, f"{BURST - recorded} exits missing and none counted as dropped"


@kernel
def test_overrun_is_counted_and_logged_never_silent(
        trees: Trees, caplog: pytest.LogCaptureFixture) -> None:
    listener = start_or_skip(receive_buffer=4096)
    try:
        with caplog.at_level(logging.WARNING, logger="gpuguard.host.procevents"):
            # Stall the reader on the store while a burst fills the small socket buffer.
            with listener._store._lock:
                shell = spawn_shell(trees, "for i in $(seq 300); do /bin/true; done")
                assert shell.wait(timeout=60) == 0
            wait_for(lambda: listener.counts()["dropped"] > 0, what="drops to be counted")
            wait_for(lambda: any("overrun" in r.getMessage() for r in caplog.records),
                     what="the overrun warning")
        assert listener.alive()  # an overrun does not stop the reader
        warnings = [r for r in caplog.records if "overrun" in r.getMessage()]
        assert len(warnings) == 1  # rate-limited
        # Roughly the burst: 300 exits (and, unfiltered, forks and execs) in a ~9-event buffer.
        assert listener.counts()["dropped"] >= 100
    finally:
        listener.stop()


def run_listener_in(wrapper: list[str], *, allow: bool) -> dict:
    """Start a listener in a child process under `wrapper` (unshare ...); its report."""
    if shutil.which(wrapper[0]) is None:
        pytest.skip(f"{wrapper[0]} not installed")
    code = (
        "import json, logging, os, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from gpuguard.host.events.listener import ProcessEvents\n"
        f"e = ProcessEvents(allow_pid_namespace={allow})\n"
        "e.start()\n"
        "print(json.dumps({'available': e.available, 'reason': e.unavailable_reason,"
        " 'host_pid': e.host_pid, 'pid': os.getpid(), 'initial': e.initial_pid_namespace,"
        " 'filtered': e.filtered}))\n"
        "e.stop()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([*wrapper, sys.executable, "-c", code], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 and "unshare" in proc.stderr:
        pytest.skip(f"cannot create namespaces here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["warnings"] = proc.stderr.count("WARNING:gpuguard.host.procevents")
    return report


def test_network_namespace_without_connector_is_unavailable_with_one_warning() -> None:
    report = run_listener_in(["unshare", "--net"], allow=True)
    assert not report["available"] and "ECONNREFUSED" in report["reason"]
    assert report["warnings"] == 1


@kernel
def test_child_pid_namespace_gets_host_pids_only_when_allowed(events: ProcessEvents) -> None:
    """Verified on 6.18: from a child PID namespace the kernel ignores the subscription
    (no acknowledgement, no filter) yet delivers every event to the bound socket, with
    pids of the initial namespace; the listener refuses that unless allowed."""
    wrapper = ["unshare", "--pid", "--fork", "--mount-proc"]
    refused = run_listener_in(wrapper, allow=False)
    assert not refused["available"] and "PID namespace" in refused["reason"]
    assert refused["warnings"] == 1
    allowed = run_listener_in(wrapper, allow=True)
    assert allowed["available"] and not allowed["initial"] and not allowed["filtered"]
    assert allowed["pid"] == 1 and allowed["host_pid"] not in (None, 1)


@kernel
def test_caught_up_reads_every_exit_queued_before_it(events: ProcessEvents) -> None:
    """The reader reads in paced batches (up to MAX_PACE_S apart): an exit a moment old
    may still be queued. A first reading of an orphan pins its launcher reason, so the
    readers ask caught_up() before concluding "unrecorded" (ProcessView.launcher_exit):
    every exit reaped before the call is recorded once it returns, without a poll."""
    for _ in range(20):
        proc = subprocess.Popen(["sleep", "30"])
        started = time.time() - 1
        proc.kill()
        proc.wait()
        assert events.caught_up(), "the reader did not drain in time"
        found = events.exit_of(proc.pid, after=started)
        assert found is not None and found.signal == signal.SIGKILL
