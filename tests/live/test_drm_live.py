"""The DRM back-end's search over the real /proc, with real processes as the holders.

What cannot be real here is the DRM descriptor itself: the kernel writes fdinfo, and no
file a test can open has `drm-driver` in it (that needs a DRM device; a host with one runs
tests/device/drm_smoke.py). So the "nodes" are regular files under a temporary dev/dri and
the sysfs tree is synthetic (tests/support/drmtree.py), and each holder reads as a client
of a driver without usage stats: found, placed on its GPU, its size unknown. Everything
else is real: processes started by the test hold the files open (inherited across fork,
as a GPU worker's children inherit its render node), the search lists the real /proc
within its budget, reads their descriptors, checks their identity, and forgets one that
exits. Counting a shared client once needs its client id, and is tested on captured fdinfo
(tests/pure/test_drm_source.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from gpuguard.base.counters import Counters
from gpuguard.gpu.drm import Drm
from tests.support.drmtree import DrmHost
from tests.support.proctree import Trees, alive, wait_for

XE = "0000:03:00.0"


def test_real_holders_are_found_within_the_budget_and_forgotten_when_they_exit(
        trees: Trees, tmp_path: Path) -> None:
    host = DrmHost(tmp_path / "host")
    host.gpu(XE, "xe", card=0, render=128)
    node = host.dev / "dri" / "renderD128"
    # The holder opens the node as fd 7, and its child (forked after) inherits it.
    tree = trees.spawn(f"exec 7<{node}; {{holder}} --pidfile {{dir}}/worker --children 1 & "
                       "wait")
    worker = tree.pid("worker")
    child = int(str(wait_for(lambda: [int(p) for p in
                                      Path(f"/proc/{worker}/task/{worker}/children")
                                      .read_text().split()], what="the worker's child")[0]))
    counters = Counters()
    budget = 40
    roots = {"proc_root": "/proc", "sys_root": str(host.sys), "dev_root": str(host.dev)}
    # A fresh source's first read is a whole pass (a one-shot command reads about once).
    once = Drm(Counters(), **roots).read()
    assert once.errors == () and all(g.processes_listed for g in once.gpus)
    assert {worker, child} <= {h.pid for h in once.holders}
    # Then in shares: this source's first read keeps the budget too.
    drm = Drm(counters, max_processes=budget, first_max_processes=budget, **roots)
    processes = len([n for n in os.listdir("/proc") if n.isdigit()])
    reads = 0
    while True:
        before = counters.snapshot()["drm_fd_search"].calls
        reading = drm.read()
        reads += 1
        assert counters.snapshot()["drm_fd_search"].calls - before <= budget
        if not reading.errors:
            break
        assert [stage for stage, _ in reading.errors] == ["drm_search"]
        assert reads <= math.ceil(processes * 2 / budget) + 2, "the pass never completes"
    found = {(h.pid, h.gpu_uuid, h.used_bytes) for h in reading.holders}
    assert {(worker, f"DRM-{XE}", None), (child, f"DRM-{XE}", None)} <= found
    # This test's own shell launcher holds fd 7 too (bash exec'd it first): it is ours.
    assert {h.pid for h in reading.holders} <= {worker, child, tree.launcher.pid}
    tree.kill(child)
    assert not alive(child)
    assert child not in {h.pid for h in drm.read().holders}
    assert worker in {h.pid for h in drm.read().holders}
