"""AMD's back-end (gpuguard/gpu/amdsmi/) over the fake libamd_smi.so, loaded by the
unmodified PyPI `amdsmi` wrapper, with real processes as the holders AMD SMI lists."""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.engine.scan.accounting import balance
from gpuguard.gpu.reading import Listed
from tests.support.fakeamdsmi import (
    AMDSMI_STATUS_DRIVER_NOT_LOADED,
    AMDSMI_STATUS_NO_PERM,
    AMDSMI_STATUS_NOT_FOUND,
    AMDSMI_STATUS_NOT_SUPPORTED,
    LIBRARY_NAME,
    MIB,
    FakeAmdWorld,
    build_library,
    implemented,
    wrapper_source,
    wrapper_symbols,
)
from tests.support.proctree import CHAIN, Trees, alive, stat_fields
from tests.support.servers import REPO, child_env

GIB = 2**30


def AmdSmi(*args, **kwargs):  # noqa: N802 (the class, imported once the fake is found)
    """gpuguard.gpu.amdsmi.reader.AmdSmi: that module binds the wrapper at its import, which
    needs the fake's ROCM_PATH (the fake_amd fixture) first."""
    from gpuguard.gpu.amdsmi.reader import AmdSmi as reader_class

    return reader_class(*args, **kwargs)


@pytest.fixture
def reader(fake_amd: FakeAmdWorld):
    made = AmdSmi(Counters())
    yield made
    made.close()


def dead_pid() -> int:
    """The pid of a process that ran and was reaped (no process there now)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not alive(proc.pid)
    return proc.pid


# -- the fake against the installed wrapper ----------------------------------------------


def test_the_fake_exports_every_symbol_the_installed_wrapper_binds(fake_amd: FakeAmdWorld,
                                                                   fake_amdsmi_lib: Path) -> None:
    import amdsmi.amdsmi_wrapper as wrapper

    # What the wrapper bound, read off the imported module (its ctypes function pointers),
    # not off its text as the build does: the two must agree, and the fake has them all.
    bound = {name for name, obj in vars(wrapper).items()
             if isinstance(obj, ctypes._CFuncPtr) and name.startswith("amdsmi_")}  # type: ignore[attr-defined]
    listed = set(wrapper_symbols())
    assert bound == listed and len(listed) >= 100
    assert implemented() <= listed, "a real body for a call the wrapper no longer binds"
    lib = ctypes.CDLL(str(fake_amdsmi_lib / "lib" / LIBRARY_NAME))
    assert all(hasattr(lib, name) for name in listed)
    assert Path(wrapper.__file__) == wrapper_source()


def test_the_fakes_structures_lie_where_the_wrapper_reads_them(fake_amdsmi_lib: Path,
                                                               fake_amd: FakeAmdWorld) -> None:
    import amdsmi.amdsmi_wrapper as w

    lib = ctypes.CDLL(str(fake_amdsmi_lib / "lib" / LIBRARY_NAME))
    lib.fakeamdsmi_offset.restype = ctypes.c_long
    lib.fakeamdsmi_offset.argtypes = [ctypes.c_char_p]
    wanted = {
        "amdsmi_proc_info_t": ctypes.sizeof(w.amdsmi_proc_info_t),
        "amdsmi_proc_info_t.pid": w.amdsmi_proc_info_t.pid.offset,
        "amdsmi_proc_info_t.mem": w.amdsmi_proc_info_t.mem.offset,
        "amdsmi_proc_info_t.engine_usage": w.amdsmi_proc_info_t.engine_usage.offset,
        "amdsmi_proc_info_t.memory_usage": w.amdsmi_proc_info_t.memory_usage.offset,
        "amdsmi_proc_info_t.cu_occupancy": w.amdsmi_proc_info_t.cu_occupancy.offset,
        "amdsmi_vram_usage_t": ctypes.sizeof(w.amdsmi_vram_usage_t),
        "amdsmi_engine_usage_t": ctypes.sizeof(w.amdsmi_engine_usage_t),
        "amdsmi_driver_info_t": ctypes.sizeof(w.amdsmi_driver_info_t),
        "amdsmi_asic_info_t": ctypes.sizeof(w.amdsmi_asic_info_t),
        "amdsmi_asic_info_t.target_graphics_version":
            w.amdsmi_asic_info_t.target_graphics_version.offset,
        "amdsmi_power_info_t": ctypes.sizeof(w.amdsmi_power_info_t),
        "amdsmi_power_info_t.current_socket_power":
            w.amdsmi_power_info_t.current_socket_power.offset,
    }
    assert {k: lib.fakeamdsmi_offset(k.encode()) for k in wanted} == wanted


# -- the probe: no AMD back-end, said plainly -----------------------------------------------


def probe_in_child(env: dict[str, str]) -> str | None:
    code = ("import json, gpuguard.gpu.amdsmi as a; print(json.dumps(a.amdsmi_probe()))")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_without_the_library_the_probe_says_no_amd_back_end(tmp_path: Path) -> None:
    env = child_env(ROCM_PATH=str(tmp_path / "no-rocm"))
    env.pop("ROCM_HOME", None)
    why = probe_in_child(env)
    assert why is not None and why.startswith("no AMD back-end: libamd_smi.so not found")


def test_a_library_older_than_the_wrapper_is_no_amd_back_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_amdsmi_lib: Path) -> None:
    # A library that lacks the newest symbol the wrapper binds: `import amdsmi` raises
    # AttributeError (not ImportError), and the wrapper prints to stdout, which stays clean.
    import tests.support.fakeamdsmi as fake

    newest = wrapper_symbols()[-1]
    monkeypatch.setattr(fake, "wrapper_symbols", lambda: wrapper_symbols()[:-1])
    build_library(tmp_path / "old")
    env = child_env(ROCM_PATH=str(tmp_path / "old"))
    env.pop("ROCM_HOME", None)
    why = probe_in_child(env)
    assert why is not None and why.startswith("no AMD back-end: libamd_smi.so is older than "
                                              "the amdsmi wrapper") and newest in why


# -- the reading ---------------------------------------------------------------------------


def test_gpus_and_a_real_processs_vram(trees: Trees, fake_amd: FakeAmdWorld, reader) -> None:
    worker = trees.spawn(CHAIN).pid("worker")
    fake_amd.update_gpu(0, vram_used_mib=5 * 1024, gfx_activity=37, temp_c=51, power_w=420)
    fake_amd.add_process(0, worker, 3 * GIB, gfx_ns=10_000)
    reading = reader.read()
    assert reading.up and reading.errors == () and reading.driver_version == "6.10.5"
    (gpu,) = reading.gpus
    assert (gpu.vendor, gpu.uuid, gpu.name, gpu.pci_bus_id) == (
        "amd", fake_amd.gpus[0].uuid, "AMD Instinct MI300X", "0000:10:00.0")
    assert gpu.memory_total_bytes == 192 * GIB  # amdsmi_get_gpu_vram_usage answers MiB
    assert gpu.memory_used_bytes == 5 * GIB
    assert (gpu.utilization_ratio, gpu.temperature_celsius, gpu.power_watts) == (0.37, 51, 420)
    (holder,) = reading.holders
    assert (holder.pid, holder.used_bytes, holder.kind, holder.gpu_index) == (
        worker, 3 * GIB, "C", 0)
    assert balance(reading.gpus, reading.holders)[0].unattributed_bytes == 2 * GIB


def test_a_figure_the_gpu_does_not_give_is_absent_and_a_failed_one_an_error(
        fake_amd: FakeAmdWorld, reader) -> None:
    fake_amd.set_field_error(0, "power", AMDSMI_STATUS_NOT_SUPPORTED)
    fake_amd.set_field_error(0, "activity", 12)  # AMDSMI_STATUS_IO
    reading = reader.read()
    (gpu,) = reading.gpus
    assert gpu.power_watts is None and gpu.utilization_ratio is None
    assert gpu.memory_used_bytes == 0
    assert [stage for stage, _ in reading.errors] == ["amdsmi_device"]
    assert "activity" in reading.errors[0][1]


def test_a_lost_gpu_is_skipped_and_a_dead_library_reads_down_then_back(
        fake_amd: FakeAmdWorld, reader) -> None:
    fake_amd.add_gpu(1)
    fake_amd.set_field_error(0, "uuid", AMDSMI_STATUS_NOT_FOUND)
    reading = reader.read()
    assert reading.up and [g.index for g in reading.gpus] == [1]
    assert reading.errors and reading.errors[0][0] == "amdsmi_device"
    fake_amd.set_runtime_error(AMDSMI_STATUS_DRIVER_NOT_LOADED)
    down = reader.read()
    assert not down.up and down.gpus == () and down.errors[0][0] == "amdsmi_device"
    fake_amd.set_runtime_error(None)
    fake_amd.set_field_error(0, "uuid", None)
    assert [g.index for g in reader.read().gpus] == [0, 1]  # initialised again


def test_a_process_list_that_cannot_be_read_lists_no_one(fake_amd: FakeAmdWorld,
                                                         reader) -> None:
    fake_amd.set_field_error(0, "processes", AMDSMI_STATUS_NO_PERM)
    reading = reader.read()
    assert not reading.gpus[0].processes_listed and reading.holders == ()
    assert "need root" in reading.errors[0][1]
    assert balance(reading.gpus, reading.holders)[0].unattributed_bytes is None


def test_a_dead_pid_in_amds_list_is_no_holder(trees: Trees, fake_amd: FakeAmdWorld,
                                              reader) -> None:
    worker = trees.spawn(CHAIN).pid("worker")
    gone = dead_pid()
    fake_amd.update_gpu(0, vram_used_mib=4 * 1024)
    fake_amd.add_process(0, worker, 1 * GIB)
    fake_amd.add_process(0, gone, 3 * GIB, name="ghost")
    for _ in range(2):  # ROCm keeps listing it: it stays no holder
        reading = reader.read()
        assert [h.pid for h in reading.holders] == [worker]
        assert [(n.pid, n.used_bytes, n.why) for n in reading.gpus[0].not_holding] == [
            (gone, 3 * GIB, Listed.NO_PROCESS)]
        # Its VRAM is held by no holder: unattributed.
        assert balance(reading.gpus, reading.holders)[0].unattributed_bytes == 3 * GIB


def test_a_process_that_started_after_the_listing_is_not_attributed(
        trees: Trees, fake_amd: FakeAmdWorld) -> None:
    """Another start time than the listed one: the listing is dated (the reader's boot
    clock) before this process existed, so it names a process that held the pid before."""
    worker = trees.spawn(CHAIN).pid("worker")
    started = int(stat_fields(worker)["start_time"]) / os.sysconf("SC_CLK_TCK")  # type: ignore[call-overload]
    fake_amd.add_process(0, worker, 2 * GIB)
    listing = [started - 5.0]
    reader = AmdSmi(Counters(), boot=lambda: listing[0])
    try:
        reading = reader.read()
        assert reading.holders == ()
        assert [(n.pid, n.why) for n in reading.gpus[0].not_holding] == [
            (worker, Listed.PID_REUSED)]
        listing[0] = started + 60.0  # later reads remember the first listing
        assert reader.read().holders == ()
        assert reader.read().gpus[0].not_holding[0].why == Listed.PID_REUSED
    finally:
        reader.close()
    # A fresh reader, whose first listing comes after the process started: the holder.
    fresh = AmdSmi(Counters())
    try:
        assert [h.pid for h in fresh.read().holders] == [worker]
    finally:
        fresh.close()


def run_pid_reuse(world: FakeAmdWorld, lib: Path, *args: str) -> dict:
    """tests/support/amd_pid_reuse.py as PID 1 of a fresh PID namespace: its JSON line."""
    argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable,
            "-m", "tests.support.amd_pid_reuse", *args]
    if subprocess.run(argv[:5] + ["true"], capture_output=True, check=False).returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("unshare --pid is not permitted")
        pytest.skip("unshare --pid is not permitted here")
    done = subprocess.run(argv, cwd=REPO, env=world.subprocess_env(lib, child_env()),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_a_pid_reused_between_two_reads_is_never_a_holder(fake_amd: FakeAmdWorld,
                                                          fake_amdsmi_lib: Path) -> None:
    """Played for real in a fresh PID namespace (tests/support/amd_pid_reuse.py): the holder
    dies and a new process takes its pid (ns_last_pid), still listed by AMD SMI."""
    result = run_pid_reuse(fake_amd, fake_amdsmi_lib)
    assert result["taker"] == result["pid"], result  # the same number, another process
    assert result["before"] == [result["pid"]]
    assert result["after"] == [] and result["not_holding"] == [[result["pid"], "pid-reused"]]


# -- the KFD device: a listed pid is a holder only with /dev/kfd open ----------------------

#: CHAIN whose worker keeps KFD (the test's stand-in for /dev/kfd) open.
KFD_CHAIN = CHAIN.replace("--pidfile {dir}/worker", "--pidfile {dir}/worker --open KFD")


def kfd_device(tmp_path: Path) -> Path:
    """A regular file of the test's own standing for /dev/kfd (matched by its inode)."""
    path = tmp_path / "kfd"
    path.write_text("")
    return path


def kfd_holder(trees: Trees, kfd: Path, *, fds: int = 0) -> int:
    """A real worker with `kfd` open (after `fds` descriptors on /dev/null)."""
    script = KFD_CHAIN.replace("KFD", shlex.quote(str(kfd)))
    if fds:
        script = script.replace("--open", f"--fds {fds} --open")
    return trees.spawn(script).pid("worker")


def test_with_the_kfd_device_a_listed_pid_is_a_holder_only_if_it_has_it_open(
        trees: Trees, fake_amd: FakeAmdWorld, tmp_path: Path) -> None:
    kfd = kfd_device(tmp_path)
    rocm = kfd_holder(trees, kfd)
    other = trees.spawn(CHAIN).pid("worker")  # a live process at a listed pid, no KFD
    fake_amd.update_gpu(0, vram_used_mib=4 * 1024)
    fake_amd.add_process(0, rocm, 1 * GIB)
    fake_amd.add_process(0, other, 3 * GIB, name="stale")
    counters = Counters()
    reader = AmdSmi(counters, kfd_path=str(kfd))
    try:
        for read in range(2):
            reading = reader.read()
            assert [h.pid for h in reading.holders] == [rocm]
            assert [(n.pid, n.used_bytes, n.why) for n in reading.gpus[0].not_holding] == [
                (other, 3 * GIB, Listed.NO_KFD)]
            assert balance(reading.gpus, reading.holders)[0].unattributed_bytes == 3 * GIB
            cost = counters.snapshot()["amdsmi_kfd"]
            assert cost.calls == 2 * (read + 1)  # one look per listed live pid per read
            if read == 0:
                first_reads = cost.proc_reads
        # The second read looks at the holder's remembered descriptor first: one stat.
        assert cost.proc_reads - first_reads < first_reads
    finally:
        reader.close()
    # Without the device on this host, the first-sighting rules stand alone: both hold.
    plain = AmdSmi(Counters(), kfd_path=str(tmp_path / "no-kfd"))
    try:
        assert sorted(h.pid for h in plain.read().holders) == sorted([rocm, other])
    finally:
        plain.close()


def test_a_listed_pid_whose_files_cannot_all_be_looked_at_is_unverified(
        trees: Trees, fake_amd: FakeAmdWorld, tmp_path: Path) -> None:
    """More descriptors than one read looks at (MAX_FDS), the device past them: not known
    to hold it, so no holder (never reaped), and not known not to: a reset waits for it."""
    from gpuguard.gpu.amdsmi.kfd import MAX_FDS

    kfd = kfd_device(tmp_path)
    crowded = kfd_holder(trees, kfd, fds=MAX_FDS + 10)
    fake_amd.add_process(0, crowded, 2 * GIB)
    reader = AmdSmi(Counters(), kfd_path=str(kfd))
    try:
        reading = reader.read()
        assert reading.holders == ()
        assert [(n.pid, n.why) for n in reading.gpus[0].not_holding] == [
            (crowded, Listed.UNVERIFIED)]
    finally:
        reader.close()


def test_a_fresh_reader_does_not_take_a_reused_pid_for_the_listed_one(
        fake_amd: FakeAmdWorld, fake_amdsmi_lib: Path, tmp_path: Path) -> None:
    """The stale entry's pid taken by a process without the KFD device before a reader's
    first read (a restarted exporter, the remediator's first alert, a one-shot command):
    no sighting dates it, the device does. Played for real in a fresh PID namespace."""
    kfd = kfd_device(tmp_path)
    result = run_pid_reuse(fake_amd, fake_amdsmi_lib, "--kfd", str(kfd))
    assert result["taker"] == result["pid"] and result["before"] == [result["pid"]], result
    assert result["after"] == [] and result["not_holding"] == [[result["pid"], "pid-reused"]]
    assert result["fresh_holders"] == [], result
    assert result["fresh_not_holding"] == [[result["pid"], "no-kfd"]]


def test_busy_pids_come_from_the_gfx_engine_times_growth(trees: Trees, fake_amd: FakeAmdWorld,
                                                         reader) -> None:
    tree = trees.spawn(CHAIN)
    worker = tree.pid("worker")
    fake_amd.add_process(0, worker, GIB, gfx_ns=1_000)
    assert reader.read().gpus[0].busy_pids is None  # unknown on the first read, not idle
    assert reader.read().gpus[0].busy_pids == frozenset()
    fake_amd.set_gfx(0, worker, 5_000)
    assert reader.read().gpus[0].busy_pids == frozenset({worker})
    assert reader.read().gpus[0].busy_pids == frozenset()
    quiet = AmdSmi(Counters(), process_utilization=False)
    try:
        assert quiet.read().gpus[0].busy_pids is None and quiet.read().gpus[0].busy_pids is None
    finally:
        quiet.close()


def test_every_call_is_counted(fake_amd: FakeAmdWorld) -> None:
    counters = Counters()
    reader = AmdSmi(counters)
    try:
        reader.read()
    finally:
        reader.close()
    costs = counters.snapshot()
    assert costs["amdsmi_init"].calls == 2  # init, shut down
    assert costs["amdsmi_processes"].calls == 1 and costs["amdsmi_device"].calls >= 8
    assert MIB == 2**20
