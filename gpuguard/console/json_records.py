"""The JSON form of the core's records (a process, a GPU holder, NVML's reading, a GPU, a
live tree), shared by the subcommands' --json documents."""

from __future__ import annotations

from typing import Any

from gpuguard.engine.decision.tree import LiveTree
from gpuguard.engine.scan.scanner import owner
from gpuguard.gpu.reading import GpuReading, GpuSample
from gpuguard.orphans.process import Holder, ProcInfo


def member_json(info: ProcInfo) -> dict[str, Any]:
    return {
        "pid": info.pid,
        "ppid": info.ppid,
        "sid": info.sid,
        "pgid": info.pgid,
        "start_time": info.start_time,
        "state": info.state,
        "uid": info.uid,
        "user": owner(info),  # a uid's name, or the Windows account
        "comm": info.comm,
    }


def holder_json(holder: Holder) -> dict[str, Any]:
    return {
        "pid": holder.pid,
        "gpu": holder.gpu_index,
        "uuid": holder.gpu_uuid,
        "used_bytes": holder.used_bytes,
        "kind": holder.kind,
    }


def sm_busy(holder: Holder, reading: GpuReading) -> bool | None:
    """Whether NVML's samples in this read show the holder using an SM on that GPU (a
    first read gets every sample the driver still keeps); None when NVML cannot say."""
    gpu = next((g for g in reading.gpus if g.uuid == holder.gpu_uuid), None)
    if gpu is None or gpu.busy_pids is None:
        return None
    return holder.pid in gpu.busy_pids


def use_json(holder: Holder, reading: GpuReading, idle_seconds: float | None) -> dict[str, Any]:
    """The keys status and explain add to a holder: its SM use in this read, and how long
    it has gone without (counted from this command's first read; None: unknown)."""
    return {"sm_busy": sm_busy(holder, reading), "idle_seconds": idle_seconds}


def nvml_json(reading: GpuReading) -> dict[str, Any]:
    return {
        "up": reading.up,
        "driver_version": reading.driver_version,
        "errors": [{"stage": s, "message": m} for s, m in reading.errors],
        "backends": [{"name": b.name, "up": b.up, "detail": b.detail}
                     for b in reading.backends],
    }


def gpu_json(gpu: GpuSample) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "memory_total_bytes": gpu.memory_total_bytes,
        "memory_used_bytes": gpu.memory_used_bytes,
        "utilization_ratio": gpu.utilization_ratio,
        "temperature_celsius": gpu.temperature_celsius,
        "power_watts": gpu.power_watts,
        "vendor": gpu.vendor,
        "driver_version": gpu.driver_version,
    }


def live_json(live: LiveTree | None) -> dict[str, Any] | None:
    if live is None:
        return None
    return {
        "root": None if live.root is None else {
            "pid": live.root.pid, "start_time": live.root.start_time, "comm": live.root.comm,
            "user": live.root.user, "state": live.root.state},
        "tree_found": live.tree_found,
        "verdict": live.verdict or None,
        "reason": live.reason or None,
        "gpu_bytes": live.gpu_bytes,
        "nvml_error": live.nvml_error,
        "members": [{"pid": m.pid, "ppid": m.ppid, "start_time": m.start_time, "uid": m.uid,
                     "user": m.user, "comm": m.comm} for m in live.members],
    }
