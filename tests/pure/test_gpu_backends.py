"""The GPU back-ends' chooser (gpuguard/gpu/vendors/): the DRM back-end comes last and is
made beside the other active back-ends, leaving their drivers' GPUs to them (amdgpu's to
AMD SMI where that runs, nvidia's to NVML always); and `gpuguard config check` prints what
this process lacks for each back-end that would run here."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

import gpuguard.gpu.vendors as vendors
from gpuguard.base.counters import Counters
from gpuguard.console.checks.config import cmd_config_check
from gpuguard.gpu.drm import Drm, privilege_lines, probe
from gpuguard.gpu.vendors import BACKENDS, DRM, NVML, Backend, Choice, vendor_source
from gpuguard.gpu.vendors.combined import Combined
from tests.support.drmtree import DrmHost

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
