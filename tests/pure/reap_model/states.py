"""What a state of the reap model is (the tree, the reaper's memory, what is durable,
the guardian, the environment), its vocabulary (the reaper's steps, and the code each
stands for) and how a signal reaches a process. model.py's docstring says what is
abstracted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

_T = TypeVar("_T", "Proc", "State")


def replace(value: _T, **changes: Any) -> _T:
    """A copy of a state (or process) with `changes`: states are immutable tuples."""
    return value._replace(**changes)

# -- the tree ----------------------------------------------------------------------------

ROOT, CHILD, JOINER = 0, 1, 2
SLOT_NAMES = ("root", "child", "joiner")


class Proc(NamedTuple):
    """One process in a slot, as the kernel has it."""

    gen: int = 0  # 0: the tree's own process; 1: an unrelated one that took the pid
    alive: bool = True
    stopped: bool = False  # state T (only the reap stops anything in this model)
    protected: bool = False  # the rules protect it now (protected name, uid, SIGHUP ignored)

    @property
    def member(self) -> bool:
        """In the alert's tree: the planned root and child, and their forked joiner."""
        return self.gen == 0

    def running(self) -> bool:
        return self.alive and not self.stopped


Procs = tuple[Any, ...]  # (Proc, Proc, Proc | None): the root, the child, the joiner
Handle = tuple[int, int]  # (slot, gen): a pidfd names one process, never its pid's next owner

# -- the reaper's steps (each is a pc value; STEPS maps it to the code) -------------------

DECIDE = "decide"
HOLD = "hold"
INTENT = "intent"
CONFIRM = "confirm"
CHECK = "check_wanted"
MARK = "mark"
STOP = "stop"
COLLECT = "collect"
JOINED = "joined"
REJUDGE = "rejudge"
RECHECK = "recheck"
TERM = "term"
RESUME = "resume"
UNMARK = "unmark"
WAIT = "wait_gone"
KILL = "kill"
THAW = "thaw"
FINAL = "final"
SETTLE = "settle"
DONE = "done"
DEAD = "dead"  # the reaper process is gone (its memory and handles with it)
RECOVER = "recover"
RECOVER_CONT = "recover_cont"

#: Stages: which part of the reap a shared step belongs to.
PRE, FROZEN, TERMING, KILLING, ABORTING, RECOVERING = (
    "pre", "frozen", "terming", "killing", "aborting", "recovering")

#: Every reaper step and the code that implements it (module, qualified name), for the
#: test that keeps the two in step and for docs/reap-safety.md's table.
STEPS: dict[str, tuple[str, str]] = {
    DECIDE: ("gpuguard.remediator.worker", "Worker._decide_and_claim"),
    HOLD: ("gpuguard.engine.reap.freezing", "Freezer.hold_planned"),
    INTENT: ("gpuguard.engine.reap.reap_run", "Run.write"),
    CONFIRM: ("gpuguard.engine.reap.skeleton", "ReaperCore._confirm"),
    CHECK: ("gpuguard.engine.reap.reap_run", "check_wanted"),
    MARK: ("gpuguard.engine.reap.reap_run", "Run.mark"),
    STOP: ("gpuguard.engine.reap.signalling", "Signaller.stop"),
    COLLECT: ("gpuguard.engine.reap.freezing", "Freezer.collect"),
    JOINED: ("gpuguard.engine.reap.reap_run", "Run.write"),
    REJUDGE: ("gpuguard.engine.reap.freezing", "Freezer.rejudge"),
    RECHECK: ("gpuguard.engine.reap.recheck", "recheck_frozen"),
    TERM: ("gpuguard.engine.reap.signalling", "Signaller.send"),
    RESUME: ("gpuguard.engine.reap.signalling", "Signaller.resume"),
    UNMARK: ("gpuguard.engine.reap.reap_run", "Run.mark"),
    WAIT: ("gpuguard.engine.reap.killing", "Killer.wait_gone"),
    KILL: ("gpuguard.engine.reap.signalling", "Signaller.send"),
    THAW: ("gpuguard.engine.reap.signalling", "Signaller.thaw"),
    FINAL: ("gpuguard.engine.state.audit_trail", "AuditTrail.decision"),
    SETTLE: ("gpuguard.engine.state.ledger", "Ledger.finish_reap"),
    RECOVER: ("gpuguard.engine.state.interrupted_reaps", "InterruptedReaps._settle_one"),
    RECOVER_CONT: ("gpuguard.engine.reap.recovery", "thaw_interrupted"),
}

#: The reasons an aborted reap ends with, each where the code names it.
ABORT_REASONS: dict[str, str] = {
    "root-gone": "gpuguard.engine.reap.freezing",
    "root-replaced": "gpuguard.engine.reap.freezing",
    "member-protected": "gpuguard.orphans.vocabulary",
    "audit-failed": "gpuguard.engine.reap.reap_run",
    "state-failed": "gpuguard.engine.reap.reap_run",
    "cancelled": "gpuguard.engine.reap.reap_run",
    "worker-timeout": "gpuguard.engine.reap.reap_run",
    "nvml-timeout": "gpuguard.engine.reap.recheck",
    "silenced": "gpuguard.engine.alerting.alertmanager",
    "not-firing": "gpuguard.engine.alerting.alertmanager",
    "alertmanager-unreachable": "gpuguard.remediator.worker",
    "interrupted-thawed": "gpuguard.engine.state.interrupted_reaps",
}
#: The audit record phases the model writes (audit.Phase's values).
PHASES = ("intent", "joined", "final")


# -- configuration: the protocol's variant and the environment's allowance ---------------


@dataclass(frozen=True)
class Config:
    """The protocol as designed by default; each flag turned the other way is one of the
    broken variants the tests show the checker catching."""

    # The protocol.
    intent_first: bool = True  # the intent record before the first SIGSTOP
    rejudge_frozen: bool = True  # every member judged again once frozen
    refreeze_before_kill: bool = True  # survivors of SIGTERM frozen and judged before SIGKILL
    pidfd: bool = True  # signals through handles (False: bare pids, no re-check)
    confirm_bounded: bool = True  # the confirmation waits no longer than the reap's deadline
    deadline_on_wall_clock: bool = False  # the deadline read from the wall clock
    whole_records: bool = True  # a failed write leaves nothing; the next starts a new line
    guardian: bool = True  # a thaw guardian holds the stopped members' pidfds
    recovery_needs_record: bool = False  # recovery sends no SIGCONT before its own record
    recovery_signal: str = "SIGCONT"  # what crash recovery sends (SIGKILL: broken)
    recovery_by_pid: bool = False  # recovery signals bare pids, unchecked
    # The deployment.
    restart: bool = True  # a daemon systemd restarts; False: `gpuguard reap --apply`
    alertmanager: bool = True  # remediate.alertmanager set: confirmations asked
    # The environment's allowance.
    reaper_crashes: int = 1
    guardian_crashes: int = 1
    wall_steps: int = 1
    foreign_cont: bool = False  # someone else (the owner) may SIGCONT what we stopped
    # Time, in ticks.
    worker_timeout: int = 2  # waits
    term_timeout: int = 1
    guardian_delay: int = 1  # the guardian acts within this long of the reaper's death
    restart_delay: int = 2  # systemd restarts the reaper within this long

    def deadline(self) -> int:
        """The promise, in ticks: nothing stays stopped by us longer than the reap's own
        deadline (every wait before SIGTERM is bounded by it; after SIGTERM nothing waits
        with a member stopped) and then the time it takes whoever continues the tree once
        the reaper is dead: the guardian, or (where the guardian may be dead too) the
        restarted reaper's recovery."""
        rescue = (self.guardian_delay if self.guardian and not self.guardian_crashes
                  else self.restart_delay)
        return self.worker_timeout + rescue


# -- the state ---------------------------------------------------------------------------


class State(NamedTuple):
    procs: Procs
    # The reaper's memory (a crash loses it).
    pc: str = DECIDE
    at: int = 0  # where in plan() the reap is (until SIGTERM)
    stage: str = PRE
    held: tuple[Handle, ...] = ()  # handles held, root first
    ours: frozenset[int] = frozenset()  # slots this reap stopped and has not continued
    sent: frozenset[int] = frozenset()  # slots a per-member loop has done
    late: frozenset[int] = frozenset()  # slots that joined after SIGTERM (judged, not refused)
    budget: int = 0  # ticks left of the reap's deadline
    killing: bool = False  # SIGTERM was sent
    ending: str = ""  # the reason the reap ends with ("" for a reap that ran)
    waited: int = 0  # ticks of the SIGTERM grace spent
    # Durable.
    ledger: str = ""  # "" | "reaping" | "done"
    marks: frozenset[Handle] = frozenset()  # the ledger's held marks
    named: frozenset[Handle] = frozenset()  # processes named by a whole intent/joined record
    final: bool = False  # a whole final record was written
    torn: bool = False  # the audit log ends in a line without its newline
    # The thaw guardian.
    guardian: str = "up"  # up | down | none
    guarded: frozenset[Handle] = frozenset()  # the pidfds handed to it
    # The environment.
    cancelled: bool = False  # a resolved alert reached the worker (work.cancelled)
    crashes_left: int = 0
    guardian_crashes_left: int = 0
    wall_steps_left: int = 0
    dead_for: int = 0  # ticks since the reaper died
    frozen_age: int = 0  # ticks something has stayed stopped by us, without a break
    outcome: str = ""  # how the reap ended (Outcome's values, and recovery's)

    def proc(self, slot: int) -> Proc | None:
        return self.procs[slot]


def initial(config: Config) -> State:
    return State(procs=(Proc(), Proc(), None),
                 guardian="up" if config.guardian else "none",
                 crashes_left=config.reaper_crashes,
                 guardian_crashes_left=config.guardian_crashes if config.guardian else 0,
                 wall_steps_left=config.wall_steps)


# -- signals -----------------------------------------------------------------------------

#: One signal as the kernel delivered it: (sender, signal, slot, the recipient before it).
Event = tuple[str, str, int, Proc]
Step = tuple[str, State, tuple[Event, ...]]


def reaches(config: Config, state: State, handle: Handle) -> Proc | None:
    """The live process a signal through `handle` reaches: through a pidfd only the process
    it was opened on; through a bare pid (config.pidfd False) whoever has the pid now."""
    slot, gen = handle
    proc = state.proc(slot)
    if proc is None or not proc.alive:
        return None
    if config.pidfd and proc.gen != gen:
        return None
    return proc


def deliver(config: Config, state: State, sender: str, sig: str, handle: Handle,
            by_pid: bool = False) -> tuple[State, tuple[Event, ...]]:
    """Deliver `sig` through `handle`; nothing happens (ESRCH) when it reaches no one."""
    proc = (reaches(dataclasses.replace(config, pidfd=False), state, handle) if by_pid
            else reaches(config, state, handle))
    if proc is None:
        return state, ()
    slot = handle[0]
    if sig == "SIGSTOP":
        after = replace(proc, stopped=True)
    elif sig == "SIGCONT":
        after = replace(proc, stopped=False)
    elif sig == "SIGKILL":
        after = Proc(gen=proc.gen, alive=False)
    else:  # SIGTERM: pending on a stopped process; a running one may die (an exit step)
        after = proc
    procs = list(state.procs)
    procs[slot] = after
    return replace(state, procs=tuple(procs)), ((sender, sig, slot, proc),)


def alive(config: Config, state: State, handle: Handle) -> bool:
    return reaches(config, state, handle) is not None


def to_each(config: Config, state: State, sig: str,
             handles: list[Handle]) -> tuple[State, tuple[Event, ...]]:
    """One signal to each of `handles`, in order (one step: see reap_steps._term)."""
    events: tuple[Event, ...] = ()
    for handle in handles:
        state, sent = deliver(config, state, "reaper", sig, handle)
        events += sent
    return state, events
