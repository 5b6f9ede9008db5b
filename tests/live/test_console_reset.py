"""`gpuguard reset GPU` as a person runs it: the console as a process over the fake
libamd_smi.so (whose amdsmi_reset_gpu logs each call) and the fake NVML, real processes as
the holders, the audit log on disk. Where the reset gets as far as the look at who has the
GPU's device files open, the command runs in this process (cmd_reset, parsed by the real
parser), pointed at a sysfs and /dev of the test's own whose "device nodes" are files that
real processes hold open."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuguard.base.counters import Counters
from gpuguard.console.cli import build_parser
from gpuguard.console.contract import Failure
from gpuguard.console.reset import cmd_reset
from gpuguard.console.reset.devices import Places
from gpuguard.gpu.amdsmi import AmdSmiSource
from gpuguard.gpu.vendors.combined import Combined
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


@dataclass
class Host:
    """A sysfs and /dev of the test's own: each fake AMD GPU's DRM nodes (card<I>,
    renderD<128+I>, regular files) under sys/bus/pci/devices/<its PCI address>/drm, and a
    /dev/kfd stand-in where `kfd` is asked for."""

    places: Places
    dev: Path

    def node(self, name: str) -> Path:
        return self.dev / "dri" / name


def fake_host(tmp_path: Path, world: FakeAmdWorld, *, kfd: bool = True,
              max_seconds: float = 10.0) -> Host:
    sys_root, dev = tmp_path / "sys", tmp_path / "dev"
    (dev / "dri").mkdir(parents=True)
    for gpu in world.gpus.values():
        for name in (f"card{gpu.index}", f"renderD{128 + gpu.index}"):
            (sys_root / "bus/pci/devices" / gpu.pci_bus_id / "drm" / name).mkdir(parents=True)
            (dev / "dri" / name).write_text("")
    if kfd:
        (dev / "kfd").write_text("")
    return Host(Places(sys_root=str(sys_root), dev_root=str(dev), kfd=str(dev / "kfd"),
                       max_seconds=max_seconds), dev)


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def reset_here(capsys: pytest.CaptureFixture[str], host: Host, *argv: str) -> Done:
    """`gpuguard reset ARGV` in this process, over the fake AMD SMI, on `host`."""
    args = build_parser().parse_args(["reset", *argv])
    source = Combined([("amdsmi", AmdSmiSource(Counters(), kfd_path=host.places.kfd))])
    try:
        code = cmd_reset(args, source=source, places=host.places)
    except Failure as failure:
        print(f"gpuguard: {failure.message}", file=sys.stderr)
        code = failure.code
    out = capsys.readouterr()
    return Done(code, out.out, out.err)


def opening(trees: Trees, *paths: Path, fds: int = 0) -> int:
    """A real worker (holder.py under sh) that keeps `paths` open, after `fds` others."""
    extra = f"--fds {fds} " if fds else ""
    opens = " ".join(f"--open {shlex.quote(str(p))}" for p in paths)
    return trees.spawn(CHAIN.replace("--pidfile {dir}/worker",
                                     f"--pidfile {{dir}}/worker {extra}{opens}")).pid("worker")


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


@pytest.mark.initial_pidns  # the look at the device files must see every process
def test_a_dry_run_resets_nothing_and_writes_nothing(
        tmp_path: Path, fake_amd: FakeAmdWorld, capsys: pytest.CaptureFixture[str]) -> None:
    host = fake_host(tmp_path, fake_amd)
    done = reset_here(capsys, host, fake_amd.gpus[0].uuid, "--config",
                      str(write_config(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("dry run: GPU amd:0")
    assert fake_amd.resets() == [] and audit_records(tmp_path) == []


@pytest.mark.initial_pidns  # a listed pid with no process waits for nothing only where
# /proc shows every pid: in a child PID namespace the reset refuses it (fail closed)
def test_apply_resets_a_gpu_nothing_holds_after_its_audit_record(
        tmp_path: Path, trees: Trees, fake_amd: FakeAmdWorld,
        capsys: pytest.CaptureFixture[str]) -> None:
    # ROCm's stale entries: a pid with no process, and one whose process has no KFD device
    # open (its pid reused), are no holders, and no reason to wait.
    gone = dead_pid()
    fake_amd.add_process(0, gone, 3 * GIB, name="ghost")
    taken = trees.spawn(CHAIN).pid("worker")
    fake_amd.add_process(0, taken, GIB, name="stale")
    config = write_config(tmp_path)
    done = reset_here(capsys, fake_host(tmp_path, fake_amd), "amd:0", "--apply", "--config",
                      str(config), "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["outcome"] == "reset" and doc["blockers"] == []
    assert sorted(doc["not_holding"], key=lambda n: n["why"]) == [
        {"pid": taken, "why": "no-kfd", "used_bytes": GIB},
        {"pid": gone, "why": "no-process", "used_bytes": 3 * GIB}]
    assert fake_amd.resets() == [fake_amd.gpus[0].uuid]
    intent, final = audit_records(tmp_path)
    assert (intent["phase"], intent["event"], intent["outcome"]) == ("intent", "gpu-reset", None)
    assert (final["phase"], final["outcome"]) == ("final", "reset")
    assert intent["reset_id"] == final["reset_id"] and intent["ts"] <= final["ts"]
    assert intent["gpu"]["uuid"] == fake_amd.gpus[0].uuid and "key" not in intent


@pytest.mark.initial_pidns  # the look at the device files must see every process
def test_no_audit_record_no_reset(tmp_path: Path, fake_amd: FakeAmdWorld,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the audit log's folder should be")
    config = write_config(tmp_path, audit_log=str(blocked / "audit.jsonl"))
    done = reset_here(capsys, fake_host(tmp_path, fake_amd), "0", "--apply", "--config",
                      str(config))
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
    # Past the choice of GPU: on to the look at its device files, which this host lacks
    # (or, in a child PID namespace, which cannot see every process): refused either way.
    named = amd_console("reset", "amd:0", env=env)
    assert named.returncode == 6 and "refusing to reset GPU amd:0" in named.stderr
    assert ("its DRM nodes cannot be listed" in named.stderr
            or "cannot see every process" in named.stderr), named.stderr
    assert "no reset call" in amd_console("reset", "nvidia:0", env=env).stderr


# -- what no back-end lists: the GPU's device files, and the rest of its hive -------------


@pytest.mark.initial_pidns  # the look at the device files must see every process
def test_reset_refuses_while_a_process_no_back_end_lists_has_the_gpus_drm_node_open(
        tmp_path: Path, trees: Trees, fake_amd: FakeAmdWorld,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A graphics or VA-API client holds the render node without KFD: AMD SMI lists no one,
    the look over /proc/*/fd finds it. A client of another GPU's node is no blocker."""
    fake_amd.add_gpu(1)
    host = fake_host(tmp_path, fake_amd)
    client = opening(trees, host.node("renderD128"))
    opening(trees, host.node("renderD129"))  # GPU 1's: not this GPU's node
    done = reset_here(capsys, host, "amd:0", "--apply", "--config",
                      str(write_config(tmp_path)))
    assert done.returncode == 6, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.endswith(f": pid(s) {client} ({host.node('renderD128')}) have its device "
                         "files open"), line
    assert fake_amd.resets() == [] and audit_records(tmp_path) == []
    doc = json.loads(reset_here(capsys, host, "amd:0", "--json").stdout)
    assert (doc["outcome"], doc["holders"], doc["blockers"]) == ("refused", [], [
        {"pid": client, "why": "device-open", "gpu": None,
         "device": str(host.node("renderD128"))}])


@pytest.mark.initial_pidns
def test_reset_refuses_while_an_unlisted_process_has_the_kfd_device_open(
        tmp_path: Path, trees: Trees, fake_amd: FakeAmdWorld,
        capsys: pytest.CaptureFixture[str]) -> None:
    host = fake_host(tmp_path, fake_amd)
    rocm = opening(trees, host.dev / "kfd")
    done = reset_here(capsys, host, "amd:0", "--json")
    doc = json.loads(done.stdout)
    assert (done.returncode, doc["outcome"]) == (6, "refused"), done
    assert doc["blockers"] == [{"pid": rocm, "why": "device-open", "gpu": None,
                                "device": str(host.dev / "kfd")}]


def test_reset_refuses_while_another_gpu_of_its_vendor_is_held(
        tmp_path: Path, trees: Trees, fake_amd: FakeAmdWorld,
        capsys: pytest.CaptureFixture[str]) -> None:
    """amdgpu resets every GPU of an XGMI hive, and the hive is not known: every AMD GPU
    must be free. Refused before any look at the device files."""
    fake_amd.add_gpu(1)
    host = fake_host(tmp_path, fake_amd, kfd=False)
    worker = trees.spawn(CHAIN).pid("worker")
    fake_amd.add_process(1, worker, 2 * GIB)
    done = reset_here(capsys, host, "amd:0", "--json")
    doc = json.loads(done.stdout)
    assert (done.returncode, doc["outcome"], doc["holders"]) == (6, "refused", [])
    assert doc["why"] == (f"GPU amd:1 ({fake_amd.gpus[1].uuid}), which a reset may take with "
                          f"it (its hive): pid(s) {worker} hold it")
    assert doc["blockers"] == [{"pid": worker, "why": "holder", "gpu": "amd:1",
                                "device": None}]
    assert fake_amd.resets() == []


def test_reset_refuses_a_listed_pid_that_cannot_be_verified(
        tmp_path: Path, trees: Trees, fake_amd: FakeAmdWorld,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A listed process with more descriptors than a read looks at, the KFD device past
    them: no holder, and not shown to hold nothing either."""
    from gpuguard.gpu.amdsmi.kfd import MAX_FDS

    host = fake_host(tmp_path, fake_amd)
    crowded = opening(trees, host.dev / "kfd", fds=MAX_FDS + 10)
    fake_amd.add_process(0, crowded, 2 * GIB)
    done = reset_here(capsys, host, "amd:0", "--apply", "--json", "--config",
                      str(write_config(tmp_path)))
    doc = json.loads(done.stdout)
    assert (done.returncode, doc["outcome"], doc["holders"]) == (6, "refused", [])
    assert doc["why"].startswith(f"pid(s) {crowded} are listed on it and their open files "
                                 "could not all be looked at"), doc["why"]
    assert doc["blockers"] == [{"pid": crowded, "why": "unverified", "gpu": "amd:0",
                                "device": None}]
    assert fake_amd.resets() == [] and audit_records(tmp_path) == []


@pytest.mark.initial_pidns
def test_reset_refuses_when_the_look_cannot_finish_or_the_nodes_cannot_be_known(
        tmp_path: Path, fake_amd: FakeAmdWorld, capsys: pytest.CaptureFixture[str]) -> None:
    slow = fake_host(tmp_path / "slow", fake_amd, max_seconds=0.0)
    done = reset_here(capsys, slow, "amd:0")
    assert done.returncode == 6 and "did not finish within 0 s" in done.stderr, done.stderr
    bare = fake_host(tmp_path / "bare", fake_amd)
    (Path(bare.places.sys_root) / "bus/pci/devices").rename(tmp_path / "elsewhere")
    done = reset_here(capsys, bare, "amd:0")
    assert done.returncode == 6 and "its DRM nodes cannot be listed" in done.stderr
    gone = fake_host(tmp_path / "gone", fake_amd)
    gone.node("card0").unlink()
    done = reset_here(capsys, gone, "amd:0")
    assert done.returncode == 6 and f"{gone.node('card0')} does not exist" in done.stderr
    assert fake_amd.resets() == []
