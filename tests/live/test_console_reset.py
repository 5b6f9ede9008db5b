"""`gpuguard reset GPU` as a person runs it: the console as a process over the fake
libamd_smi.so (whose amdsmi_reset_gpu logs each call) and the fake NVML, real processes as
the holders, the audit log on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.fakeamdsmi import AMDSMI_STATUS_NO_PERM, FakeAmdWorld
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, alive
from tests.support.remediator_harness import write_config
from tests.support.servers import REPO, child_env

GIB = 2**30
Run = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def amd_console(fake_amd: FakeAmdWorld, fake_amdsmi_lib: Path, tmp_path: Path) -> Run:
    """`python -m gpuguard.console ARGS` on a host whose only GPU library is the fake AMD
    SMI; `env` for another host."""
    default = fake_amd.subprocess_env(fake_amdsmi_lib, child_env(NO_COLOR="1"))

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpuguard.console", *args], cwd=REPO,
                              env=env or default, capture_output=True, text=True, timeout=60)

    return run


def audit_records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not alive(proc.pid)
    return proc.pid


def test_reset_refuses_while_a_process_holds_the_gpu(tmp_path: Path, trees: Trees,
                                                     fake_amd: FakeAmdWorld,
                                                     amd_console: Run) -> None:
    worker = trees.spawn(CHAIN).pid("worker")
    fake_amd.add_process(0, worker, 2 * GIB)
    config = write_config(tmp_path)
    done = amd_console("reset", "amd:0", "--apply", "--config", str(config))
    assert done.returncode == 6, done.stderr
    (line,) = done.stderr.strip().splitlines()  # one clear line
    assert line == (f"gpuguard: refusing to reset GPU amd:0 ({fake_amd.gpus[0].uuid}): "
                    f"pid(s) {worker} hold it")
    assert fake_amd.resets() == [] and audit_records(tmp_path) == []
    doc = json.loads(amd_console("reset", "0", "--json").stdout)
    assert (doc["schema"], doc["outcome"], doc["holders"], doc["exit_code"]) == (
        "gpuguard.reset/v1", "refused", [worker], 6)


def test_reset_refuses_a_reading_that_cannot_show_the_gpu_free(
        tmp_path: Path, fake_amd: FakeAmdWorld, amd_console: Run) -> None:
    fake_amd.set_field_error(0, "processes", AMDSMI_STATUS_NO_PERM)
    done = amd_console("reset", "0", "--apply", "--config", str(write_config(tmp_path)))
    assert done.returncode == 6 and "incomplete" in done.stderr, done.stderr
    assert fake_amd.resets() == []


def test_a_dry_run_resets_nothing_and_writes_nothing(tmp_path: Path, fake_amd: FakeAmdWorld,
                                                     amd_console: Run) -> None:
    done = amd_console("reset", fake_amd.gpus[0].uuid, "--config", str(write_config(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("dry run: GPU amd:0")
    assert fake_amd.resets() == [] and audit_records(tmp_path) == []


@pytest.mark.initial_pidns  # a listed pid with no process waits for nothing only where
# /proc shows every pid: in a child PID namespace the reset refuses it (fail closed)
def test_apply_resets_a_gpu_nothing_holds_after_its_audit_record(
        tmp_path: Path, fake_amd: FakeAmdWorld, amd_console: Run) -> None:
    # ROCm's stale entry: a pid with no process is no holder, and no reason to wait.
    gone = dead_pid()
    fake_amd.add_process(0, gone, 3 * GIB, name="ghost")
    config = write_config(tmp_path)
    done = amd_console("reset", "amd:0", "--apply", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["outcome"] == "reset" and doc["not_holding"] == [
        {"pid": gone, "why": "no-process", "used_bytes": 3 * GIB}]
    assert fake_amd.resets() == [fake_amd.gpus[0].uuid]
    intent, final = audit_records(tmp_path)
    assert (intent["phase"], intent["event"], intent["outcome"]) == ("intent", "gpu-reset", None)
    assert (final["phase"], final["outcome"]) == ("final", "reset")
    assert intent["reset_id"] == final["reset_id"] and intent["ts"] <= final["ts"]
    assert intent["gpu"]["uuid"] == fake_amd.gpus[0].uuid and "key" not in intent


def test_no_audit_record_no_reset(tmp_path: Path, fake_amd: FakeAmdWorld,
                                  amd_console: Run) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the audit log's folder should be")
    config = write_config(tmp_path, audit_log=str(blocked / "audit.jsonl"))
    done = amd_console("reset", "0", "--apply", "--config", str(config))
    assert done.returncode == 6 and "no audit record" in done.stderr, done.stderr
    assert fake_amd.resets() == []


def test_an_nvidia_gpu_has_no_reset_call(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                                         amd_console: Run) -> None:
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env(NO_COLOR="1"))
    env.pop("ROCM_PATH", None)
    done = amd_console("reset", "0", env=env)
    assert done.returncode == 6
    (line,) = done.stderr.strip().splitlines()
    assert "NVML has no reset call" in line and "gpuguardgpurecoveryaction.md" in line
    assert "nvidia-smi -r" in line


def test_an_index_two_vendors_share_needs_the_vendor(
        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, fake_amd: FakeAmdWorld,
        fake_amdsmi_lib: Path, amd_console: Run) -> None:
    env = fake_gpu.subprocess_env(fake_nvml_lib, fake_amd.subprocess_env(
        fake_amdsmi_lib, child_env(NO_COLOR="1")))
    done = amd_console("reset", "0", env=env)
    assert done.returncode == 2
    assert "ambiguous" in done.stderr and "nvidia:0" in done.stderr and "amd:0" in done.stderr
    assert amd_console("reset", "amd:0", env=env).returncode == 0
    assert amd_console("reset", "nvidia:0", env=env).returncode == 6
