"""The real-NVML smoke check: run by hand (`make smoke`) on a host with an NVIDIA GPU.

Not collected by pytest, and never run by CI (CI has no GPU; the fake NVML in
tests/support/fakenvml/ stands in there). It prints what the driver itself answers to
each call gpuguard makes, so that the fake's behaviour can be checked against it: the
identity reads (minor number, PCI bus id), the memory and process lists, and both
per-process utilization calls (R550's nvmlDeviceGetProcessesUtilizationInfo and the
legacy nvmlDeviceGetProcessUtilization), then reads through gpuguard's own wrapper and
scrapes a real gpuguard-exporter once. Exit 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pynvml

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def answer(call: Callable[[], Any]) -> str:
    """What a call returned, or the NVML error it raised (its code and text)."""
    try:
        return repr(call())
    except pynvml.NVMLError as err:
        return f"NVMLError {err.value} ({err})"


def device_report(index: int, handle: Any) -> None:
    print(f"GPU {index}", pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetName(handle))
    print("  minor number", answer(lambda: pynvml.nvmlDeviceGetMinorNumber(handle)))
    print("  pci busId", answer(lambda: pynvml.nvmlDeviceGetPciInfo(handle).busId))
    print("  memory v2", answer(lambda: pynvml.nvmlDeviceGetMemoryInfo(
        handle, version=pynvml.nvmlMemory_v2)))
    print("  compute v3", answer(lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle)))
    print("  MIG mode", answer(lambda: pynvml.nvmlDeviceGetMigMode(handle)))
    for name in ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization"):
        fn = getattr(pynvml, name)
        print(f"  {name}(0)", answer(lambda: [(s.pid, s.timeStamp, s.smUtil)
                                              for s in fn(handle, 0)]))  # noqa: B023


def raw_driver() -> None:
    pynvml.nvmlInit()
    try:
        print("driver", pynvml.nvmlSystemGetDriverVersion(), "NVML",
              answer(pynvml.nvmlSystemGetNVMLVersion))
        for index in range(pynvml.nvmlDeviceGetCount()):
            device_report(index, pynvml.nvmlDeviceGetHandleByIndex(index))
    finally:
        pynvml.nvmlShutdown()


def through_gpuguard() -> None:
    from gpuguard.gpu.nvml import Nvml

    nvml = Nvml()
    try:
        first, second = nvml.read(), nvml.read()
    finally:
        nvml.close()
    check(first.up and not first.errors, f"gpuguard's read: ok, errors {first.errors}")
    for gpu in second.gpus:
        print(f"  {gpu}")
        check(bool(gpu.device and re.fullmatch(r"nvidia\d+", gpu.device)),
              f"GPU {gpu.index}: device label {gpu.device!r}")
        check(bool(gpu.pci_bus_id and re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]",
                                                   gpu.pci_bus_id)),
              f"GPU {gpu.index}: pci_bus_id {gpu.pci_bus_id!r} in dcgm-exporter's format")
        print(f"  GPU {gpu.index}: busy pids {gpu.busy_pids} (None: NVML cannot say)")
    print("  holders", second.holders)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exporter_scrape() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.exporter",
                             "--web.listen-address", f"127.0.0.1:{port}",
                             "--scan-interval", "1"])
    try:
        deadline, body = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2):
                    pass
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=5) as r:
                    body = r.read().decode()
                break
            except OSError:
                time.sleep(0.2)
        for line in body.splitlines():
            if line.startswith(("gpuguard_gpu_info", "gpuguard_gpu_memory_used",
                                "gpuguard_gpu_process_", "gpuguard_scan_errors",
                                "gpuguard_build_info")):
                print("  " + line)
        check('device="nvidia' in body, "the exporter's gpuguard_gpu_info carries device")
        check("pci_bus_id=" in body, "the exporter's gpuguard_gpu_info carries pci_bus_id")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> int:
    print("== the driver's own answers")
    raw_driver()
    print("== through gpuguard.gpu.nvml")
    through_gpuguard()
    print("== gpuguard-exporter, one scrape")
    exporter_scrape()
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
