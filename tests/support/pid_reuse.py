"""The pid-reuse race of a reap, played for real: run as PID 1 of a fresh PID namespace.

`unshare --pid --fork --mount-proc python -m tests.support.pid_reuse` (as root). The
scenario: an orphan tree R (sh) -> M (sleep) is reaped. Right after the last
SIGCONT, while the reaper waits for the tree to die, M has died and its pid is
taken (ns_last_pid makes that deterministic) by an unrelated process Q, which
forks C. C's ppid is M's old pid. A walk that trusts "ppid matches" collects C
and signals it; the reaper must check that M is still M. Prints one JSON line:
the pids and the reap's signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from gpuguard.base.counters import Counters
from gpuguard.config.remediate import Remediate, UserFilter
from gpuguard.engine.decision.reap_plan import ReapPlan
from gpuguard.engine.decision.tree import TreeKey
from gpuguard.engine.reap.reaper import Reaper
from gpuguard.engine.scan.inspection import member_of
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.procfs import ProcessView
from gpuguard.orphans.rules_config import Rules
from tests.support.proctree import reap_zombie_children

POLICY = Remediate(mode="enforce", term_timeout_seconds=1.0, allow_root_owned=True,
                   users=UserFilter(allow=("*",), deny=()))


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        reap_zombie_children()  # we are PID 1: or the pid is never free again
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def take_pid(pid: int) -> tuple[int, int]:
    """Fork Q at exactly `pid` (ns_last_pid); Q forks C and reports it. Returns (Q, C)."""
    read, write = os.pipe()
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(pid - 1))
    q = os.fork()
    if q == 0:
        os.close(read)
        c = os.fork()
        if c == 0:
            signal.pause()
            os._exit(0)
        os.write(write, str(c).encode())
        signal.pause()
        os._exit(0)
    os.close(write)
    c = int(os.read(read, 32))
    os.close(read)
    return q, c


def main() -> None:
    assert os.getpid() == 1, "run me as PID 1 of a new PID namespace"
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write("100")  # the tree above pid 2: pids 1 and 2 are never signalled
    root = subprocess.Popen(["sh", "-c", "sleep 3600 & echo $! ; wait"],
                            stdout=subprocess.PIPE, text=True)
    assert root.stdout is not None
    member = int(root.stdout.readline())
    # `$!` is printed right after sh forks, before the child execs sleep: a member read in
    # between is sh's copy, whose environment the reaper cannot read yet, and it refuses
    # (member-unknown) before the race this stages. Wait for the exec.
    wait_until(lambda: _comm(member) == "sleep", "the member to exec sleep")
    view = ProcessView(counters=Counters())
    infos = [view.fresh_stat(root.pid), view.fresh_stat(member)]
    assert all(infos)
    members = tuple(member_of(i, view) for i in infos if i is not None)
    # The walk is under test, not a verdict: no holder, nothing classified to re-derive.
    plan = ReapPlan(TreeKey("h", root.pid, members[0].start_time), members, (), 0, False,
                    classified=False)
    raced: dict[str, int] = {}
    conts = 0

    def send(fd: int, sig: int) -> None:
        nonlocal conts
        signal.pidfd_send_signal(fd, sig)
        if sig == signal.SIGCONT:
            conts += 1
            if conts == len(members) and not raced:  # every member has TERM + CONT now
                wait_until(lambda: not os.path.exists(f"/proc/{member}"), "M to be gone")
                raced["q"], raced["c"] = take_pid(member)

    nvml = Nvml(counters=Counters())
    result = Reaper(nvml=nvml, counters=Counters(), pidfd_send=send).reap(
        plan, policy=POLICY, rules=Rules(), protected_pids=frozenset({1}),
        deadline=time.monotonic() + 30, journal=lambda phase, ms: None)
    c = view.fresh_stat(raced["c"]) if "c" in raced else None
    c_alive = c is not None and not c.is_zombie
    print(json.dumps({"member": member, "q": raced.get("q"), "c": raced.get("c"),
                      "c_alive": c_alive, "outcome": result.outcome, "reason": result.reason,
                      "detail": result.detail,
                      "signals": [[s.pid, s.signal, s.result] for s in result.signals]}),
          flush=True)
    for pid in (raced.get("c"), raced.get("q")):
        if pid:
            os.kill(pid, signal.SIGKILL)
    nvml.close()


if __name__ == "__main__":
    main()
