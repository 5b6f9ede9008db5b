"""Synthetic /proc, /sys and /dev trees for the DRM back-end (gpuguard/gpu/drm/), built in a
temporary directory: the reader takes its three roots as parameters.

The "device nodes" are regular files under DEV/dri: a descriptor is a symlink to one, and
stat() through it follows the link to that very inode, which the search matches by (st_dev,
st_ino) as it matches a real node by its device number (host/fdsearch.py, file keys).
What cannot be made here is a real DRM descriptor: the kernel writes fdinfo, and no
process can hold a file whose fdinfo says `drm-driver` without a DRM device. So each
process's fdinfo is a file written by the test, with text captured from real drivers
(tests/pure/test_drm_fdinfo.py says where each capture comes from).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: fdinfo of a descriptor that is no DRM client (what the kernel writes for a plain file).
PLAIN = "pos:\t0\nflags:\t0100002\nmnt_id:\t26\nino:\t1234\n"


class DrmHost:
    """One synthetic host: `proc`, `sys` and `dev` roots under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc, self.sys, self.dev = root / "proc", root / "sys", root / "dev"
        for d in (self.proc, self.sys / "class" / "drm", self.sys / "bus" / "pci" / "devices",
                  self.sys / "bus" / "pci" / "drivers", self.dev / "dri",
                  self.sys / "devices" / "pci0000:00"):
            d.mkdir(parents=True, exist_ok=True)

    def roots(self) -> dict[str, str]:
        """The reader's keyword arguments for these roots."""
        return {"proc_root": str(self.proc), "sys_root": str(self.sys), "dev_root": str(self.dev)}

    def gpu(self, pdev: str, driver: str, *, card: int, render: int | None,
            files: dict[str, str] | None = None, sysfs: bool = True) -> None:
        """A PCI device at `pdev` driven by `driver`, with nodes cardN and renderDN (None: a
        display-only device, a BMC's, with no render node), and `files` (name -> text) in
        its sysfs directory; `sysfs` False: nodes only."""
        names = [f"card{card}"] + ([f"renderD{render}"] if render is not None else [])
        for node in names:
            (self.dev / "dri" / node).write_text("")
            if not sysfs:
                continue
            device = self.sys / "devices" / "pci0000:00" / pdev
            device.mkdir(exist_ok=True)
            klass = self.sys / "class" / "drm" / node
            klass.mkdir(exist_ok=True)
            _link(klass / "device", device)
            _link(self.sys / "bus" / "pci" / "devices" / pdev, device)
            drivers = self.sys / "bus" / "pci" / "drivers" / driver
            drivers.mkdir(exist_ok=True)
            _link(device / "driver", drivers)
            for name, text in (files or {}).items():
                (device / name).write_text(text)

    def process(self, pid: int, *, start_time: int = 1000, fds: dict[int, str] | None = None,
                fdinfo: dict[int, str] | None = None, others: int = 3) -> None:
        """A process: its stat (with `start_time`), `others` plain descriptors, and `fds`
        (descriptor -> node name) open on DRM nodes with `fdinfo` text (default PLAIN)."""
        base = self.proc / str(pid)
        shutil.rmtree(base, ignore_errors=True)
        (base / "fd").mkdir(parents=True)
        (base / "fdinfo").mkdir()
        (base / "stat").write_text(
            f"{pid} (proc{pid}) S 1 {pid} {pid} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 "
            f"{start_time} 0 0\n")
        plain = self.root / "plain"
        plain.write_text("")
        for n in range(others):
            _link(base / "fd" / str(n), plain)
            (base / "fdinfo" / str(n)).write_text(PLAIN)
        for fd, node in (fds or {}).items():
            _link(base / "fd" / str(fd), self.dev / "dri" / node)
            (base / "fdinfo" / str(fd)).write_text((fdinfo or {}).get(fd, PLAIN))

    def exit(self, pid: int) -> None:
        shutil.rmtree(self.proc / str(pid))


def _link(path: Path, target: Path) -> None:
    if path.is_symlink() or path.exists():
        os.unlink(path)
    os.symlink(target, path)
