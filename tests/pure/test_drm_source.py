"""The DRM back-end's source (gpuguard/gpu/drm/) over synthetic /proc, /sys and /dev trees
built in a temporary directory (tests/support/drmtree.py): two devices, processes sharing
clients, a process gone between the listing and the read, unreadable descriptors and
fdinfo, the other back-ends' drivers left to them, and the search's budget and resumption,
counted on the Counters as the scan's cost rules require."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.gpu.drm import Drm, privilege_lines, probe
from gpuguard.gpu.drm.devices import find_devices
from gpuguard.gpu.drm.search import DrmSearch
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.fdsearch import CLOCK_EVERY
from gpuguard.host.procfs import CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE
from tests.pure.test_drm_fdinfo import AMDGPU, XE_DOC
from tests.support.drmtree import DrmHost

XE = "0000:03:00.0"
AMD = "0000:04:00.0"
BMC = "0000:02:00.0"
NV = "0000:3b:00.0"
KIB = 1024
#: A BMC's display (ast) as Xorg holds it on kernel 6.5 and later: drm_show_fdinfo() names
#: the driver, client and device, and ast publishes no usage stats.
AST = (f"pos:\t0\nflags:\t02100002\nmnt_id:\t26\nino:\t1047\ndrm-driver:\tast\n"
       f"drm-client-id:\t5\ndrm-pdev:\t{BMC}\n")


def xe_client(client: int, vram_kib: int, rcs: int) -> str:
    return (XE_DOC.replace("drm-client-id:  3", f"drm-client-id:  {client}")
            .replace("drm-total-vram0:        23992 KiB", f"drm-total-vram0: {vram_kib} KiB")
            .replace("drm-cycles-rcs: 28257900", f"drm-cycles-rcs: {rcs}"))


@pytest.fixture
def host(tmp_path: Path) -> DrmHost:
    host = DrmHost(tmp_path)
    host.gpu(XE, "xe", card=0, render=128, files={"vendor": "0x8086\n", "device": "0x56a0\n"})
    host.gpu(AMD, "amdgpu", card=1, render=129, files={
        "product_name": "AMD Radeon PRO W7900\n", "mem_info_vram_total": str(48 << 30),
        "mem_info_vram_used": str(1 << 30), "gpu_busy_percent": "37\n"})
    return host


def costs(counters: Counters) -> dict[str, tuple[int, int]]:
    return {site: (c.calls, c.proc_reads) for site, c in counters.snapshot().items()
            if site.startswith("drm_")}


def test_two_devices_shared_clients_and_each_client_once(host: DrmHost) -> None:
    host.process(100, start_time=500, fds={5: "renderD128", 6: "renderD128"},
                 fdinfo={5: xe_client(7, 1000, 10), 6: xe_client(7, 1000, 10)})  # dup'd
    host.process(101, start_time=600, fds={5: "renderD128"},
                 fdinfo={5: xe_client(7, 1000, 10)})  # its forked child: the same client
    host.process(102, start_time=700, fds={4: "card1"}, fdinfo={4: AMDGPU})
    host.process(103, start_time=800)  # no GPU
    drm = Drm(Counters(), **host.roots())
    reading = drm.read()
    assert reading.up and reading.errors == ()
    xe, amd = reading.gpus
    assert (xe.index, xe.uuid, xe.vendor, xe.name, xe.pci_bus_id, xe.device) == (
        0, f"DRM-{XE}", "intel", "xe 8086:56a0", XE, "card0")
    assert (xe.memory_total_bytes, xe.memory_used_bytes, xe.utilization_ratio) == (None,) * 3
    assert (amd.index, amd.vendor, amd.name) == (1, "amd", "AMD Radeon PRO W7900")
    assert (amd.memory_total_bytes, amd.memory_used_bytes, amd.utilization_ratio) == (
        48 << 30, 1 << 30, 0.37)
    assert not amd.used_excludes_reserved and amd.processes_listed
    assert xe.busy_pids is None  # the first read cannot say who used a GPU since
    assert {(h.pid, h.gpu_uuid, h.used_bytes, h.kind) for h in reading.holders} == {
        (100, f"DRM-{XE}", 1000 * KIB, "drm"), (102, f"DRM-{AMD}", 44564 * KIB, "drm")}


def test_engine_growth_between_reads_names_the_busy_pids(host: DrmHost) -> None:
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 10)})
    host.process(200, fds={5: "renderD128"}, fdinfo={5: xe_client(8, 1, 10)})
    drm = Drm(Counters(), **host.roots())
    drm.read()
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 99)})
    assert drm.read().gpus[0].busy_pids == frozenset({100})
    assert Drm(Counters(), process_utilization=False, **host.roots()).read().gpus[0] \
        .busy_pids is None


def test_a_process_gone_between_listing_and_reading_is_no_holder(host: DrmHost) -> None:
    """Its /proc directory is listed but its descriptors are gone (exited, being reaped)."""
    (host.proc / "150").mkdir()
    (host.proc / "150" / "stat").write_text("150 (x) Z 1 150 150 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 "
                                            "9 0 0\n")
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    reading = Drm(Counters(), **host.roots()).read()
    assert [h.pid for h in reading.holders] == [100] and reading.errors == ()


def test_a_client_that_exits_between_reads_is_forgotten(host: DrmHost) -> None:
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    drm = Drm(Counters(), **host.roots())
    assert [h.pid for h in drm.read().holders] == [100]
    host.exit(100)
    assert drm.read().holders == ()


def test_a_reused_pid_is_not_the_known_client(host: DrmHost) -> None:
    """The same pid, another start time, and no DRM descriptor: not a holder, even for the
    reads before the pass comes back to it."""
    host.process(100, start_time=500, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    host.process(101)
    drm = Drm(Counters(), max_processes=1, first_max_processes=1, pass_every=0,
              **host.roots())
    drm.read()
    drm.read()  # a whole pass: 100 known
    host.process(100, start_time=900, fds={5: "renderD128"})  # fd 5 open on the node, no stats
    reading = drm.read()  # the pass is at 100 again: examined afresh
    assert {(h.pid, h.used_bytes) for h in reading.holders} == {(100, None)}
    host.process(100, start_time=950)  # again reused, now no DRM descriptor
    reading = drm.read()  # the pass examines 101 this time; 100's identity check drops it
    assert reading.holders == ()


def test_unreadable_fdinfo_is_a_holder_of_unknown_size(host: DrmHost) -> None:
    """The descriptor is open on an xe node (stat says so) but its stats cannot be read
    (root reads any mode, so the test makes the file a directory: open() fails alike)."""
    host.process(100, fds={5: "renderD128"})
    fdinfo = host.proc / "100" / "fdinfo" / "5"
    fdinfo.unlink()
    fdinfo.mkdir()
    reading = Drm(Counters(), **host.roots()).read()
    assert [(h.pid, h.gpu_uuid, h.used_bytes) for h in reading.holders] == [
        (100, f"DRM-{XE}", None)]


def test_unreadable_descriptors_are_counted_not_guessed(host: DrmHost,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    (host.proc / "100" / "fd").rename(host.proc / "100" / "fd.real")
    (host.proc / "100" / "fd").write_text("")  # listdir fails, not with ENOENT
    reading = Drm(Counters(), **host.roots()).read()
    assert reading.holders == () and reading.errors == ()
    assert "descriptors of 1 processes could not be read" in caplog.text


def test_a_driver_without_usage_stats_still_shows_its_holders(host: DrmHost) -> None:
    host.process(100, fds={5: "renderD129"})  # fdinfo without any drm- key
    reading = Drm(Counters(), **host.roots()).read()
    assert [(h.pid, h.gpu_uuid, h.used_bytes) for h in reading.holders] == [
        (100, f"DRM-{AMD}", None)]


def test_a_closed_and_reused_descriptor_number_is_no_client(host: DrmHost) -> None:
    host.process(100, fds={5: "renderD128"})
    host.process(101)
    drm = Drm(Counters(), max_processes=1, first_max_processes=1, **host.roots())
    assert [h.pid for h in drm.read().holders] == [100]  # examines 100
    host.process(100, others=6)  # fd 5 is now a plain file
    assert drm.read().holders == ()  # examines 101; 100's fd 5 re-read, stat()ed, dropped


def test_the_other_back_ends_drivers_are_left_to_them(host: DrmHost) -> None:
    host.process(100, fds={5: "renderD128", 6: "renderD129"},
                 fdinfo={5: xe_client(7, 1, 0), 6: AMDGPU})
    reading = Drm(Counters(), skip_drivers=frozenset({"amdgpu", "nvidia"}), **host.roots()).read()
    assert [g.uuid for g in reading.gpus] == [f"DRM-{XE}"]
    assert [h.gpu_uuid for h in reading.holders] == [f"DRM-{XE}"]


def test_a_host_whose_nodes_are_all_another_back_ends_reads_no_proc(tmp_path: Path) -> None:
    host = DrmHost(tmp_path)
    host.gpu("0000:3b:00.0", "nvidia", card=0, render=128)
    host.process(100, fds={5: "renderD128"})
    counters = Counters()
    reading = Drm(counters, skip_drivers=frozenset({"nvidia"}), **host.roots()).read()
    assert (reading.up, reading.gpus, reading.holders, reading.errors) == (True, (), (), ())
    assert sum(reads for _calls, reads in costs(counters).values()) == 0


def test_no_device_node_reads_down_and_no_proc(tmp_path: Path) -> None:
    host = DrmHost(tmp_path)
    counters = Counters()
    reading = Drm(counters, **host.roots()).read()
    assert not reading.up and reading.errors[0][0] == "drm_devices"
    assert costs(counters)["drm_list"] == (0, 0)
    assert probe(str(host.dev)) is not None
    host.gpu(XE, "xe", card=0, render=128)
    assert probe(str(host.dev)) is None


def test_a_node_sysfs_does_not_name_is_placed_by_its_clients_fdinfo(tmp_path: Path) -> None:
    host = DrmHost(tmp_path)
    host.gpu(XE, "xe", card=0, render=128, sysfs=False)
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 2, 0)})
    host.process(101, fds={5: "renderD128"})  # no stats and no sysfs: which GPU is unknown
    reading = Drm(Counters(), **host.roots()).read()
    assert [(g.uuid, g.vendor) for g in reading.gpus] == [(f"DRM-{XE}", "intel")]
    assert [h.pid for h in reading.holders] == [100]
    assert [stage for stage, _ in reading.errors] == ["drm_clients"]


def test_the_search_stays_within_its_budget_and_resumes(host: DrmHost) -> None:
    """50 processes at 10 a read (the first read too, here): five reads make a pass, each
    examining at most 10, every process once; until the first pass ends the reading says
    its list is incomplete."""
    for pid in range(1000, 1050):
        host.process(pid)
    host.process(1025, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    host.process(1049, fds={5: "card1"}, fdinfo={5: AMDGPU})
    counters = Counters()
    drm = Drm(counters, max_processes=10, first_max_processes=10, **host.roots())
    readings: list[GpuReading] = []
    for _ in range(5):
        before = costs(counters)
        readings.append(drm.read())
        after = costs(counters)
        examined = after["drm_fd_search"][0] - before["drm_fd_search"][0]
        assert examined <= 10 and after["drm_list"][0] - before["drm_list"][0] == 1
    assert costs(counters)["drm_fd_search"][0] == 50  # each process examined once
    for reading in readings[:4]:
        assert [s for s, _ in reading.errors] == ["drm_search"]
        assert not any(g.processes_listed for g in reading.gpus)
    assert readings[4].errors == () and all(g.processes_listed for g in readings[4].gpus)
    assert {h.pid for h in readings[2].holders} == {1025}  # found mid-pass, kept since
    assert {h.pid for h in readings[4].holders} == {1025, 1049}


def test_a_steady_host_rereads_only_its_known_clients_fdinfo(host: DrmHost) -> None:
    """Between passes a read lists nothing and examines no one: two fdinfo reads and one
    stat (its identity) for the one known client. The next pass starts `pass_every`
    seconds after the last one started."""
    for pid in range(1000, 1040):
        host.process(pid)
    host.process(1010, fds={5: "renderD128", 6: "renderD128"},
                 fdinfo={5: xe_client(7, 1, 0), 6: xe_client(8, 1, 0)})
    for pass_every, examined, listings in ((3600.0, 0, 0), (0.0, 10, 1)):
        counters = Counters()
        drm = Drm(counters, max_processes=10, first_max_processes=10, pass_every=pass_every,
                  **host.roots())
        for _ in range(4):
            drm.read()  # one pass
        before = costs(counters)
        assert {h.pid for h in drm.read().holders} == {1010}
        after = costs(counters)
        assert after["drm_fdinfo"][1] - before["drm_fdinfo"][1] == 3
        assert after["drm_fd_search"][0] - before["drm_fd_search"][0] == examined
        assert after["drm_list"][0] - before["drm_list"][0] == listings


def test_privileges_name_what_is_missing() -> None:
    assert privilege_lines(None) == []
    assert privilege_lines(1 << CAP_SYS_PTRACE | 1 << CAP_DAC_READ_SEARCH) == []
    [line] = privilege_lines(1 << CAP_SYS_PTRACE)
    assert "missing CAP_DAC_READ_SEARCH" in line and "not seen" in line
    [line] = privilege_lines(0)
    assert "missing CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH" in line


def test_a_device_without_a_render_node_is_no_gpu(tmp_path: Path) -> None:
    """An NVIDIA host with a BMC's display chip (ast: card0, no render node), whose only
    client is Xorg: no GPU, no holder. A display-only device whose clients publish usage
    stats (an SoC's) is one."""
    host = DrmHost(tmp_path)
    host.gpu(BMC, "ast", card=0, render=None)
    host.gpu(NV, "nvidia", card=1, render=128)
    host.process(900, fds={4: "card0"}, fdinfo={4: AST})  # Xorg on the BMC's display
    host.process(901, fds={5: "renderD128"})  # a CUDA job's nvidia-drm descriptor
    reading = Drm(Counters(), skip_drivers=frozenset({"nvidia"}), **host.roots()).read()
    assert (reading.up, reading.gpus, reading.holders, reading.errors) == (True, (), (), ())
    soc = "0000:05:00.0"
    host.gpu(soc, "v3d", card=2, render=None)
    host.process(902, fds={4: "card2"}, fdinfo={4: f"drm-driver:\tv3d\ndrm-client-id:\t9\n"
                                                   f"drm-pdev:\t{soc}\n"
                                                   "drm-engine-render:\t1200 ns\n"})
    reading = Drm(Counters(), skip_drivers=frozenset({"nvidia"}), **host.roots()).read()
    assert [g.uuid for g in reading.gpus] == [f"DRM-{soc}"]
    assert [h.pid for h in reading.holders] == [902]


def test_the_first_read_is_a_whole_pass_and_later_ones_keep_the_budget(host: DrmHost) -> None:
    """A one-shot command (gpuguard reap --apply) reads a fresh source about once: its
    first read must be complete, or every reap's check is refused."""
    for pid in range(1000, 1050):
        host.process(pid)
    host.process(1025, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    host.process(1049, fds={5: "card1"}, fdinfo={5: AMDGPU})
    counters = Counters()
    drm = Drm(counters, max_processes=10, pass_every=0, **host.roots())
    reading = drm.read()
    assert reading.errors == () and all(g.processes_listed for g in reading.gpus)
    assert {h.pid for h in reading.holders} == {1025, 1049}
    assert costs(counters)["drm_fd_search"][0] == 50
    drm.read()  # the next pass: within the budget again
    assert costs(counters)["drm_fd_search"][0] == 60


def test_past_the_first_reads_cap_the_reading_is_incomplete(host: DrmHost) -> None:
    for pid in range(1000, 1050):
        host.process(pid)
    counters = Counters()
    drm = Drm(counters, max_processes=10, first_max_processes=20, **host.roots())
    examined = []
    while True:
        before = costs(counters)["drm_fd_search"][0]
        reading = drm.read()
        examined.append(costs(counters)["drm_fd_search"][0] - before)
        if not reading.errors:
            break
        assert [s for s, _ in reading.errors] == ["drm_search"]
        assert not any(g.processes_listed for g in reading.gpus)
    assert examined == [20, 10, 10, 10]


def test_a_process_with_many_descriptors_is_examined_in_shares(host: DrmHost) -> None:
    """A process with thousands of descriptors costs each step no more than its time
    budget: the step stops part-way through its table and the next resumes there. The
    clock ticks 10 ms a look, so a 50 ms step looks some five times, CLOCK_EVERY stats
    apart."""
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    counters = Counters()
    ticks = itertools.count()
    search = DrmSearch(proc_root=str(host.proc), counters=counters, max_seconds=0.05,
                       pass_every=0, clock=lambda: next(ticks) * 0.01)
    nodes = find_devices(str(host.dev), str(host.sys)).nodes
    assert search.step(nodes).complete
    host.process(200, others=2000, fds={2000: "renderD129"})
    shares = []
    while True:
        before = counters.snapshot()["drm_fd_search"].proc_reads
        step = search.step(nodes)
        shares.append(counters.snapshot()["drm_fd_search"].proc_reads - before)
        if step.complete:
            break
        assert (200, 2000) not in {(o.pid, o.fd) for o in step.opened}  # not yet seen
        assert len(shares) < 100, "the pass never completes"
    assert len(shares) >= 3 and max(shares) <= 8 * CLOCK_EVERY
    assert {(o.pid, o.fd, o.node) for o in step.opened} == {
        (100, 5, "renderD128"), (200, 2000, "renderD129")}
    # Stopped part-way, the process's descriptor directory is held open until it is done,
    # the source is closed, or the process is gone.
    search.step(nodes)  # a new pass, part-way through 200 again
    held = len(os.listdir("/proc/self/fd"))
    search.close()
    assert len(os.listdir("/proc/self/fd")) == held - 1
    search.step(nodes)  # 200 from its first descriptor again
    host.exit(200)
    while not search.step(nodes).complete:
        pass
    assert len(os.listdir("/proc/self/fd")) == held - 1
    assert {o.pid for o in search.step(nodes).opened} == {100}


def test_unreadable_processes_leave_no_list_complete(host: DrmHost,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """While a process's descriptors could not be read in the last complete pass, it may
    hold any GPU unseen: no GPU's process list reads complete, and the count is logged
    each time it changes."""
    host.process(100, fds={5: "renderD128"}, fdinfo={5: xe_client(7, 1, 0)})
    host.process(101, fds={5: "renderD128"}, fdinfo={5: xe_client(8, 1, 0)})
    fd = host.proc / "100" / "fd"
    fd.rename(host.proc / "100" / "fd.real")
    fd.write_text("")  # listdir fails, not with ENOENT
    drm = Drm(Counters(), pass_every=0, **host.roots())
    with caplog.at_level(logging.INFO, logger="gpuguard.gpu"):
        reading = drm.read()
        assert [h.pid for h in reading.holders] == [101] and reading.errors == ()
        assert reading.gpus and not any(g.processes_listed for g in reading.gpus)
        assert "descriptors of 1 processes could not be read" in caplog.text
        caplog.clear()
        assert not any(g.processes_listed for g in drm.read().gpus)
        assert "could not be read" not in caplog.text  # no change: no line
        fd.unlink()
        (host.proc / "100" / "fd.real").rename(fd)
        reading = drm.read()
    assert {h.pid for h in reading.holders} == {100, 101}
    assert all(g.processes_listed for g in reading.gpus)
    assert "every process's descriptors could be read again" in caplog.text
