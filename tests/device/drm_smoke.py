"""The DRM back-end's smoke check: run by hand on a host with a real Intel or AMD GPU.

    sudo .venv/bin/python tests/device/drm_smoke.py [--hold SECONDS]

Not collected by pytest, and never run by CI (CI has no DRM device; tests/pure and
tests/live use synthetic trees, tests/support/drmtree.py). It prints what the kernel
itself shows (the render nodes, each one's PCI device and driver from sysfs, and the raw
fdinfo of this process's own descriptor on each node), then opens every render node
itself, in a child that also forks a grandchild (which inherits the descriptor, as a GPU
worker's data loaders do), and reads the host through gpuguard's `Drm` source: every
device is a GPU with its vendor, the child is a holder on each device whose driver
publishes usage stats, the grandchild is not (one client, counted once, for the oldest
holder), and a second read after the child exits no longer lists it. A driver without
usage stats (no `drm-driver` in fdinfo) is reported, not failed: its holders read with
no size. Run it as root (or with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH) to see other
users' clients too. Exit 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpuguard.base.counters import Counters  # noqa: E402
from gpuguard.gpu.drm import Drm, privileges, probe  # noqa: E402
from gpuguard.gpu.drm.devices import find_devices, render_nodes  # noqa: E402
from gpuguard.gpu.drm.fdinfo import parse_fdinfo  # noqa: E402
from gpuguard.gpu.drm.reader import uuid_of  # noqa: E402

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def raw_report() -> dict[str, bool]:
    """Each render node's device and driver, and whether its fdinfo has usage stats."""
    found = find_devices("/dev", "/sys")
    stats: dict[str, bool] = {}
    for device in found.devices.values():
        print(f"device {device.pdev}: driver {device.driver}, nodes {', '.join(device.nodes)}")
    for path in render_nodes("/dev"):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            text = Path(f"/proc/self/fdinfo/{fd}").read_text()
        finally:
            os.close(fd)
        print(f"--- fdinfo of {path}\n{text.rstrip()}")
        client = parse_fdinfo(text)
        pdev = found.device_of.get(os.path.basename(path))
        if pdev is not None:
            stats[pdev] = client is not None and client.client_id is not None
    return stats


def hold(seconds: float) -> tuple[int, int]:
    """A child holding every render node open and a grandchild that inherited them."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        fds = [os.open(p, os.O_RDWR) for p in render_nodes("/dev")]
        grandchild = os.fork()
        if grandchild == 0:
            time.sleep(seconds)
            os._exit(0)
        os.write(write_end, f"{grandchild}\n".encode())
        time.sleep(seconds)
        del fds
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        grandchild = int(fh.readline())
    return child, grandchild


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=float, default=60.0,
                        help="how long the holders live at most (default: %(default)g s)")
    args = parser.parse_args()
    problem = probe()
    check(problem is None, f"a render node is present ({problem or 'yes'})")
    if problem is not None:
        return 1
    for line in privileges():
        print(f"note  {line}")
    stats = raw_report()
    child, grandchild = hold(args.hold)
    try:
        drm = Drm(Counters(), max_processes=10**6, max_seconds=60.0,
                  first_max_processes=10**6, first_max_seconds=60.0, pass_every=0)
        first = drm.read()
        print("errors", first.errors)
        check(first.up and not first.errors, "the first read is whole (one pass, no budget)")
        for gpu in first.gpus:
            print(f"GPU {gpu.index} {gpu.uuid} vendor={gpu.vendor} name={gpu.name!r} "
                  f"memory={gpu.memory_used_bytes}/{gpu.memory_total_bytes} "
                  f"driver={gpu.driver_version}")
        mine = {h.gpu_uuid: h for h in first.holders if h.pid == child}
        for pdev, has_stats in stats.items():
            uuid = uuid_of(pdev)
            check(uuid in {g.uuid for g in first.gpus}, f"{pdev} is a GPU of the reading")
            check(uuid in mine, f"the holder {child} is listed on {pdev}")
            shared = [h for h in first.holders if h.pid == grandchild and h.gpu_uuid == uuid]
            if has_stats:
                check(not shared, f"{pdev}: the inherited client is counted once, for {child}")
                print(f"      {child} on {pdev}: {mine[uuid].used_bytes if uuid in mine else '?'}"
                      " bytes")
            else:
                print(f"note  {pdev}: its driver publishes no usage stats: holders unsized")
        time.sleep(1.0)
        second = drm.read()
        check(child in {h.pid for h in second.holders}, "a second read keeps the holder")
        print("busy pids", {g.uuid: g.busy_pids for g in second.gpus})
    finally:
        for pid in (grandchild, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(child, 0)
    third = drm.read()
    check(child not in {h.pid for h in third.holders}, "the exited holder is forgotten")
    print(f"\n{len(failures)} failure(s)" if failures else "\nall checks hold")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
