"""The kernel's DRM client usage stats (Documentation/gpu/drm-usage-stats.rst), as a DRM
file descriptor's /proc/PID/fdinfo/FD shows them, and what one read of every such
descriptor on a host says per process and per GPU. Pure: the reader (reader.py) reads the
files; these functions only parse and count.

What counts, and why (docs/gpu-vendors.md, DRM fdinfo):
- one client is one `drm-client-id` on one device (`drm-pdev`): a dup'd descriptor and a
  forked child's inherited one show the same client, and the kernel's own doc asks that
  it be counted once. It is attributed to the oldest process holding it (earliest start
  time, then lowest pid): the one that opened it, in the usual fork case, while it lives.
- a client's memory is its `drm-total-<region>` figures where the driver gives them (what
  it allocated, resident or not), else the deprecated `drm-memory-<region>`, else
  `drm-resident-<region>`; summed over the device's own regions (`vram*`, `local*`)
  where the client names any, else over every region (an integrated GPU's memory is
  system memory).
- a client is busy when any of its engine counters (`drm-engine-<name>` ns, xe's
  `drm-cycles-<name>`) grew since the previous read; the doc lets a counter go back for a
  while, so the largest value seen is the one a later read must pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Units a memory value may carry (the doc: bytes, KiB or MiB; GiB taken too).
UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
#: The memory keys, most preferred first (what each is: module docstring).
MEMORY_KINDS = ("total", "memory", "resident")
#: Region names that are the device's own memory (amdgpu "vram", xe "vram0", i915 "local0").
LOCAL_REGIONS = ("vram", "local")
#: What drivers are made by, for the `vendor` label; any other driver is its own name.
VENDORS = {"i915": "intel", "xe": "intel", "amdgpu": "amd", "radeon": "amd",
           "nouveau": "nvidia", "nvidia": "nvidia", "nvidia-drm": "nvidia"}


@dataclass(frozen=True)
class DrmClient:
    """One DRM file descriptor's usage stats.

    `client_id` None: the driver names no client, so two descriptors of one client cannot
    be told apart and its memory is not counted (`memory_bytes` None). `memory_kind`: which
    keys the memory came from (MEMORY_KINDS), None when it has none. `counters`: every
    engine counter, "ns:<engine>" or "cycles:<engine>" -> its value."""

    driver: str
    pdev: str | None
    client_id: int | None
    memory: Mapping[str, int] = field(default_factory=dict)  # region -> bytes
    memory_kind: str | None = None
    counters: Mapping[str, int] = field(default_factory=dict)

    @property
    def usage(self) -> bool:
        """Whether it publishes usage stats (memory or engine figures), beyond the keys
        every DRM client's fdinfo has since Linux 6.5 (driver, client id, device)."""
        return bool(self.counters) or self.memory_kind is not None

    @property
    def memory_bytes(self) -> int | None:
        """What this client holds on its device (module docstring); None when unknown."""
        if self.client_id is None or self.memory_kind is None:
            return None
        local = [v for region, v in self.memory.items() if region.startswith(LOCAL_REGIONS)]
        return sum(local) if local else sum(self.memory.values())


def vendor_of(driver: str) -> str:
    """The `vendor` label of a GPU driven by `driver`."""
    return VENDORS.get(driver, driver)


def size(value: str) -> int | None:
    """A memory value ("23992 KiB", "0", "16 MiB") in bytes; None when malformed."""
    number, _, unit = value.strip().partition(" ")
    if not number.isdigit() or unit.strip() not in UNITS:
        return None
    return int(number) * UNITS[unit.strip()]


def _count(value: str) -> int | None:
    """An engine counter ("9288864723 ns", "28257900"); None when malformed."""
    number, _, unit = value.strip().partition(" ")
    return int(number) if number.isdigit() and unit.strip() in ("", "ns") else None


def parse_fdinfo(text: str) -> DrmClient | None:
    """The usage stats in one fdinfo file, or None: not a DRM descriptor, or a driver that
    publishes none (no `drm-driver` key). A memory value that cannot be read makes the
    client's memory unknown; an engine counter that cannot be read is left out."""
    keys: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.startswith("drm-"):
            keys[key.strip()] = value.strip()
    driver = keys.get("drm-driver")
    if not driver:
        return None
    client = keys.get("drm-client-id", "")
    counters: dict[str, int] = {}
    memory: dict[str, dict[str, int | None]] = {kind: {} for kind in MEMORY_KINDS}
    for key, value in keys.items():
        name = key[len("drm-"):]
        if name.startswith("engine-capacity-") or name.startswith("total-cycles-"):
            continue
        if name.startswith("engine-") or name.startswith("cycles-"):
            kind, _, engine = name.partition("-")
            number = _count(value)
            if number is not None:
                counters[f"{'ns' if kind == 'engine' else 'cycles'}:{engine}"] = number
            continue
        kind, _, region = name.partition("-")
        if kind in memory and region:
            memory[kind][region] = size(value)
    chosen = next((kind for kind in MEMORY_KINDS if memory[kind]), None)
    figures = memory[chosen] if chosen is not None else {}
    unreadable = any(v is None for v in figures.values())
    return DrmClient(
        driver=driver,
        pdev=keys.get("drm-pdev") or None,
        client_id=int(client) if client.isdigit() else None,
        memory={} if unreadable else {r: v for r, v in figures.items() if v is not None},
        memory_kind=None if unreadable else chosen,
        counters=counters,
    )


@dataclass(frozen=True)
class DrmFd:
    """One DRM descriptor as the search read it: whose (pid and start time), which device
    (the PCI address of the node it is open on), and its stats (None: its fdinfo named
    no usage stats, or could not be read)."""

    pid: int
    start_time: int
    fd: int
    pdev: str
    client: DrmClient | None


#: A client's key on its device: its id, or (for a driver that names none) the descriptor.
ClientKey = tuple[str, int] | tuple[str, int, int]


def client_key(fd: DrmFd) -> ClientKey:
    """Clients are one per `drm-client-id` per device; without an id, one per descriptor."""
    if fd.client is not None and fd.client.client_id is not None:
        return (fd.pdev, fd.client.client_id)
    return (fd.pdev, fd.pid, fd.fd)


@dataclass(frozen=True)
class Owned:
    """One client and the process it is attributed to."""

    pid: int
    client: DrmClient | None


def attribute(fds: Iterable[DrmFd]) -> dict[ClientKey, Owned]:
    """Each client once, attributed to the oldest process holding it (earliest start time,
    then lowest pid), with the stats read from that process's lowest descriptor."""
    best: dict[ClientKey, DrmFd] = {}
    for fd in fds:
        key = client_key(fd)
        held = best.get(key)
        if held is None or (fd.start_time, fd.pid, fd.fd) < (held.start_time, held.pid, held.fd):
            best[key] = fd
    return {key: Owned(fd.pid, fd.client) for key, fd in best.items()}


@dataclass(frozen=True)
class ProcessUse:
    """What one process holds on one device: its clients' memory summed (None when any
    one's is unknown) and how many clients."""

    pid: int
    pdev: str
    memory_bytes: int | None
    clients: int


def per_process(owned: Mapping[ClientKey, Owned]) -> list[ProcessUse]:
    """The attributed clients summed per (device, process), by device then pid."""
    sums: dict[tuple[str, int], list[int | None]] = {}
    for key, own in owned.items():
        sums.setdefault((key[0], own.pid), []).append(
            own.client.memory_bytes if own.client is not None else None)
    return [ProcessUse(pid, pdev, None if None in figures else sum(f or 0 for f in figures),
                       len(figures))
            for (pdev, pid), figures in sorted(sums.items())]


#: The highest value each counter of each client has shown.
Marks = Mapping[ClientKey, Mapping[str, int]]


def marks_of(owned: Mapping[ClientKey, Owned], previous: Marks) -> dict[ClientKey, dict[str, int]]:
    """This read's marks: per live client, each counter's largest value so far (a counter
    may step back for a while; the doc says to keep the larger value)."""
    out: dict[ClientKey, dict[str, int]] = {}
    for key, own in owned.items():
        if own.client is None:
            continue
        before = previous.get(key, {})
        out[key] = {name: max(value, before.get(name, 0))
                    for name, value in own.client.counters.items()}
    return out


def busy_pids(owned: Mapping[ClientKey, Owned], previous: Marks | None,
              pdev: str) -> frozenset[int] | None:
    """The pids whose clients on `pdev` used an engine since the previous read; None when
    that cannot be said of every client there: no previous read, or a client with no
    engine counter, or none readable. A client first seen now counts as busy (its use
    before now is unknown, and unknown must never read as idle)."""
    if previous is None:
        return None
    busy: set[int] = set()
    for key, own in owned.items():
        if key[0] != pdev:
            continue
        if own.client is None or not own.client.counters:
            return None
        before = previous.get(key)
        if before is None or any(value > before.get(name, 0)
                                 for name, value in own.client.counters.items()):
            busy.add(own.pid)
    return frozenset(busy)
