"""The daemons as their systemd units run them: another uid, only the units' capabilities.

There is no systemd as PID 1 here, so `setpriv` does what the units' User=,
AmbientCapabilities=, CapabilityBoundingSet= and NoNewPrivileges= do, and a small
libseccomp loader applies their SystemCallFilter= and RestrictAddressFamilies=. The
capabilities are read from deploy/systemd/*.service, so the units and this proof cannot
drift apart. The GPU jobs belong to yet another uid and are orphaned by killing their
launcher; both uids are unused numbers (no passwd entry needed).

Shown: with exactly the unit's capabilities the exporter classifies the other user's trees
(orphan; protected by GPUGUARD_KEEP=1 in its environ; normal, detached on purpose, by its
cwd and stdin) and the remediator reaps the orphan and audits it; without any one of them
(each capability in turn), neither gives a wrong verdict: the trees read unknown or the
reap is refused or aborted with the reason, the tree is left as it was, and the daemon
names the missing capability at start. A capability whose removal changes nothing fails
these tests: it is not needed.

Not shown (no GPU here; a fake libnvidia-ml.so.1 stands in): that the units' DeviceAllow=
reaches the NVIDIA device nodes. The other hardening (ProtectSystem=, ...) needs systemd.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from packaging.requirements import Requirement

from gpuguard.exporter.procfs import in_host_pid_namespace
from tests.ci import require
from tests.fakenvml import LIBRARY_NAME, STATE_ENV, FakeGpuWorld
from tests.proctree import HOLDER, Tree, Trees, alive, stat_fields, wait_for
from tests.remediator_helpers import HOST, alert, payload
from tests.servers import REPO, ServerProcess, find, parse_samples
from tests.test_systemd_units import EXPORTER, REMEDIATOR, capabilities, settings

SERVICE_UID = 64123  # the units' `gpuguard`
OWNER_UID = 64124  # the user whose GPU jobs are orphaned
TOKEN = "privilege-test-token"
GIB = 2**30
#: The reasons of a job whose launcher lives.
LAUNCHER_ALIVE = {"attached", "detached"}
#: What each capability's absence shows, in the remediator's audit record.
REFUSAL = {"CAP_KILL": "signal-failed", "CAP_SYS_PTRACE": "member-unknown",
           "CAP_DAC_READ_SEARCH": "member-unknown"}

#: Loads a seccomp filter as systemd builds it from SystemCallFilter=, SystemCallErrorNumber=
#: and RestrictAddressFamilies= (argv[1], JSON), then execs argv[2:]. Run after setpriv's
#: --no-new-privs, as systemd applies it: last, right before the program.
SECCOMP_EXEC = r"""
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                       ctypes.c_uint, ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ALLOW, EQ = 0x7FFF0000, 4
ctx = lib.seccomp_init(0x00050000 | spec["errno"])
socket_nr = lib.seccomp_syscall_resolve_name(b"socket")
for name in spec["allow"]:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0 and nr != socket_nr:
        assert lib.seccomp_rule_add_array(ctx, ALLOW, nr, 0, None) == 0, name
for family in spec["families"]:
    cmp = Cmp(0, EQ, family, 0)
    assert lib.seccomp_rule_add_array(ctx, ALLOW, socket_nr, 1, ctypes.byref(cmp)) == 0
assert lib.seccomp_load(ctx) == 0
os.execv(sys.argv[2], sys.argv[2:])
"""

FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}


def setpriv(uid: int, caps: frozenset[str]) -> list[str]:
    """User=, AmbientCapabilities=, CapabilityBoundingSet=, NoNewPrivileges=, as setpriv."""
    names = "".join(f",+{cap.removeprefix('CAP_').lower()}" for cap in sorted(caps))
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
            f"--inh-caps=-all{names}", f"--ambient-caps=-all{names}",
            f"--bounding-set=-all{names}"]


def syscall_set(group: str, seen: set[str] | None = None) -> set[str]:
    """A systemd syscall group, nested groups expanded, from systemd-analyze itself."""
    seen = set() if seen is None else seen
    seen.add(group)
    listing = subprocess.run(["systemd-analyze", "syscall-filter", group], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    names: set[str] = set()
    for line in listing.splitlines()[1:]:
        word = line.strip()
        if not word or word.startswith("#"):
            continue
        if word.startswith("@"):
            if word not in seen:
                names |= syscall_set(word, seen)
        else:
            names.add(word)
    return names


@functools.cache
def seccomp_spec(unit: Path) -> dict[str, Any]:
    """The unit's filter: an allow list, minus what later `~` lines remove."""
    lines = settings(unit)["SystemCallFilter"]
    assert not lines[0].startswith("~"), "the first SystemCallFilter= is an allow list"
    allow: set[str] = set()
    for group in lines[0].split():
        allow |= syscall_set(group)
    for line in lines[1:]:
        assert line.startswith("~")
        for group in line[1:].split():
            allow -= syscall_set(group) if group.startswith("@") else {group}
    errno_name = settings(unit)["SystemCallErrorNumber"][0]
    families = settings(unit)["RestrictAddressFamilies"][0].split()
    return {"allow": sorted(allow), "errno": {"EPERM": 1}[errno_name],
            "families": [FAMILIES[f] for f in families]}


@dataclass(frozen=True)
class Sandbox:
    """Where the service uid can reach: an interpreter, the fake NVML, a world directory."""

    root: Path
    python: str
    env: dict[str, str]  # the daemons' environment (PYTHONPATH, the fake library)

    def command(self, unit: Path, caps: frozenset[str], module: str) -> list[str]:
        """How `unit` would run `module`: its uid and capabilities, then its seccomp filter."""
        return [*setpriv(SERVICE_UID, caps), self.python, "-c", SECCOMP_EXEC,
                json.dumps(seccomp_spec(unit)), self.python, "-m", module]


def _runtime_distributions(name: str = "gpuguard") -> set[str]:
    """gpuguard's run-time dependencies, transitively (no extras): what the daemons import."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower()
        if key in seen:
            continue
        seen.add(key)
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen - {name}


def stage(root: Path) -> dict[str, str]:
    """Copy gpuguard and its run-time dependencies under root, readable by any uid.

    The checkout and this environment's packages may sit below a folder other uids may
    not enter (a clone under /root); the staged copy makes the test independent of that.
    """
    shutil.copytree(REPO / "gpuguard", root / "src" / "gpuguard", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    site = root / "site"
    for name in _runtime_distributions():
        dist = importlib.metadata.distribution(name)
        for file in dist.files or ():
            source = Path(str(dist.locate_file(file)))
            if "__pycache__" in file.parts or not source.is_file():
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    for path in (root / "src", site):
        for folder, _dirs, files in os.walk(path):
            os.chmod(folder, 0o755)
            for f in files:
                os.chmod(os.path.join(folder, f), 0o644 if not f.endswith(".so") else 0o755)
    return {"PYTHONPATH": f"{root / 'src'}:{site}", "PYTHONDONTWRITEBYTECODE": "1"}


def _interpreters() -> Iterator[str]:
    """This test's own Python first; else the system's (an interpreter under /root, such
    as pyenv's, is out of the service uid's reach). Same minor version: the staged
    packages' compiled parts are built for it."""
    yield sys.executable
    system = shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}",
                          path="/usr/bin:/bin")
    if system and os.path.realpath(system) != os.path.realpath(sys.executable):
        yield system


@pytest.fixture(scope="module")
def sandbox(fake_nvml_lib: Path) -> Iterator[Sandbox]:
    for tool in ("setpriv", "systemd-analyze"):
        if shutil.which(tool) is None:
            require(False, f"{tool} not found (Debian packages util-linux, systemd)")
    if ctypes.util.find_library("seccomp") is None:
        require(False, "libseccomp.so.2 not found (Debian package libseccomp2, systemd's "
                       "dependency)")
    if os.geteuid() != 0:
        pytest.skip("needs root: runs the daemons and the jobs as other uids")
    root = Path(tempfile.mkdtemp(prefix="gpuguard-privilege-"))
    try:
        root.chmod(0o755)
        (root / "lib").mkdir(mode=0o755)
        shutil.copy(fake_nvml_lib / LIBRARY_NAME, root / "lib" / LIBRARY_NAME)
        (root / "lib" / LIBRARY_NAME).chmod(0o755)
        staged = stage(root)
        tried = []
        for python in _interpreters():
            env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(root / "lib"), **staged}
            # Through env: setpriv's own exec still runs with its capabilities, a second
            # exec (the seccomp loader's) does not.
            probe = subprocess.run(
                [*setpriv(SERVICE_UID, frozenset()), "env", python, "-c",
                 "import gpuguard.exporter.cli, gpuguard.remediator.cli"],
                env=env, cwd="/", capture_output=True, text=True, timeout=60, check=False)
            if probe.returncode == 0:
                yield Sandbox(root, python, env)
                return
            tried.append(f"{python}: {probe.stderr.strip().splitlines()[-1:]}")
        require(False, f"no Python that uid {SERVICE_UID} may run with gpuguard importable: "
                       f"{tried}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


class SharedWorld(FakeGpuWorld):
    """The fake GPU world, readable by the service uid (the state file is written 0600)."""

    def save(self) -> None:
        super().save()
        self.path.chmod(0o644)


@dataclass
class Job:
    """Another user's GPU job: bash (its launcher, killed) -> sh (the tree's root) -> holder."""

    tree: Tree
    root: int
    holder: int

    @property
    def members(self) -> tuple[int, int]:
        return (self.root, self.holder)

    def alert(self) -> dict[str, Any]:
        start = stat_fields(self.root)
        assert start is not None, f"root {self.root} is gone"
        return alert(self.root, str(start["start_time"]), user=str(OWNER_UID))

    def untouched(self) -> bool:
        """Every member alive and running (an aborted reap must not leave it stopped)."""
        fields = [stat_fields(pid) for pid in self.members]
        return all(f is not None and f["state"] in ("S", "R") for f in fields)


@dataclass
class Rig:
    """One test's world: fake GPU, the jobs' registry, a directory per daemon."""

    box: Sandbox
    base: Path
    world: SharedWorld
    trees: Trees

    def job(self, *, keep: bool = False, daemon: bool = False) -> Job:
        """Start another user's job: GPUGUARD_KEEP=1 in its environment with `keep`; in /
        with `daemon` (stdin is /dev/null either way: detached on purpose, classify rule 6)."""
        python, holder = shlex.quote(self.box.python), shlex.quote(str(HOLDER))
        inner = f'sh -c "{python} {holder} --pidfile $1/holder" & echo $! > "$1/root"; wait'
        # Not in / unless `daemon`: the runner's own directory might be /.
        inner = ("cd /; " if daemon else 'cd "$1"; ') + inner
        drop = " ".join(setpriv(OWNER_UID, frozenset()))
        keep_env = " GPUGUARD_KEEP=1" if keep else ""
        # The launcher hands the tree's directory to the owner, then becomes the owner's bash.
        script = (f"chown {OWNER_UID}:{OWNER_UID} {{dir}} && exec {drop} env -i "
                  f"PATH=/usr/bin:/bin{keep_env} bash -c {shlex.quote(inner)} job {{dir}}")
        tree = self.trees.spawn(script.replace("{", "{{").replace("}", "}}")
                                .replace("{{dir}}", "{dir}"))
        job = Job(tree, tree.pid("root"), tree.pid("holder"))
        holder_fields = stat_fields(job.holder)
        assert holder_fields is not None and holder_fields["ppid"] == job.root
        assert os.stat(f"/proc/{job.holder}").st_uid == OWNER_UID
        self.world.add_process(0, job.holder, 2 * GIB)
        return job

    def env(self) -> dict[str, str]:
        return {**self.box.env, STATE_ENV: str(self.world.path)}

    def exporter(self, caps: frozenset[str]) -> ServerProcess:
        return ServerProcess("gpuguard.exporter", ["--scan-interval", "0.2"], env=self.env(),
                             command=self.box.command(EXPORTER, caps, "gpuguard.exporter"),
                             cwd=Path("/"))

    def remediator(self, caps: frozenset[str]) -> tuple[ServerProcess, Path]:
        """The remediator in enforce mode; its state, audit log and token owned by its uid."""
        home = self.base / "remediator"
        for path, mode in ((home, 0o700), (home / "state", 0o700), (home / "log", 0o750)):
            path.mkdir(mode=mode)
            os.chown(path, SERVICE_UID, SERVICE_UID)
        token = home / "token"  # as LoadCredential= leaves it: the service user's, 0400
        token.write_text(TOKEN + "\n")
        os.chown(token, SERVICE_UID, SERVICE_UID)
        token.chmod(0o400)
        config = self.base / "gpuguard.yml"
        config.write_text(yaml.safe_dump({"remediate": {
            "mode": "enforce", "min_age_seconds": 0, "term_timeout_seconds": 2,
            "state_dir": str(home / "state"), "audit_log": str(home / "log" / "audit.jsonl"),
        }}))
        config.chmod(0o644)
        server = ServerProcess(
            "gpuguard.remediator",
            ["--config", str(config), "--token-file", str(token), "--hostname", HOST,
             "--allow-pid-namespace"],  # CI runs in a PID namespace; the fake NVML agrees
            env=self.env(), command=self.box.command(REMEDIATOR, caps, "gpuguard.remediator"),
            cwd=Path("/"))
        return server, home / "log" / "audit.jsonl"


@pytest.fixture
def rig(sandbox: Sandbox) -> Iterator[Rig]:
    base = Path(tempfile.mkdtemp(prefix="test-", dir=sandbox.root))
    base.chmod(0o755)
    trees = Trees(base / "trees")
    world = SharedWorld(base / "nvml-state.txt")
    world.add_gpu(0)
    try:
        yield Rig(sandbox, base, world, trees)
    finally:
        trees.cleanup()


def without(unit: Path) -> list[Any]:
    """One case per capability of `unit`: the unit's set minus that one."""
    return [pytest.param(cap, id=cap) for cap in sorted(capabilities(unit))]


def missing_named(server: ServerProcess, cap: str) -> bool:
    return re.search(rf"missing [^)]*\b{cap}\b", server.stderr()) is not None


def process_info(server: ServerProcess, pids: tuple[int, ...]) -> dict[int, dict[str, str]]:
    """gpuguard_gpu_process_info labels per pid, once a scan has seen every one of `pids`."""

    def scrape() -> dict[int, dict[str, str]] | None:
        samples = parse_samples(requests.get(f"{server.url}/metrics", timeout=5).text)
        got = {pid: find(samples, "gpuguard_gpu_process_info", pid=str(pid)) for pid in pids}
        if not all(got.values()):
            return None
        return {pid: rows[0][0] for pid, rows in got.items()}

    found = wait_for(scrape, timeout=15, what=f"process_info for {pids}")
    assert isinstance(found, dict)
    return found


def metric(server: ServerProcess, name: str) -> float:
    samples = parse_samples(requests.get(f"{server.url}/metrics", timeout=5).text)
    ((_, value),) = find(samples, name)
    return value


def kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found[1]), int(found[2])) >= (major, minor)


def test_seccomp_loader_enforces_the_units_filter(sandbox: Sandbox) -> None:
    """The emulated filter is real: a call the unit's filter leaves out (setpriority, in
    @resources) and a socket family it does not list fail; ordinary calls work."""
    probe = ("import os, socket\n"
             "try:\n    os.setpriority(os.PRIO_PROCESS, 0, 5); print('setpriority ok')\n"
             "except PermissionError: print('setpriority EPERM')\n"
             "try:\n    socket.socket(socket.AF_PACKET, socket.SOCK_RAW); print('packet ok')\n"
             "except PermissionError: print('packet EPERM')\n"
             "socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11).close(); print(os.getuid())")
    command = sandbox.command(EXPORTER, capabilities(EXPORTER), "unused")[:-2]
    done = subprocess.run([*command, "-c", probe], env=sandbox.env, cwd="/",
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.split() == ["setpriority", "EPERM", "packet", "EPERM",
                                   str(SERVICE_UID)], done.stderr


def test_exporter_with_its_unit_classifies_another_users_trees(rig: Rig) -> None:
    orphan, kept, daemon = rig.job(), rig.job(keep=True), rig.job(daemon=True)
    jobs = (orphan, kept, daemon)
    holders = tuple(job.holder for job in jobs)
    exporter = rig.exporter(capabilities(EXPORTER))
    try:
        # The connector needs no CAP_NET_ADMIN since Linux 6.6; in a child PID namespace
        # (CI) the listener stays off by design and launchers' exits read session-ended.
        events = in_host_pid_namespace() is True and kernel_at_least(6, 6)
        wait_for(lambda: metric(exporter, "gpuguard_process_events_up") == float(events),
                 what=f"gpuguard_process_events_up {int(events)}")
        before = process_info(exporter, holders)
        # Under a live launcher; `detached` where the test runner is PID 1 (unshare).
        assert {labels["reason"] for labels in before.values()} <= LAUNCHER_ALIVE
        for job in jobs:
            job.tree.kill_launcher()
        expected = {
            orphan.holder: ("orphan", "launcher-killed" if events else "session-ended"),
            kept.holder: ("protected", "keep-marker"),  # read from /proc/PID/environ
            daemon.holder: ("normal", "daemon"),  # from /proc/PID/cwd and fd/0
        }
        seen: list[dict[int, tuple[str, str]]] = []

        def settled() -> bool:
            now = process_info(exporter, holders)
            seen[:] = [{pid: (labels["verdict"], labels["reason"]) for pid, labels in now.items()}]
            return seen[0] == expected

        with contextlib.suppress(AssertionError):  # the comparison below says what differs
            wait_for(settled, timeout=15, what="the verdicts after the launchers died")
        assert seen[0] == expected
        labels = process_info(exporter, holders)[orphan.holder]
        assert (labels["root_pid"], labels["user"]) == (str(orphan.root), str(OWNER_UID))
        assert "missing CAP" not in exporter.stderr()
    finally:
        exporter.stop()


@pytest.mark.parametrize("dropped", without(EXPORTER))
def test_exporter_without_a_capability_fails_closed(rig: Rig, dropped: str) -> None:
    """No wrong verdict: every tree reads unknown (an unreadable environ never makes a
    keep-marked tree, nor an unreadable cwd a daemon, look like an orphan), and the
    exporter says what it lacks."""
    jobs = (rig.job(), rig.job(keep=True), rig.job(daemon=True))
    for job in jobs:
        job.tree.kill_launcher()
    exporter = rig.exporter(capabilities(EXPORTER) - {dropped})
    try:
        got = process_info(exporter, tuple(job.holder for job in jobs))
        for job in jobs:
            assert (got[job.holder]["verdict"], got[job.holder]["reason"]) == \
                ("unknown", "member-unknown"), f"without {dropped}: {got[job.holder]} " \
                f"(a verdict that does not change is no proof that {dropped} is needed)"
        assert metric(exporter, "gpuguard_orphan_trees") == 0
        assert missing_named(exporter, dropped), exporter.stderr()
    finally:
        exporter.stop()


def audit_finals(path: Path, root: int) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []
    return [r for r in records if r["phase"] == "final" and r["key"]["root_pid"] == root]


def deliver(server: ServerProcess, *jobs: Job) -> None:
    """POST one firing alert per job, as Alertmanager would, and wait until all is done."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for job in jobs:
        resp = requests.post(f"{server.url}/alerts", json=payload(job.alert()), headers=auth,
                             timeout=10)
        assert resp.status_code == 200, resp.text
        assert [a["status"] for a in resp.json()["accounts"]] == ["accepted"], resp.text

    def idle() -> bool:
        state = requests.get(f"{server.url}/state", headers=auth, timeout=10).json()
        return state["in_flight"] is None and not state["pending"]

    wait_for(idle, timeout=30, what="the remediator to finish")


def test_remediator_with_its_unit_reaps_another_users_orphan(rig: Rig) -> None:
    orphan, kept = rig.job(), rig.job(keep=True)
    orphan.tree.kill_launcher()
    kept.tree.kill_launcher()
    remediator, audit = rig.remediator(capabilities(REMEDIATOR))
    try:
        deliver(remediator, orphan, kept)
        wait_for(lambda: not any(alive(pid) for pid in orphan.members), what="the orphan reaped")
        (reaped,) = audit_finals(audit, orphan.root)
        assert (reaped["outcome"], reaped["kill_path"]) == ("reaped", "pidfd")
        assert {s["pid"] for s in reaped["signals"] if s["result"] == "sent"} == \
            set(orphan.members)
        (refused,) = audit_finals(audit, kept.root)
        assert refused["decision"]["reason"] == "not-orphan:protected"
        assert "GPUGUARD_KEEP=1" in refused["decision"]["detail"]
        assert kept.untouched()
        assert "missing CAP" not in remediator.stderr()
    finally:
        remediator.stop()


@pytest.mark.parametrize("dropped", without(REMEDIATOR))
def test_remediator_without_a_capability_refuses_with_the_reason(rig: Rig, dropped: str) -> None:
    """Nothing is reaped, nothing is left stopped, the audit record says why, and the
    remediator named the missing capability at start."""
    orphan, kept = rig.job(), rig.job(keep=True)
    orphan.tree.kill_launcher()
    kept.tree.kill_launcher()
    remediator, audit = rig.remediator(capabilities(REMEDIATOR) - {dropped})
    try:
        deliver(remediator, orphan, kept)
        for job in (orphan, kept):
            assert job.untouched(), f"without {dropped} the remediator still signalled " \
                f"{job.members}: {audit_finals(audit, job.root)}"
            (final,) = audit_finals(audit, job.root)
            assert final["outcome"] != "reaped"
        (final,) = audit_finals(audit, orphan.root)
        assert final["decision"]["reason"] == REFUSAL.get(dropped), final["decision"]
        if dropped == "CAP_KILL":  # the first SIGSTOP was refused: nothing else was sent
            assert final["outcome"] == "aborted"
            assert {s["signal"] for s in final["signals"]} == {"SIGSTOP"}
        else:
            assert f"cannot read /proc/{orphan.root}/" in final["decision"]["detail"]
        assert missing_named(remediator, dropped), remediator.stderr()
    finally:
        remediator.stop()
