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
these tests: it is not needed. The exporter's verdicts with the unit's capabilities, each
one removed, and the capability-free drop-in (deploy/systemd/gpuguard-exporter.service.d/)
are compared cell by cell with the table in docs/deployment.md; without a capability no
scrape ever shows an orphan. And what the capabilities would also allow, the units'
filter refuses: with them alone the service uid writes another user's memory
(process_vm_writev), traces it and takes its file descriptors; under the filter each call
fails with EPERM.

Not shown (no GPU here; a fake libnvidia-ml.so.1 stands in): that the units' DeviceAllow=
reaches the NVIDIA device nodes. The other hardening (ProtectSystem=, ...) needs systemd.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from gpuguard.host.procfs import in_host_pid_namespace
from tests.deploy.test_systemd_units import (
    EXPORTER,
    NO_CAPABILITIES,
    REMEDIATOR,
    capabilities,
    settings,
)
from tests.support.ci import require
from tests.support.fakenvml import LIBRARY_NAME, STATE_ENV, FakeGpuWorld
from tests.support.proctree import Tree, Trees, alive, stat_fields, wait_for
from tests.support.remediator_harness import HOST, alert, payload
from tests.support.servers import REPO, ServerProcess, find, parse_samples
from tests.support.staging import stage, staged_holder, staged_python

SERVICE_UID = 64123  # the units' `gpuguard`
OWNER_UID = 64124  # the user whose GPU jobs are orphaned
TOKEN = "privilege-test-token"
GIB = 2**30
#: The reasons of a job whose launcher lives.
LAUNCHER_ALIVE = {"attached", "detached"}
#: The policy's reasons where a launcher may die unheard: session-ended where no listener
#: may run (the suite's PID namespace), launcher-unrecorded where one started after the
#: launcher died; the policy of such a host opts in to both. The default is the first alone.
LATE_REASONS = ("launcher-killed", "session-ended", "launcher-unrecorded")
#: What the kernel's process-events subscription needs (gpuguard/host/events/privilege.py):
#: its absence shows in the listener, not in /proc reads or signals.
NET_ADMIN = "CAP_NET_ADMIN"
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
    """The unit's filter: an allow list, minus what later `~` lines remove, plus what
    later plain lines add back (systemd.exec(5): in allow-list mode, in order)."""
    lines = settings(unit)["SystemCallFilter"]
    assert not lines[0].startswith("~"), "the first SystemCallFilter= is an allow list"
    allow: set[str] = set()
    for line in lines:
        deny = line.startswith("~")
        for group in line.removeprefix("~").split():
            names = syscall_set(group) if group.startswith("@") else {group}
            allow = allow - names if deny else allow | names
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
        env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(root / "lib"), **stage(root)}
        python, tried = staged_python(setpriv(SERVICE_UID, frozenset()), env)
        if python is None:
            require(False, f"no Python that uid {SERVICE_UID} may run with gpuguard "
                           f"importable: {tried}")
        assert python is not None
        yield Sandbox(root, python, env)
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

    def alert(self, reason: str = "session-ended") -> dict[str, Any]:
        """The exporter's alert for this job, its `reason` label as the exporter read it."""
        start = stat_fields(self.root)
        assert start is not None, f"root {self.root} is gone"
        return alert(self.root, str(start["start_time"]), user=str(OWNER_UID), reason=reason)

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

    def job(self, *, keep: bool = False, daemon: bool = False, nohup: bool = False) -> Job:
        """Start another user's job: GPUGUARD_KEEP=1 in its environment with `keep`; in /
        with `daemon` (stdin is /dev/null either way: detached on purpose, classify rule 6);
        ignoring SIGHUP with `nohup` (inherited by the root and the holder: rule 4)."""
        python = shlex.quote(self.box.python)
        holder = shlex.quote(str(staged_holder(self.box.root)))
        inner = f'sh -c "{python} {holder} --pidfile $1/holder" & echo $! > "$1/root"; wait'
        # Not in / unless `daemon`: the runner's own directory might be /.
        inner = ("cd /; " if daemon else 'cd "$1"; ') + inner
        if nohup:
            inner = "trap '' HUP; " + inner
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

    def remediator(self, caps: frozenset[str], reasons: tuple[str, ...] = LATE_REASONS
                   ) -> tuple[ServerProcess, Path]:
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
            "reasons": list(reasons),
            "state_dir": str(home / "state"), "audit_log": str(home / "log" / "audit.jsonl"),
            # The owner has no passwd entry: deny [root] alone would refuse it (unresolved).
            "users": {"allow": [f"uid:{OWNER_UID}"], "deny": ["uid:0"]},
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
    """One case per capability of `unit` that /proc reads or signals need: the unit's set
    minus that one. CAP_NET_ADMIN, the listener's, has tests of its own (below)."""
    return [pytest.param(cap, id=cap) for cap in sorted(capabilities(unit) - {NET_ADMIN})]


def missing_named(server: ServerProcess, cap: str) -> bool:
    return re.search(rf"missing [^)]*\b{cap}\b", server.stderr()) is not None


def named_missing(server: ServerProcess, cap: str) -> None:
    """The daemon named `cap` as missing. It logs that before its `listening on` line, but
    its stderr reaches us through a thread of ours (servers.py) that may lag: poll."""
    with contextlib.suppress(AssertionError):  # the assertion below shows the stderr
        wait_for(lambda: missing_named(server, cap), what=f"the warning naming {cap}")
    assert missing_named(server, cap), server.stderr()


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


#: Binds a process-events socket (NETLINK_CONNECTOR to CN_IDX_PROC): "ok", or the errno.
SUBSCRIBE = """
import errno, socket
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11)
try:
    sock.bind((0, 1))
    print("ok")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


@functools.cache
def _subscribes_without_capabilities(python: str) -> str:
    done = subprocess.run([*setpriv(SERVICE_UID, frozenset()), python, "-c", SUBSCRIBE],
                          cwd="/", capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def subscription_needs_net_admin(box: Sandbox) -> bool:
    """Whether this kernel refuses the subscription to the service uid without CAP_NET_ADMIN
    (EPERM on 6.18; docs/deployment.md)."""
    return _subscribes_without_capabilities(box.python) == "EPERM"


CAP_NET_ADMIN_BIT = 1 << 12


def net_admin_holders(pid: int) -> dict[int, dict[str, str]]:
    """The threads of `pid` holding CAP_NET_ADMIN in any set but the bounding one, with
    those sets (CapInh, CapPrm, CapEff, CapAmb) as /proc/PID/task/TID/status shows them."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # a thread that has just ended
        sets = dict(re.findall(r"^(Cap(?:Inh|Prm|Eff|Amb)):\s+([0-9a-f]+)$", status, re.M))
        assert len(sets) == 4, status
        if any(int(value, 16) & CAP_NET_ADMIN_BIT for value in sets.values()):
            found[int(task.name)] = sets
    return found


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


#: What CAP_SYS_PTRACE opens beyond the /proc reads gpuguard needs: the calls containerd's
#: and moby's default seccomp profiles allow only with it. The units refuse them all.
PTRACE_CALLS = frozenset({"kcmp", "pidfd_getfd", "process_madvise", "process_vm_readv",
                          "process_vm_writev", "ptrace"})

#: Another user's process: a buffer at a known address, alive until its stdin closes.
TARGET = """
import ctypes, sys
buf = ctypes.create_string_buffer(b"AAAAAAAA", 8)
print(ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""

#: Each call of PTRACE_CALLS (but process_madvise, which also needs CAP_SYS_NICE) against
#: argv[1]'s buffer at argv[2], and /proc/PID/mem opened both ways; prints {call: result}.
PTRACE_PROBE = r"""
import ctypes, errno, json, os, sys
pid, addr, calls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
seccomp = ctypes.CDLL("libseccomp.so.2")
seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
into, out = ctypes.create_string_buffer(8), ctypes.create_string_buffer(b"WRITTEN!", 8)
read_to, write_from = Iov(ctypes.addressof(into), 8), Iov(ctypes.addressof(out), 8)
remote = Iov(addr, 8)
def call(name, *args):
    nr = seccomp.seccomp_syscall_resolve_name(name.encode())
    got = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return "ok" if got >= 0 else errno.errorcode[ctypes.get_errno()]
def opened(flags):
    try:
        os.close(os.open(f"/proc/{pid}/mem", flags))
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
iov = lambda v: ctypes.addressof(v)
run = {
    "process_vm_readv": lambda: call("process_vm_readv", pid, iov(read_to), 1, iov(remote), 1,
                                     0),
    "process_vm_writev": lambda: call("process_vm_writev", pid, iov(write_from), 1, iov(remote),
                                      1, 0),
    "ptrace-seize": lambda: call("ptrace", 0x4206, pid, 0, 0),
    "ptrace-attach": lambda: call("ptrace", 16, pid, 0, 0),
    "kcmp": lambda: call("kcmp", os.getpid(), pid, 1, 0, 0),  # KCMP_VM
    "pidfd_getfd": lambda: call("pidfd_getfd", os.pidfd_open(pid), 0, 0),
    "mem-read": lambda: opened(os.O_RDONLY),
    "mem-write": lambda: opened(os.O_RDWR),
}
print(json.dumps({name: run[name]() for name in calls}))
"""


@pytest.fixture
def other_users_buffer(sandbox: Sandbox) -> Iterator[tuple[int, int]]:
    """(pid, address) of 8 bytes b"AAAAAAAA" in a process of OWNER_UID."""
    proc = subprocess.Popen([sandbox.python, "-c", TARGET], user=OWNER_UID, group=OWNER_UID,
                            extra_groups=[], env=sandbox.env, cwd="/", stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = int(proc.stdout.readline())
        assert os.stat(f"/proc/{proc.pid}").st_uid == OWNER_UID
        yield proc.pid, address
    finally:
        proc.kill()
        proc.wait(timeout=10)


def peek(pid: int, address: int) -> bytes:
    """8 bytes of another process's memory, read by the test (root)."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(address)
        return mem.read(8)


def ptrace_probe(command: list[str], box: Sandbox, target: tuple[int, int],
                 calls: list[str]) -> dict[str, str]:
    done = subprocess.run([*command, "-c", PTRACE_PROBE, str(target[0]), str(target[1]),
                           ",".join(calls)], env=box.env, cwd="/", capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_units_refuse_every_call_cap_sys_ptrace_would_open() -> None:
    """As systemd compiles SystemCallFilter= (groups expanded by systemd-analyze itself):
    @system-service alone allows kcmp, process_madvise and process_vm_readv/writev."""
    for unit in (EXPORTER, REMEDIATOR):
        assert PTRACE_CALLS & set(seccomp_spec(unit)["allow"]) == set(), unit.name


@pytest.mark.parametrize("unit", [EXPORTER, REMEDIATOR], ids=lambda u: u.stem)
def test_unit_cannot_write_another_processes_memory(
        sandbox: Sandbox, other_users_buffer: tuple[int, int], unit: Path) -> None:
    """With the unit's capabilities alone, uid SERVICE_UID can read and WRITE another user's
    memory (process_vm_writev; root's too), trace it and take its file descriptors; the
    unit's filter refuses each call. /proc/PID/mem is readable either way (the unit header
    says so) and never writable: the capabilities override no write permission."""
    caps = capabilities(unit)
    calls = ["process_vm_readv", "process_vm_writev", "ptrace-seize", "kcmp", "pidfd_getfd",
             "mem-read", "mem-write"]
    confined = ptrace_probe(sandbox.command(unit, caps, "unused")[:-2], sandbox,
                            other_users_buffer, [*calls, "ptrace-attach"])
    assert peek(*other_users_buffer) == b"AAAAAAAA"
    assert confined == {**{call: "EPERM" for call in calls}, "ptrace-attach": "EPERM",
                        "mem-read": "ok", "mem-write": "EACCES"}
    # Without the filter the same uid and capabilities succeed: the EPERMs above are the
    # filter's, not a missing privilege (else this test would prove nothing).
    bare = ptrace_probe([*setpriv(SERVICE_UID, caps), sandbox.python], sandbox,
                        other_users_buffer, calls)
    assert bare == {**{call: "ok" for call in calls}, "mem-write": "EACCES"}
    assert peek(*other_users_buffer) == b"WRITTEN!"


def test_exporter_with_its_unit_classifies_another_users_trees(rig: Rig) -> None:
    orphan, kept, daemon = rig.job(), rig.job(keep=True), rig.job(daemon=True)
    jobs = (orphan, kept, daemon)
    holders = tuple(job.holder for job in jobs)
    exporter = rig.exporter(capabilities(EXPORTER))
    try:
        # The unit grants CAP_NET_ADMIN for the subscription; in a child PID namespace
        # (CI's) the listener stays off by design and launchers' exits read session-ended
        # (test_units_hear_a_killed_launcher runs outside it).
        events = in_host_pid_namespace() is True
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
        named_missing(exporter, dropped)
    finally:
        exporter.stop()


#: The exporter profiles of the table in docs/deployment.md, by its column headings: the
#: unit's capabilities, the unit less each one, and the unit with the no-capabilities
#: drop-in (read from the files, so the table, the unit and the drop-in cannot drift).
EXPORTER_PROFILES: dict[str, frozenset[str]] = {
    "the unit": capabilities(EXPORTER),
    **{f"without {cap}": capabilities(EXPORTER) - {cap} for cap in sorted(capabilities(EXPORTER))},
    "no capabilities": capabilities(EXPORTER, NO_CAPABILITIES),
}
#: The rows of that table: another user's job, started as Rig.job(**options).
SCENARIOS: dict[str, dict[str, bool]] = {
    "orphan": {}, "keep": {"keep": True}, "daemon": {"daemon": True},
    "nohup": {"nohup": True}, "attached": {},
}
#: The jobs whose launcher stays alive.
LAUNCHER_LIVES = {"attached"}
DEPLOYMENT_DOC = REPO / "docs" / "deployment.md"
TABLE_MARK = "<!-- privilege-table"


def docs_table() -> dict[str, dict[str, str]]:
    """The verdict table of docs/deployment.md: {row: {column heading: cell}}, each cell
    with its backticks and parentheses dropped ("`orphan` (launcher-killed)" reads
    "orphan launcher-killed"). A row is named by its first word (a scenario of SCENARIOS,
    or a metric's name)."""
    lines = DEPLOYMENT_DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(TABLE_MARK)) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([re.sub(r"[`()*]", "", cell).strip() for cell in line.strip("|").split("|")])
    heading, _rule, *body = rows
    table = {}
    for cells in body:
        name = re.split(r"[\s:]", cells[0], maxsplit=1)[0]
        table[name] = dict(zip(heading[1:], cells[1:], strict=True))
    return table


def as_documented(verdict: str, reason: str) -> str:
    """A verdict as the table writes it (its cells without backticks and parentheses)."""
    return f"{verdict} {reason}"


def total(server: ServerProcess, name: str) -> float:
    samples = parse_samples(requests.get(f"{server.url}/metrics", timeout=5).text)
    return sum(value for _, value in find(samples, name))


@pytest.mark.initial_pidns
@pytest.mark.parametrize("profile", list(EXPORTER_PROFILES))
def test_exporter_verdicts_per_profile_are_the_docs_table(rig: Rig, profile: str) -> None:
    """The table of docs/deployment.md, measured: each profile's exporter watches another
    user's jobs while their launchers die (one lives). Without a capability the jobs whose
    verdict needs /proc/PID/environ, cwd or fd/0 read unknown at every scrape, never
    orphan, and no orphan tree is ever counted; what world-readable files decide (nohup's
    status, a live launcher) reads as with them. Without CAP_NET_ADMIN the listener is
    down: a killed launcher reads session-ended. Run where a deployment runs, outside any
    PID namespace of the tests' own, every cell compared as measured."""
    table = docs_table()
    assert set(table) == {*SCENARIOS, "gpuguard_orphan_trees",
                          "gpuguard_orphan_tree_memory_bytes",
                          "gpuguard_process_events_up"}, sorted(table)
    assert all(set(row) == set(EXPORTER_PROFILES) for row in table.values()), table
    caps = EXPORTER_PROFILES[profile]
    lacking = capabilities(EXPORTER) - caps
    if NET_ADMIN in lacking and not subscription_needs_net_admin(rig.box):
        pytest.skip("this kernel lets a process without CAP_NET_ADMIN subscribe: the "
                    "table's columns without it are measured where it does not")
    exporter = rig.exporter(caps)
    try:
        up = float(table["gpuguard_process_events_up"][profile])
        wait_for(lambda: metric(exporter, "gpuguard_process_events_up") == up,
                 what=f"gpuguard_process_events_up {up:g}")
        jobs = {name: rig.job(**options) for name, options in SCENARIOS.items()}
        holders = tuple(job.holder for job in jobs.values())
        seen: list[dict[str, str]] = []
        orphan_counts: list[float] = []

        def observe() -> dict[str, str]:
            now = process_info(exporter, holders)
            got = {name: as_documented(now[job.holder]["verdict"], now[job.holder]["reason"])
                   for name, job in jobs.items()}
            seen.append(got)
            orphan_counts.append(metric(exporter, "gpuguard_orphan_trees"))
            return got

        before = observe()
        assert {v.split()[1] for v in before.values()} <= {"attached", "ignores-sighup"}, before
        for name, job in jobs.items():
            if name not in LAUNCHER_LIVES:
                job.tree.kill_launcher()
        expected = {name: table[name][profile] for name in jobs}
        with contextlib.suppress(AssertionError):  # the comparison below says what differs
            wait_for(lambda: observe() == expected, timeout=15,
                     what=f"the verdicts of column {profile!r}")
        assert seen[-1] == expected, f"{profile}: measured {seen[-1]}, the docs say {expected}"
        assert metric(exporter, "gpuguard_orphan_trees") == \
            float(table["gpuguard_orphan_trees"][profile])
        gib = total(exporter, "gpuguard_orphan_tree_memory_bytes") / GIB
        assert f"{gib:g} GiB" == table["gpuguard_orphan_tree_memory_bytes"][profile]
        if lacking - {NET_ADMIN}:
            # Never orphan, at any scrape on the way: not one verdict, not one count.
            assert not any(v.startswith("orphan") for got in seen for v in got.values()), seen
            assert set(orphan_counts) == {0.0}, orphan_counts
        if lacking:
            for cap in sorted(lacking):
                named_missing(exporter, cap)
        else:
            assert "missing CAP" not in exporter.stderr()
    finally:
        exporter.stop()


@pytest.mark.initial_pidns
def test_exporter_with_its_unit_hears_a_killed_launcher(rig: Rig) -> None:
    """The shipped unit's exact uid, groups, capabilities and filter, outside any PID
    namespace of the tests' own (as a host runs it): the listener is up, another user's
    job whose launcher is SIGKILLed reads launcher-killed (what the default policy reaps),
    and no thread of the exporter still holds CAP_NET_ADMIN once it has subscribed."""
    exporter = rig.exporter(capabilities(EXPORTER))
    try:
        wait_for(lambda: metric(exporter, "gpuguard_process_events_up") == 1.0,
                 what="gpuguard_process_events_up 1")
        job = rig.job()
        assert process_info(exporter, (job.holder,))[job.holder]["reason"] in LAUNCHER_ALIVE
        job.tree.kill_launcher()

        def verdict() -> tuple[str, str]:
            labels = process_info(exporter, (job.holder,))[job.holder]
            return labels["verdict"], labels["reason"]

        with contextlib.suppress(AssertionError):
            wait_for(lambda: verdict() == ("orphan", "launcher-killed"), timeout=15,
                     what="launcher-killed")
        assert verdict() == ("orphan", "launcher-killed"), exporter.stderr()
        assert net_admin_holders(exporter.proc.pid) == {}
        assert NET_ADMIN not in exporter.stderr()  # neither missing nor still held
    finally:
        exporter.stop()


@pytest.mark.initial_pidns
def test_remediator_with_its_unit_reaps_a_killed_launchers_tree_by_default(rig: Rig) -> None:
    """The same for the remediator, under the default policy (launcher-killed alone): its
    own listener hears the launcher's SIGKILL, so the tree is reaped as launcher-killed;
    without it the tree would read session-ended and be refused."""
    orphan = rig.job()
    remediator, audit = rig.remediator(capabilities(REMEDIATOR), reasons=("launcher-killed",))
    try:
        wait_for(lambda: metric(remediator, "gpuguard_process_events_up") == 1.0,
                 what="gpuguard_process_events_up 1")
        orphan.tree.kill_launcher()  # while it listens
        # As an exporter that heard it too alerts; the remediator judges on its own evidence.
        deliver(remediator, orphan, reason="launcher-killed")
        (reaped,) = audit_finals(audit, orphan.root)
        assert reaped["outcome"] == "reaped", json.dumps(reaped)
        wait_for(lambda: not any(alive(pid) for pid in orphan.members), what="the orphan reaped")
        assert reaped["decision"]["reason"] == "launcher-killed", reaped["decision"]
        assert net_admin_holders(remediator.proc.pid) == {}
        assert NET_ADMIN not in remediator.stderr()
    finally:
        remediator.stop()


@pytest.mark.initial_pidns
@pytest.mark.parametrize("unit", [EXPORTER, REMEDIATOR], ids=lambda u: u.stem)
def test_unit_without_cap_net_admin_says_the_listener_is_down_and_why(
        rig: Rig, unit: Path) -> None:
    """Why the units grant CAP_NET_ADMIN, on this kernel: without it the subscription is
    refused, gpuguard_process_events_up reads 0 (what GPUGuardProcessEventsDown fires on), and
    the start-up warning names the missing capability and who grants it."""
    assert NET_ADMIN in capabilities(unit)
    if not subscription_needs_net_admin(rig.box):
        pytest.skip("this kernel lets a process without CAP_NET_ADMIN subscribe")
    caps = capabilities(unit) - {NET_ADMIN}
    server = rig.exporter(caps) if unit == EXPORTER else rig.remediator(caps)[0]
    try:
        assert metric(server, "gpuguard_process_events_up") == 0.0
        named_missing(server, NET_ADMIN)
        assert "cannot subscribe to process events (EPERM: missing CAP_NET_ADMIN, which " \
            "this kernel requires" in server.stderr(), server.stderr()
        assert "AmbientCapabilities=" in server.stderr()  # where to look
    finally:
        server.stop()


def audit_finals(path: Path, root: int) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []
    return [r for r in records if r["phase"] == "final" and r["key"]["root_pid"] == root]


def deliver(server: ServerProcess, *jobs: Job, reason: str = "session-ended") -> None:
    """POST one firing alert per job (its `reason` label: `reason`), as Alertmanager would,
    and wait until all is done."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for job in jobs:
        resp = requests.post(f"{server.url}/alerts", json=payload(job.alert(reason)),
                             headers=auth, timeout=10)
        assert resp.status_code == 200, resp.text
        assert [a["status"] for a in resp.json()["accounts"]] == ["accepted"], resp.text

    def idle() -> bool:
        state = requests.get(f"{server.url}/state", headers=auth, timeout=10).json()
        return state["in_flight"] is None and not state["pending"]

    wait_for(idle, timeout=30, what="the remediator to finish")


def test_remediator_with_its_unit_reaps_another_users_orphan(rig: Rig) -> None:
    orphan, kept = rig.job(), rig.job(keep=True)
    remediator, audit = rig.remediator(capabilities(REMEDIATOR))
    # Killed while the remediator listens: launcher-killed in the host PID namespace (a
    # remediator started later would read launcher-unrecorded), session-ended in CI's.
    orphan.tree.kill_launcher()
    kept.tree.kill_launcher()
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
    remediator, audit = rig.remediator(capabilities(REMEDIATOR) - {dropped})
    orphan.tree.kill_launcher()  # while it listens, as above
    kept.tree.kill_launcher()
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
        named_missing(remediator, dropped)
    finally:
        remediator.stop()
