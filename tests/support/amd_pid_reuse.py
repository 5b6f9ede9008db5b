"""A pid AMD SMI lists, reused between two reads, played for real: run as PID 1 of a fresh
PID namespace (`unshare --pid --fork --mount-proc python -m tests.support.amd_pid_reuse`, as
root), with ROCM_PATH and FAKE_AMDSMI_STATE naming the fake library and its state file.

A holder (sleep) is listed and read as the holder; it dies; a new process takes its pid
(ns_last_pid makes that deterministic), and AMD SMI still lists the pid, as ROCm did. Prints
one JSON line: the pid, its taker, the holders before and after, the pids found no holder.

With `--kfd PATH` the holder keeps PATH open (the stand-in for /dev/kfd, which the taker
lacks) and every reader is told it is the KFD device; the line then also gives what a
reader made after the reuse (a restarted exporter, a one-shot `gpuguard reap`) reads on
its first read: `fresh_holders`, `fresh_not_holding`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path

from gpuguard.base.counters import Counters
from gpuguard.gpu.amdsmi.reader import AmdSmi
from tests.support.fakeamdsmi import STATE_ENV, FakeAmdWorld
from tests.support.pid_reuse import take_pid, wait_until


def main() -> None:
    assert os.getpid() == 1, "run me as PID 1 of a new PID namespace"
    parser = argparse.ArgumentParser()
    parser.add_argument("--kfd", help="the KFD device's stand-in, which the holder keeps open")
    kfd = parser.parse_args().kfd
    where = {"kfd_path": kfd} if kfd else {}
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write("100")
    world = FakeAmdWorld(Path(os.environ[STATE_ENV]))
    world.add_gpu(0)
    if kfd:
        with open(kfd, "rb") as device:  # closed here at once: only the holder keeps it
            holder = subprocess.Popen(["sleep", "3600"], stdin=device)
    else:
        holder = subprocess.Popen(["sleep", "3600"])
    world.add_process(0, holder.pid, 2**30)
    reader = AmdSmi(Counters(), **where)
    before = [h.pid for h in reader.read().holders]
    holder.kill()
    holder.wait()
    wait_until(lambda: not os.path.exists(f"/proc/{holder.pid}"), "the holder to be gone")
    taker, child = take_pid(holder.pid)
    reading = reader.read()
    result = {"pid": holder.pid, "taker": taker, "before": before,
              "after": [h.pid for h in reading.holders],
              "not_holding": [[n.pid, str(n.why)] for g in reading.gpus
                              for n in g.not_holding]}
    reader.close()
    if kfd:
        fresh = AmdSmi(Counters(), **where)  # made after the reuse: no sighting to compare
        first = fresh.read()
        fresh.close()
        result["fresh_holders"] = [h.pid for h in first.holders]
        result["fresh_not_holding"] = [[n.pid, str(n.why)] for g in first.gpus
                                       for n in g.not_holding]
    print(json.dumps(result), flush=True)
    for pid in (child, taker):
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
