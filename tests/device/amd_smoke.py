"""The real-AMD-SMI smoke check: run by hand on a host with an AMD GPU and ROCm's
libamd_smi.so (`.venv/bin/python tests/device/amd_smoke.py`, with gpuguard[amd]).

Not collected by pytest, and never run by CI (CI has no AMD GPU; the fake libamd_smi.so in
tests/support/fakeamdsmi/ stands in there). It prints what the library itself answers to
each call gpuguard makes, so that the fake's behaviour can be checked against it (VRAM in
MiB, the process list's pids, VRAM bytes and gfx nanoseconds, the N/A figures), then reads
through gpuguard's own back-end (the pids checked against /proc) and scrapes a real
gpuguard-exporter once. It never resets a GPU. Exit 0 when every check holds, 1 otherwise.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def answer(call: Callable[[], Any]) -> str:
    """What a call returned, or the AMD SMI error it raised (its code and text)."""
    try:
        return repr(call())
    except Exception as err:  # the wrapper's AmdSmiException family, or a ctypes error
        return f"{type(err).__name__} {getattr(err, 'err_code', '')} ({err})".replace("\n", " ")


def raw_library() -> None:
    from gpuguard.gpu.amdsmi.library import find_library, load

    print("library", find_library())
    amdsmi = load()
    amdsmi.amdsmi_init()
    try:
        for index, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
            print(f"GPU {index}", answer(lambda: amdsmi.amdsmi_get_gpu_device_uuid(h)))  # noqa: B023
            for name in ("amdsmi_get_gpu_asic_info", "amdsmi_get_gpu_device_bdf",
                         "amdsmi_get_gpu_driver_info", "amdsmi_get_gpu_vram_usage",
                         "amdsmi_get_gpu_activity", "amdsmi_get_power_info",
                         "amdsmi_get_gpu_process_list"):
                fn = getattr(amdsmi, name)
                print(f"  {name}", answer(lambda: fn(h)))  # noqa: B023
            for sensor in ("EDGE", "HOTSPOT"):
                print(f"  temperature {sensor}", answer(lambda: amdsmi.amdsmi_get_temp_metric(  # noqa: B023
                    h, getattr(amdsmi.AmdSmiTemperatureType, sensor),  # noqa: B023
                    amdsmi.AmdSmiTemperatureMetric.CURRENT)))
    finally:
        amdsmi.amdsmi_shut_down()


def through_gpuguard() -> None:
    from gpuguard.gpu.amdsmi import AmdSmiSource, amdsmi_privileges, amdsmi_probe

    check(amdsmi_probe() is None, f"the probe finds the back-end ({amdsmi_probe()})")
    for line in amdsmi_privileges():
        print("  privileges:", line)
    source = AmdSmiSource()
    try:
        first, second = source.read(), source.read()
    finally:
        source.close()
    check(first.up and not first.errors, f"gpuguard's read: ok, errors {first.errors}")
    check(bool(second.gpus), "at least one AMD GPU read")
    for gpu in second.gpus:
        print(f"  {gpu}")
        total = gpu.memory_total_bytes or 0
        check(total >= 2**30, f"GPU {gpu.index}: VRAM total {total} bytes (MiB read as MiB)")
        print(f"  GPU {gpu.index}: busy pids {gpu.busy_pids} (None: cannot say)")
        print(f"  GPU {gpu.index}: listed pids that are no holder {gpu.not_holding}")
    print("  holders", second.holders)
    for holder in second.holders:
        check(os.path.exists(f"/proc/{holder.pid}"), f"holder {holder.pid} is in /proc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exporter_scrape() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuguard.exporter",
                             "--web.listen-address", f"127.0.0.1:{port}",
                             "--scan-interval", "1", "--collector.amdsmi"])
    try:
        deadline, body = time.monotonic() + 30, ""
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=5) as r:
                    body = r.read().decode()
                if 'vendor="amd"' in body:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        for line in body.splitlines():
            if line.startswith(("gpuguard_gpu_info", "gpuguard_gpu_memory_used",
                                "gpuguard_gpu_process_", "gpuguard_gpu_backend",
                                "gpuguard_gpu_unseen", "gpuguard_scan_errors")):
                print("  " + line)
        check('gpuguard_gpu_backend_up{backend="amdsmi"} 1.0' in body,
              "the exporter reads AMD SMI")
        check('vendor="amd"' in body, "the exporter's GPU series carry vendor=\"amd\"")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> int:
    print("== the library's own answers")
    raw_library()
    print("== through gpuguard.gpu.amdsmi")
    through_gpuguard()
    print("== gpuguard-exporter, one scrape")
    exporter_scrape()
    print("FAILED: " + "; ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
