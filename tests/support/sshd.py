"""A private sshd on 127.0.0.1 for the tests that log in (tests/live/test_sessions.py) or
run commands over ssh (tests/live/test_remote.py): its own config, host key and
authorized key, started on a free port as a child of the test (root only: it logs in as
root)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tests.support.proctree import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Sshd:
    """A private sshd on 127.0.0.1: its own config, host key and authorized key; `extra`
    lines join its config (`SetEnv NAME=VALUE`: the environment of its sessions)."""

    def __init__(self, base: Path, extra: Sequence[str] = ()) -> None:
        self.base = base
        base.mkdir()
        for name in ("host_key", "user_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuguard-test",
                            "-f", str(base / name)], check=True, timeout=30)
        (base / "authorized_keys").write_text((base / "user_key.pub").read_text())
        config = base / "sshd_config"
        config.write_text("\n".join([
            "ListenAddress 127.0.0.1",
            f"HostKey {base / 'host_key'}",
            "PidFile none",
            f"AuthorizedKeysFile {base / 'authorized_keys'}",
            "PermitRootLogin yes",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the key lives under /tmp, which is world-writable
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            "X11Forwarding no",
            "AllowTcpForwarding no",
            "LogLevel VERBOSE",
            *extra,
            "",
        ]))
        # sshd refuses to start without its privilege-separation directory (the Debian
        # service makes it at boot; a container that never ran the service has none).
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.log = base / "sshd.log"
        self.logins: list[Closable] = []
        for attempt in range(3):  # another process may take the free port before sshd does
            self.port = free_port()
            self.proc = subprocess.Popen(
                ["/usr/sbin/sshd", "-D", "-f", str(config), "-p", str(self.port),
                 "-E", str(self.log)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
            try:
                wait_for(self._listening, what=f"sshd on 127.0.0.1:{self.port}")
                break
            except AssertionError:
                self.stop()
                if attempt == 2:
                    raise

    @property
    def known_host(self) -> str:
        """This server's line for a known_hosts file (its port, its host key)."""
        kind, key = (self.base / "host_key.pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {key}"

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"sshd exited {self.proc.returncode}: {tail(self.log)}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        for made in self.logins:
            made.close()
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class Closable(Protocol):
    """What the server closes when it stops (test_sessions.py's logins)."""

    def close(self) -> None: ...
