"""A small executable model of Linux process semantics, as far as gpuguard reads them.

A `World` starts with PID 1 and is changed one step at a time; every step is a
line of `World.history`. Any moment renders as the `tests.support.proctable.SyntheticView`
that classify() reads (`World.view()`), so the classifier sees exactly what
/proc would show, and nothing the kernel does not show (who forked whom, who is
a child subreaper, which handler a process installed).

What is modelled (kernel behaviour, not any one program's):

- fork: the child gets the next free pid (cyclic allocation up to `pid_max`,
  wrapping; a pid is not handed out while any task, zombies included, uses it
  as its pid, process group id or session id), and inherits sid, pgid, cgroup,
  environment (`keep`: GPUGUARD_KEEP=1), cwd/stdin (`daemon_io`), signal
  dispositions (ignored *and* handled: fork copies handlers; exec resets them),
  and its PID namespace. It does not inherit the child-subreaper flag or a GPU
  context. `unshare` forks a child into a new PID namespace (its init).
- setsid (EPERM for a process group leader, or while a group with the caller's
  pid exists), setpgid (own group, or a group of the same session; EPERM for a
  session leader).
- exec: comm (cut to 15 bytes) and command line change, handled SIGHUP goes
  back to default, ignored SIGHUP stays, the child-subreaper flag stays, the
  GPU context is gone, the environment is kept or replaced.
- SIGHUP dispositions (default, ignore, handle); SIGTERM and SIGKILL kill.
  `hangup`: the terminal of a session goes away: its leader and then every
  member get SIGHUP (what bash's huponexit / an ssh drop does to plain jobs).
- exit by status or by signal: the process becomes a zombie until reaped; its
  children (zombies too) go to the nearest live child-subreaper among its
  ancestors in the same PID namespace, else that namespace's init. When a
  namespace's init dies every other process in it is killed (SIGKILL) and
  reaped.
- programs, not the kernel: a program named in the default `classify.adopters` list
  (tini, systemd, containerd-shim; docs/design.md, Orphan rules) never calls setsid()
  after forking, and no process that did so execs one. That is the trust rule 6
  places in the list (E1 under a named reaper is proof of adoption); `apply()` skips
  such steps.
- start times (one clock tick per step: a child is always newer than its
  parent), cgroups (fixed paths, each labelled managed or not per rule 5 of
  docs/design.md, Orphan rules), PID namespaces (depth only: nspid).

Every exit is appended to `World.exits` as the process-events listener would
record it (pid, time, signal or status); `World.view(listener="every")` lets
classify() see all of them, `listener="none"` none (gpuguard started later).
"""

from __future__ import annotations

import signal as signal_module
from dataclasses import dataclass, field

from gpuguard.orphans.process import ProcInfo
from tests.support.proctable import Exit, FakeProc, SyntheticView

COMM_LEN = 15
PID_MAX = 32  # small, so that pids wrap and are reused within tens of steps
ALIVE, ZOMBIE, GONE = "alive", "zombie", "gone"
DEFAULT, IGNORE, HANDLE = "default", "ignore", "handle"
SIGHUP, SIGKILL, SIGTERM = (int(signal_module.SIGHUP), int(signal_module.SIGKILL),
                            int(signal_module.SIGTERM))


@dataclass(frozen=True)
class Program:
    """What exec installs. `protected` and `reaper` are labelled by hand from the default
    `classify.protect` and `classify.adopters` lists (gpuguard.orphans.rules_config), not
    computed with the classifier's matcher."""

    comm: str
    cmdline: str
    protected: bool = False
    reaper: bool = False

    @property
    def kernel_comm(self) -> str:
        return self.comm[:COMM_LEN]


INIT = Program("systemd", "/sbin/init", reaper=True)
USER_MANAGER = Program("systemd", "/lib/systemd/systemd --user", reaper=True)
SSHD = Program("sshd", "sshd: /usr/sbin/sshd -D")
SSHD_SESSION = Program("sshd", "sshd: alice@pts/0")
BASH = Program("bash", "-bash")

#: What generated histories exec.
PROGRAMS = (
    Program("python", "python train.py --rank 0"),
    Program("sh", "sh -c ./run.sh"),
    Program("python", "python -m ipykernel_launcher -f kernel-1.json", protected=True),
    Program("jupyter-lab", "/opt/conda/bin/jupyter-lab --no-browser", protected=True),
    Program("torchrun", "torchrun --nproc-per-node 2 train.py"),
    Program("tini", "tini -s -- ./run.sh", reaper=True),
    Program("tmux: server", "tmux new-session -d -s jobs", protected=True),
    Program("containerd-shim-runc-v2", "containerd-shim-runc-v2 -id 0123", protected=True,
            reaper=True),
    BASH,
)


@dataclass(frozen=True)
class Cgroup:
    """A cgroup path; `managed` per rule 5 (docs/design.md, Orphan rules), labelled by hand."""

    path: str
    managed: bool


SESSION_SCOPE = Cgroup("/user.slice/user-1000.slice/session-1.scope", False)
INIT_SCOPE = Cgroup("/init.scope", False)
SSH_SERVICE = Cgroup("/system.slice/ssh.service", True)
USER_MANAGER_SCOPE = Cgroup("/user.slice/user-1000.slice/user@1000.service/init.scope", False)

#: Where generated histories move processes (systemd-run, docker, slurm, ...).
CGROUPS = (
    SESSION_SCOPE,
    Cgroup("/user.slice/user-1000.slice/user@1000.service/app.slice/vte-spawn-1.scope", False),
    Cgroup("/user.slice/user-1000.slice/user@1000.service/app.slice/run-u7.service", True),
    Cgroup("/system.slice/train.service", True),
    Cgroup("/system.slice/docker-0123456789ab.scope", True),
    Cgroup("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/"
           "cri-containerd-abc.scope", True),
    Cgroup("/slurm/uid_1000/job_42/step_0", True),
    USER_MANAGER_SCOPE,
)


@dataclass(frozen=True)
class Death:
    """How a process died, as the kernel's exit event says it."""

    signal: int | None
    status: int | None
    at: int

    def __str__(self) -> str:
        if self.signal is not None:
            return f"killed by {signal_module.Signals(self.signal).name}"
        return f"exited with status {self.status}"


@dataclass
class Namespace:
    level: int  # 0: the initial (host) PID namespace
    init: int | None  # serial of its init
    parent: Namespace | None
    next_pid: int = 1

    def alloc(self) -> int:
        pid = self.next_pid
        self.next_pid += 1
        return pid


@dataclass(eq=False)
class Proc:
    """One process; `serial` is its identity in the model (never reused, unlike pid)."""

    serial: int
    pid: int
    nspid: tuple[int, ...]
    ns: Namespace
    parent: Proc | None  # current parent (real_parent): changes on reparenting
    born_of: Proc | None  # the process that forked it: never changes
    sid: int
    session: Proc | None  # the process whose setsid() created its session
    pgid: int
    start_time: int
    program: Program
    cgroup: Cgroup
    sighup: str = DEFAULT
    keep: bool = False
    daemon_io: bool = False
    subreaper: bool = False
    setsid_after_fork: bool = False  # called setsid() while it had children
    uid: int = 0
    gpu: bool = False
    state: str = ALIVE
    death: Death | None = None

    @property
    def alive(self) -> bool:
        return self.state == ALIVE

    @property
    def comm(self) -> str:
        return self.program.kernel_comm

    @property
    def is_session_leader(self) -> bool:
        return self.sid == self.pid

    @property
    def is_ns_init(self) -> bool:
        return self.ns.init == self.serial

    @property
    def identity(self) -> tuple[int, int]:
        return (self.pid, self.start_time)

    def label(self) -> str:
        return f"{self.pid}({self.comm})"

    def ancestry(self) -> list[Proc]:
        """Self, parent, grandparent, ... up to PID 1 (current parents)."""
        out = [self]
        cur = self
        while cur.parent is not None:
            cur = cur.parent
            out.append(cur)
        return out

    def launch_chain(self) -> list[Proc]:
        """Self and who forked it, and who forked that, ... up to its session's creator
        (the process whose setsid() made the session it is in), or to PID 1."""
        out = [self]
        cur = self
        while cur is not self.session and cur.born_of is not None:
            cur = cur.born_of
            out.append(cur)
        return out

    def born_of_parent(self) -> bool:
        """The current parent is the one that forked it (never adopted)."""
        return self.parent is self.born_of


class ModelView(SyntheticView):
    """SyntheticView plus the process-events listener's query as gpuguard/host/events/listener.py
    answers it: the latest exit of `pid`, if it happened at or after `after_start_time`
    (SyntheticView ignores that bound)."""

    def __init__(self, procs, *, exit_log: dict[int, list[Exit]], **kw) -> None:
        super().__init__(procs, **kw)
        self.exit_log = exit_log
        for pid, records in exit_log.items():
            self.exits[pid] = records[-1]

    def launcher_exit(self, pid: int, after_start_time: int) -> Exit | None:
        self.calls.append(("launcher_exit", pid))
        records = self.exit_log.get(pid)
        if not records or records[-1].at < after_start_time:
            return None
        return records[-1]


@dataclass
class World:
    pid_max: int = PID_MAX
    clock: int = 0
    procs: list[Proc] = field(default_factory=list)  # every process ever, gone ones too
    history: list[str] = field(default_factory=list)
    exits: list[tuple[int, Death]] = field(default_factory=list)  # (pid, how), in order
    last_pid: int = 1
    host_ns: Namespace = field(default_factory=lambda: Namespace(0, None, None))

    def __post_init__(self) -> None:
        init = Proc(serial=0, pid=1, nspid=(1,), ns=self.host_ns, parent=None, born_of=None,
                    sid=1, session=None, pgid=1, start_time=0, program=INIT, cgroup=INIT_SCOPE,
                    uid=0)
        init.session = init
        self.host_ns.init = 0
        self.host_ns.next_pid = 2
        self.procs.append(init)
        self.history.append("t=0 boot: 1(systemd) leads session 1")

    # -- looking -----------------------------------------------------------------------

    @property
    def init(self) -> Proc:
        return self.procs[0]

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p.state == ALIVE]

    def existing(self) -> list[Proc]:
        """Alive or zombie: what /proc lists."""
        return [p for p in self.procs if p.state != GONE]

    def zombies(self) -> list[Proc]:
        return [p for p in self.procs if p.state == ZOMBIE]

    def by_pid(self, pid: int) -> Proc | None:
        for p in self.procs:
            if p.pid == pid and p.state != GONE:
                return p
        return None

    def children(self, p: Proc) -> list[Proc]:
        return [c for c in self.procs if c.parent is p and c.state != GONE]

    def descendants(self, p: Proc) -> list[Proc]:
        """Live (not zombie) descendants by current parent, breadth first."""
        out: list[Proc] = []
        frontier = [p]
        while frontier:
            frontier = [c for q in frontier for c in self.children(q) if c.alive]
            out += frontier
        return out

    def holders(self) -> list[Proc]:
        return [p for p in self.procs if p.gpu and p.alive]

    def _ns_init(self, ns: Namespace) -> Proc:
        assert ns.init is not None
        return self.procs[ns.init]

    # -- the steps ------------------------------------------------------------------------

    def _tick(self, line: str) -> str:
        self.clock += 1
        line = f"t={self.clock} {line}"
        self.history.append(line)
        return line

    def _pid_in_use(self, pid: int) -> bool:
        return any(pid in (p.pid, p.pgid, p.sid) for p in self.procs if p.state != GONE)

    def _alloc_pid(self) -> int | None:
        span = self.pid_max - 2
        for step in range(1, span + 1):
            pid = 2 + (self.last_pid - 2 + step) % span
            if not self._pid_in_use(pid):
                self.last_pid = pid
                return pid
        return None

    def fork(self, parent: Proc, *, new_ns: bool = False) -> Proc | None:
        assert parent.alive
        pid = self._alloc_pid()
        if pid is None:
            self._tick(f"fork {parent.label()} failed: EAGAIN (no free pid)")
            return None
        ns = parent.ns
        if new_ns:
            ns = Namespace(parent.ns.level + 1, None, parent.ns)
        levels: list[Namespace] = []
        cur: Namespace | None = ns
        while cur is not None and cur.level > 0:
            levels.append(cur)
            cur = cur.parent
        nspid = (pid, *(n.alloc() for n in reversed(levels)))
        child = Proc(
            serial=len(self.procs), pid=pid, nspid=nspid, ns=ns, parent=parent,
            born_of=parent, sid=parent.sid, session=parent.session, pgid=parent.pgid,
            start_time=self.clock + 1, program=parent.program, cgroup=parent.cgroup,
            sighup=parent.sighup, keep=parent.keep, daemon_io=parent.daemon_io,
            uid=parent.uid,
        )
        if new_ns:
            ns.init = child.serial
        self.procs.append(child)
        what = "unshare(CLONE_NEWPID)+fork" if new_ns else "fork"
        self._tick(f"{what} {parent.label()} -> {child.pid}"
                   + (f" (pid 1 of a level-{ns.level} namespace)" if new_ns else ""))
        return child

    def setsid(self, p: Proc) -> bool:
        if p.pgid == p.pid or any(q.pgid == p.pid for q in self.existing()):
            self._tick(f"setsid {p.label()} failed: EPERM (a process group leader)")
            return False
        p.sid = p.pgid = p.pid
        p.session = p
        self._tick(f"setsid {p.label()}: leads session {p.pid}")
        return True

    def setpgid(self, p: Proc, choice: int) -> bool:
        if p.is_session_leader:
            self._tick(f"setpgid {p.label()} failed: EPERM (a session leader)")
            return False
        groups = sorted({q.pgid for q in self.existing() if q.sid == p.sid} | {p.pid})
        pgid = groups[choice % len(groups)]
        p.pgid = pgid
        self._tick(f"setpgid {p.label()} -> group {pgid}")
        return True

    def exec(self, p: Proc, program: Program, keep: bool | None = None) -> None:
        p.program = program
        if p.sighup == HANDLE:
            p.sighup = DEFAULT  # handlers do not survive exec; ignored signals do
        if keep is not None:
            p.keep = keep
        p.gpu = False
        env = "" if keep is None else f" with GPUGUARD_KEEP={int(keep)}"
        self._tick(f"exec {p.pid} {program.cmdline!r}{env}")

    def sighup_disposition(self, p: Proc, disposition: str) -> None:
        p.sighup = disposition
        self._tick(f"{p.label()} sets SIGHUP to {disposition}")

    def set_subreaper(self, p: Proc) -> None:
        p.subreaper = True
        self._tick(f"prctl(PR_SET_CHILD_SUBREAPER) {p.label()}")

    def detach_io(self, p: Proc) -> None:
        p.daemon_io = True
        self._tick(f"{p.label()} chdir / and stdin from /dev/null")

    def move(self, p: Proc, cgroup: Cgroup) -> None:
        p.cgroup = cgroup
        self._tick(f"{p.label()} moved to cgroup {cgroup.path}")

    def setuid(self, p: Proc, uid: int) -> None:
        p.uid = uid
        self._tick(f"{p.label()} setuid {uid}")

    def gpu(self, p: Proc) -> None:
        p.gpu = True
        self._tick(f"{p.label()} opens a GPU context")

    def exit(self, p: Proc, status: int) -> None:
        self._tick(f"{p.label()} exits with status {status}")
        self._die(p, Death(None, status, self.clock))

    def kill(self, p: Proc, sig: int) -> bool:
        name = signal_module.Signals(sig).name
        if sig == SIGHUP and p.sighup != DEFAULT:
            self._tick(f"{name} to {p.label()}: {'ignored' if p.sighup == IGNORE else 'handled'}")
            return False
        self._tick(f"{name} kills {p.label()}")
        self._die(p, Death(sig, None, self.clock))
        return True

    def hangup(self, p: Proc) -> None:
        """The session's terminal goes away: SIGHUP to the leader, then to every member."""
        sid = p.sid
        self._tick(f"hangup of session {sid}")
        members = [q for q in self.live() if q.sid == sid and q is not self.init]
        members.sort(key=lambda q: q.pid != sid)  # the leader first
        for q in members:
            if q.alive:
                self.kill(q, SIGHUP)

    def reap(self, z: Proc) -> None:
        assert z.state == ZOMBIE
        z.state = GONE
        who = z.parent.label() if z.parent is not None else "?"
        self._tick(f"{who} reaps zombie {z.pid}")

    def _record(self, p: Proc, death: Death) -> None:
        p.death = death
        self.exits.append((p.pid, death))

    def _die(self, p: Proc, death: Death) -> None:
        assert p.alive and p is not self.init
        self._record(p, death)
        p.state = ZOMBIE
        if p.is_ns_init:
            # zap_pid_ns_processes: everything else in the namespace is killed and reaped
            for q in self.procs:
                if q is p or q.state == GONE or not self._inside(q.ns, p.ns):
                    continue
                if q.alive:
                    self._record(q, Death(SIGKILL, None, self.clock))
                q.state = GONE
            self.history.append(f"    namespace of {p.pid} torn down: its processes killed")
            return
        reaper = self._new_reaper(p)
        moved = self.children(p)
        for c in moved:
            c.parent = reaper
        if moved:
            self.history.append(f"    {', '.join(str(c.pid) for c in moved)} reparented to "
                                f"{reaper.label()}")

    @staticmethod
    def _inside(ns: Namespace, outer: Namespace) -> bool:
        cur: Namespace | None = ns
        while cur is not None:
            if cur is outer:
                return True
            cur = cur.parent
        return False

    def _new_reaper(self, p: Proc) -> Proc:
        """find_new_reaper(): the nearest live child subreaper among p's ancestors in its
        PID namespace, else the namespace's init."""
        a = p.parent
        while a is not None and a.ns is p.ns:
            if a.is_ns_init:
                break
            if a.subreaper and a.alive:
                return a
            a = a.parent
        return self._ns_init(p.ns)

    # -- rendering -----------------------------------------------------------------------

    def fake(self, p: Proc) -> FakeProc:
        zombie = p.state == ZOMBIE
        return FakeProc(
            pid=p.pid,
            ppid=p.parent.pid if p.parent is not None else 0,
            sid=p.sid,
            pgid=p.pgid,
            start_time=p.start_time,
            comm=p.comm,
            state="Z" if zombie else "S",
            uid=p.uid,
            cmdline="" if zombie else p.program.cmdline,
            cgroup=(p.cgroup.path,),
            sighup_ignored=p.sighup == IGNORE,
            nspid=p.nspid,
            keep=p.keep and not zombie,
            daemon_io=p.daemon_io and not zombie,
        )

    def info(self, p: Proc) -> ProcInfo:
        return self.fake(p).info()

    def view(self, listener: str = "every") -> ModelView:
        """The moment as /proc shows it; `listener`: "every" exit was seen, or "none"."""
        log: dict[int, list[Exit]] = {}
        if listener == "every":
            for pid, death in self.exits:
                log.setdefault(pid, []).append(Exit(death.signal, death.status, death.at))
        elif listener != "none":
            raise ValueError(listener)
        return ModelView([self.fake(p) for p in self.existing()], exit_log=log,
                         listener=listener == "every")

    def find(self, identity: tuple[int, int]) -> Proc | None:
        for p in self.procs:
            if p.identity == identity and p.state != GONE:
                return p
        return None

    def dump(self) -> str:
        return "\n".join(self.history)


def login(world: World) -> dict[str, Proc]:
    """The prologue every generated history starts from: the user's systemd --user manager
    (a child subreaper that leads its own session), then an ssh login with bash, the newest
    process (where generated histories start forking)."""
    init = world.init
    manager = world.fork(init)
    assert manager is not None
    world.setsid(manager)
    world.exec(manager, USER_MANAGER)
    world.set_subreaper(manager)
    world.move(manager, USER_MANAGER_SCOPE)
    world.setuid(manager, 1000)
    sshd = world.fork(init)
    assert sshd is not None
    world.exec(sshd, SSHD)
    world.setsid(sshd)
    world.move(sshd, SSH_SERVICE)
    priv = world.fork(sshd)
    assert priv is not None
    world.setsid(priv)
    world.move(priv, SESSION_SCOPE)
    user = world.fork(priv)
    assert user is not None
    world.exec(user, SSHD_SESSION)
    world.setuid(user, 1000)
    bash = world.fork(user)
    assert bash is not None
    world.setsid(bash)
    world.exec(bash, BASH)
    return {"sshd": sshd, "priv": priv, "user": user, "bash": bash, "manager": manager}


#: The step vocabulary of generated histories: (kind, a, b), a and b small integers that
#: pick the target (among live processes other than PID 1, newest first) and an argument.
#: A step the kernel refuses (setsid of a group leader, ...) is a line of history too.
STEP_KINDS = (
    "spawn", "fork", "gpu", "exit", "kill", "hangup", "reap", "setsid", "setpgid", "exec",
    "sighup", "subreaper", "daemon_io", "cgroup", "unshare", "parent_dies",
)


def _program(b: int) -> tuple[Program, bool | None]:
    """A program to exec, and its environment: inherited (None) or GPUGUARD_KEEP=1/0."""
    return PROGRAMS[b % len(PROGRAMS)], (None, None, True, False)[b // len(PROGRAMS) % 4]


def apply(world: World, kind: str, a: int, b: int) -> None:
    """One generated step."""
    if kind == "reap":
        zombies = world.zombies()
        if zombies:
            world.reap(zombies[a % len(zombies)])
        return
    targets = [p for p in world.live() if p is not world.init]
    if kind == "parent_dies":  # the parent of a GPU holder (or of any process) dies
        targets = world.holders() or targets
    if not targets:
        return
    p = targets[-1 - a % len(targets)]  # 0 is the newest: small numbers grow deep trees
    if kind == "parent_dies":
        if p.parent is None or p.parent is world.init:
            return
        p, kind = p.parent, ("exit", "kill")[b % 2]
        b //= 2
    if kind in ("spawn", "fork", "unshare"):
        child = world.fork(p, new_ns=kind == "unshare")
        if child is not None and kind == "spawn":
            program, keep = _program(b)
            world.exec(child, program, keep)
            if program.reaper:  # tini -s, containerd-shim: they make themselves subreapers
                world.set_subreaper(child)
    elif kind == "gpu":
        world.gpu(p)
    elif kind == "exit":
        world.exit(p, b % 3)
    elif kind == "kill":
        world.kill(p, (SIGTERM, SIGKILL, SIGHUP)[b % 3])
    elif kind == "hangup":
        world.hangup(p)
    elif kind == "setsid":
        if p.program.reaper and world.children(p):
            return  # what the reapers list trusts: they never setsid() after forking
        if world.setsid(p) and world.children(p):
            p.setsid_after_fork = True
    elif kind == "setpgid":
        world.setpgid(p, b)
    elif kind == "exec":
        program, keep = _program(b)
        if program.reaper and p.setsid_after_fork:
            return  # the same trust: no reaper is a process that did so before exec
        world.exec(p, program, keep)
    elif kind == "sighup":
        world.sighup_disposition(p, (IGNORE, HANDLE, DEFAULT)[b % 3])
    elif kind == "subreaper":
        world.set_subreaper(p)
    elif kind == "daemon_io":
        world.detach_io(p)
    elif kind == "cgroup":
        world.move(p, CGROUPS[b % len(CGROUPS)])
    else:
        raise ValueError(kind)
