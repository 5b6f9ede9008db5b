"""Issue #18's properties over generated histories (hypothesis).

Every history starts from the same login (init, sshd, bash, systemd --user) and
adds up to MAX_STEPS generated steps; after every step each live GPU holder is
classified twice (a listener that saw every exit, and none) and checked against
the truth computed from the history (properties.py).

Budget: the `gpuguard-lifecycle` profile (derandomized: the same histories on
every run, so CI is deterministic). GPUGUARD_LIFECYCLE_EXAMPLES=N switches to the
`gpuguard-lifecycle-nightly` profile: N examples, a fresh random seed each run
(hypothesis prints how to reproduce a failure).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.pure.lifecycle.model import STEP_KINDS, World, apply, login
from tests.pure.lifecycle.properties import check_history, check_walk

DEFAULT_EXAMPLES = 2000  # about 11 s on a 2-core machine
MAX_STEPS = 30  # build (12) + GPU (3) + events (15)

settings.register_profile(
    "gpuguard-lifecycle",
    max_examples=DEFAULT_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "gpuguard-lifecycle-nightly",
    max_examples=int(os.environ.get("GPUGUARD_LIFECYCLE_EXAMPLES") or DEFAULT_EXAMPLES),
    derandomize=False,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile(
    "gpuguard-lifecycle-nightly" if os.environ.get("GPUGUARD_LIFECYCLE_EXAMPLES")
    else "gpuguard-lifecycle")

#: A history: a build phase (processes forked, exec'd, detached, moved), GPU contexts
#: opened, then events (exits, kills, hangups, reaps, more of everything). Each step is
#: (kind, target, argument); a target is counted from the newest live process and is
#: one of the four newest half the time, so chains grow deep enough to break in the
#: middle. `parent_dies` kills (or exits) the parent of a GPU holder.
target = st.integers(0, 3) | st.integers(0, 63)
argument = st.integers(0, 63)
BUILD = ("spawn", "spawn", "spawn", "fork", "setsid", "sighup", "exec", "subreaper",
         "setpgid", "daemon_io", "cgroup", "unshare")
EVENTS = ("kill", "exit", "spawn", "gpu", "parent_dies", "kill", "exit", "reap", "hangup",
          "setsid", "fork", "exec", "sighup", "subreaper", "setpgid", "daemon_io", "cgroup",
          "unshare", "parent_dies", "spawn")
assert set(BUILD) | set(EVENTS) == set(STEP_KINDS)
histories = st.tuples(
    st.lists(st.tuples(st.sampled_from(BUILD), target, argument), min_size=1, max_size=12),
    st.lists(st.tuples(st.just("gpu"), target, argument), min_size=1, max_size=3),
    st.lists(st.tuples(st.sampled_from(EVENTS), target, argument), min_size=1,
             max_size=MAX_STEPS - 15),
).map(lambda phases: phases[0] + phases[1] + phases[2])


@PROFILE
@given(histories)
def test_every_moment_of_a_history_is_classified_as_the_truth_says(steps):
    world = World()
    login(world)
    check_history(world, steps)


#: Between the walk's reads: ordinary events, and `reuse` (a pid the walk read dies and
#: is handed to a process outside the tree, with or without a child).
WALK_EVENTS = ("reuse", "reuse", "exit", "kill", "reap", "spawn", "fork", "parent_dies")
walk_steps = st.lists(st.tuples(st.sampled_from(WALK_EVENTS), target, argument),
                      min_size=1, max_size=20)


@PROFILE
@given(histories, st.integers(0, 63), walk_steps)
def test_member_walk_never_returns_a_process_from_outside_the_tree(steps, root, during):
    # The kill scope (docs/reap-safety.md) under pid reuse during the walk:
    # pids are freed and handed out again (PID_MAX 32) between the walk's reads.
    world = World()
    login(world)
    for step in steps:
        apply(world, *step)
    check_walk(world, root, during)
