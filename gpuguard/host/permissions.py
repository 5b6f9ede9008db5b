"""Who may read a secret or write a state directory, as POSIX says it: an owner uid and
mode bits (Linux's back-end's `secret_file_problem` and `private_dir_problem`). The
callers check what every platform shares (a regular file; a real directory, no symlink)
and hand the rest to their platform, so none of them asks which one it runs on."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def secret_file_problem(path: str, st: os.stat_result) -> str | None:
    """Why a regular file holding a secret is not private, or None: private means only its
    owner can read or write it (mode 0600 or stricter), and its owner is this daemon's
    user or root (a file another user owns is one they can rewrite, and so choose the
    token; a group- or world-readable one leaks it)."""
    if st.st_mode & 0o077:
        return (f"{path} is mode {stat.S_IMODE(st.st_mode):04o}: a token file must be "
                "readable by its owner only (chmod 600)")
    euid = os.geteuid()
    if st.st_uid not in (euid, 0):
        return (f"{path} is owned by uid {st.st_uid}: a token file must belong to this "
                f"daemon's user (uid {euid}) or root")
    return None


def private_dir_problem(path: Path, what: str, st: os.stat_result) -> str | None:
    """Why a directory for state or the audit log lets others tamper, or None: it must be
    owned by this process's user and writable by no one else (the remediator runs as
    root, and a directory someone else can write lets them plant a symlink at the audit
    log or swap the state file under it)."""
    if st.st_uid != os.geteuid():
        return (f"{path}: {what} is owned by uid {st.st_uid}, not by this "
                f"process's uid {os.geteuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path}: {what} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it")
    return None
