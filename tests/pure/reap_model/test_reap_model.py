"""The reap protocol, checked: every state the model can reach within DEPTH steps keeps
the four promises (model.INVARIANTS), each promise is shown able to fail (a broken
variant of the protocol and the counterexample the checker finds for it, printed), and
the model's steps are kept in step with the code's (the order of the reaper's calls, the
reasons, the outcomes, the audit phases). `pytest -s` prints the state counts and traces.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import textwrap

import pytest

from gpuguard.engine.decision.policy import Action
from gpuguard.engine.reap import killing, reaper, skeleton
from gpuguard.engine.reap.audit import Phase
from gpuguard.engine.reap.freezing import Freezer
from gpuguard.engine.reap.outcome import Outcome
from gpuguard.orphans.vocabulary import DecisionReason
from tests.pure.reap_model import model as m
from tests.pure.reap_model import reap_steps as rs
from tests.pure.reap_model import states as st
from tests.pure.reap_model.checker import Result, explore

#: The depth bound. Every reachable state of both deployments lies within it (the deepest
#: about 50 steps): the test asserts the search ended because nothing new was left.
DEPTH = 80

#: The deployments checked, with floors under their state counts (a model broken so that
#: it explores little fails here): the daemon, which systemd restarts, with the reaper
#: and the guardian each SIGKILLed once at any moment; and `gpuguard reap --apply`, which
#: nothing restarts, with the reaper SIGKILLed once (both dead at once is the gap left:
#: test_both_killed_at_once_is_the_gap_left).
DEPLOYMENTS = {
    "daemon": (st.Config(), 60_000),
    "reap-apply": (st.Config(restart=False, guardian_crashes=0), 20_000),
}


def check(config: st.Config, *, depth: int = DEPTH, stop_on: str | None = None
          ) -> tuple[Result[st.State], int]:
    """The checker over `config`'s model; also the longest stretch anything stayed stopped."""
    longest = [0]

    def promises(before: st.State, events: tuple[st.Event, ...], after: st.State) -> list[str]:
        longest[0] = max(longest[0], after.frozen_age)
        return m.violations(config, before, events, after)

    result = explore([st.initial(config)], lambda s: m.successors(config, s), promises,
                     depth=depth, stop_on=stop_on,
                     classify=lambda s: s.outcome if s.pc == st.DONE else None)
    return result, longest[0]


def describe(state: st.State) -> str:
    procs = " ".join(
        f"{name}:-" if p is None else
        f"{name}:{'new-owner' if not p.member else 'member'}"
        f"{'' if p.alive else ',gone'}{',T' if p.stopped and p.alive else ''}"
        f"{',protected' if p.protected else ''}"
        for name, p in zip(st.SLOT_NAMES, state.procs, strict=True))
    return (f"[{procs}] pc={state.pc} stopped-for={state.frozen_age} "
            f"named={sorted(state.named)} marks={sorted(state.marks)} "
            f"guardian={state.guardian}")


# -- the protocol as designed -----------------------------------------------------------


@functools.cache
def checked_deployment(name: str) -> tuple[str, Result[st.State], int, st.Config]:
    """Each deployment is checked once per session (several tests read the result)."""
    config, _ = DEPLOYMENTS[name]
    result, longest = check(config)
    print(f"\nreap model, {name}: {result.summary()}; deadline {config.deadline()} ticks, "
          f"longest stopped {longest}; outcomes {dict(result.finals)}")
    return name, result, longest, config


@pytest.fixture(params=sorted(DEPLOYMENTS))
def checked(request: pytest.FixtureRequest) -> tuple[str, Result[st.State], int, st.Config]:
    return checked_deployment(request.param)


def test_every_reachable_state_keeps_every_promise(checked) -> None:
    name, result, _, _ = checked
    assert result.complete, f"{name}: states left beyond depth {DEPTH}"
    assert result.states >= DEPLOYMENTS[name][1], result.summary()
    assert not result.counterexamples, "\n\n".join(
        ce.render(describe) for ce in result.counterexamples.values())


def test_the_deadline_is_reached_and_not_exceeded(checked) -> None:
    """The bound is tight: some path keeps a member stopped for the whole deadline (so a
    variant that adds a single tick is caught), none for longer."""
    _, _, longest, config = checked
    assert longest == config.deadline()


#: Every environment step the model allows, by a word of its label: each is taken.
ENVIRONMENT = ("exits", "forks", "pid is reused", "execs a protected name",
               "the reaper is SIGKILLed", "a resolved alert reaches the worker",
               "the wall clock steps back", "still waiting on a slow Alertmanager",
               "silenced", "not firing", "unreachable", "the disk is full",
               "the state file cannot be written", "NVML hangs")


def test_every_environment_step_and_every_ending_is_reached(checked) -> None:
    name, result, _, config = checked
    taken = " | ".join(result.labels)
    for word in ENVIRONMENT:
        assert word in taken, f"{name}: no step {word!r}"
    if config.guardian_crashes:
        assert "the guardian is SIGKILLed" in taken
    assert ("systemd restarts the reaper" in taken) == config.restart
    assert "the guardian sees the reaper gone" in taken
    endings = {"reaped", "aborted", "failed", "ignore", "cancel"}
    if config.restart:
        endings.add("interrupted-thawed")
    assert endings <= set(result.finals), result.finals


# -- each promise can fail --------------------------------------------------------------

#: A broken variant of the protocol per promise (and more), and the promise it breaks.
#: Where a crash plays no part, none is allowed, to keep the search short.
QUIET = {"reaper_crashes": 0, "guardian_crashes": 0}
BROKEN = {
    "signal before the intent record": (
        {"intent_first": False, **QUIET}, m.INTENT_FIRST),
    "a torn audit line glues the next record onto it": (
        {"whole_records": False, **QUIET}, m.INTENT_FIRST),
    "recovery continues bare pids": (
        {"recovery_by_pid": True, "guardian_crashes": 0}, m.INTENT_FIRST),
    "no re-judge under freeze": (
        {"rejudge_frozen": False, **QUIET}, m.PROTECTED_SPARED),
    "no re-freeze and re-judge before SIGKILL": (
        {"refreeze_before_kill": False, **QUIET}, m.PROTECTED_SPARED),
    "signals by bare pid": (
        {"pidfd": False, **QUIET}, m.PROTECTED_SPARED),
    "recovery that SIGKILLs": (
        {"recovery_signal": "SIGKILL", "guardian_crashes": 0}, m.RECOVERY_NEVER_KILLS),
    "no guardian (gpuguard reap --apply today)": (
        {"guardian": False, "restart": False}, m.FREEZE_BOUNDED),
    "a confirmation not bounded by the reap's deadline": (
        {"confirm_bounded": False, **QUIET}, m.FREEZE_BOUNDED),
    "the deadline read from the wall clock": (
        {"deadline_on_wall_clock": True, **QUIET}, m.FREEZE_BOUNDED),
    "recovery that waits for its audit record": (
        {"recovery_needs_record": True, "guardian": False}, m.FREEZE_BOUNDED),
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_a_broken_protocol_is_caught(variant: str) -> None:
    changes, promise = BROKEN[variant]
    config = dataclasses.replace(st.Config(), **changes)
    result, _ = check(config, stop_on=promise)
    assert promise in result.counterexamples, f"{variant}: {result.summary()}"
    print(f"\n{variant}: {result.summary()}\n"
          + result.counterexamples[promise].render(describe))


def test_every_promise_has_a_broken_variant() -> None:
    assert {promise for _, promise in BROKEN.values()} == set(m.INVARIANTS)


# -- what is left (docs/reap-safety.md says so) -------------------------------------------


def test_both_killed_at_once_is_the_gap_left() -> None:
    """`gpuguard reap --apply` (nothing restarts it) with its guardian SIGKILLed too while a
    tree is frozen: nobody is left to continue it. The daemon's restart covers this."""
    config = st.Config(restart=False)
    result, _ = check(config, stop_on=m.FREEZE_BOUNDED)
    example = result.counterexamples[m.FREEZE_BOUNDED]
    print("\n" + example.render(describe))
    labels = [label for label, _ in example.trace]
    assert "the reaper is SIGKILLed" in labels and "the guardian is SIGKILLed" in labels


def test_a_sigcont_from_someone_else_reopens_the_window() -> None:
    """The freeze is what keeps a judged member from exec'ing into a protected program
    before its SIGTERM; its owner (or root) can SIGCONT it in between."""
    result, _ = check(st.Config(foreign_cont=True, **QUIET), stop_on=m.PROTECTED_SPARED)
    example = result.counterexamples[m.PROTECTED_SPARED]
    print("\n" + example.render(describe))
    assert any("sends it SIGCONT" in label for label, _ in example.trace)


# -- the model and the code, in step ------------------------------------------------------


def test_every_model_step_names_code_that_exists() -> None:
    for step, (module, qualname) in st.STEPS.items():
        target: object = importlib.import_module(module)
        for part in qualname.split("."):
            assert hasattr(target, part), f"{step}: {module}.{qualname} is gone"
            target = getattr(target, part)
        assert callable(target), f"{step}: {module}.{qualname}"


def _calls(function: object, wanted: set[str]) -> list[str]:
    """The names of the calls in `function`'s body, in source order, among `wanted`; a
    `send` is named by its signal (send:SIGTERM). The dry run's branch is left out."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))  # type: ignore[arg-type]
    for node in ast.walk(tree):  # the dry run signals nothing: not part of the protocol
        if isinstance(node, ast.If) and "dry_run" in ast.unparse(node.test):
            node.body = []
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in wanted:
            continue
        if name == "send":
            name = f"send:{ast.unparse(node.args[-1]).split('.')[-1]}"
        found.append((node.lineno, node.col_offset, name))
    return [name for _, _, name in sorted(found)]


def _happy_path(config: st.Config) -> list[str]:
    """The reaper's steps when nothing goes wrong and no one else acts: each time the
    first of its choices (the model lists success first)."""
    state, visited = st.initial(config), []
    while state.pc != st.DONE:
        visited.append(state.pc)
        _, after, _ = m.reaper_successors(config, state)[0]
        state = after
    return [pc for i, pc in enumerate(visited) if i == 0 or visited[i - 1] != pc]


#: Each model step as the code's calls it stands for.
CODE_CALLS = {
    st.HOLD: ["_hold"], st.CHECK: ["check_wanted"], st.INTENT: ["write"],
    st.CONFIRM: ["_confirm"], st.MARK: ["mark"], st.STOP: ["stop"], st.COLLECT: ["collect"],
    st.REJUDGE: ["rejudge"], st.RECHECK: ["recheck_frozen"], st.TERM: ["send:SIGTERM"],
    st.RESUME: ["resume"], st.UNMARK: [], st.WAIT: ["wait_gone"],
    st.KILL: ["send:SIGKILL", "wait_gone"],
}


def test_the_model_reaps_in_the_order_the_code_does() -> None:
    """The happy path of the model is plan() then KILL_PLAN, and those are the order of
    the skeleton's _freeze_and_judge (Linux's freeze: Freezer.freeze's), then of
    Killer.kill. A step moved in one and not the other fails here."""
    config = st.Config()
    path = _happy_path(config)
    assert path == [*rs.plan(config), *rs.KILL_PLAN], path
    before_term = list(rs.plan(config)[1:])  # the decision is the worker's
    frozen = before_term.index(st.MARK)
    assert before_term[frozen:frozen + 3] == [st.MARK, st.STOP, st.COLLECT]
    collapsed = [*before_term[:frozen], "freeze", *before_term[frozen + 3:]]
    expected = [call for step in collapsed for call in CODE_CALLS.get(step, [step])]
    # The order is the skeleton's (every platform's); Linux's freeze and re-judgement
    # are its Freezer's.
    steps = {"_freeze": "freeze", "_rejudge": "rejudge"}
    assert [steps.get(call, call) for call in _calls(skeleton.ReaperCore._freeze_and_judge, {
        "_hold", "check_wanted", "write", "_confirm", "_freeze", "_rejudge",
        "recheck_frozen"})] == expected
    assert _calls(reaper.Reaper._hold, {"hold_planned"}) == ["hold_planned", "hold_planned"]
    assert _calls(reaper.Reaper._freeze, {"freeze"}) == ["freeze"]
    assert _calls(reaper.Reaper._rejudge, {"rejudge"}) == ["rejudge"]
    assert _calls(Freezer.freeze, {"mark", "stop", "collect"}) == ["mark", "stop", "collect"]
    # Killer.kill: both of its rejudge calls (the joiners', everyone's) are one model step.
    kill_steps = [s for s in rs.KILL_PLAN if s not in (st.FINAL, st.SETTLE)]
    expected = [call for step in kill_steps for call in CODE_CALLS[step]
                for call in (["rejudge", "rejudge"] if call == "rejudge" else [call])]
    assert _calls(killing.Killer.kill, {"send", "resume", "wait_gone", "mark", "stop",
                                        "collect", "rejudge"}) == expected


def test_the_model_ends_reaps_the_ways_the_code_does() -> None:
    """Its outcomes are Outcome's (but the dry run, which signals nothing) and the
    worker's actions; its abort reasons are the code's, each where it is named."""
    _, result, _, _ = checked_deployment("daemon")
    assert {"reaped", "aborted", "failed"} == {o.value for o in Outcome} - {"dry-run"}
    assert {"ignore", "cancel"} <= {a.value for a in Action}
    # ... and a restart's: a reap to recover, or none ("restarted").
    assert set(result.finals) <= {"reaped", "aborted", "failed", "interrupted-thawed",
                                  "ignore", "cancel", "restarted"}
    reached = {match for label in result.labels
               for match in re.findall(r"\[abort: ([a-z-]+)\]", label)}
    reached.add("interrupted-thawed")  # recovery's ending, not an abort
    assert reached == set(st.ABORT_REASONS)
    for reason, module in st.ABORT_REASONS.items():
        source = inspect.getsource(importlib.import_module(module))
        # Named there as the string, or as its member of the decision-reason enum.
        member = f"DecisionReason.{DecisionReason(reason).name}" if reason in set(
            DecisionReason) else None
        assert f'"{reason}"' in source or (member is not None and member in source), \
            f"{reason} is not named in {module}"


def test_the_model_writes_the_audit_phases_the_code_has() -> None:
    assert st.PHASES == tuple(p.value for p in Phase)
