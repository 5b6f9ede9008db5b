"""GPU memory NVML does not put a name to: holders it does not list, pids it lists that
this /proc does not show. Pure: the scanner gathers the facts (the GPUs' balance, the
search's finds, the classifier's trees) and these functions say what the exporter
publishes and `gpuguard node-check` judges. Nothing here leads to a reap: an unlisted
holder is not a GPU holder to the remediator, whose re-inspection asks NVML and finds
none (docs/accounting.md, Holders NVML does not list).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuguard.engine.scan.accounting import GpuBalance
from gpuguard.gpu.reading import GpuSample
from gpuguard.orphans.process import Holder
from gpuguard.orphans.verdicts import Tree
from gpuguard.orphans.vocabulary import Reason

#: The character-device major number the NVIDIA driver registers its per-GPU nodes and
#: nvidiactl under (/dev/nvidiaN is 195:N; nvidia-uvm's major is dynamic).
NVIDIA_MAJOR = 195
#: At most this many found processes are judged and exported per scan (lowest pids
#: first); the rest are counted.
MAX_REPORTED = 256
#: The kind of a synthetic Holder made for a found process (NVML's kinds are C, G, C+G).
UNLISTED_KIND = "unlisted"


@dataclass(frozen=True)
class UnlistedHolder:
    """A process that has a GPU device file open and that NVML does not list."""

    pid: int
    start_time: int
    user: str
    comm: str
    device_file: str
    gpu_index: int | None  # None: the file is not a node NVML names a GPU for
    gpu_uuid: str | None
    verdict: str
    reason: str


@dataclass(frozen=True)
class UnseenOnGpu:
    """Pids NVML lists on one GPU that this /proc does not show (dead, or in another PID
    namespace), and the memory NVML says they hold (known figures only)."""

    index: int
    uuid: str
    processes: int
    memory_bytes: int


@dataclass(frozen=True)
class SearchProgress:
    """The search as the last scan left it, for /metrics."""

    active: bool
    passes: int
    examined: int
    unreadable: int
    found: int  # processes found holding a file, NVML's own holders left out
    reported: int


def unattributed_gpus(balances: Sequence[GpuBalance], threshold: int) -> tuple[GpuBalance, ...]:
    """The GPUs whose unattributed memory is known and above `threshold`: the search runs
    only while there is one (unknown is not above: it costs nothing either)."""
    return tuple(b for b in balances
                 if b.unattributed_bytes is not None and b.unattributed_bytes > threshold)


def gpu_of(rdev: int | None, gpus: Sequence[GpuSample],
           minors: Mapping[str, int]) -> GpuSample | None:
    """The GPU whose device node has number `rdev` (195:minor, with the minor number NVML
    gives for it in `minors`, by uuid), or None: the file is reported without a GPU."""
    if rdev is None:
        return None
    major = ((rdev >> 8) & 0xFFF) | ((rdev >> 32) & ~0xFFF)  # glibc's dev_t encoding
    if major != NVIDIA_MAJOR:
        return None
    minor = (rdev & 0xFF) | ((rdev >> 12) & ~0xFF)
    return next((g for g in gpus if minors.get(g.uuid) == minor), None)


def search_holders(found: Mapping[int, str], listed: Sequence[Holder],
                   rdevs: Mapping[str, int | None], gpus: Sequence[GpuSample],
                   minors: Mapping[str, int]) -> tuple[Holder, ...]:
    """The found processes NVML does not list, as holders for classify() to judge (at most
    MAX_REPORTED, lowest pids first); a GPU named where the file's node says which."""
    names = {h.pid for h in listed}
    out = []
    for pid in sorted(p for p in found if p not in names)[:MAX_REPORTED]:
        gpu = gpu_of(rdevs.get(found[pid]), gpus, minors)
        out.append(Holder(pid, gpu.uuid if gpu else "", gpu.index if gpu else -1, None,
                          UNLISTED_KIND))
    return tuple(out)


def unseen(gpus: Sequence[GpuSample], trees: Sequence[Tree]) -> tuple[UnseenOnGpu, ...]:
    """Per GPU, the listed holders the classifier could not find in /proc (not-visible),
    and the pids a back-end listed and found no holder itself (GpuSample.not_holding: AMD
    SMI's dead and reused pids), with the memory they hold; every GPU has an entry (0 when
    none)."""
    gone = [hv.holder for tree in trees for hv in tree.holder_verdicts
            if hv.reason == Reason.NOT_VISIBLE]
    out = []
    for gpu in gpus:
        mine = {h.pid: h.used_bytes for h in gone if h.gpu_uuid == gpu.uuid}
        mine.update((n.pid, n.used_bytes) for n in gpu.not_holding)
        out.append(UnseenOnGpu(gpu.index, gpu.uuid, len(mine),
                               sum(used or 0 for used in mine.values())))
    return tuple(out)
