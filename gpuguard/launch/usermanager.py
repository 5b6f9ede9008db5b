"""The cgroup tier through the user's systemd manager: a delegated transient scope.

Where the launcher's own cgroup is not its user's (a login session's scope is root's),
a systemd user manager can give it one: a transient scope unit holding the launcher
(StartTransientUnit over D-Bus, through busctl), with Delegate=yes, below which the
cgroup tier's leaf and guardian (cgroup.py, guardian.py) work as in any delegated
cgroup. Without a manager (no `$XDG_RUNTIME_DIR/systemd/private`), or where it refuses,
the reason is returned and the next tier is tried. Not tested against a running
manager: the test machine has none (docs/run.md says what was tested).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time

from gpuguard.launch.cgroup import own_cgroup

#: How long busctl may take, and how long the manager may take to move us after it.
CALL_TIMEOUT_SECONDS = 5.0
MOVE_TIMEOUT_SECONDS = 2.0


def runtime_dir() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}"


def manager_socket() -> str | None:
    """The user manager's private socket, where one runs for this user."""
    path = os.path.join(runtime_dir(), "systemd", "private")
    try:
        return path if stat.S_ISSOCK(os.stat(path).st_mode) else None
    except OSError:
        return None


def _cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as fh:
            return own_cgroup(fh.read())
    except OSError:
        return None


def into_scope(name: str) -> str | None:
    """Have the user's systemd manager move this process into a new delegated scope
    `name`.scope; why not, or None once /proc/self/cgroup shows it."""
    if manager_socket() is None:
        return (f"no systemd user manager ({os.path.join(runtime_dir(), 'systemd', 'private')} "
                "is not a socket)")
    busctl = shutil.which("busctl")
    if busctl is None:
        return "a systemd user manager runs, but busctl is not installed"
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime_dir()}
    bus = os.path.join(runtime_dir(), "bus")
    if "DBUS_SESSION_BUS_ADDRESS" not in env and os.path.exists(bus):
        env["DBUS_SESSION_BUS_ADDRESS"] = f"unix:path={bus}"
    unit = f"{name}.scope"
    argv = [busctl, "--user", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))", unit,
            "fail", "3", "PIDs", "au", "1", str(os.getpid()), "Delegate", "b", "true",
            "CollectMode", "s", "inactive-or-failed", "0"]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False,
                              timeout=CALL_TIMEOUT_SECONDS, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the systemd user manager did not answer ({exc})"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        return f"the systemd user manager gave no scope ({said})"
    # The manager moves us when its job runs, just after it answered.
    deadline = time.monotonic() + MOVE_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if (_cgroup() or "").endswith("/" + unit):
            return None
        time.sleep(0.01)
    return f"the systemd user manager did not move the launcher into {unit}"
