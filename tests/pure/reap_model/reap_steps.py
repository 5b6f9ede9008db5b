"""The reaper's steps in the reap model, one function per code step (states.STEPS names
the code): each takes a state and lists the steps that may follow, with the signals they
send. The environment's steps and time are model.py's."""

from __future__ import annotations

from tests.pure.reap_model.states import (
    ABORTING,
    CHECK,
    CHILD,
    COLLECT,
    CONFIRM,
    DECIDE,
    DONE,
    FINAL,
    FROZEN,
    HOLD,
    INTENT,
    JOINED,
    JOINER,
    KILL,
    KILLING,
    MARK,
    PRE,
    RECHECK,
    RECOVER,
    RECOVER_CONT,
    RECOVERING,
    REJUDGE,
    RESUME,
    ROOT,
    SETTLE,
    SLOT_NAMES,
    STOP,
    TERM,
    TERMING,
    THAW,
    UNMARK,
    WAIT,
    Config,
    Event,
    Handle,
    Proc,
    State,
    Step,
    alive,
    deliver,
    reaches,
    replace,
    to_each,
)

# -- helpers ---------------------------------------------------------------------------


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
    """The steps from the decision to SIGTERM, in order: ReaperCore._freeze_and_judge's (the
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
    """Run.write(Phase.INTENT): the ledger's member list and the fsynced audit record
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
    """Run.mark(held=True) right before SIGSTOP: the ledger's marks and the pidfds
    handed to the guardian."""
    if state.stage == KILLING:
        handles = frozenset(h for h in state.held if alive(config, state, h))
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
        if handle[0] not in state.ours and alive(config, state, handle):
            after, events = deliver(config, state, "reaper", "SIGSTOP", handle)
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
    """Run.write(Phase.JOINED) and its held mark (and the guardian's pidfd), before the
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
    live = [h for h in state.held if alive(config, state, h)]
    if state.stage == FROZEN:
        if any(p.protected for h in live if (p := reaches(config, state, h)) is not None):
            return [("rejudge: a member became protected", _abort(state, "member-protected"),
                     ())]
        return [("rejudge: every member still ours", _advance(config, state), ())]
    if state.stage == TERMING:
        handle = (JOINER, 0)
        proc = reaches(config, state, handle)
        if proc is None:
            return [("rejudge: the joiner is gone", _go(state, RESUME), ())]
        if proc.protected:
            after, events = deliver(config, state, "reaper", "SIGCONT", handle)
            let_go = replace(after, pc=UNMARK, ours=after.ours - {JOINER},
                             held=tuple(h for h in after.held if h != handle))
            return [("rejudge: the joiner is protected: continued, let go", let_go, events)]
        after, events = deliver(config, state, "reaper", "SIGTERM", handle)
        return [("rejudge: the joiner is ours: SIGTERM", _go(after, RESUME), events)]
    # KILLING
    events: tuple[Event, ...] = ()
    after = state
    for handle in live:
        proc = reaches(config, after, handle)
        assert proc is not None
        if not proc.protected:
            continue
        if handle[0] in state.late:
            after, sent = deliver(config, after, "reaper", "SIGCONT", handle)
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


def _term(config: Config, state: State) -> list[Step]:
    """Killer.kill: SIGTERM to every member. One step for the loop: every member is
    stopped, so nothing of the tree can act between two of its signals, and a crash
    between them leaves the marks and the stopped members of the state before it."""
    after, events = to_each(config, state, "SIGTERM", list(state.held))
    return [("SIGTERM every member", _go(after, RESUME, stage=TERMING, killing=True), events)]


def _resume(config: Config, state: State) -> list[Step]:
    """Signaller.resume (after SIGTERM) and Signaller.thaw (an abort): SIGCONT each member
    the reap stopped (one step, as in _term); then the marks are cleared."""
    handles = [h for h in state.held if h[0] in state.ours]
    after, events = to_each(config, state, "SIGCONT", handles)
    label = "SIGCONT what the reap stopped" if state.pc == RESUME else "thaw: SIGCONT"
    return [(label, _go(after, UNMARK, ours=frozenset()), events)]


def _unmark(config: Config, state: State) -> list[Step]:
    """Run.mark(held=False): what was continued is no longer held (a failed write
    leaves the marks: a restart continues them again, harmlessly); the guardian forgets it."""
    continued = frozenset(h for h in state.marks if h[0] not in state.ours)
    nxt = FINAL if state.stage == ABORTING else WAIT
    cleared = _go(state, nxt, guarded=state.guarded - continued, waited=0)
    return [("unmark: written", replace(cleared, marks=state.marks - continued), ()),
            ("unmark: the state file cannot be written", cleared, ())]


def _wait(config: Config, state: State) -> list[Step]:
    """Killer.wait_gone after SIGTERM: joiners get their own SIGTERM; then the re-freeze."""
    if not any(alive(config, state, h) for h in state.held):
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
    after, events = to_each(config, state, "SIGKILL", list(state.held))
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
            after, events = deliver(config, done, "recovery", config.recovery_signal, handle,
                                    by_pid=True)
            return [(f"recover: {config.recovery_signal} pid of {SLOT_NAMES[handle[0]]}",
                     after, events)]
        proc = reaches(config, state, handle)
        if proc is None or not proc.stopped:  # not that process, or not stopped
            return [(f"recover: {SLOT_NAMES[handle[0]]} not ours or not stopped", done, ())]
        after, events = deliver(config, done, "recovery", config.recovery_signal, handle)
        return [(f"recover: {config.recovery_signal} {SLOT_NAMES[handle[0]]}", after, events)]
    return [("recover: every held mark done", _go(state, FINAL, stage=RECOVERING), ())]


REAPER = {
    DECIDE: _decide, HOLD: _hold, INTENT: _intent, CONFIRM: _confirm, CHECK: _check,
    MARK: _mark, STOP: _stop, COLLECT: _collect, JOINED: _joined, REJUDGE: _rejudge,
    RECHECK: _recheck, TERM: _term, RESUME: _resume, THAW: _resume, UNMARK: _unmark,
    WAIT: _wait, KILL: _kill, FINAL: _final, SETTLE: _settle, RECOVER: _recover,
    RECOVER_CONT: _recover_cont,
}



def reaper_steps(config: Config, state: State) -> list[Step]:
    return REAPER[state.pc](config, state)
