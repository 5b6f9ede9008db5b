"""The cgroup tier's leaf: a cgroup v2 child of the launcher's own cgroup, for its tree.

Everything the launcher forks after it moved itself in is born inside (double forks and
`setsid` daemons too: a cgroup is inherited at fork and no process may leave it without
write access to an ancestor), so one write to the leaf's `cgroup.kill` (kernel 5.14 and
later) SIGKILLs the whole tree at once, racing no fork. The guardian (guardian.py) does
that write when the launcher dies. Where the launcher cannot create the leaf (no cgroup
v2 mount, no delegated cgroup, a read-only mount, a kernel without `cgroup.kill`), the
reason is returned and the launcher falls back to the subreaper tier.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass

#: The leaf's name in its parent: the launcher's identity (pid and start time).
LEAF_PREFIX = "gpuguard-run-"
#: What the reason says where the launcher's own cgroup is not its user's.
NOT_DELEGATED = "no delegated cgroup"


def unescape(field: str) -> str:
    """mountinfo's octal escapes (a space is \\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def v2_mount(mountinfo: str) -> tuple[str, str] | None:
    """The first cgroup2 mount in /proc/self/mountinfo: (its root in the hierarchy, its
    mount point); None without one (a v1-only host)."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if sep and right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return unescape(fields[3]), unescape(fields[4])
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path: the `0::` line of /proc/self/cgroup."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def cgroup_dir(mount: tuple[str, str], path: str) -> str | None:
    """Where the cgroup `path` lies under the mount, or None where the mount does not show
    it (a mount of another subtree, a `(deleted)` path)."""
    root, point = mount
    root = root.rstrip("/")
    if not path.startswith("/"):
        return None
    if root and path != root and not path.startswith(root + "/"):
        return None
    return os.path.normpath(os.path.join(point, path[len(root):].lstrip("/")))


@dataclass
class Leaf:
    """A created leaf and the fds the guardian writes and watches (held open: a leaf
    removed and re-created at the same path by someone else is never the one written)."""

    path: str
    parent: str  # the launcher's own cgroup directory, where it goes back at the end
    kill_fd: int  # cgroup.kill, write-only
    events_fd: int  # cgroup.events, read-only: "populated 0" once the tree is gone

    def close(self) -> None:
        for fd in (self.kill_fd, self.events_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def create_leaf(name: str) -> Leaf | str:
    """Make the leaf `name` below this process's own cgroup v2; the Leaf, or why not."""
    try:
        mount = v2_mount(_read("/proc/self/mountinfo"))
        own = own_cgroup(_read("/proc/self/cgroup"))
    except OSError as exc:
        return f"cannot read /proc/self ({exc.strerror})"
    if mount is None:
        return "no cgroup v2 mount in /proc/self/mountinfo"
    if own is None:
        return "no cgroup v2 line (0::) in /proc/self/cgroup"
    parent = cgroup_dir(mount, own)
    if parent is None or not os.path.isdir(parent):
        return f"this process's cgroup {own} is not visible under {mount[1]}"
    path = os.path.join(parent, name)
    try:
        os.mkdir(path)
    except OSError as exc:
        return f"cannot create a cgroup in {parent} ({exc.strerror}: {NOT_DELEGATED})"
    try:
        kill_fd = os.open(os.path.join(path, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        remove(path)
        why = "a kernel before 5.14" if exc.errno == errno.ENOENT else exc.strerror
        return f"cannot open {path}/cgroup.kill ({why})"
    try:
        events_fd = os.open(os.path.join(path, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        os.close(kill_fd)
        remove(path)
        return f"cannot open {path}/cgroup.events ({exc.strerror})"
    return Leaf(path, parent, kill_fd, events_fd)


def enter(directory: str) -> str | None:
    """Move this process (every thread of it) into the cgroup `directory`; why not."""
    try:
        fd = os.open(os.path.join(directory, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot move into {directory} ({exc.strerror})"
    return None


def populated(events_fd: int) -> bool:
    """Whether a process is still in the leaf (cgroup.events' `populated`); an unreadable
    file reads populated (the guardian then waits its bound out)."""
    try:
        text = os.pread(events_fd, 4096, 0).decode("ascii", "replace")
    except OSError:
        return True
    return "populated 0" not in text.splitlines()


def remove(path: str) -> bool:
    """rmdir the leaf; False while a process is in it (keep-leftovers) or it is gone."""
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True
