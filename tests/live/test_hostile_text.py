"""One process's hostile text never blinds a scan (issue 48): real processes, real /proc,
the fake NVML, the exporter's scanner, the remediator, the console.

`GPUGUARD_RUN=<5000 digits>:1` in one GPU job's environment made `int()` raise (Python's
digit limit) in the environment's parser, which nothing caught short of the scan's last
resort: every tree of the host vanished from the scan, every inspection failed, and
`gpuguard status`/`node-check` crashed. Now the marker is parsed with bounds (a malformed
one names no launcher, as `abc:1` never did), and the neighbour's tree is judged as ever.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.scanner import Scanner
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.procfs import MARKER_DIGITS, ProcessView, parse_environ_markers
from gpuguard.orphans.classify import classify
from gpuguard.orphans.process import Holder, ProcUnreadable
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import Verdict
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees
from tests.support.remediator_harness import (
    SH_CHAIN,
    Harness,
    Orphan,
    Run,
    account,
    alert,
    payload,
    spawn_orphan,
)

#: The hostile job: the same chain, its holder's environment carrying a 5,000-digit run
#: marker (past Python's 4,300-digit int() limit).
HOSTILE = ('sh -c "GPUGUARD_RUN=' + "9" * 5000 + ':1 {holder} --pidfile {dir}/holder" & '
           'echo $! > {dir}/root; wait')


def two_orphans(trees: Trees, fake_gpu: FakeGpuWorld) -> tuple[Orphan, Orphan]:
    """An ordinary orphan tree and, beside it, the hostile one."""
    return spawn_orphan(trees, fake_gpu, SH_CHAIN), spawn_orphan(trees, fake_gpu, HOSTILE)


def test_a_huge_run_marker_blinds_no_scan(trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    plain, hostile = two_orphans(trees, fake_gpu)
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=counters),
                      view=ProcessView(counters=counters), counters=counters)
    snap = scanner.scan_once()
    assert [e for e in snap.errors if e[0] == "scan"] == [], snap.errors
    verdicts = {t.root_pid: (t.verdict, t.reason) for t in snap.trees}
    assert verdicts[plain.root][0] == "orphan", verdicts
    # A marker that names no launcher is no marker, as a malformed one always was.
    assert verdicts[hostile.root][0] == "orphan", verdicts
    assert set(snap.orphans) == {(plain.root, plain.root_start),
                                 (hostile.root, hostile.root_start)}


def test_the_remediator_inspects_beside_a_huge_run_marker(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    plain, _ = two_orphans(trees, fake_gpu)
    h = harness(mode="dry-run", reasons=["session-ended", "launcher-unrecorded"])
    answer = account(h.post(payload(alert(plain.root, plain.root_start))))
    assert answer["status"] == "accepted", answer
    h.settle()
    (record,) = [r for r in h.audit() if r["key"]["root_pid"] == plain.root
                 and r["phase"] == "final"]
    # inspected, found an orphan and decided (dry-run: every step but the signals)
    assert record["decision"]["action"] == "dry-run", record["decision"]
    assert record["decision"]["reason"] == "session-ended", record["decision"]
    assert record["signals"] == [] and plain.all_alive()


def test_status_and_node_check_answer_beside_a_huge_run_marker(
        gpuguard: Run, trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    plain, hostile = two_orphans(trees, fake_gpu)
    done = gpuguard("status", "--json")
    assert done.returncode == 0, done.stderr
    roots = {t["root_pid"]: t["verdict"] for t in json.loads(done.stdout)["trees"]}
    assert roots == {plain.root: "orphan", hostile.root: "orphan"}, roots
    done = gpuguard("node-check", "--json")
    assert done.returncode == 1, done.stderr  # two orphan trees: not clean, no crash
    doc = json.loads(done.stdout)
    assert {t["root_pid"] for t in doc["remaining"]["trees"]} == {plain.root, hostile.root}
    assert "Traceback" not in done.stderr


# -- every reader, fed hostile text (a fake /proc root: the files any process writes) -----

#: Runs of digits a user may write: past int()'s limit, past a 64-bit count, non-ASCII
#: digits that str.isdigit() accepts ('²' even int() refuses), and plain ones.
DIGIT_RUNS = st.sampled_from(["9" * 5000, "1" * 4301, "9" * 21, "18446744073709551616",
                              "²", "٣٤", "１２", "7", "0", "", "-1", "0x10"])
#: Any text a file can hold: no lone surrogates (no encoding writes them).
TEXT = st.characters(blacklist_categories=("Cs",))
VALUES = st.lists(st.one_of(DIGIT_RUNS, st.text(TEXT, max_size=12)), max_size=4).map(":".join)
ENTRIES = st.one_of(
    VALUES.map(lambda v: f"GPUGUARD_RUN={v}".encode()),
    st.just(b"GPUGUARD_KEEP=1"),
    st.just(b"GPUGUARD_KEEP=1\0"),  # a NUL inside: two entries
    st.binary(max_size=40),
    st.text(TEXT, max_size=30).map(str.encode),
)
ENVIRONS = st.lists(ENTRIES, max_size=6).map(b"\0".join)
LINES = st.lists(st.one_of(VALUES, st.text(TEXT, max_size=30)), max_size=5).map("\n".join)
COMMS = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
                max_size=32)
PID = 4242


def fake_proc(root: Path, *, comm: str, environ: bytes, cmdline: bytes, cgroup: str,
              status: str, children: str) -> None:
    """/proc/PID as a process with this text would make it (stat's numbers the kernel's)."""
    own = root / str(PID)
    (own / "task" / str(PID)).mkdir(parents=True)
    stat = f"{PID} ({comm}) S 1 {PID} {PID} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 987654 0 0\n"
    (own / "stat").write_text(stat)
    (own / "task" / str(PID) / "stat").write_text(stat)
    (own / "task" / str(PID) / "children").write_text(children)
    (own / "environ").write_bytes(environ)
    (own / "cmdline").write_bytes(cmdline)
    (own / "cgroup").write_text(cgroup)
    (own / "status").write_text(f"Name:\t{comm}\n{status}\nNSpid:\t{PID}\n")
    (root / "stat").write_text("btime 1700000000\n")
    if os.geteuid() == 0:  # a user's process: stat alone names its owner (procfs.owner_uid)
        for path in (own, *own.rglob("*")):
            os.chown(path, 1000, 1000)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ENVIRONS)
def test_environ_markers_take_only_bounded_ascii_numbers(raw: bytes) -> None:
    for complete in (True, False):
        markers = parse_environ_markers(raw, complete=complete)
        if markers is not None and markers.run is not None:
            assert all(0 <= n < 10**MARKER_DIGITS for n in markers.run), markers


@settings(max_examples=150, deadline=None, derandomize=True)
@given(comm=COMMS, environ=ENVIRONS, cmdline=ENVIRONS, cgroup=LINES,
       status=LINES, children=LINES)
def test_every_reader_answers_or_says_unreadable_never_raises(
        comm: str, environ: bytes, cmdline: bytes, cgroup: str, status: str,
        children: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fake_proc(Path(tmp), comm=comm, environ=environ, cmdline=cmdline, cgroup=cgroup,
                  status=status, children=children)
        view = ProcessView(proc_root=tmp, counters=Counters())
        info = view.stat(PID)
        assert info is not None and info.comm == comm.encode().decode("utf-8", "replace")
        readers: list[Callable[[], object]] = [
            lambda: view.cmdline(info), lambda: view.cgroup(info),
            lambda: view.status(info), lambda: view.keep_marker(info),
            lambda: view.run_launcher(info), lambda: view.daemon_io(info),
            lambda: view.children(PID), lambda: view.thread_states(PID)]
        for read in readers:
            try:
                read()
            except ProcUnreadable as exc:
                assert f"/proc/{PID}/" in str(exc) and len(str(exc)) < 400
        # and the classifier over it: a verdict for the holder, whatever it read
        view.begin_scan()
        (tree,) = classify([Holder(PID, "GPU-0", 0, 1, "C")], view, Rules())
        assert tree.verdict in Verdict


def test_a_file_no_parser_takes_reads_unreadable_not_an_exception(tmp_path: Path) -> None:
    fake_proc(tmp_path, comm="x", environ=b"A=1\0", cmdline=b"x\0", cgroup="0::/",
              status="SigIgn:\t²", children="12 ²")
    view = ProcessView(proc_root=str(tmp_path), counters=Counters())
    info = view.stat(PID)
    assert info is not None
    with pytest.raises(ProcUnreadable, match=f"/proc/{PID}/status: could not be parsed"):
        view.status(info)
    with pytest.raises(ProcUnreadable, match=f"/proc/{PID}/task/\\*/children"):
        view.children(PID)
