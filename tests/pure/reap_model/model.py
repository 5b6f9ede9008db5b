"""The reap protocol (docs/design.md, The reap) as an explicit-state model.

A `State` is everything that matters to the reap's promises at one moment: the tree's
processes as the kernel has them, the reaper's memory (lost in a crash), what is durable
(the ledger's marks, the audit log), the thaw guardian, and the environment's leftovers
(a resolved alert delivered, crashes still allowed). `successors(config, state)` lists
every step that may come next, the reaper's own and the environment's, each with the
signals it sent; checker.py explores them breadth first and `violations()` says which
promise a step broke. docs/reap-safety.md ("The protocol as a checked model") maps each
step to the code that carries it out; states.STEPS does the same for test_reap_model.py.

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
- Time moves in ticks of waiting: a wait on Alertmanager, SIGTERM's grace, a moment
  with the reaper down. Every other step, the environment's and the reaper's, is
  instantaneous (each of the reaper's loops is bounded by the three members).
  `worker_timeout` is the reap's deadline in ticks, checked where the code checks it;
  `Config.deadline()` is the promise: no process stays stopped by us longer.
"""

from __future__ import annotations

from tests.pure.reap_model.reap_steps import reaper_steps
from tests.pure.reap_model.states import (
    ABORTING,
    DEAD,
    DONE,
    FINAL,
    INTENT,
    JOINED,
    JOINER,
    KILLING,
    PRE,
    RECOVER,
    RECOVERING,
    SETTLE,
    SLOT_NAMES,
    TERMING,
    Config,
    Event,
    Proc,
    State,
    Step,
    deliver,
    reaches,
    replace,
)

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
        (p := reaches(config, state, h)) is not None and p.stopped for h in state.guarded)


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
            after, sent = deliver(config, after, "guardian", "SIGCONT", handle)
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
    for label, after, events in reaper_steps(config, state):
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
