"""The DRM devices of this host, from /dev/dri and sysfs: which nodes there are, which PCI
device each belongs to and which driver drives it, and the few gauges sysfs gives cheaply
(amdgpu's VRAM and busy percent). Nothing here reads /proc."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass

from gpuguard.host.fdsearch import device_files

#: The DRM nodes a client may hold: the primary node (cardN) and the render node
#: (renderDN); both reach the same device.
NODE_PATTERNS = ("card[0-9]*", "renderD[0-9]*")


@dataclass(frozen=True)
class Device:
    """One DRM device: its PCI address, the driver sysfs says drives it (None where sysfs
    cannot say), and its nodes' names, primary node first."""

    pdev: str
    driver: str | None
    nodes: tuple[str, ...]

    @property
    def renders(self) -> bool:
        """Whether it has a render node."""
        return any(node.startswith(RENDER) for node in self.nodes)


@dataclass(frozen=True)
class Devices:
    """The device nodes by file key (what a descriptor open on one stat()s to), each
    node's device (PCI address) where sysfs names it, and the devices by PCI address."""

    nodes: Mapping[tuple[int, ...], str]
    device_of: Mapping[str, str]
    devices: Mapping[str, Device]


#: What a render node's name starts with: a device with one can run work (a display-only
#: device, a BMC's or a plain framebuffer, has only its primary node).
RENDER = "renderD"


def render_nodes(dev_root: str) -> list[str]:
    """The render nodes under `dev_root`/dri (the DRM back-end's probe looks for these)."""
    return sorted(glob.glob(os.path.join(dev_root, "dri", RENDER + "[0-9]*")))


def node_driver(sys_root: str, node: str) -> str | None:
    """The driver sysfs names for DRM node `node` ("renderD128"); None where it cannot say."""
    return _link_name(os.path.join(sys_root, "class", "drm", node, "device", "driver"))


def read_by(driver: str | None, others: frozenset[str]) -> bool:
    """Whether another back-end, reading `others`' GPUs, reads this driver's: its name or
    its DRM module's (nvidia-drm is nvidia's)."""
    return driver is not None and (driver in others or driver.removesuffix("-drm") in others)


def find_devices(dev_root: str, sys_root: str) -> Devices:
    """Every card and render node under `dev_root`/dri, stat()ed, and its PCI device and
    driver from `sys_root`/class/drm/NODE/device (a link to the PCI device's directory,
    whose `driver` link names the driver)."""
    files = device_files([os.path.join(dev_root, "dri", p) for p in NODE_PATTERNS])
    nodes = {f.key: os.path.basename(f.path) for f in files}
    device_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    drivers: dict[str, str | None] = {}
    for name in sorted(set(nodes.values()), key=_node_order):
        link = os.path.join(sys_root, "class", "drm", name, "device")
        try:
            pdev = os.path.basename(os.path.realpath(link, strict=True))
        except OSError:
            continue  # no sysfs entry: its clients' fdinfo names the device
        device_of[name] = pdev
        members.setdefault(pdev, []).append(name)
        if pdev not in drivers:
            drivers[pdev] = _link_name(os.path.join(link, "driver"))
    devices = {pdev: Device(pdev, drivers[pdev], tuple(names))
               for pdev, names in sorted(members.items())}
    return Devices(nodes, device_of, devices)


def _link_name(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def _node_order(name: str) -> tuple[int, int]:
    """Primary nodes before render nodes, each by number."""
    digits = "".join(c for c in name if c.isdigit())
    return (0 if name.startswith("card") else 1, int(digits or 0))


def _text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(4096).strip() or None
    except OSError:
        return None


def _number(path: str) -> int | None:
    text = _text(path)
    return int(text) if text is not None and text.isdigit() else None


def device_name(sys_root: str, pdev: str, driver: str | None) -> str | None:
    """A name for the GPU: sysfs' `product_name` where the driver gives one (amdgpu),
    else the driver and the PCI vendor and device ids ("xe 8086:56a0"), else None."""
    base = os.path.join(sys_root, "bus", "pci", "devices", pdev)
    product = _text(os.path.join(base, "product_name"))
    if product:
        return product
    vendor, device = _text(os.path.join(base, "vendor")), _text(os.path.join(base, "device"))
    if vendor is None or device is None:
        return None
    ids = f"{vendor.removeprefix('0x')}:{device.removeprefix('0x')}"
    return f"{driver} {ids}" if driver else ids


@dataclass(frozen=True)
class Gauges:
    """What sysfs says of a device now; None where it has no file for it."""

    memory_total_bytes: int | None
    memory_used_bytes: int | None
    utilization_ratio: float | None


def gauges(sys_root: str, pdev: str) -> Gauges:
    """amdgpu's mem_info_vram_total and _used (bytes) and gpu_busy_percent; other drivers
    publish none of these, and read None."""
    base = os.path.join(sys_root, "bus", "pci", "devices", pdev)
    busy = _number(os.path.join(base, "gpu_busy_percent"))
    return Gauges(_number(os.path.join(base, "mem_info_vram_total")),
                  _number(os.path.join(base, "mem_info_vram_used")),
                  None if busy is None else busy / 100)


def driver_version(sys_root: str, driver: str | None) -> str | None:
    """The driver module's own version where it has one (an out-of-tree amdgpu), else
    the running kernel's release (in-tree drivers are versioned with it)."""
    if driver:
        version = _text(os.path.join(sys_root, "module", driver, "version"))
        if version:
            return version
    return os.uname().release if hasattr(os, "uname") else None
