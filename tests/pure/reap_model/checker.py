"""A breadth-first explicit-state checker: every state reachable within `depth` steps is
visited once (states are frozen and hashable, so a state reached twice is explored once),
every step is checked against the promises, and the first counterexample for each is
kept with the shortest trace that leads to it (breadth first: no shorter one exists)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

S = TypeVar("S", bound=Hashable)
E = TypeVar("E")


@dataclass
class Counterexample(Generic[S]):
    invariant: str
    trace: list[tuple[str, S]]  # (the step's label, the state it led to), from the start

    def render(self, describe: Callable[[S], str] = repr) -> str:
        lines = [f"counterexample to: {self.invariant} ({len(self.trace) - 1} steps)"]
        for depth, (label, state) in enumerate(self.trace):
            lines.append(f"{depth:>3}. {label}")
            lines.append(f"       {describe(state)}")
        return "\n".join(lines)


@dataclass
class Result(Generic[S]):
    states: int = 0
    transitions: int = 0
    depth: int = 0  # the deepest layer explored
    complete: bool = False  # the frontier emptied before the depth bound: every state seen
    counterexamples: dict[str, Counterexample[S]] = field(default_factory=dict)
    labels: Counter[str] = field(default_factory=Counter)  # steps taken, by label
    finals: Counter[str] = field(default_factory=Counter)  # terminal states, by `classify`
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.states} states, {self.transitions} transitions, depth {self.depth}"
                f"{' (every reachable state)' if self.complete else ''}, "
                f"{self.seconds:.1f} s")


def explore(initial: Sequence[S],
            successors: Callable[[S], Iterable[tuple[str, S, E]]],
            check: Callable[[S, E, S], list[str]], *, depth: int,
            stop_on: str | None = None,
            classify: Callable[[S], str | None] | None = None) -> Result[S]:
    """Breadth first from `initial` to `depth` steps. `check(before, events, after)` names
    the promises a step broke; a state that broke one is not explored further. With
    `stop_on`, the search ends at the first counterexample to that promise."""
    import time

    began = time.perf_counter()
    result: Result[S] = Result()
    parent: dict[S, tuple[S | None, str]] = {s: (None, "start") for s in initial}
    frontier = list(dict.fromkeys(initial))
    layer = 0
    while frontier and layer < depth:
        layer += 1
        following: list[S] = []
        for state in frontier:
            steps = list(successors(state))
            if not steps and classify is not None:
                kind = classify(state)
                if kind is not None:
                    result.finals[kind] += 1
            for label, after, events in steps:
                result.transitions += 1
                result.labels[label] += 1
                broken = check(state, events, after)
                if after not in parent:
                    parent[after] = (state, label)
                    if not broken:
                        following.append(after)
                for invariant in broken:
                    if invariant not in result.counterexamples:
                        trace = _trace(parent, state) + [(label, after)]
                        result.counterexamples[invariant] = Counterexample(invariant, trace)
                if stop_on is not None and stop_on in result.counterexamples:
                    return _done(result, parent, layer, False, began)
        frontier = following
    return _done(result, parent, layer, not frontier, began)


def _done(result: Result[S], parent: dict[S, tuple[S | None, str]], layer: int,
          complete: bool, began: float) -> Result[S]:
    import time

    result.states, result.depth, result.complete = len(parent), layer, complete
    result.seconds = time.perf_counter() - began
    return result


def _trace(parent: dict[S, tuple[S | None, str]], state: S) -> list[tuple[str, S]]:
    trace: list[tuple[str, S]] = []
    current: S | None = state
    while current is not None:
        before, label = parent[current]
        trace.append((label, current))
        current = before
    trace.reverse()
    return trace
