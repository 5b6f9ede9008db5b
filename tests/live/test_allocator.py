"""gpuguard/host/allocator.py: one malloc arena for every thread, where glibc is the C
library. A thread's own arena is a 64 MiB reservation whose unused part is mapped
without access: counted here in the process's own maps, after threads that allocate."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests

from gpuguard.host.allocator import c_library
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, wait_for
from tests.support.servers import REPO, Exporter, child_env, find

SCRIPT = textwrap.dedent("""
    import sys, threading
    from gpuguard.host.allocator import one_malloc_arena
    from tests.live.test_allocator import reserved_arenas
    if sys.argv[1] == "one":
        print(one_malloc_arena())
    else:
        print("left as glibc sets it")
    held, ready, done = [], threading.Barrier(5), threading.Event()

    def allocate():
        held.append([bytes(1000 + i % 7) for i in range(2000)])  # past obmalloc: malloc's
        ready.wait()
        done.wait()

    threads = [threading.Thread(target=allocate) for _ in range(4)]
    for thread in threads:
        thread.start()
    ready.wait()
    print(reserved_arenas("self"))
    done.set()
""")


def reserved_arenas(pid: int | str) -> int:
    """Arenas a process's threads hold: each one's unused reservation, mapped without
    access (a thread stack's guard is 4 KiB)."""
    count = 0
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            count += fields[1] == "---p" and len(fields) == 5 and high - low >= 2**20
    return count


def arenas(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, cwd=REPO,
                         env=child_env(), text=True, check=True, timeout=60).stdout.splitlines()
    return out[0], int(out[1])


@pytest.mark.skipif(c_library() is None, reason="not glibc: no malloc arenas to limit")
def test_threads_share_one_arena_once_asked() -> None:
    said, count = arenas("glibc")
    assert count >= 1, "glibc gave these threads no arenas of their own: the check is void"
    said, count = arenas("one")
    assert said.startswith("malloc arenas: one for every thread (glibc "), said
    assert count == 0


@pytest.mark.skipif(c_library() is None, reason="not glibc: no malloc arenas to limit")
def test_the_exporters_threads_keep_no_arenas_of_their_own(
        trees: Trees, fake_gpu: FakeGpuWorld, fake_nvml_lib: Path) -> None:
    """main() asks before its first thread (the scanner, the listener, waitress's four):
    after scans and scrapes on every thread, no thread holds an arena (each was 0.3 MiB)."""
    tree = trees.spawn(CHAIN)
    fake_gpu.add_gpu(0)
    fake_gpu.add_process(0, tree.pid("worker"), 2**30)
    exporter = Exporter(env=fake_gpu.subprocess_env(fake_nvml_lib, child_env()),
                        scan_interval=0.2)
    try:
        wait_for(lambda: find(exporter.scrape(), "gpuguard_gpu_process_info"), timeout=20,
                 what="a scan that saw the holder")
        with requests.Session() as session:
            for _ in range(40):  # waitress's threads take turns
                session.get(f"{exporter.url}/metrics", timeout=5).raise_for_status()
        assert reserved_arenas(exporter.proc.pid) == 0
    finally:
        exporter.stop()
