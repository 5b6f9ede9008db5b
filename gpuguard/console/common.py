"""What several subcommands share: the config, JSON pieces, classify()'s walk, Alertmanager."""

from __future__ import annotations

import getpass
import os
import time
from typing import Any

from gpuguard.config import Config, ConfigError, load_config
from gpuguard.console.contract import EXIT_USAGE, Failure
from gpuguard.exporter.scanner import Snapshot, user_name
from gpuguard.host.nvml import GpuSample, NvmlReading
from gpuguard.orphans.classify import ORPHAN, HolderVerdict, Tree
from gpuguard.orphans.process import Holder, ProcInfo
from gpuguard.remediator.alertmanager import (
    FIRING,
    INHIBITED,
    NOT_FIRING,
    SILENCED,
    UNREACHABLE,
    AlertmanagerClient,
)
from gpuguard.remediator.policy import LiveTree


def load(path: str | None) -> Config:
    """The config file, or the built-in defaults; a bad file is exit 2 with one line."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise Failure(EXIT_USAGE, f"config error: {exc}") from None


def operator() -> str:
    """Who asked: the sudo caller when there is one, else the login name."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


# -- JSON pieces ------------------------------------------------------------------------------


def member_json(info: ProcInfo) -> dict[str, Any]:
    return {
        "pid": info.pid,
        "ppid": info.ppid,
        "sid": info.sid,
        "pgid": info.pgid,
        "start_time": info.start_time,
        "state": info.state,
        "uid": info.uid,
        "user": user_name(info.uid),
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


def nvml_json(reading: NvmlReading) -> dict[str, Any]:
    return {
        "up": reading.up,
        "driver_version": reading.driver_version,
        "errors": [{"stage": s, "message": m} for s, m in reading.errors],
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


# -- what classify() walked -------------------------------------------------------------------


def upto_root(hv: HolderVerdict) -> tuple[ProcInfo, ...]:
    """The chain from the holder up to and including its root (not the adopter above)."""
    if hv.root is None or hv.root not in hv.chain:
        return hv.chain
    return hv.chain[: hv.chain.index(hv.root) + 1]


def tree_members(tree: Tree) -> list[ProcInfo]:
    """Every process classify() walked for this tree, holder up to root; root first."""
    seen: dict[int, ProcInfo] = {}
    for hv in tree.holder_verdicts:
        for info in upto_root(hv):
            seen.setdefault(info.pid, info)
    members = list(seen.values())
    members.sort(key=lambda m: (m.pid != tree.root_pid, m.start_time, m.pid))
    return members


def chain_roles(hv: HolderVerdict) -> list[tuple[str, ProcInfo]]:
    """Each chain member with its role: holder, ancestor, root, above-root."""
    root_pid = hv.root.pid if hv.root is not None else None
    out: list[tuple[str, ProcInfo]] = []
    above = False
    for i, info in enumerate(hv.chain):
        if above:
            role = "above-root"
        elif info.pid == root_pid:
            role = "holder,root" if i == 0 else "root"
            above = True
        else:
            role = "holder" if i == 0 else "ancestor"
        out.append((role, info))
    return out



_TICKS = os.sysconf("SC_CLK_TCK")


def process_age(start_time: int | None) -> float | None:
    """Age from stat's start_time (ticks since boot) and CLOCK_BOOTTIME: no /proc read."""
    if start_time is None:
        return None
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_time / _TICKS)



# -- Alertmanager's word ----------------------------------------------------------------------


def alert_state(config: Config, hostname: str, root_pid: int,
                root_start_time: int) -> dict[str, Any] | None:
    """Alertmanager's view of this tree's alert (None when remediate.alertmanager is unset).

    Every alertname in remediate.alerts is asked; the answer that most constrains a
    reap is kept: silenced, then unreachable, then inhibited, firing, not-firing.
    """
    if config.remediate.alertmanager is None:
        return None
    client = AlertmanagerClient(config.remediate.alertmanager)
    answers = [(name, client.confirm(alertname=name, hostname=hostname, root_pid=root_pid,
                                     root_start_time=root_start_time))
               for name in config.remediate.alerts]
    # A question that got no answer may be the one whose alert is silenced: it ranks
    # right after a silence, above every answer that would let a reap go on.
    rank = {SILENCED: 0, UNREACHABLE: 1, INHIBITED: 2, FIRING: 3, NOT_FIRING: 4}
    name, answer = min(answers, key=lambda a: rank.get(a[1].state, 5))
    return {"alertname": name, **answer.to_json()}


def alert_line(alert: dict[str, Any]) -> str:
    if alert["state"] == SILENCED:
        creators = ", ".join(alert["silence_creators"]) or "unknown"
        return (f"{alert['alertname']} silenced by {', '.join(alert['silenced_by'])} "
                f"(created by {creators}): the remediator will not reap it")
    return f"{alert['alertname']} {alert['state']}: {alert['detail']}"


def orphan_alerts(config: Config, hostname: str, snap: Snapshot) -> dict[int, dict[str, Any]]:
    """Alertmanager's state for each orphan tree's alert; {} when not configured."""
    out: dict[int, dict[str, Any]] = {}
    for tree in snap.trees:
        if tree.verdict == ORPHAN and tree.root is not None:
            state = alert_state(config, hostname, tree.root.pid, tree.root.start_time)
            if state is not None:
                out[tree.root_pid] = state
    return out
