"""Several GPU back-ends on one host (gpuguard/gpu/vendors/): which run, and how their
readings combine. A wrong choice blinds the scan to a vendor's GPUs or pages on a back-end
nobody asked for; a wrong combination lets a reap go on while a back-end is down."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

import gpuguard.gpu.vendors as vendors
from gpuguard.base.counters import Counters
from gpuguard.console.checks.config import cmd_config_check
from gpuguard.gpu.drm import Drm, privilege_lines, probe
from gpuguard.gpu.reading import BackendState, GpuReading, GpuSample
from gpuguard.gpu.source import GpuSource
from gpuguard.gpu.vendors import BACKENDS, DRM, NVML, Backend, Choice, choose, vendor_source
from gpuguard.gpu.vendors.combined import Combined
from gpuguard.orphans.process import Holder
from tests.support.drmtree import DrmHost


def sample(index: int, uuid: str, vendor: str) -> GpuSample:
    return GpuSample(index=index, uuid=uuid, name=None, memory_total_bytes=None,
                     memory_used_bytes=None, utilization_ratio=None, temperature_celsius=None,
                     power_watts=None, vendor=vendor)


class Fixed:
    """A source that answers one reading (or raises), and says whether it was closed."""

    def __init__(self, reading: GpuReading | Exception) -> None:
        self.reading = reading
        self.closed = False

    def read(self) -> GpuReading:
        if isinstance(self.reading, Exception):
            raise self.reading
        return self.reading

    def close(self) -> None:
        self.closed = True


NV = GpuReading(True, "550.54", (sample(0, "GPU-a", "nvidia"),),
                (Holder(10, "GPU-a", 0, 1 << 30, "C"),), ())
AMD = GpuReading(True, "6.8.0", (sample(0, "amd-b", "amd"),),
                 (Holder(20, "amd-b", 0, 2 << 30, "C"),), ())
DOWN = GpuReading(False, None, (), (), (("init", "libamd_smi.so not found"),))


def backend(name: str, problem: str | None) -> Backend:
    def factory(counters: Counters, **_: object) -> GpuSource:
        raise AssertionError("choose() makes no source")
    return Backend(name, lambda: problem, factory)


def test_one_back_end_reads_as_before_with_its_state() -> None:
    reading = Combined([("nvml", Fixed(NV))]).read()
    assert reading == GpuReading(True, "550.54",
                                 (dataclasses.replace(NV.gpus[0], driver_version="550.54"),),
                                 NV.holders, (), (BackendState("nvml", True),))


def test_two_back_ends_list_both_vendors_with_their_drivers() -> None:
    reading = Combined([("nvml", Fixed(NV)), ("amdsmi", Fixed(AMD))]).read()
    assert reading.up and not reading.errors
    assert [(g.vendor, g.index, g.driver_version) for g in reading.gpus] == [
        ("nvidia", 0, "550.54"), ("amd", 0, "6.8.0")]
    assert [h.pid for h in reading.holders] == [10, 20]
    assert reading.backends == (BackendState("nvml", True), BackendState("amdsmi", True))


@pytest.mark.parametrize("failure", [DOWN, RuntimeError("library crashed")])
def test_one_back_end_down_makes_the_whole_reading_incomplete(
        failure: GpuReading | Exception) -> None:
    """A holder on the down back-end's GPUs could change a tree's verdict: a reap's check
    reads errors as incomplete (engine/scan/inspection.py, nvml_problem) and refuses."""
    reading = Combined([("nvml", Fixed(NV)), ("amdsmi", Fixed(failure))]).read()
    assert reading.up and reading.errors
    assert all(message.startswith("amdsmi: ") for _, message in reading.errors)
    assert reading.backends[1].name == "amdsmi" and not reading.backends[1].up
    assert reading.backends[1].detail


def test_all_back_ends_down_is_down() -> None:
    reading = Combined([("nvml", Fixed(DOWN)), ("amdsmi", Fixed(DOWN))]).read()
    assert not reading.up and reading.errors


def test_close_closes_every_part() -> None:
    parts = [Fixed(NV), Fixed(AMD)]
    Combined([("nvml", parts[0]), ("amdsmi", parts[1])]).close()
    assert all(p.closed for p in parts)


def test_a_back_end_runs_where_its_probe_finds_it() -> None:
    amd, drm = backend("amdsmi", None), backend("drm", "no /dev/dri/renderD*")
    choice = choose({}, backends=(NVML, amd, drm))
    assert drm not in choice.active and ("drm", "no /dev/dri/renderD*") in choice.inactive
    assert amd in choice.active


def test_nvml_alone_runs_even_without_its_library() -> None:
    """A host whose driver is not loaded yet reads NVML down (GPUGuardNVMLDown) and picks
    it up later, as before there were other back-ends."""
    missing = Backend("nvml", lambda: "libnvidia-ml.so.1 cannot be loaded", NVML.source,
                      NVML.drivers)
    alone = choose({}, backends=(missing, backend("amdsmi", "absent")))
    assert alone.active == (missing,)
    beside = choose({}, backends=(missing, backend("amdsmi", None)))
    assert [b.name for b in beside.active] == ["amdsmi"]
    assert beside.inactive[0][0] == "nvml"


def test_a_named_back_end_runs_even_if_its_probe_fails_and_off_means_off(
        caplog: pytest.LogCaptureFixture) -> None:
    amd = backend("amdsmi", "libamd_smi.so not found")
    with caplog.at_level(logging.INFO, logger="gpuguard.gpu"):
        choice = choose({"amdsmi": True, "nvml": False}, backends=(NVML, amd))
    assert choice.active == (amd,)  # it reads down: the metric and alert show it
    assert choice.inactive == (("nvml", "switched off (--no-collector.nvml)"),)
    assert "GPU back-end nvml not used: switched off" in caplog.text


REPO = Path(__file__).resolve().parents[2]


def _nothing(counters: Counters, **_: Any) -> Combined:
    return Combined([])


AMD_LIKE = Backend("amdsmi", lambda: None, _nothing, frozenset({"amdgpu"}))


def drm_of(choice: Choice) -> Drm:
    source = vendor_source(Counters(), choice=choice)
    assert isinstance(source, Combined)
    drm = dict(source.parts)["drm"]
    assert isinstance(drm, Drm)
    return drm


def test_the_drm_back_end_is_the_last_one() -> None:
    assert BACKENDS[0] is NVML and BACKENDS[-1] is DRM


def test_drm_leaves_the_other_active_back_ends_drivers_to_them() -> None:
    beside = drm_of(Choice((NVML, AMD_LIKE, DRM), ()))
    assert beside.skipped("nvidia") and beside.skipped("nvidia-drm")
    assert beside.skipped("amdgpu") and not beside.skipped("xe")
    alone = drm_of(Choice((DRM,), ()))  # no ROCm: amdgpu's GPUs are DRM's to read
    assert not alone.skipped("amdgpu") and not alone.skipped("nvidia")


def test_config_check_warns_of_each_lack_of_a_back_end_that_would_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    host = DrmHost(tmp_path)
    here = Backend("drm", lambda: probe(str(host.dev)), DRM.source,
                   privileges=lambda: privilege_lines(0))
    monkeypatch.setattr(vendors, "BACKENDS", (NVML, here))
    args = argparse.Namespace(file=str(REPO / "deploy/systemd/gpuguard.yml"),
                              web_config_file=None)
    assert cmd_config_check(args) == 0
    assert "warning: drm" not in capsys.readouterr().out  # no render node: not run here
    host.gpu("0000:00:02.0", "i915", card=0, render=128)
    assert cmd_config_check(args) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "drm:" in line]
    assert warnings == ["warning: drm: cannot read other users' /proc/PID/fd and fdinfo "
                        "(missing CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH): their DRM clients "
                        "(Intel, AMD without ROCm) are not seen; run as root or with the "
                        "capabilities of deploy/systemd/"]


def test_drm_does_not_run_where_every_render_node_is_another_back_ends(tmp_path: Path) -> None:
    """An NVIDIA host whose BMC has a display chip (ast: card0, no render node): nvidia-drm's
    render node is NVML's, so the DRM back-end is not chosen and searches no /proc. It
    runs where NVML does not, or where a render node is no other back-end's."""
    host = DrmHost(tmp_path)
    host.gpu("0000:02:00.0", "ast", card=0, render=None)
    host.gpu("0000:3b:00.0", "nvidia", card=1, render=128)
    nvml = Backend("nvml", lambda: None, _nothing, frozenset({"nvidia"}))
    drm = Backend("drm", lambda: probe(str(host.dev), str(host.sys)), DRM.source,
                  probe_beside=lambda others: probe(str(host.dev), str(host.sys), others))
    choice = choose({}, backends=(nvml, drm))
    assert choice.active == (nvml,)
    assert choice.inactive == (("drm", "every render node is read by another back-end "
                                       "(nvidia)"),)
    assert choose({"nvml": False}, backends=(nvml, drm)).active == (drm,)
    assert choose({"drm": True}, backends=(nvml, drm)).active == (nvml, drm)
    host.gpu("0000:00:02.0", "i915", card=2, render=129)
    assert choose({}, backends=(nvml, drm)).active == (nvml, drm)
    assert DRM.probe_beside is not None
