"""A prometheus_client Collector over the scanner's latest Snapshot.

Fresh metric families on every collect(): a tree that is gone leaves no stale
series behind. No label carries a full command line (secrets live there).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuguard.base.build import version
from gpuguard.base.counters import Counters
from gpuguard.engine.reading_metrics import event_metrics, foreign_marks_metric, inspector_metrics
from gpuguard.engine.scan.attribution import NONE as NO_CONTAINER
from gpuguard.engine.scan.scanner import Scanner, Snapshot
from gpuguard.gpu.reading import GpuReading
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.orphans.vocabulary import Verdict

#: Every per-GPU series (each series that names a GPU, per-process ones too), in
#: dcgm-exporter's label names: gpu (the index), UUID, and the host as dcgm-exporter before
#: 4.5.3-4.8.2's rename spelled it (Hostname, which older dcgm-exporters' joins use; the
#: alert contract's `hostname` stays on gpuguard_host_info alone: docs/metrics.md, Labels).
GPU_LABELS = ["gpu", "UUID", "Hostname", "vendor"]
#: gpuguard_gpu_info's identity labels, in dcgm-exporter's names and order.
INFO_LABELS = [*GPU_LABELS, "pci_bus_id", "device", "modelName"]
TREE_LABELS = ["root_pid", "root_start_time", "comm", "user", "reason"]


class GpuguardCollector(Collector):
    def __init__(self, scanner: Scanner, *, hostname: str | None = None,
                 counters: Counters | None = None, events: ProcessEvents | None = None,
                 gpu: bool = True, processes: bool = True,
                 registrar: Callable[[], str | None] | None = None,
                 inactive_backends: tuple[tuple[str, str], ...] = ()) -> None:
        self.scanner = scanner
        #: The GPU back-ends that do not run here, and why (gpuguard/gpu/vendors/, choose).
        self.inactive_backends = inactive_backends
        #: The registrar's health (Registrar.health), where this exporter serves one.
        self.registrar = registrar
        #: node_exporter-style switches: the GPU gauges (which dcgm-exporter also exports)
        #: and the per-process series (pid and start_time labels: one series per process).
        self.gpu = gpu
        self.processes = processes
        self.hostname = hostname or socket.gethostname()
        self.counters = counters if counters is not None else scanner.counters
        self.events = events

    def describe(self) -> Iterator[Metric]:
        """Every family this collector can yield, without samples: a registry needs the
        names up front to answer `/metrics?name[]=...` (and to catch name clashes)."""
        empty = Snapshot(taken_at=0.0, duration_seconds=0.0,
                         reading=GpuReading(False, None, (), (), ()), trees=())
        for family in self._families(empty):
            family.samples = []
            yield family

    def collect(self) -> Iterator[Metric]:
        return self._families(self.scanner.latest)

    def _families(self, snap: Snapshot | None) -> Iterator[Metric]:
        host = GaugeMetricFamily("gpuguard_host_info", "This host; join on instance for hostname.",
                                 labels=["hostname", "version"])
        host.add_metric([self.hostname, version()], 1)
        yield host
        if snap is not None:
            yield from self._gpu_metrics(snap)
            yield from self._tree_metrics(snap)
            yield from self._accounting_metrics(snap)
            yield GaugeMetricFamily("gpuguard_scan_duration_seconds",
                                    "Wall time of the last completed scan.",
                                    value=snap.duration_seconds)
            yield GaugeMetricFamily("gpuguard_last_scan_timestamp_seconds",
                                    "Unix time the last scan completed.", value=snap.taken_at)
        yield from self._counter_metrics()

    def _gpu(self, index: int, uuid: str, reading: GpuReading) -> list[str]:
        """GPU_LABELS' values for one GPU of this host (its vendor as `reading` names it)."""
        vendor = next((g.vendor for g in reading.gpus if g.uuid == uuid), "")
        return [str(index), uuid, self.hostname, vendor]

    def _backend_metrics(self, reading: GpuReading) -> Iterator[Metric]:
        """Each GPU back-end's state: up per active one (gpuguard_nvml_up for NVML's, kept
        from before there were others), and why each other one does not run."""
        nvml = [b.up for b in reading.backends if b.name == "nvml"]
        if nvml or not reading.backends:  # no back-end list: a single NVML reading
            yield GaugeMetricFamily("gpuguard_nvml_up",
                                    "1 when the last scan could talk to NVML, else 0.",
                                    value=1 if (nvml[0] if nvml else reading.up) else 0)
        up = GaugeMetricFamily("gpuguard_gpu_backend_up",
                               "1 when the last scan could read this GPU back-end (nvml, "
                               "amdsmi, drm), else 0; one series per back-end that runs.",
                               labels=["backend"])
        for state in reading.backends:
            up.add_metric([state.name], 1 if state.up else 0)
        yield up
        off = GaugeMetricFamily("gpuguard_gpu_backend_disabled",
                                "A GPU back-end that does not run here, and why (switched "
                                "off, or its library or devices are not found).",
                                labels=["backend", "reason"])
        for name, reason in self.inactive_backends:
            off.add_metric([name, reason], 1)
        yield off

    def _recovery_metric(self, reading: GpuReading) -> Metric:
        """What each GPU's driver asks for before it can be used again, its name the
        `action` label (docs/metrics.md, Recovery action). Not a GPU gauge that
        --no-collector.gpu drops: GPUGuardGPURecoveryAction reads it."""
        family = GaugeMetricFamily(
            "gpuguard_gpu_recovery_action",
            "The recovery the GPU's driver asks for before the GPU can be used again, in "
            "the action label (none, gpu-reset, node-reboot, drain-p2p, drain-and-reset, "
            "...: NVML's recovery action); always 1, one series per GPU; absent where the "
            "driver cannot say.", labels=[*GPU_LABELS, "action"])
        for gpu in reading.gpus:
            if gpu.recovery_action is not None:
                family.add_metric([*self._gpu(gpu.index, gpu.uuid, reading),
                                   gpu.recovery_action], 1)
        return family

    def _gpu_metrics(self, snap: Snapshot) -> Iterator[Metric]:
        reading = snap.reading
        yield from self._backend_metrics(reading)
        yield self._recovery_metric(reading)
        if not (self.gpu or self.processes):
            return
        # dcgm-exporter's label names (UUID, pci_bus_id, device, modelName), so series join
        # with its series on UUID and read alike; modelName is the one camelCase name
        # promtool's lint flags, and dcgm's spelling wins (docs/metrics.md, Labels). The
        # labels that only describe a GPU live here alone, not on every gauge as dcgm puts
        # them: the same series, shorter bodies; join on UUID for them.
        info = GaugeMetricFamily("gpuguard_gpu_info", "One series per GPU with its identity.",
                                 labels=[*INFO_LABELS, "driver_version"])
        gauges = {
            "memory_total_bytes": GaugeMetricFamily(
                "gpuguard_gpu_memory_bytes", "Total GPU memory.", labels=GPU_LABELS),
            "memory_used_bytes": GaugeMetricFamily(
                "gpuguard_gpu_memory_used_bytes", "GPU memory in use.", labels=GPU_LABELS),
            "utilization_ratio": GaugeMetricFamily(
                "gpuguard_gpu_utilization_ratio", "GPU utilization, 0..1.",
                labels=GPU_LABELS),
            "temperature_celsius": GaugeMetricFamily(
                "gpuguard_gpu_temperature_celsius", "GPU temperature.", labels=GPU_LABELS),
            "power_watts": GaugeMetricFamily(
                "gpuguard_gpu_power_watts", "GPU power draw.", labels=GPU_LABELS),
        }
        for gpu in reading.gpus if self.gpu else ():
            labels = self._gpu(gpu.index, gpu.uuid, reading)
            info.add_metric([*labels, gpu.pci_bus_id or "", gpu.device or "",
                             gpu.name or "", gpu.driver_version or reading.driver_version or ""],
                            1)
            for attr, family in gauges.items():
                value = getattr(gpu, attr)
                if value is not None:  # a field the driver cannot give is absent, not zero
                    family.add_metric(labels, value)
        if self.gpu:
            yield info
            yield from gauges.values()
        if not self.processes:
            return
        mem = GaugeMetricFamily("gpuguard_gpu_process_memory_bytes",
                                "GPU memory held by one process on one GPU.",
                                labels=[*GPU_LABELS, "pid"])
        for holder in reading.holders:
            if holder.used_bytes is not None:
                mem.add_metric([*self._gpu(holder.gpu_index, holder.gpu_uuid, reading),
                                str(holder.pid)], holder.used_bytes)
        yield mem
        idle = GaugeMetricFamily(
            "gpuguard_gpu_process_idle_seconds",
            "Seconds since one GPU process last used one GPU (SM, memory controller, encoder "
            "or decoder), counted from when this exporter first saw it; absent when NVML "
            "cannot say (MIG, unsupported, a wall-clock step).",
            labels=[*GPU_LABELS, "pid"])
        for tree in snap.trees:
            for hv in tree.holder_verdicts:
                if not hv.chain:
                    continue
                value = snap.idle_seconds(hv.holder.pid, hv.chain[0].start_time,
                                          hv.holder.gpu_uuid)
                if value is not None:
                    idle.add_metric([*self._gpu(hv.holder.gpu_index, hv.holder.gpu_uuid,
                                               snap.reading),
                                     str(hv.holder.pid)], value)
        yield idle

    def _tree_metrics(self, snap: Snapshot) -> Iterator[Metric]:
        pinfo = GaugeMetricFamily(
            "gpuguard_gpu_process_info",
            "One series per GPU-holding process: its own verdict, reason and root (its "
            "tree's when a member of the tree is what refuses a reap), and its container and "
            "Kubernetes pod from its cgroup (empty when none).",
            labels=["pid", "start_time", "user", "comm", "verdict", "reason", "root_pid",
                    "container_id", "pod_uid"])
        age = GaugeMetricFamily("gpuguard_orphan_tree_age_seconds",
                                "Seconds since a scan first saw this tree orphaned.",
                                labels=TREE_LABELS)
        memory = GaugeMetricFamily("gpuguard_orphan_tree_memory_bytes",
                                   "GPU memory held by an orphan tree.", labels=TREE_LABELS)
        idle = GaugeMetricFamily("gpuguard_orphan_tree_idle_seconds",
                                 "Seconds since the least idle holder of an orphan tree last "
                                 "used the GPU; absent when any holder's is unknown.",
                                 labels=TREE_LABELS)
        procs = GaugeMetricFamily("gpuguard_orphan_tree_processes",
                                  "Processes in an orphan tree (root and descendants).",
                                  labels=TREE_LABELS)
        seen: set[int] = set()
        for tree in snap.trees:
            # --no-collector.processes: no per-process series. Names come from the scan
            # (snap.owner): a scrape never asks NSS, and its series agree on each uid.
            for hv in tree.holder_verdicts if self.processes else ():
                pid = hv.holder.pid
                if pid in seen:
                    continue  # one series per process, even when it holds several GPUs
                seen.add(pid)
                me = hv.chain[0] if hv.chain else None
                # The holder's own verdict (two users' jobs grouped under one root each keep
                # theirs), unless a member of its tree is what makes it unreapable.
                tree_decides = hv.verdict == Verdict.ORPHAN and tree.verdict != Verdict.ORPHAN
                where = snap.accounting.attribution.get(pid, NO_CONTAINER)
                pinfo.add_metric([
                    str(pid),
                    str(me.start_time) if me else "",
                    snap.owner(me) if me else "",
                    me.comm if me else "",
                    tree.verdict if tree_decides else hv.verdict,
                    tree.reason if tree_decides else hv.reason,
                    str(hv.root.pid if hv.root is not None else tree.root_pid),
                    where.container_id,
                    where.pod_uid,
                ], 1)
            if tree.root is None or tree.root.identity not in snap.orphans:
                continue
            orphan = snap.orphans[tree.root.identity]
            labels = [str(tree.root.pid), str(tree.root.start_time), tree.root.comm,
                      snap.owner(tree.root), tree.reason]
            age.add_metric(labels, orphan.age_seconds)
            memory.add_metric(labels, tree.gpu_bytes)
            procs.add_metric(labels, orphan.processes)
            if (seconds := snap.tree_idle_seconds(tree)) is not None:
                idle.add_metric(labels, seconds)
        if self.processes:
            yield pinfo
        yield age
        yield memory
        yield idle
        yield procs
        yield GaugeMetricFamily("gpuguard_orphan_trees", "Orphan trees in the last scan.",
                                value=len(snap.orphans))

    def _accounting_metrics(self, snap: Snapshot) -> Iterator[Metric]:
        """Per-user memory and quotas, suspects, unattributed memory: for people, never
        for the remediator (no reap follows from any of them)."""
        acc = snap.accounting
        used = GaugeMetricFamily("gpuguard_user_gpu_memory_bytes",
                                 "GPU memory held by one user's processes, all GPUs together.",
                                 labels=["user"])
        quota = GaugeMetricFamily("gpuguard_user_gpu_memory_quota_bytes",
                                  "The quotas: section's GPU memory quota for a user who holds "
                                  "GPU memory (absent when none applies; \"*\" never applies "
                                  "to root).", labels=["user"])
        idle = GaugeMetricFamily("gpuguard_user_gpu_idle_memory_bytes",
                                 "Of gpuguard_user_gpu_memory_bytes, what the user's processes "
                                 "idle (no GPU use) for accounting.idle_after_seconds or more "
                                 "hold.", labels=["user"])
        for usage in acc.users:
            used.add_metric([usage.user], usage.used_bytes)
            idle.add_metric([usage.user], usage.idle_bytes)
            if usage.quota_bytes is not None:
                quota.add_metric([usage.user], usage.quota_bytes)
        suspect = GaugeMetricFamily(
            "gpuguard_suspect_process_info",
            "A GPU-holding process that looks like a miner: why is comm-pattern (a suspect "
            "name or pattern in its comm), cmdline-pattern (in its command line) or "
            "sustained-utilization.",
            labels=["pid", "start_time", "user", "comm", "why"])
        for s in acc.suspects:
            suspect.add_metric([str(s.pid), str(s.start_time), s.user, s.comm, s.why], 1)
        unattributed = GaugeMetricFamily(
            "gpuguard_gpu_memory_unattributed_bytes",
            "GPU memory in use (without the driver's reserved memory) that no listed process "
            "accounts for; absent when a process's usage is unavailable, and on drivers "
            "without nvmlDeviceGetMemoryInfo_v2 (their used memory includes reserved).",
            labels=GPU_LABELS)
        for gpu in acc.gpus:
            if gpu.unattributed_bytes is not None:
                unattributed.add_metric(self._gpu(gpu.index, gpu.uuid, snap.reading),
                                        gpu.unattributed_bytes)
        yield used
        yield idle
        yield quota
        yield suspect
        yield unattributed
        yield from self._unlisted_metrics(snap)

    def _unlisted_metrics(self, snap: Snapshot) -> Iterator[Metric]:
        """Memory NVML puts no live name to: the holders it does not list (found by the
        search while memory is unattributed), and the pids it lists that /proc lacks."""
        holder = GaugeMetricFamily(
            "gpuguard_gpu_unlisted_holder_info",
            "A process NVML does not list that has a GPU device file open (searched for "
            "only while a GPU's unattributed memory is above "
            "accounting.unlisted_threshold_bytes), with the classifier's verdict; gpu and "
            "UUID empty when the file names no GPU. Never reaped: NVML does not name it.",
            labels=["pid", "start_time", "comm", "user", "device_file", "verdict", "reason",
                    *GPU_LABELS])
        for h in snap.unlisted if self.processes else ():
            holder.add_metric([str(h.pid), str(h.start_time), h.comm, h.user, h.device_file,
                               h.verdict, h.reason,
                               "" if h.gpu_index is None else str(h.gpu_index),
                               h.gpu_uuid or "", self.hostname,
                               self._gpu(0, h.gpu_uuid or "", snap.reading)[3]], 1)
        yield holder
        count = GaugeMetricFamily(
            "gpuguard_gpu_unseen_processes",
            "Processes NVML lists on a GPU that this exporter's /proc does not show: exited "
            "since, or in another PID namespace.", labels=GPU_LABELS)
        memory = GaugeMetricFamily(
            "gpuguard_gpu_unseen_process_memory_bytes",
            "GPU memory NVML says the processes of gpuguard_gpu_unseen_processes hold.",
            labels=GPU_LABELS)
        for gpu in snap.unseen:
            count.add_metric(self._gpu(gpu.index, gpu.uuid, snap.reading), gpu.processes)
            memory.add_metric(self._gpu(gpu.index, gpu.uuid, snap.reading), gpu.memory_bytes)
        yield count
        yield memory
        search = snap.search
        yield GaugeMetricFamily(
            "gpuguard_unlisted_search_active",
            "1 while the search for unlisted holders runs (some GPU's unattributed memory "
            "is above the threshold), else 0.",
            value=1 if search is not None and search.active else 0)
        yield GaugeMetricFamily(
            "gpuguard_unlisted_search_passes",
            "Complete passes of the search over the process table since it last started.",
            value=search.passes if search is not None else 0)
        yield GaugeMetricFamily(
            "gpuguard_unlisted_search_unreadable_processes",
            "Processes whose open files the search could not read (the last pass): a holder "
            "among them would not be found.",
            value=search.unreadable if search is not None else 0)

    def _counter_metrics(self) -> Iterator[Metric]:
        scans, errors = self.scanner.counts()
        yield CounterMetricFamily("gpuguard_scans", "Scans completed.", value=scans)
        yield CounterMetricFamily(
            "gpuguard_scans_early",
            "Scans run before their interval, each woken by the exit of a process the last "
            "scan found on a GPU holder's chain (at most 4 a second); counted in "
            "gpuguard_scans_total too.",
            value=self.scanner.early_scans())
        err = CounterMetricFamily("gpuguard_scan_errors", "Scan errors by stage.",
                                  labels=["stage"])
        for stage, count in errors.items():
            err.add_metric([stage], count)
        yield err
        yield from inspector_metrics(self.counters)
        yield from event_metrics(self.events)
        yield foreign_marks_metric()
        if self.registrar is not None:
            yield GaugeMetricFamily(
                "gpuguard_registrar_up",
                "1 while this exporter's registrar serves `gpuguard keep` and `gpuguard run` "
                "registrations at its socket; 0 while it stands by for another or lost it.",
                value=1 if self.registrar() is None else 0)

