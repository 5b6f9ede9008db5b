"""GPU memory NVML puts no live name to (issue 40, part B): real processes holding files
the config names as GPU device files, the real /proc, pynvml over the fake NVML.

- the search runs only while a GPU's memory is unattributed, and costs nothing (no /proc
  listing, no descriptor read: the per-callsite counters) otherwise;
- its budget bounds one scan and the next scan resumes where it stopped;
- a pid NVML lists that this /proc lacks is counted, with its memory;
- a holder NVML does not list is reported with its verdict and never reaped: the
  remediator, asked by an alert, finds no such tree;
- `gpuguard node-check` exits 0 clean, 1 with an orphan, 1 with unattributed memory.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuguard.base.counters import Counters
from gpuguard.config.accounting import UnlistedSettings
from gpuguard.engine.scan.scanner import Scanner, Snapshot
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.nvml import Nvml
from gpuguard.host.fdsearch import FdSearch, device_files
from gpuguard.host.procfs import ProcessView, in_host_pid_namespace
from gpuguard.orphans.rules_config import Rules
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import Trees, alive, wait_for
from tests.support.remediator_harness import (
    Harness,
    Run,
    account,
    alert,
    payload,
    start_time_of,
)

GIB = 2**30
MIB = 2**20
#: A holder that keeps DEVICE open on fd 3, under an sh its bash launcher started (a
#: background job: the sh forks before the redirection, so only the holder has it open).
HOLDS = 'sh -c "{holder} --pidfile {dir}/holder 3<DEVICE & wait" & echo $! > {dir}/root; wait'


def device(tmp_path: Path, name: str = "nvidia0") -> Path:
    """A file of the test's own, standing for a GPU's device node."""
    path = tmp_path / "dev" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("")
    return path


def holding(trees: Trees, path: Path) -> tuple[int, int, Trees]:
    """(holder pid, root pid): a real tree whose holder has `path` open."""
    tree = trees.spawn(HOLDS.replace("DEVICE", shlex.quote(str(path))))
    return tree.pid("holder"), tree.pid("root"), tree  # type: ignore[return-value]


def scanner_for(tmp_path: Path, **settings: object) -> tuple[Scanner, Counters]:
    counters = Counters()
    unlisted = UnlistedSettings(device_files=(str(tmp_path / "dev" / "nvidia[0-9]*"),),
                                **settings)  # type: ignore[arg-type]
    return Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                   view=ProcessView(counters=counters), unlisted=unlisted), counters


def search_cost(counters: Counters) -> tuple[int, int]:
    """(calls, reads) of the search's two callsites together."""
    snap = counters.snapshot()
    return (snap["proc_list"].calls + snap["proc_fd_search"].calls,
            snap["proc_list"].proc_reads + snap["proc_fd_search"].proc_reads)


def test_a_device_file_holder_is_found_only_while_memory_is_unattributed(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    node = device(tmp_path)
    other = device(tmp_path, "not-a-gpu")  # open too, but no pattern names it
    holder, root, tree = holding(trees, node)
    bystander, _, _ = holding(trees, other)
    listed, _, _ = holding(trees, node)  # NVML's own holder: listed, never "unlisted"
    fake_gpu.add_process(0, listed, GIB)
    fake_gpu.update_gpu(0, memory_used=GIB)  # every byte accounted for
    scanner, counters = scanner_for(tmp_path)
    snap = scanner.scan_once()
    assert snap.unlisted == () and snap.search is not None and not snap.search.active
    assert search_cost(counters) == (0, 0), "nothing unattributed: no /proc listing at all"

    fake_gpu.update_gpu(0, memory_used=3 * GIB)  # 2 GiB no listed process accounts for
    snap = scanner.scan_once()
    assert [u.pid for u in snap.unlisted] == [holder], (snap.unlisted, holder, listed)
    (found,) = snap.unlisted
    assert (found.pid, found.device_file) == (holder, str(node))
    assert (found.start_time, found.verdict, found.reason) == (
        start_time_of(holder), "normal", "attached")
    assert (found.gpu_index, found.gpu_uuid) == (None, None)  # a plain file: no GPU named
    assert bystander not in {u.pid for u in snap.unlisted}
    assert counters.snapshot()["proc_list"].calls == 1

    tree.kill_launcher()  # the holder's launcher dies: the classifier's verdict follows
    snap = scanner.scan_once()
    assert [(u.pid, u.verdict, u.reason) for u in snap.unlisted] == [
        (holder, "orphan", "session-ended")]
    assert root not in {u.pid for u in snap.unlisted}  # sh does not have the file open
    # ... and it is a series of its own, never an orphan tree's (nothing alerts on it).
    assert snap.orphans == {} and all(t.root_pid != root for t in snap.trees)

    fake_gpu.update_gpu(0, memory_used=GIB)
    before = search_cost(counters)
    snap = scanner.scan_once()
    assert snap.unlisted == () and search_cost(counters) == before


def test_the_budget_bounds_one_scan_and_the_search_resumes(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """Two processes a scan: the holder, spawned last (the highest pid), is found only
    because each scan goes on where the last stopped."""
    node = device(tmp_path)
    for _ in range(3):
        holding(trees, device(tmp_path, "unrelated"))
    holder, _, _ = holding(trees, node)
    fake_gpu.update_gpu(0, memory_used=2 * GIB)
    scanner, counters = scanner_for(tmp_path, unlisted_search_budget_processes=2)
    steps = []
    for _ in range(200):
        before = counters.snapshot()["proc_fd_search"].calls
        snap = scanner.scan_once()
        assert snap.search is not None
        steps.append(snap.search.examined)
        assert counters.snapshot()["proc_fd_search"].calls - before == snap.search.examined
        if snap.unlisted:
            break
    assert [u.pid for u in snap.unlisted] == [holder]
    assert max(steps) == 2 and len(steps) > 2, steps


def test_the_time_budget_bounds_one_step(trees: Trees, tmp_path: Path) -> None:
    """A clock that moves 10 ms at each look: one process a step, then the next."""
    node = device(tmp_path)
    holder, _, _ = holding(trees, node)
    ticks = iter(range(10**6))
    search = FdSearch(counters=Counters(), clock=lambda: next(ticks) / 100)
    files = device_files([str(node)])
    seen: list[int] = []
    for _ in range(10_000):
        step = search.step(files, max_processes=10**6, max_seconds=0.005)
        seen.append(step.examined)
        if step.complete:
            break
    assert set(seen) == {1} and holder in step.found, seen


def test_a_character_device_matches_by_number_whichever_node_was_opened(
        trees: Trees, tmp_path: Path) -> None:
    """A pod's own /dev/nvidia0 (Docker's --device makes one: another inode, the same
    device number) is the GPU's as much as the host's node is. Here /dev/zero stands in:
    the config names a node of the test's own with its number, the holder opens the
    host's; and a readlink() of the holder's descriptor would not name the configured
    path at all."""
    copy = tmp_path / "zero"
    zero = os.stat("/dev/zero")
    try:
        os.mknod(copy, stat.S_IFCHR | 0o600, zero.st_rdev)
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    tree = trees.spawn('sh -c "{holder} --pidfile {dir}/holder 3</dev/zero & wait" & wait')
    holder = tree.pid("holder")
    assert os.readlink(f"/proc/{holder}/fd/3") == "/dev/zero"
    (node,) = device_files([str(copy)])
    assert (node.rdev, node.ino) == (zero.st_rdev, os.stat(copy).st_ino) != (None, zero.st_ino)
    step = FdSearch(counters=Counters()).step([node], max_processes=10**6, max_seconds=60)
    assert step.complete and step.found.get(holder) == str(copy)


def test_nvml_gives_each_gpu_its_node_s_minor_number(fake_gpu: FakeGpuWorld) -> None:
    fake_gpu.add_gpu(1)
    nvml = Nvml(counters=Counters())
    try:
        reading = nvml.read()
        assert [g.device for g in reading.gpus] == [f"nvidia{g.index}" for g in reading.gpus]
        fake_gpu.set_missing("nvmlDeviceGetMinorNumber")
        again = nvml.read()  # read once per GPU: the call is not asked again
        assert [g.device for g in again.gpus] == [g.device for g in reading.gpus]
    finally:
        nvml.close()
    fresh = Nvml(counters=Counters())
    try:
        reading = fresh.read()
        # A driver without the call: no node name, no scan error (files are reported alone).
        assert [g.device for g in reading.gpus] == [None, None] and reading.errors == ()
    finally:
        fresh.close()


def test_a_pid_nvml_lists_that_proc_lacks_is_counted_with_its_memory(
        fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    fake_gpu.add_process(0, 4_000_001, 3 * GIB)  # no such pid in this namespace
    fake_gpu.add_process(0, 4_000_002, None)  # nor this one, its usage unknown
    fake_gpu.update_gpu(0, memory_used=3 * GIB)
    scanner, _ = scanner_for(tmp_path)
    snap = scanner.scan_once()
    (gpu,) = snap.unseen
    assert (gpu.index, gpu.processes, gpu.memory_bytes) == (0, 2, 3 * GIB)
    got = scrape(scanner, snap)
    labels = (("Hostname", "h"), ("UUID", gpu.uuid), ("gpu", "0"), ("vendor", "nvidia"))
    assert got[("gpuguard_gpu_unseen_processes", labels)] == 2
    assert got[("gpuguard_gpu_unseen_process_memory_bytes", labels)] == 3 * GIB



def test_a_holder_nvml_lists_after_it_exited_is_exited_since_not_a_scan_error(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """Issue 50: the driver lists a process for a while after it exits. In the host's PID
    namespace (where NVML's pids are this /proc's) a listed pid missing from /proc has
    exited since: counted with the unseen processes, never a scan error, which fired
    GPUGuardScanErrors for a job that simply ended. Outside it, the same pid may be one
    this /proc cannot show: that stays the `procfs` stage's error (is the exporter in the
    host PID namespace?)."""
    tree = trees.spawn("{holder} --pidfile {dir}/worker & wait")
    worker = tree.pid("worker")
    fake_gpu.add_process(0, worker, GIB)
    fake_gpu.update_gpu(0, memory_used=GIB)
    scanner, _ = scanner_for(tmp_path)
    first = scanner.scan_once()
    assert [t.verdict for t in first.trees] == ["normal"] and first.errors == ()
    tree.kill(worker)
    wait_for(lambda: not os.path.exists(f"/proc/{worker}"), what="the worker reaped")
    snap = scanner.scan_once()  # NVML still lists it
    (gone,) = snap.trees
    assert (gone.verdict, gone.reason) == ("unknown", "not-visible")
    (gpu,) = snap.unseen
    assert (gpu.processes, gpu.memory_bytes) == (1, GIB)
    got = scrape(scanner, snap)
    assert got[("gpuguard_gpu_unseen_processes",
                (("Hostname", "h"), ("UUID", gpu.uuid), ("gpu", "0"), ("vendor", "nvidia")))] == 1
    errors = got[("gpuguard_scan_errors_total", (("stage", "procfs"),))]
    if in_host_pid_namespace():
        assert snap.errors == () and errors == 0  # was 1: GPUGuardScanErrors fired
    else:  # CI's fresh PID namespace: the namespace question stands
        assert [stage for stage, _ in snap.errors] == ["procfs"] and errors == 1

    # Told explicitly, either way round.
    for host_pids, expected in ((True, []), (False, ["procfs"])):
        counters = Counters()
        told = Scanner(rules=Rules(), nvml=Nvml(counters=counters), counters=counters,
                       view=ProcessView(counters=counters), host_pids=host_pids)
        assert [stage for stage, _ in told.scan_once().errors] == expected
        assert told.counts()[1]["procfs"] == len(expected)

def scrape(scanner: Scanner, snap: Snapshot) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname="h"))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_unlisted_holder_series(trees: Trees, fake_gpu: FakeGpuWorld,
                                    tmp_path: Path) -> None:
    holder, _, _ = holding(trees, device(tmp_path))
    fake_gpu.update_gpu(0, memory_used=GIB)
    scanner, _ = scanner_for(tmp_path)
    snap = scanner.scan_once()
    (found,) = snap.unlisted
    series = [(name, dict(labels)) for (name, labels), v in scrape(scanner, snap).items()
              if name == "gpuguard_gpu_unlisted_holder_info" and v == 1]
    assert series == [("gpuguard_gpu_unlisted_holder_info", {
        "pid": str(holder), "start_time": str(found.start_time), "comm": found.comm,
        "user": found.user, "device_file": str(tmp_path / "dev" / "nvidia0"),
        "verdict": "normal", "reason": "attached", "gpu": "", "UUID": "",
        "Hostname": "h", "vendor": ""})]


def test_the_remediator_refuses_a_tree_nvml_does_not_list(
        harness: Callable[..., Harness], trees: Trees, fake_gpu: FakeGpuWorld,
        tmp_path: Path) -> None:
    """What could reach the remediator for an unlisted holder is an alert naming its
    orphaned tree (someone's own rule over gpuguard_gpu_unlisted_holder_info, labelled
    remediate="true"): its re-inspection asks NVML, which lists none of the tree, so
    there is no tree to reap, and nothing is signalled."""
    holder, root, tree = holding(trees, device(tmp_path))
    tree.kill_launcher()
    fake_gpu.update_gpu(0, memory_used=2 * GIB)
    scanner, _ = scanner_for(tmp_path)
    (found,) = scanner.scan_once().unlisted
    assert (found.pid, found.verdict) == (holder, "orphan")  # what the exporter says
    h = harness()
    answer = account(h.post(payload(alert(root, start_time_of(root), comm="sh"))))
    h.settle()
    assert alive(holder) and alive(root)
    reasons = [d["reason"] for d in h.service.snapshot()["recent_decisions"]
               if d["fingerprint"] == answer["fingerprint"]]
    assert "tree-not-found" in reasons and "reap" not in reasons, reasons
    (record,) = [r for r in h.audit() if r["key"]["root_pid"] == root]
    assert record["signals"] == [] and record["decision"]["reason"] == "tree-not-found"


# -- gpuguard node-check -----------------------------------------------------------------


def node_check(gpuguard: Run, *args: str) -> tuple[int, dict]:
    done = gpuguard("node-check", "--json", *args)
    return done.returncode, json.loads(done.stdout)


def test_node_check_clean_orphan_and_unattributed(
        gpuguard: Run, trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    node = device(tmp_path)
    config = tmp_path / "gpuguard.yml"
    config.write_text(f"accounting:\n  device_files: ['{tmp_path}/dev/nvidia[0-9]*']\n"
                      "  unlisted_threshold_bytes: 64MiB\n")
    code, doc = node_check(gpuguard, "--config", str(config))
    assert (code, doc["clean"], doc["why"]) == (0, True, []), doc  # an idle GPU
    working, root, tree = holding(trees, node)
    fake_gpu.add_process(0, working, GIB)
    fake_gpu.update_gpu(0, memory_used=GIB + 32 * MIB)  # under the threshold: rounding
    code, doc = node_check(gpuguard, "--config", str(config))
    assert (code, doc["clean"]) == (0, True), doc  # a live job's normal tree
    assert doc["remaining"] == {"trees": [], "unattributed": [], "unlisted": [],
                                "unseen": [], "search": doc["remaining"]["search"]}

    tree.kill_launcher()
    code, doc = node_check(gpuguard, "--config", str(config))
    assert (code, doc["clean"]) == (1, False), doc
    (left,) = doc["remaining"]["trees"]
    # (its reason is the console's: it hears no process events, launcher-unrecorded)
    assert (left["root_pid"], left["verdict"]) == (root, "orphan")
    assert [h["pid"] for h in left["holders"]] == [working]
    assert doc["why"] == ["1 trees that are not normal"]

    fake_gpu.remove_process(working)  # NVML forgets it; its memory stays in use
    code, doc = node_check(gpuguard, "--config", str(config))
    assert (code, doc["clean"]) == (1, False), doc
    assert [(g["index"], g["unattributed_bytes"]) for g in doc["remaining"]["unattributed"]] \
        == [(0, GIB + 32 * MIB)]
    (unlisted,) = doc["remaining"]["unlisted"]
    assert (unlisted["pid"], unlisted["device_file"], unlisted["verdict"]) == (
        working, str(node), "orphan")
    assert doc["remaining"]["search"]["passes"] == 1


def test_node_check_fails_closed(gpuguard: Run, fake_gpu: FakeGpuWorld,
                                 tmp_path: Path) -> None:
    fake_gpu.set_init_error(9)  # NVML_ERROR_DRIVER_NOT_LOADED
    code, doc = node_check(gpuguard)
    assert (code, doc["clean"], doc["nvml"]["up"]) == (1, False, False), doc
    assert doc["why"][0].startswith("nvml-unavailable")
    bad = tmp_path / "bad.yml"
    bad.write_text("accounting:\n  unlisted_threshold_bytes: lots\n")
    done = gpuguard("node-check", "--config", str(bad))
    assert done.returncode == 2 and done.stdout == ""
    assert f"{bad}: accounting.unlisted_threshold_bytes" in done.stderr


def test_node_check_counts_a_protected_tree_only_when_told(
        gpuguard: Run, trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """Another job's tree (a protect pattern: slurmstepd on a shared node) holds its GPU
    on purpose: not clean by default, clean with --allow-protected."""
    config = tmp_path / "gpuguard.yml"
    config.write_text("classify:\n  protect: [another-job]\n")
    job = trees.spawn("{holder} --pidfile {dir}/holder another-job & wait").pid("holder")
    fake_gpu.add_process(0, job, GIB)
    fake_gpu.update_gpu(0, memory_used=GIB)
    code, doc = node_check(gpuguard, "--config", str(config))
    assert code == 1 and [t["verdict"] for t in doc["remaining"]["trees"]] == ["protected"]
    code, doc = node_check(gpuguard, "--config", str(config), "--allow-protected")
    assert (code, doc["clean"], doc["remaining"]["trees"]) == (0, True, []), doc


def test_one_process_with_many_files_is_resumed_at_its_next_descriptor(
        trees: Trees, tmp_path: Path) -> None:
    """A process with 300 files open before the device file: a clock that moves 10 ms at
    each look ends each step after 64 descriptors, and the next step goes on in the same
    process where the last stopped, until the file is found."""
    node = device(tmp_path)
    opens = " ".join(f"{fd}</dev/null" for fd in range(10, 310))
    tree = trees.spawn(f'bash -c "exec {opens}; exec {{holder}} --pidfile {{dir}}/holder '
                       f'310<{shlex.quote(str(node))}" & wait')
    holder = tree.pid("holder")
    assert len(os.listdir(f"/proc/{holder}/fd")) > 300
    ticks = iter(range(10**7))
    search = FdSearch(counters=Counters(), clock=lambda: next(ticks) / 100,
                      exclude=frozenset(p for p in map(int, filter(str.isdigit,
                                                                    os.listdir("/proc")))
                                        if p != holder))
    files = device_files([str(node)])
    steps = 0
    while holder not in search.step(files, max_processes=10**6, max_seconds=0.005).found:
        steps += 1
        assert steps < 20, "the search never got past the holder's first descriptors"
    assert steps >= 4  # 300 descriptors, 64 a step: resumed, not started over


def test_a_pid_reused_since_it_was_found_is_not_reported(
        trees: Trees, fake_gpu: FakeGpuWorld, tmp_path: Path) -> None:
    """Found at one pass, the holder dies and an unrelated process takes its pid
    (ns_last_pid) before the search looks at that pid again: the new process is not
    reported in the old one's name (its start time differs)."""
    import subprocess

    holder, _, tree = holding(trees, device(tmp_path))
    fake_gpu.update_gpu(0, memory_used=GIB)
    scanner, _ = scanner_for(tmp_path, unlisted_search_budget_processes=1)
    for _ in range(100):
        if [u.pid for u in scanner.scan_once().unlisted] == [holder]:
            break
    assert [u.pid for u in scanner.latest.unlisted] == [holder]  # type: ignore[union-attr]
    tree.kill(holder)
    wait_for(lambda: not os.path.exists(f"/proc/{holder}"), what="the holder's pid freed")
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(holder - 1))
    except OSError as exc:
        pytest.skip(f"cannot choose the next pid here ({exc}): needs root in a PID namespace")
    squatter = subprocess.Popen(["sleep", "60"])
    try:
        if squatter.pid != holder:
            pytest.skip("another process took the pid first")
        snap = scanner.scan_once()
        assert snap.unlisted == (), snap.unlisted
    finally:
        squatter.kill()
        squatter.wait()


def test_a_huge_descriptor_table_is_passed_in_a_bounded_number_of_steps(
        trees: Trees, tmp_path: Path) -> None:
    """A user can open as many files as RLIMIT_NOFILE allows; listing them costs about as
    much as stat()ing a 16th of them, so each step looks at no fewer than that: 8,000
    descriptors take at most 16 steps (64 a step would take 125), and the device file
    after them is found."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 9000:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    node = device(tmp_path)
    script = (f"import os, resource, time; resource.setrlimit(resource.RLIMIT_NOFILE, "
              f"(9000, {hard if hard != resource.RLIM_INFINITY else 9000})); "
              f"fds = [os.open('/dev/null', os.O_RDONLY) for _ in range(8000)]; "
              f"node = os.open({str(node)!r}, os.O_RDONLY); "
              f"open({str(tmp_path / 'pid')!r} + '.tmp', 'w').write(str(os.getpid())); "
              f"os.rename({str(tmp_path / 'pid')!r} + '.tmp', {str(tmp_path / 'pid')!r}); "
              f"time.sleep(600)")
    trees.spawn(f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}")
    holder = int(str(wait_for(lambda: (tmp_path / "pid").exists()
                              and (tmp_path / "pid").read_text(), what="the holder")))
    ticks = iter(range(10**8))
    search = FdSearch(counters=Counters(), clock=lambda: next(ticks) / 100,
                      exclude=frozenset(p for p in map(int, filter(str.isdigit,
                                                                    os.listdir("/proc")))
                                        if p != holder))
    files = device_files([str(node)])
    steps = 1
    while holder not in search.step(files, max_processes=10**6, max_seconds=0.005).found:
        steps += 1
        assert steps <= 17, "a step made less than a 16th of the table's progress"
