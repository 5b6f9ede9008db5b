"""The exporter on Windows names an orphaned chain on /metrics, scraped from Linux.

A Windows launcher starts launcher -> worker -> leaf; the leaf holds the fake GPU (its
Windows pid in the fake NVML state). While the launcher lives the chain is normal; once
it is killed hard (TerminateProcess), the worker is the topmost live member: the tree is
an orphan `parent-gone` rooted there, with the worker's creation time in integer ms as
root_start_time (the one Windows encoding). Wine's sockets are the host's, so Linux
scrapes 127.0.0.1.
"""

from __future__ import annotations

import requests

from tests.support.fakenvml import FakeGpuWorld
from tests.support.servers import find, parse_samples
from tests.support.winchain import Chains
from tests.support.wine import WinePrefix, poll

GIB = 2**30


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    resp = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    resp.raise_for_status()
    return parse_samples(resp.text)


def ms(create_time: float) -> str:
    """gpuguard.host.windows.tree.encode_create_time, as the label carries it."""
    return str(round(create_time * 1000))


def test_orphaned_chain_is_named_with_its_root(wine: WinePrefix, chains: Chains,
                                               world: FakeGpuWorld) -> None:
    exporter = wine.spawn(["-m", "gpuguard.exporter", "--listen", "127.0.0.1:0",
                           "--scan-interval", "0.3"], state=world.path)
    port = exporter.listening_port()
    chain = chains.start(depth=2)
    launcher, worker, leaf = chain.levels
    assert worker.ppid == launcher.pid and leaf.ppid == worker.pid, chain.levels
    world.add_process(0, leaf.pid, 2 * GIB)

    def holder_row(verdict: str) -> list[tuple[dict[str, str], float]]:
        return find(scrape(port), "gpuguard_gpu_process_info", pid=str(leaf.pid),
                    verdict=verdict)

    poll(lambda: holder_row("normal"), timeout=30, interval=0.2,
         what=f"the live chain's holder {leaf.pid} judged normal ({exporter.describe()})")
    samples = scrape(port)
    roots = {labels["root_pid"] for labels, _ in find(samples, "gpuguard_orphan_tree_processes")}
    assert not roots & {str(p) for p in chain.pids()}, "a live chain was called an orphan"

    wine.terminate(launcher.pid)
    rows = poll(lambda: holder_row("orphan"), timeout=30, interval=0.2,
                what=f"the holder {leaf.pid} judged orphan after its launcher died "
                     f"({exporter.describe()})")
    assert rows[0][0]["reason"] == "parent-gone", rows
    assert rows[0][0]["root_pid"] == str(worker.pid), rows

    samples = scrape(port)
    tree = find(samples, "gpuguard_orphan_tree_processes", root_pid=str(worker.pid))
    assert len(tree) == 1, tree
    labels, processes = tree[0]
    assert labels["reason"] == "parent-gone"
    assert labels["root_start_time"].isdigit(), labels
    assert labels["root_start_time"] == ms(worker.create_time), (labels, worker)
    assert processes == 2  # the worker and the leaf: the dead launcher is no member
    memory = find(samples, "gpuguard_orphan_tree_memory_bytes", root_pid=str(worker.pid))
    assert memory and memory[0][1] == 2 * GIB, memory
    assert find(samples, "gpuguard_orphan_trees")[0][1] == 1  # Wine's own hold no GPU
