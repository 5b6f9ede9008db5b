"""Killing a frozen tree: SIGTERM and SIGCONT everyone, wait, then freeze whoever is left
(joiners included), judge them all again and SIGKILL them."""

from __future__ import annotations

import signal

from gpuguard.engine.reap.freezing import Freezer
from gpuguard.engine.reap.reap_run import ReapRun, Target
from gpuguard.engine.reap.signalling import POLL_SECONDS

#: How long SIGKILLed members get to become zombies before they count as survivors.
KILL_CONFIRM_SECONDS = 5.0
#: Bound on re-collection rounds once the term wait is over (the deadline no longer applies).
MAX_FREEZE_ROUNDS = 100


class Killer:
    """The kill phase of a reap, once the frozen tree was judged for the last time."""

    def __init__(self, freezer: Freezer) -> None:
        self.freezer = freezer
        self.signaller = freezer.signaller

    def kill(self, run: ReapRun) -> list[Target]:
        """TERM + CONT everyone, wait, then freeze and KILL whoever is left: the survivors."""
        signaller, freezer = self.signaller, self.freezer
        for target in run.targets.values():
            signaller.send(run, target, signal.SIGTERM)
        signaller.resume(run, list(run.targets.values()))
        survivors = self.wait_gone(run, run.policy.term_timeout_seconds)
        if not survivors:
            return survivors
        # Survivors of our SIGTERM and SIGCONT: whatever stops them now is this reap's
        # SIGSTOP (ours to continue, handed to the guardian), whatever /proc said before.
        run.mark(survivors, held=True)
        for target in survivors:
            # Continued after SIGTERM, so found stopped now means someone else stopped it
            # (another reaper that does not share this lock, a debugger): no SIGKILL on a
            # freeze this reap did not make (member-stopped; the caller thaws the rest).
            freezer.stop(run, target)
        joined: list[Target] = []
        for _ in range(MAX_FREEZE_ROUNDS):  # each round stops what it finds: it converges
            found = freezer.collect(run, stop=True, refuse=False)
            if not found:
                break
            joined += found
        if freezer.on_refused_stop == "release":
            freezer.refused_stop(run)
            joined = [t for t in joined if run.targets.get(t.member.pid) is t]
        freezer.rejudge(run, joined, refuse=False)
        # Every member again, not only those that joined: one that began ignoring
        # SIGHUP (or exec'd into a protected program) after its SIGTERM is no longer
        # ours to kill, and then nobody is SIGKILLed (the caller thaws the rest).
        new = {id(t) for t in joined}
        freezer.rejudge(run, [t for t in run.targets.values() if id(t) not in new],
                        refuse=True)
        for target in list(run.targets.values()):
            if not signaller.gone(run, target):
                signaller.send(run, target, signal.SIGKILL)
        return self.wait_gone(run, KILL_CONFIRM_SECONDS, adopt=False)

    def wait_gone(self, run: ReapRun, timeout: float, *, adopt: bool = True) -> list[Target]:
        """Wait (pidfd poll, or short /proc polls) until every member is gone or time is up.

        Children born after the SIGTERM (a cleanup handler that forks) join the
        reap and get a SIGTERM of their own, so the final SIGKILL reaches them.
        """
        signaller, freezer = self.signaller, self.freezer
        until = signaller.monotonic() + timeout
        while True:
            if adopt:
                joined = freezer.collect(run, stop=True, refuse=False)
                if joined and freezer.on_refused_stop == "release":
                    freezer.refused_stop(run)
                    joined = [t for t in joined if run.targets.get(t.member.pid) is t]
                kept = freezer.rejudge(run, joined, refuse=False) if joined else []
                for target in kept:
                    signaller.send(run, target, signal.SIGTERM)
                signaller.resume(run, kept)
            alive = [t for t in run.targets.values() if not signaller.gone(run, t)]
            remaining = until - signaller.monotonic()
            if not alive or remaining <= 0:
                return alive
            signaller.sleep_until_exit(alive, min(remaining, POLL_SECONDS * 5))
