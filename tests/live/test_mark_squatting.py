"""A neighbour cannot take a tree's registration names (issue 36, item 1).

`gpuguard keep PID` and `gpuguard run` register a process at a name anyone can compute
(`keep-PID-START`, `run-PID-START`: /proc/PID/stat is public). When users wrote those
files into a world-writable sticky directory, Bob could write Alice's names first: her
tree read `unknown` (blamed on an "unreadable environment"), she could not remove his
file, and a loop doing it for every new process turned reaping off for the host.

Now the exporter's registrar writes registrations, for the caller's own processes only
(SO_PEERCRED), into a directory only the daemons' user may write. Two real local users
(uids without passwd entries, through setpriv), a real exporter serving the registrar,
real orphaned trees over the fake NVML, and the in-process remediator:

- before: Bob takes the names of Alice's tree in the old layout (mode 1733), then the
  exporter starts; his files protect nothing (orphan, not unknown), are counted on both
  daemons, and Alice's `gpuguard keep` and `gpuguard run` registrations still protect;
- after: Alice registers first; Bob can neither write, replace nor remove a name, nor
  have the registrar register or unregister anything of hers, and a tree of hers he
  tries to protect stays an orphan.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuguard.host.marks import FOREIGN, Marks, ensure_marks_dir, mark_name
from gpuguard.host.procfs import boot_id
from gpuguard.host.registrar import NOT_OWNER, REQUEST_DEADLINE, Registrar, request
from gpuguard.orphans.rules_config import Rules
from gpuguard.orphans.vocabulary import Reason
from tests.live.test_missing_evidence import deliver, one_tree
from tests.live.test_run import CMD, LAUNCHER
from tests.support.ci import require
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import HOLDER, Trees, environment_in_place, stat_fields, wait_for
from tests.support.remediator_harness import GIB, Harness, Orphan, start_time_of
from tests.support.servers import REPO, Exporter, child_env, find

ALICE, BOB = 64311, 64312

#: bash (the launcher, killed) -> sh (the root, Alice) -> sleep (the holder, Alice). The
#: pids go out through files the launcher opened: Alice may not enter the test's folders.
ALICE_TREE = (f"setpriv --reuid={ALICE} --regid={ALICE} --clear-groups "
              "sh -c 'sleep 3600 & echo $! >&3; wait' 3>{dir}/holder & "
              "echo $! > {dir}/root; wait")


@functools.cache
def as_user(uid: int) -> tuple[str, ...]:
    """setpriv to `uid` with no capabilities, or, where this Python lives in a folder only
    root may enter (a pyenv under /root), with CAP_DAC_READ_SEARCH alone to reach it (as
    tests/live/test_run.py does): it reads, it writes nothing the uid could not."""
    plain = ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")
    probe = [sys.executable, "-c", "import subprocess, sys; import gpuguard.console.run.launcher; "
             "subprocess.run([sys.executable, '-c', ''], check=True)"]
    if subprocess.run([*plain, *probe], cwd="/", env=child_env(), capture_output=True,
                      check=False, timeout=60).returncode == 0:
        return plain
    return (*plain, "--inh-caps", "+dac_read_search", "--ambient-caps", "+dac_read_search")


@dataclass
class Site:
    """A host's /run/gpuguard: run/ (0755, the daemons') holding marks/ and the socket."""

    base: Path
    run: Path
    marks: Path
    config: Path
    env: dict[str, str]

    def gpuguard(self, uid: int, *args: str) -> subprocess.CompletedProcess:
        """`gpuguard ARGS --marks-dir MARKS` as `uid`."""
        return subprocess.run([*as_user(uid), sys.executable, "-m", "gpuguard.console", *args,
                               "--marks-dir", str(self.marks)], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=60, check=False)

    def squat(self, uid: int, name: str) -> subprocess.CompletedProcess:
        """`uid` writes this boot's id at `name` in the registration directory."""
        script = ("import sys; open(sys.argv[1], 'w').write(sys.argv[2])")
        return subprocess.run([*as_user(uid), sys.executable, "-c", script,
                               str(self.marks / name), boot_id() + "\n"],
                              capture_output=True, text=True, timeout=30, check=False)

    def rules(self) -> Rules:
        return Rules(marks_dir=str(self.marks))


@pytest.fixture
def site(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> Iterator[Site]:
    require(os.geteuid() == 0, "needs root to run processes as two other uids")
    require(shutil.which("setpriv"), "setpriv not found (util-linux)")
    base = Path(tempfile.mkdtemp(prefix="gpuguard-marks-"))
    base.chmod(0o755)  # Alice and Bob reach the socket and the directory, as on a host
    run = base / "run"
    run.mkdir(mode=0o755)
    config = base / "gpuguard.yml"
    config.write_text(f"classify:\n  marks_dir: {run / 'marks'}\n")
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))
    try:
        yield Site(base, run, run / "marks", config, env)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def exporter(site: Site) -> Iterator[Callable[[], Exporter]]:
    started: list[Exporter] = []

    def start() -> Exporter:
        exp = Exporter(env=site.env, args=["--config", str(site.config)])
        started.append(exp)
        assert (site.run / "register.sock").is_socket(), exp.stderr()
        return exp

    yield start
    for exp in started:
        exp.stop()


def alice_orphan(trees: Trees, fake_gpu: FakeGpuWorld) -> Orphan:
    tree = trees.spawn(ALICE_TREE)
    holder, root = tree.pid("holder"), tree.pid("root")
    wait_for(lambda: (stat_fields(holder) or {}).get("comm") == "sleep"
             and environment_in_place(holder), what="the holder to exec sleep")
    assert os.stat(f"/proc/{holder}").st_uid == os.stat(f"/proc/{root}").st_uid == ALICE
    fake_gpu.add_process(0, holder, 2 * GIB)
    tree.kill_launcher()
    return Orphan(tree, root, start_time_of(root), holder)


def names_of(orphan: Orphan) -> list[str]:
    return [mark_name("keep", pid, start_time_of(pid)) for pid in orphan.members]


def foreign_on(exp: Exporter, at_least: int) -> float:
    def counted() -> float | None:
        found = find(exp.scrape(), "gpuguard_foreign_marks_total")
        value = found[0][1] if found else 0.0
        return value if value >= at_least else None

    return float(str(wait_for(counted, what=f"gpuguard_foreign_marks_total >= {at_least}")))


def remediator_foreign(h: Harness) -> float:
    text = h.client.get("/metrics").get_data(as_text=True)
    (line,) = [x for x in text.splitlines() if x.startswith("gpuguard_foreign_marks_total ")]
    return float(line.split()[1])


def old_layout(site: Site) -> None:
    """The registration directory as the daemons left it before: sticky, writable by all."""
    site.marks.mkdir(mode=0o1733)
    site.marks.chmod(0o1733)


# -- before: Bob takes the names first ---------------------------------------------------


def test_names_taken_before_the_owner_registers_protect_nothing_and_block_nothing(
        site: Site, exporter: Callable[[], Exporter], trees: Trees, fake_gpu: FakeGpuWorld,
        harness: Callable[..., Harness]) -> None:
    old_layout(site)
    orphan = alice_orphan(trees, fake_gpu)
    for name in names_of(orphan):  # every member Bob can see in /proc
        taken = site.squat(BOB, name)
        assert taken.returncode == 0, taken.stderr
        assert (site.marks / name).stat().st_uid == BOB
    exp = exporter()  # the upgraded exporter starts: the directory is closed to others
    assert site.marks.stat().st_mode & 0o7777 == 0o755
    before = FOREIGN.total()

    # Bob's files protect nothing and are not "cannot tell": Alice's tree is an orphan.
    tree = one_tree(orphan.root, rules=site.rules())
    assert (tree.verdict, tree.root_pid) == ("orphan", orphan.root), tree.evidence
    assert FOREIGN.total() >= before + len(orphan.members)  # each counted once...
    again = FOREIGN.total()
    one_tree(orphan.root, rules=site.rules())
    assert FOREIGN.total() == again  # ...not once per scan
    assert foreign_on(exp, len(orphan.members)) >= len(orphan.members)  # the exporter's

    # Alice's own registration still protects: the registrar writes over Bob's file.
    kept = site.gpuguard(ALICE, "keep", str(orphan.root))
    assert kept.returncode == 0, kept.stderr
    name = mark_name("keep", orphan.root, orphan.root_start)
    assert (site.marks / name).stat().st_uid == 0  # the daemons' file now, not Bob's
    tree = one_tree(orphan.root, rules=site.rules())
    assert (tree.verdict, tree.reason) == ("protected", Reason.KEEP_MARKER), tree.evidence
    h = harness(classify={"marks_dir": str(site.marks)})
    record = deliver(h, orphan.root, orphan.root_start)
    assert record["signals"] == [] and orphan.all_alive(), record
    assert record["decision"]["action"] != "reap", record["decision"]
    assert remediator_foreign(h) >= 1  # the holder's name is still Bob's file


def test_a_run_name_taken_before_the_launcher_registers_does_not_detach_it(
        site: Site, exporter: Callable[[], Exporter], trees: Trees, fake_gpu: FakeGpuWorld,
        gpuguard: Callable[..., subprocess.CompletedProcess]) -> None:
    """Alice's `gpuguard run` is held before it execs (its pid and start time are then
    final), Bob writes its run name in the old layout, the exporter starts; once the
    launcher runs, its registration (not Bob's file) attaches the daemon it adopted,
    though the daemon erased GPUGUARD_RUN from its environment."""
    old_layout(site)
    d = Path(tempfile.mkdtemp(prefix="run-", dir=site.base))
    d.chmod(0o777)
    (d / "cmd.py").write_text(CMD)
    # --tier subreaper: the pidns tier's user namespace drops the ambient capability
    # as_user() may need to reach this Python; names, not tiers, are what this test is about.
    argv = [*as_user(ALICE), *LAUNCHER, "--tier", "subreaper", "--marks-dir", str(site.marks), "--",
            sys.executable, str(d / "cmd.py"), str(d), f"erased-daemon={HOLDER}",
            "await=daemon"]
    held = (f"sh -c 'echo $$ > {d}/pre; kill -STOP $$; exec \"$@\"' sh "
            + " ".join(f"'{a}'" for a in argv) + f" 2> {d}/stderr; wait")
    trees.spawn(held, env=site.env)
    pre = int(str(wait_for(lambda: (d / "pre").exists() and (d / "pre").read_text().strip(),
                           what="the held launcher")))
    wait_for(lambda: (stat_fields(pre) or {}).get("state") == "T", what="the launcher held")
    name = mark_name("run", pre, start_time_of(pre))
    assert site.squat(BOB, name).returncode == 0
    exporter()
    os.kill(pre, signal.SIGCONT)
    try:
        daemon = int(str(wait_for(lambda: (d / "daemon").exists()
                                  and (d / "daemon").read_text().strip(), what="the daemon")))
    except AssertionError:
        raise AssertionError((d / "stderr").read_text() if (d / "stderr").exists()
                             else "no stderr") from None
    trees.pids.append((daemon, stat_fields(daemon)))
    trees.pids.append((pre, stat_fields(pre)))
    # Adopted by the launcher once the middle process has exited, on its own time.
    wait_for(lambda: (stat_fields(daemon) or {}).get("ppid") == pre, what="the adoption")
    assert os.stat(f"/proc/{daemon}").st_uid == ALICE
    assert set(Path(f"/proc/{daemon}/environ").read_bytes()) == {0}
    assert (site.marks / name).stat().st_uid == 0, (d / "stderr").read_text()
    fake_gpu.add_process(0, daemon, GIB)
    status = tree_json(gpuguard, daemon, site)
    assert (status["verdict"], status["reason"]) == ("normal", "run-launcher"), status
    os.kill(pre, signal.SIGTERM)
    wait_for(lambda: not (site.marks / name).exists(), what="the launcher to unregister")


def tree_json(gpuguard: Callable[..., subprocess.CompletedProcess], pid: int,
              site: Site) -> dict:
    import json

    proc = gpuguard("status", "--json", "--config", str(site.config))
    assert proc.returncode == 0, proc.stderr
    (tree,) = [t for t in json.loads(proc.stdout)["trees"]
               if pid in [h["pid"] for h in t["holders"]]]
    return tree


# -- after: Alice registers first ---------------------------------------------------------


def test_names_taken_after_the_owner_registers_cannot_be_taken_at_all(
        site: Site, exporter: Callable[[], Exporter], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    exporter()
    kept, other = alice_orphan(trees, fake_gpu), alice_orphan(trees, fake_gpu)
    done = site.gpuguard(ALICE, "keep", str(kept.root))
    assert done.returncode == 0, done.stderr
    before = FOREIGN.total()

    name = mark_name("keep", kept.root, kept.root_start)
    assert site.squat(BOB, name).returncode != 0  # cannot write or replace it
    assert "Permission denied" in site.squat(BOB, name).stderr
    removed = site.gpuguard(BOB, "keep", "--remove", str(kept.root))
    assert removed.returncode == 6, removed.stderr  # the console refuses before asking
    for pid in (kept.root, other.root, other.holder):
        refused = site.gpuguard(BOB, "keep", str(pid))
        assert refused.returncode == 6 and "belongs to uid" in refused.stderr, refused.stderr
    # The registrar itself refuses him, whatever a client says (SO_PEERCRED):
    bob_asks = subprocess.run(
        [*as_user(BOB), sys.executable, "-c",
         "import sys; from gpuguard.host.registrar import request, Refused\n"
         "try: request(sys.argv[1], sys.argv[2], 'keep', int(sys.argv[3]), int(sys.argv[4]))\n"
         "except Refused as e: print(e.code)\n",
         str(site.run / "register.sock"), "unregister", str(kept.root), str(kept.root_start)],
        cwd=REPO, env=site.env, capture_output=True, text=True, timeout=30, check=False)
    assert bob_asks.stdout.strip() == NOT_OWNER, bob_asks.stderr

    tree = one_tree(kept.root, rules=site.rules())
    assert (tree.verdict, tree.reason) == ("protected", Reason.KEEP_MARKER), tree.evidence
    tree = one_tree(other.root, rules=site.rules())
    assert (tree.verdict, tree.root_pid) == ("orphan", other.root), tree.evidence
    assert sorted(p.name for p in site.marks.iterdir()) == [name]
    assert FOREIGN.total() == before  # no foreign file could be made


# -- the reader's rule, with a daemons' user that is not root ------------------------------


def test_a_file_of_the_directorys_owner_counts_and_another_users_is_foreign(
        tmp_path: Path) -> None:
    require(os.geteuid() == 0, "needs root to chown")
    marks = tmp_path / "marks"
    marks.mkdir(mode=0o755)
    me = os.getpid()
    start = start_time_of(me)
    uid = os.stat(f"/proc/{me}").st_uid
    reader = Marks(str(marks), boot_id())
    path = marks / mark_name("keep", me, start)
    path.write_text(boot_id() + "\n")
    os.chown(marks, 64320, 64320)  # the daemons' user (gpuguard), not root
    os.chown(path, 64320, 64320)
    assert reader.has("keep", me, start, uid=ALICE) is True
    os.chown(path, BOB, BOB)
    before = FOREIGN.total()
    assert reader.has("keep", me, start, uid=ALICE) is False  # not None: blocks nothing
    assert reader.has("keep", me, start, uid=ALICE) is False
    assert FOREIGN.total() == before + 1
    path.unlink()
    os.symlink("/etc/hostname", path)
    assert reader.has("keep", me, start, uid=uid) is False
    assert FOREIGN.total() == before + 2
    assert ensure_marks_dir(str(marks)) is None


# -- the registrar's bounds -----------------------------------------------------------------

#: Bob opens N connections to the socket and says nothing; "ready" once they are open.
SILENT = ("import socket, sys, time\n"
          "held = []\n"
          "for _ in range(int(sys.argv[2])):\n"
          "    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); held.append(s)\n"
          "print('ready', flush=True); time.sleep(60)\n")


#: Connects and says nothing: prints `closed` once the registrar closes it unanswered.
CLOSED = ("import socket, sys\n"
          "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.settimeout(10)\n"
          "print('closed' if s.recv(1) == b'' else 'answered', flush=True)\n")


def test_a_neighbour_holding_connections_open_does_not_keep_the_owner_out(
        site: Site, exporter: Callable[[], Exporter], trees: Trees,
        fake_gpu: FakeGpuWorld) -> None:
    """Bob holds 20 connections open without a word (the registrar keeps 4 per uid, each
    until its 2 s deadline): Alice's registration is answered at once, not after them."""
    exporter()
    orphan = alice_orphan(trees, fake_gpu)
    sock = str(site.run / "register.sock")
    bob = subprocess.Popen([*as_user(BOB), sys.executable, "-c", SILENT, sock, "20"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert bob.stdout is not None and bob.stdout.readline().strip() == "ready"
        started = time.monotonic()
        assert request(sock, "register", "keep", orphan.holder,
                       start_time_of(orphan.holder)) == "registered"
        waited = time.monotonic() - started
        assert waited < REQUEST_DEADLINE / 2, waited  # measured: 3.8 ms, 2 loaded cores
        kept = site.gpuguard(ALICE, "keep", str(orphan.root))
        assert kept.returncode == 0, kept.stderr
    finally:
        bob.kill()
        bob.wait(timeout=10)
    tree = one_tree(orphan.root, rules=site.rules())
    assert (tree.verdict, tree.reason) == ("protected", Reason.KEEP_MARKER), tree.evidence


def test_a_neighbour_with_many_uids_filling_every_slot_does_not_keep_the_owner_out(
        site: Site, trees: Trees, fake_gpu: FakeGpuWorld) -> None:
    """Bob's subordinate uids (a user namespace maps him 65,536 of them) hold 4 silent
    connections each until every slot is taken: Alice's registration used to be closed
    unanswered; now it takes the slot of the oldest connection of a uid holding more."""
    assert ensure_marks_dir(str(site.marks)) is None
    registrar = Registrar(str(site.marks), max_connections=8)
    registrar.start()
    sock = registrar.socket_path
    orphan = alice_orphan(trees, fake_gpu)
    bobs = [subprocess.Popen([*as_user(uid), sys.executable, "-c", SILENT, sock, "4"],
                             stdout=subprocess.PIPE, text=True) for uid in (BOB, BOB + 1)]
    try:
        for bob in bobs:
            assert bob.stdout is not None and bob.stdout.readline().strip() == "ready"
        wait_for(lambda: registrar.connections == 8, what="every slot taken")
        # A uid at its own limit takes nobody's slot: its fifth connection is closed.
        fifth = subprocess.run([*as_user(BOB + 1), sys.executable, "-c", CLOSED, sock],
                               capture_output=True, text=True, timeout=30, check=False)
        assert fifth.stdout.strip() == "closed", fifth
        assert registrar.evicted == 0 and registrar.connections == 8
        kept = site.gpuguard(ALICE, "keep", str(orphan.root))
        assert kept.returncode == 0, kept.stderr
        assert registrar.evicted == 1  # one of Bob's, closed unanswered
        wait_for(lambda: registrar.connections == 7, what="Alice's connection closed")
    finally:
        for bob in bobs:
            bob.kill()
            bob.wait(timeout=10)
        registrar.stop()
    tree = one_tree(orphan.root, rules=site.rules())
    assert (tree.verdict, tree.reason) == ("protected", Reason.KEEP_MARKER), tree.evidence


def test_registrations_of_processes_that_are_gone_are_swept(
        site: Site, trees: Trees) -> None:
    """Every prune_every registrations the registrar removes those whose process is gone:
    a user who registers many short-lived processes cannot fill /run."""
    assert ensure_marks_dir(str(site.marks)) is None
    registrar = Registrar(str(site.marks), prune_every=4)
    registrar.start()
    sock = registrar.socket_path
    try:
        short = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
        for proc in short:
            assert request(sock, "register", "keep", proc.pid,
                           start_time_of(proc.pid)) == "registered"
        for proc in short:
            proc.kill()
            proc.wait(timeout=10)
        me = os.getpid()
        assert len(list(site.marks.iterdir())) == 3
        assert request(sock, "register", "keep", me, start_time_of(me)) == "registered"
        assert [p.name for p in site.marks.iterdir()] == [
            mark_name("keep", me, start_time_of(me))]
    finally:
        registrar.stop()
    assert not Path(sock).exists()


def test_run_without_a_registrar_says_so_and_runs_cmd(site: Site) -> None:
    """Where the daemons' directory exists but nothing listens, `gpuguard run` says so in
    one line and runs CMD anyway; where it does not exist (gpuguard not deployed), it
    says nothing, as before."""
    site.marks.mkdir(mode=0o755)
    done = subprocess.run([*LAUNCHER, "--marks-dir", str(site.marks), "--", "sh", "-c",
                           "echo ran"], cwd=REPO, env=site.env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("gpuguard run: not registered: no gpuguard registrar listens"), line
    assert line.endswith("only the GPUGUARD_RUN environment marker names this launcher")
    elsewhere = subprocess.run([*LAUNCHER, "--marks-dir", str(site.base / "none" / "marks"),
                                "--", "true"], cwd=REPO, env=site.env, capture_output=True,
                               text=True, timeout=60, check=False)
    assert (elsewhere.returncode, elsewhere.stderr) == (0, "")


def test_a_run_registration_is_made_by_the_launcher_itself_or_root(site: Site) -> None:
    """A subreaper's adoptions are about that one process: Alice may keep any process of
    hers, but have a `run` registration written only for the process that asks."""
    from gpuguard.host.procfs import ProcessView
    from gpuguard.host.registrar import NOT_SELF, Caller, decide

    sleeper = subprocess.Popen([*as_user(ALICE), "sleep", "600"])
    try:
        wait_for(lambda: os.stat(f"/proc/{sleeper.pid}").st_uid == ALICE
                 and (stat_fields(sleeper.pid) or {}).get("comm") == "sleep",
                 what="sleep as Alice")
        start = start_time_of(sleeper.pid)
        view = ProcessView()
        other = Caller(pid=os.getpid(), uid=ALICE)  # another process of hers asks
        assert decide(other, "register", "keep", sleeper.pid, start, view) is None
        refusal = decide(other, "register", "run", sleeper.pid, start, view)
        assert refusal is not None and refusal[0] == NOT_SELF
        itself = Caller(pid=sleeper.pid, uid=ALICE)
        assert decide(itself, "register", "run", sleeper.pid, start, view) is None
        assert decide(Caller(pid=os.getpid(), uid=0), "register", "run", sleeper.pid, start,
                      view) is None
        bob = decide(Caller(pid=os.getpid(), uid=BOB), "register", "keep", sleeper.pid,
                     start, view)
        assert bob is not None and bob[0] == NOT_OWNER
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
