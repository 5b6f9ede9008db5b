"""The reap protocol (docs/design.md, The reap) as an explicit-state model.

A `State` is everything that matters to the reap's promises at one moment: the tree's
processes as the kernel has them, the reaper's memory (lost in a crash), what is durable
(the ledger's marks, the audit log), the thaw guardian, and the environment's leftovers
(a resolved alert delivered, crashes still allowed). `successors(config, state)` lists
every step that may come next, the reaper's own and the environment's, each with the
signals it sent; checker.py explores them breadth first and `violations()` says which
promise a step broke. docs/reap-safety.md ("The protocol as a checked model") maps each
step to the code that carries it out; STEPS below does the same for test_reap_model.py.

Abstractions (each over-approximates what the real system can do, so that a promise the
model keeps, the real protocol keeps as far as the model reaches):

- Three process slots: the root, one child and one process that may join (a fork). A
  slot's pid can be taken by an unrelated process once its owner is gone (`gen` 1).
  "The rules protect it" is one fact per process: it exec'd a protected name, changed uid
  to one the policy refuses, or began ignoring SIGHUP (three environment steps, one
  fact). Only a running process changes it; a stopped one can neither exec nor change a
  disposition, and a SIGSTOP queued for a process in D state takes effect before it runs
  user code again, so a SIGSTOP is taken to stop at once.
- Alertmanager is seen only by the reap's confirmation, so its answer is chosen there,
  among everything the environment could have made of it by then (firing, silenced,
  resolved, unreachable, or still answering, one slow byte at a time).
- A disk (state directory and audit log alike) is seen only by a write, so every write
  may fail (the disk filled) or succeed (it was freed).
- Time moves in ticks: one per reaper step, one per wait (a slow answer, the SIGTERM
  grace), one per moment the reaper is down. Only time spent by or for the reaper counts:
  the environment's steps are instantaneous. `worker_timeout` is the reap's deadline in
  ticks, checked where the code checks it; `deadline()` is the promise: no process stays
  stopped by us longer.
"""

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
    HOLD: ("gpuguard.remediator.freezing", "Freezer.hold_planned"),
    INTENT: ("gpuguard.remediator.reap_run", "ReapRun.write"),
    CONFIRM: ("gpuguard.remediator.reaper", "Reaper._confirm"),
    CHECK: ("gpuguard.remediator.reap_run", "check_wanted"),
    MARK: ("gpuguard.remediator.signalling", "Signaller.mark"),
    STOP: ("gpuguard.remediator.signalling", "Signaller.stop"),
    COLLECT: ("gpuguard.remediator.freezing", "Freezer.collect"),
    JOINED: ("gpuguard.remediator.reap_run", "ReapRun.write"),
    REJUDGE: ("gpuguard.remediator.freezing", "Freezer.rejudge"),
    RECHECK: ("gpuguard.remediator.recheck", "recheck_frozen"),
    TERM: ("gpuguard.remediator.signalling", "Signaller.send"),
    RESUME: ("gpuguard.remediator.signalling", "Signaller.resume"),
    UNMARK: ("gpuguard.remediator.signalling", "Signaller.mark"),
    WAIT: ("gpuguard.remediator.killing", "Killer.wait_gone"),
    KILL: ("gpuguard.remediator.signalling", "Signaller.send"),
    THAW: ("gpuguard.remediator.signalling", "Signaller.thaw"),
    FINAL: ("gpuguard.remediator.audit_trail", "AuditTrail.decision"),
    SETTLE: ("gpuguard.remediator.ledger", "Ledger.finish_reap"),
    RECOVER: ("gpuguard.remediator.interrupted_reaps", "InterruptedReaps._settle_one"),
    RECOVER_CONT: ("gpuguard.remediator.recovery", "thaw_interrupted"),
}

#: The reasons an aborted reap ends with, each where the code names it.
ABORT_REASONS: dict[str, str] = {
    "root-gone": "gpuguard.remediator.freezing",
    "root-replaced": "gpuguard.remediator.freezing",
    "member-protected": "gpuguard.orphans.vocabulary",
    "audit-failed": "gpuguard.remediator.reap_run",
    "state-failed": "gpuguard.remediator.signalling",
    "cancelled": "gpuguard.remediator.reap_run",
    "worker-timeout": "gpuguard.remediator.reap_run",
    "nvml-timeout": "gpuguard.remediator.recheck",
    "silenced": "gpuguard.remediator.alertmanager",
    "not-firing": "gpuguard.remediator.alertmanager",
    "alertmanager-unreachable": "gpuguard.remediator.worker",
    "interrupted-thawed": "gpuguard.remediator.interrupted_reaps",
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


def _reaches(config: Config, state: State, handle: Handle) -> Proc | None:
    """The live process a signal through `handle` reaches: through a pidfd only the process
    it was opened on; through a bare pid (config.pidfd False) whoever has the pid now."""
    slot, gen = handle
    proc = state.proc(slot)
    if proc is None or not proc.alive:
        return None
    if config.pidfd and proc.gen != gen:
        return None
    return proc


def _signal(config: Config, state: State, sender: str, sig: str, handle: Handle,
            by_pid: bool = False) -> tuple[State, tuple[Event, ...]]:
    """Deliver `sig` through `handle`; nothing happens (ESRCH) when it reaches no one."""
    proc = (_reaches(dataclasses.replace(config, pidfd=False), state, handle) if by_pid
            else _reaches(config, state, handle))
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


def _alive(config: Config, state: State, handle: Handle) -> bool:
    return _reaches(config, state, handle) is not None


# -- the reaper --------------------------------------------------------------------------


def _go(state: State, pc: str, **changes: object) -> State:
    return replace(state, pc=pc, **changes)


def _abort(state: State, reason: str) -> State:
    """An abort: continue what the reap stopped (the thaw), then the final record."""
    return replace(state, pc=THAW, stage=ABORTING, ending=reason, sent=frozenset())


def _write(config: Config, state: State, label: str, ok: State,
           failed: State) -> list[Step]:
    """A durable write: it succeeds (`ok`) or the disk is full (`failed`). With torn
    records (config.whole_records False) a failed write leaves a line without its newline,
    and the next record is glued onto it: written, but no longer a record."""
    if not config.whole_records:
        failed = replace(failed, torn=True)
    return [(f"{label}: written", ok, ()), (f"{label}: the disk is full", failed, ())]


def _record(config: Config, state: State, names: frozenset[Handle]) -> State:
    """`state` after a successful write of a record naming `names`."""
    if state.torn and not config.whole_records:
        return replace(state, torn=False)  # glued onto the torn line: unreadable
    return replace(state, named=state.named | names, torn=False)


def plan(config: Config) -> tuple[str, ...]:
    """The steps from the decision to SIGTERM, in order: Reaper._freeze_and_judge's (the
    freeze being Freezer.freeze's mark, stop, collect); a broken variant moves or drops
    one. `State.at` is the position in it."""
    steps = [DECIDE, HOLD, CHECK, INTENT, CONFIRM, CHECK, MARK, STOP, COLLECT, REJUDGE,
             RECHECK, CONFIRM, CHECK]
    if not config.intent_first:  # written once the tree is frozen: too late
        steps.remove(INTENT)
        steps.insert(steps.index(COLLECT) + 1, INTENT)
    if not config.rejudge_frozen:
        steps.remove(REJUDGE)
    return tuple(steps)


#: The steps from SIGTERM to the end of a reap that ran (Killer.kill's order).
KILL_PLAN = (TERM, RESUME, UNMARK, WAIT, MARK, STOP, COLLECT, REJUDGE, KILL, FINAL, SETTLE)


def _advance(config: Config, state: State, **changes: object) -> State:
    """The next step of plan() (SIGTERM after its last); the freeze begins at its mark."""
    steps = plan(config)
    at = state.at + 1
    if at == len(steps):
        return _go(state, TERM, stage=FROZEN, at=at, **changes)
    stage = FROZEN if at >= steps.index(MARK) else PRE
    return _go(state, steps[at], stage=stage, at=at, **changes)


def _decide(config: Config, state: State) -> list[Step]:
    """The worker's live check and policy.decide(), then Ledger.begin_reap."""
    root = state.proc(ROOT)
    assert root is not None
    if state.cancelled:
        return [("decide: cancel, resolved before the live check",
                 _go(state, DONE, outcome="cancel"), ())]
    if not (root.alive and root.member):
        return [("decide: ignore, root gone", _go(state, DONE, outcome="ignore"), ())]
    if any(p is not None and p.alive and p.member and p.protected for p in state.procs):
        return [("decide: ignore, a member is protected", _go(state, DONE, outcome="ignore"),
                 ())]
    begun = _advance(config, state, ledger="reaping", budget=config.worker_timeout)
    return [("decide: reap; ledger says reaping", begun, ()),
            ("decide: reap; the state file cannot be written",
             _go(state, DONE, outcome="ignore"), ())]


def _hold(config: Config, state: State) -> list[Step]:
    """Freezer.hold_planned: a pidfd on each planned member, its identity, its judgement."""
    root = state.proc(ROOT)
    assert root is not None
    if not root.alive:
        return [("hold: root gone", _abort(state, "root-gone"), ())]
    if not root.member:
        return [("hold: root replaced", _abort(state, "root-replaced"), ())]
    held: list[Handle] = [(ROOT, 0)]
    for slot in (CHILD, JOINER):
        proc = state.proc(slot)
        if proc is None or not proc.alive or not proc.member:
            continue  # exited since the inspection, or never planned
        if slot == JOINER:
            continue  # born after the inspection: the freeze collects it
        held.append((slot, 0))
    if any(p.protected for h in held if (p := state.proc(h[0])) is not None):
        return [("hold: a member is protected", _abort(state, "member-protected"), ())]
    return [("hold: members held", _advance(config, state, held=tuple(held)), ())]


def _intent(config: Config, state: State) -> list[Step]:
    """ReapRun.write(Phase.INTENT): the ledger's member list and the fsynced audit record
    naming every held member, before the first SIGSTOP (or, broken, after the freeze)."""
    ok = _advance(config, _record(config, state, frozenset(state.held)))
    return _write(config, state, "intent record", ok, _abort(state, "audit-failed"))


def _confirm(config: Config, state: State) -> list[Step]:
    """Reaper._confirm: Alertmanager asked (once before the freeze, once frozen)."""
    if not config.alertmanager:
        return [("confirm: no Alertmanager configured", _advance(config, state), ())]
    if config.confirm_bounded and state.budget <= 0:
        return [("confirm: timed out at the reap's deadline",
                 _abort(state, "alertmanager-unreachable"), ())]
    return [
        ("confirm: firing", _advance(config, state), ()),
        ("confirm: firing, after a wait", _advance(config, state), ()),
        ("confirm: silenced (a silence was added)", _abort(state, "silenced"), ()),
        ("confirm: not firing (the alert resolved)", _abort(state, "not-firing"), ()),
        ("confirm: unreachable (Alertmanager absent)",
         _abort(state, "alertmanager-unreachable"), ()),
        ("confirm: still waiting on a slow Alertmanager", state, ()),
    ]


def _check(config: Config, state: State) -> list[Step]:
    """check_wanted: a resolved alert withdrew the reap, or the deadline ran out."""
    if state.cancelled:
        return [("check_wanted: cancelled", _abort(state, "cancelled"), ())]
    if state.budget <= 0:
        return [("check_wanted: deadline", _abort(state, "worker-timeout"), ())]
    return [("check_wanted: go on", _advance(config, state), ())]


def _mark(config: Config, state: State) -> list[Step]:
    """Signaller.mark(held=True) right before SIGSTOP: the ledger's marks and the pidfds
    handed to the guardian."""
    if state.stage == KILLING:
        handles = frozenset(h for h in state.held if _alive(config, state, h))
        if not handles:
            return [("mark: nobody survived SIGTERM", _go(state, FINAL), ())]
    else:
        handles = frozenset(state.held)
    guarded = state.guarded | handles if state.guardian == "up" else state.guarded
    ok = _go(state, STOP, marks=state.marks | handles, guarded=guarded)
    return [("mark: held marks written", ok, ()),
            ("mark: the state file cannot be written", _abort(state, "state-failed"), ())]


def _stop(config: Config, state: State) -> list[Step]:
    """Signaller.stop: SIGSTOP, root first; then the collection (or, for a joiner after
    SIGTERM, its judgement)."""
    # After SIGTERM only the joiner is frozen (to be judged); the others run their handlers.
    handles = [(JOINER, 0)] if state.stage == TERMING else state.held
    for handle in handles:
        if handle[0] not in state.ours and _alive(config, state, handle):
            after, events = _signal(config, state, "reaper", "SIGSTOP", handle)
            return [(f"SIGSTOP {SLOT_NAMES[handle[0]]}",
                     replace(after, ours=after.ours | {handle[0]}), events)]
    if state.stage == FROZEN:
        return [("stop: every member stopped", _advance(config, state), ())]
    nxt = REJUDGE if state.stage == TERMING else COLLECT
    return [("stop: every member stopped", _go(state, nxt), ())]


def _joiner(state: State) -> Proc | None:
    """A live member not held yet: a child forked while the reap ran."""
    proc = state.proc(JOINER)
    if proc is None or not proc.alive or not proc.member or (JOINER, 0) in state.held:
        return None
    return proc


def _collect(config: Config, state: State) -> list[Step]:
    """Freezer.collect: children of members not held yet are held, judged, recorded."""
    joiner = _joiner(state)
    if joiner is None:
        if state.stage == KILLING:
            return [("collect: no one new", _go(state, REJUDGE), ())]
        return [("collect: no one new", _advance(config, state), ())]
    if joiner.protected:
        if state.stage == KILLING:  # refuse=False: left alone, never signalled
            return [("collect: a protected joiner is left alone", _go(state, REJUDGE), ())]
        return [("collect: a protected joiner", _abort(state, "member-protected"), ())]
    if state.stage == FROZEN and state.budget <= 0:
        return [("collect: the tree kept growing", _abort(state, "worker-timeout"), ())]
    return [("collect: a joiner", _go(state, JOINED), ())]


def _joined(config: Config, state: State) -> list[Step]:
    """ReapRun.write(Phase.JOINED) and its held mark (and the guardian's pidfd), before the
    joiner's SIGSTOP. Not written: during the freeze the reap aborts; after SIGTERM the
    joiner is left unsignalled (the next collection finds it again)."""
    handle = (JOINER, 0)
    recorded = _record(config, state, frozenset({handle}))
    guarded = recorded.guarded | {handle} if recorded.guardian == "up" else recorded.guarded
    late = recorded.late | {JOINER} if state.stage in (TERMING, KILLING) else recorded.late
    at = plan(config).index(STOP) if state.stage == FROZEN else state.at
    ok = _go(recorded, STOP, held=(*state.held, handle), marks=recorded.marks | {handle},
             guarded=guarded, late=late, at=at)
    if state.stage == FROZEN:
        failed = _abort(state, "audit-failed")
    elif state.stage == TERMING:
        failed = _go(state, WAIT)
    else:
        failed = _go(state, REJUDGE)
    return _write(config, state, "joined record", ok, failed)


def _rejudge(config: Config, state: State) -> list[Step]:
    """Freezer.rejudge with the tree frozen: before SIGTERM every member (refuse), after
    it the joiner alone (then SIGTERM, or SIGCONT and let go), before SIGKILL every member
    again (a late joiner let go, any other refusal ends the reap: nobody is SIGKILLed)."""
    live = [h for h in state.held if _alive(config, state, h)]
    if state.stage == FROZEN:
        if any(p.protected for h in live if (p := _reaches(config, state, h)) is not None):
            return [("rejudge: a member became protected", _abort(state, "member-protected"),
                     ())]
        return [("rejudge: every member still ours", _advance(config, state), ())]
    if state.stage == TERMING:
        handle = (JOINER, 0)
        proc = _reaches(config, state, handle)
        if proc is None:
            return [("rejudge: the joiner is gone", _go(state, RESUME), ())]
        if proc.protected:
            after, events = _signal(config, state, "reaper", "SIGCONT", handle)
            let_go = replace(after, pc=UNMARK, ours=after.ours - {JOINER},
                             held=tuple(h for h in after.held if h != handle))
            return [("rejudge: the joiner is protected: continued, let go", let_go, events)]
        after, events = _signal(config, state, "reaper", "SIGTERM", handle)
        return [("rejudge: the joiner is ours: SIGTERM", _go(after, RESUME), events)]
    # KILLING
    events: tuple[Event, ...] = ()
    after = state
    for handle in live:
        proc = _reaches(config, after, handle)
        assert proc is not None
        if not proc.protected:
            continue
        if handle[0] in state.late:
            after, sent = _signal(config, after, "reaper", "SIGCONT", handle)
            events += sent
            after = replace(after, ours=after.ours - {handle[0]},
                            held=tuple(h for h in after.held if h != handle))
        else:
            return [("rejudge: a survivor became protected: no SIGKILL",
                     _abort(state, "member-protected"), ())]
    return [("rejudge: every survivor still ours", _go(after, KILL, sent=frozenset()), events)]


def _recheck(config: Config, state: State) -> list[Step]:
    """recheck_frozen: NVML once more within the deadline, the verdict derived again."""
    if state.budget <= 0:
        return [("recheck: deadline", _abort(state, "worker-timeout"), ())]
    return [("recheck: still the orphan decided on", _advance(config, state), ()),
            ("recheck: NVML hangs", _abort(state, "nvml-timeout"), ())]


def _to_each(config: Config, state: State, sig: str,
             handles: list[Handle]) -> tuple[State, tuple[Event, ...]]:
    """One signal to each of `handles`, in order (one step: see _term)."""
    events: tuple[Event, ...] = ()
    for handle in handles:
        state, sent = _signal(config, state, "reaper", sig, handle)
        events += sent
    return state, events


def _term(config: Config, state: State) -> list[Step]:
    """Killer.kill: SIGTERM to every member. One step for the loop: every member is
    stopped, so nothing of the tree can act between two of its signals, and a crash
    between them leaves the marks and the stopped members of the state before it."""
    after, events = _to_each(config, state, "SIGTERM", list(state.held))
    return [("SIGTERM every member", _go(after, RESUME, stage=TERMING, killing=True), events)]


def _resume(config: Config, state: State) -> list[Step]:
    """Signaller.resume (after SIGTERM) and Signaller.thaw (an abort): SIGCONT each member
    the reap stopped (one step, as in _term); then the marks are cleared."""
    handles = [h for h in state.held if h[0] in state.ours]
    after, events = _to_each(config, state, "SIGCONT", handles)
    label = "SIGCONT what the reap stopped" if state.pc == RESUME else "thaw: SIGCONT"
    return [(label, _go(after, UNMARK, ours=frozenset()), events)]


def _unmark(config: Config, state: State) -> list[Step]:
    """Signaller.mark(held=False): what was continued is no longer held (a failed write
    leaves the marks: a restart continues them again, harmlessly); the guardian forgets it."""
    continued = frozenset(h for h in state.marks if h[0] not in state.ours)
    nxt = FINAL if state.stage == ABORTING else WAIT
    cleared = _go(state, nxt, guarded=state.guarded - continued, waited=0)
    return [("unmark: written", replace(cleared, marks=state.marks - continued), ()),
            ("unmark: the state file cannot be written", cleared, ())]


def _wait(config: Config, state: State) -> list[Step]:
    """Killer.wait_gone after SIGTERM: joiners get their own SIGTERM; then the re-freeze."""
    if not any(_alive(config, state, h) for h in state.held):
        return [("wait_gone: every member gone", _go(state, FINAL), ())]
    joiner = _joiner(state)
    if joiner is not None and not joiner.protected:
        return [("wait_gone: a joiner", _go(state, JOINED), ())]
    if state.waited >= config.term_timeout:
        if config.refreeze_before_kill:
            return [("wait_gone: SIGTERM's grace is over",
                     _go(state, MARK, stage=KILLING), ())]
        return [("wait_gone: SIGTERM's grace is over", _go(state, KILL, stage=KILLING,
                                                            sent=frozenset()), ())]
    return [("wait_gone: waiting", replace(state, waited=state.waited + 1), ())]


def _kill(config: Config, state: State) -> list[Step]:
    """Signaller.send(SIGKILL) to every frozen, judged survivor (one step, as in _term)."""
    after, events = _to_each(config, state, "SIGKILL", list(state.held))
    return [("SIGKILL every survivor", _go(after, FINAL, ours=frozenset()), events)]


def _final(config: Config, state: State) -> list[Step]:
    """The final audit record, then the ledger settles (Worker._settle)."""
    if state.stage == RECOVERING:
        outcome = "interrupted-thawed"
    elif state.stage == ABORTING:
        outcome = "failed" if state.killing else "aborted"
    else:
        outcome = "reaped"
    ok = _go(replace(state, final=not state.torn or config.whole_records, torn=False),
             SETTLE, outcome=outcome)
    return _write(config, state, "final record", ok, _go(state, DONE, outcome=outcome))


def _settle(config: Config, state: State) -> list[Step]:
    return [("settle: ledger done", _go(state, DONE, ledger="done"), ()),
            ("settle: the state file cannot be written", _go(state, DONE), ())]


def _recover(config: Config, state: State) -> list[Step]:
    """InterruptedReaps._settle_one at restart: a reap without its final record gets a
    record, and every member it marked held is continued (recovery.thaw_interrupted)."""
    if state.final:
        return [("recover: the final record made it", _go(state, SETTLE), ())]
    ok = _go(_record(config, state, frozenset()), RECOVER_CONT, sent=frozenset())
    if config.recovery_needs_record:  # stays unsettled: retried every loop, the tree stopped
        return [("recovery record: written", ok, ()),
                ("recovery waits for the audit log (the disk is full)", state, ())]
    return _write(config, state, "recovery record", ok,
                  _go(state, RECOVER_CONT, sent=frozenset()))


def _recover_cont(config: Config, state: State) -> list[Step]:
    for handle in sorted(state.marks):
        if handle[0] in state.sent:
            continue
        done = replace(state, sent=state.sent | {handle[0]})
        if config.recovery_by_pid:
            after, events = _signal(config, done, "recovery", config.recovery_signal, handle,
                                    by_pid=True)
            return [(f"recover: {config.recovery_signal} pid of {SLOT_NAMES[handle[0]]}",
                     after, events)]
        proc = _reaches(config, state, handle)
        if proc is None or not proc.stopped:  # not that process, or not stopped
            return [(f"recover: {SLOT_NAMES[handle[0]]} not ours or not stopped", done, ())]
        after, events = _signal(config, done, "recovery", config.recovery_signal, handle)
        return [(f"recover: {config.recovery_signal} {SLOT_NAMES[handle[0]]}", after, events)]
    return [("recover: every held mark done", _go(state, FINAL, stage=RECOVERING), ())]


REAPER = {
    DECIDE: _decide, HOLD: _hold, INTENT: _intent, CONFIRM: _confirm, CHECK: _check,
    MARK: _mark, STOP: _stop, COLLECT: _collect, JOINED: _joined, REJUDGE: _rejudge,
    RECHECK: _recheck, TERM: _term, RESUME: _resume, THAW: _resume, UNMARK: _unmark,
    WAIT: _wait, KILL: _kill, FINAL: _final, SETTLE: _settle, RECOVER: _recover,
    RECOVER_CONT: _recover_cont,
}


def _reaper_steps(config: Config, state: State) -> list[Step]:
    return REAPER[state.pc](config, state)


# -- time --------------------------------------------------------------------------------


#: Stages after the last look at the deadline and the resolved flag (SIGTERM was sent, or
#: the reap is ending): what they were no longer changes what the reaper does.
_PAST_CHECKS = (TERMING, KILLING, ABORTING, RECOVERING)


def _tick(config: Config, state: State, *, wait: bool) -> State:
    """A wait (for Alertmanager, for SIGTERM's grace, with the reaper down) takes a tick:
    what is stopped stays stopped a tick longer, and the reap's deadline (which bounds the
    waits before SIGTERM) a tick nearer. Other steps are instantaneous: each loop of the
    reaper's is bounded by the members there are (three)."""
    if not wait:
        return _canon(state)
    stopped = any(p is not None and p.alive and p.stopped for p in state.procs)
    return _canon(replace(state, frozen_age=state.frozen_age + 1 if stopped else 0,
                          budget=max(0, state.budget - 1),
                          dead_for=state.dead_for + 1 if state.pc == DEAD else 0))


def _canon(state: State) -> State:
    """What no longer matters is forgotten, so that states that differ only there are one:
    a stretch of stopped time ends once nothing is stopped; the deadline and the resolved
    flag once nothing reads them again."""
    changes: dict[str, object] = {}
    if state.frozen_age and not any(p is not None and p.alive and p.stopped
                                    for p in state.procs):
        changes["frozen_age"] = 0
    if state.pc == DEAD or state.stage in _PAST_CHECKS:
        if state.cancelled:
            changes["cancelled"] = False
        if state.budget:
            changes["budget"] = 0
    if state.pc == DONE:  # the end: only how it ended, and what it left stopped, remain
        return State(procs=tuple(p if p is None else replace(p, protected=False)
                                 for p in state.procs), pc=DONE, outcome=state.outcome,
                     guardian="", frozen_age=state.frozen_age)
    if state.dead_for and state.pc != DEAD:
        changes["dead_for"] = 0
    if _ending(state) and any(p is not None and p.protected for p in state.procs):
        # Nothing judges a member again: only SIGCONTs are left to send.
        changes["procs"] = tuple(p if p is None else replace(p, protected=False)
                                 for p in state.procs)
    return replace(state, **changes) if changes else state


# -- the environment ---------------------------------------------------------------------


def _with(state: State, slot: int, proc: Proc | None) -> State:
    procs = list(state.procs)
    procs[slot] = proc
    return replace(state, procs=tuple(procs))


def _ending(state: State) -> bool:
    """The reap only continues what it stopped from here (or the reaper is down): no
    member is judged or gets a SIGTERM or SIGKILL again."""
    return state.pc in (DEAD, FINAL, SETTLE) or state.stage in (ABORTING, RECOVERING)


def _process_steps(config: Config, state: State) -> list[Step]:
    """What the tree's processes may do: exit, exec a protected name, change uid, start
    ignoring SIGHUP, fork (one joiner), and have their pid reused once gone. Once the reap
    is ending only exits and reuse matter (who a SIGCONT may reach)."""
    ending = _ending(state)
    steps: list[Step] = []
    for slot, proc in enumerate(state.procs):
        name = SLOT_NAMES[slot]
        if proc is None:
            continue
        if not proc.member:
            continue  # an unrelated process: what it does is nobody's business here
        if proc.running():
            steps.append((f"{name} exits", _with(state, slot, Proc(alive=False)), ()))
            if ending:
                continue
            if not proc.protected:
                # Three causes, one fact (and one step: they lead to the same state).
                steps.append((f"{name} execs a protected name, changes uid to one the "
                              "policy refuses or starts ignoring SIGHUP",
                              _with(state, slot, replace(proc, protected=True)), ()))
            if state.proc(JOINER) is None:
                steps.append((f"{name} forks", _with(state, JOINER, Proc()), ()))
        elif not proc.alive and proc.gen == 0:
            steps.append((f"{name}'s pid is reused by an unrelated process",
                          _with(state, slot, Proc(gen=1)), ()))
        elif proc.stopped and config.foreign_cont and not ending:
            steps.append((f"{name}'s owner sends it SIGCONT",
                          _with(state, slot, replace(proc, stopped=False)), ()))
    return steps


def _guardian_duty(config: Config, state: State) -> bool:
    return state.guardian == "up" and any(
        (p := _reaches(config, state, h)) is not None and p.stopped for h in state.guarded)


def _environment(config: Config, state: State) -> list[Step]:
    steps = _process_steps(config, state)
    if not state.cancelled and state.pc != DEAD and state.stage not in _PAST_CHECKS:
        steps.append(("a resolved alert reaches the worker", replace(state, cancelled=True), ()))
    if state.wall_steps_left:
        stepped = replace(state, wall_steps_left=state.wall_steps_left - 1)
        if config.deadline_on_wall_clock and state.pc != DEAD:
            stepped = replace(stepped, budget=state.budget + config.deadline())  # a step back
        steps.append(("the wall clock steps back",
                      stepped if config.deadline_on_wall_clock else state, ()))
    if state.crashes_left and state.pc not in (DEAD, DONE):
        dead = replace(state, pc=DEAD, at=0, stage=PRE, held=(), ours=frozenset(), sent=frozenset(),
                       late=frozenset(), budget=0, killing=False, ending="", waited=0,
                       crashes_left=state.crashes_left - 1, dead_for=0)
        steps.append(("the reaper is SIGKILLed", dead, ()))
        if state.pc in (INTENT, JOINED, FINAL) and not config.whole_records:
            steps.append(("the reaper is SIGKILLed mid-write", replace(dead, torn=True), ()))
    if state.guardian == "up" and state.guardian_crashes_left:
        steps.append(("the guardian is SIGKILLed",
                      replace(state, guardian="down", guarded=frozenset(),
                              guardian_crashes_left=state.guardian_crashes_left - 1), ()))
    if state.pc == DEAD:
        steps += _while_dead(config, state)
    return steps


def _while_dead(config: Config, state: State) -> list[Step]:
    steps: list[Step] = []
    if _guardian_duty(config, state):
        after, events = state, ()
        for handle in sorted(state.guarded):
            after, sent = _signal(config, after, "guardian", "SIGCONT", handle)
            events += sent
        steps.append(("the guardian sees the reaper gone: SIGCONT what it holds",
                      replace(after, guarded=frozenset(), guardian="done"), events))
    if config.restart:
        if state.ledger == "reaping":
            restarted = replace(state, pc=RECOVER, stage=RECOVERING, dead_for=0)
        else:  # no reap under way: nothing to recover
            restarted = replace(state, pc=DONE, outcome="restarted")
        steps.append(("systemd restarts the reaper", restarted, ()))
    guardian_due = _guardian_duty(config, state) and state.dead_for >= config.guardian_delay
    restart_due = config.restart and state.dead_for >= config.restart_delay
    if not (guardian_due or restart_due):
        steps.append(("time passes with the reaper down", _tick(config, state, wait=True), ()))
    return steps


#: The reaper's steps that wait (their labels begin so); the others are instantaneous.
WAITS = ("confirm: still waiting", "confirm: firing, after a wait", "wait_gone: waiting",
         "recovery waits")


# -- the whole step relation -------------------------------------------------------------


def terminal(config: Config, state: State) -> bool:
    """Nothing that could signal is left: the reap is over, or the reaper is down for good
    with nothing stopped and no one to act."""
    if state.pc == DONE:
        return True
    stopped = any(p is not None and p.alive and p.stopped for p in state.procs)
    return state.pc == DEAD and not config.restart and not stopped


def reaper_successors(config: Config, state: State) -> list[Step]:
    """The reaper's own next steps (none while it is down)."""
    steps: list[Step] = []
    if state.pc in (DEAD, DONE):
        return steps
    for label, after, events in _reaper_steps(config, state):
        if after.ending:  # the reason is the step's, not the state's: it changes nothing
            label, after = f"{label} [abort: {after.ending}]", replace(after, ending="")
        steps.append((label, _tick(config, after, wait=label.startswith(WAITS)), events))
    return steps


def successors(config: Config, state: State) -> list[Step]:
    if terminal(config, state):
        return []
    steps = reaper_successors(config, state)
    for label, after, events in _environment(config, state):
        steps.append((label, _canon(after), events))
    return steps


# -- the promises ------------------------------------------------------------------------

INTENT_FIRST = "no signal without a whole intent record before it"
PROTECTED_SPARED = "no SIGTERM or SIGKILL to a process the rules protect at that moment"
FREEZE_BOUNDED = "every process we stopped is continued or killed within the deadline"
RECOVERY_NEVER_KILLS = "recovery never kills"
INVARIANTS = (INTENT_FIRST, PROTECTED_SPARED, FREEZE_BOUNDED, RECOVERY_NEVER_KILLS)


def violations(config: Config, before: State, events: tuple[Event, ...],
               after: State) -> list[str]:
    """Which promises the step from `before` to `after`, sending `events`, broke."""
    broken: list[str] = []
    for sender, sig, slot, proc in events:
        if (slot, proc.gen) not in before.named:
            broken.append(INTENT_FIRST)
        if sig in ("SIGTERM", "SIGKILL"):
            # Outside the tree (a pid's new owner) is as protected as a protected member.
            if proc.protected or not proc.member:
                broken.append(PROTECTED_SPARED)
            if sender != "reaper":
                broken.append(RECOVERY_NEVER_KILLS)
    if after.frozen_age > config.deadline():
        broken.append(FREEZE_BOUNDED)
    elif after.pc == DONE and any(p is not None and p.alive and p.stopped for p in after.procs):
        broken.append(FREEZE_BOUNDED)  # the reap is over and left something stopped
    return broken
