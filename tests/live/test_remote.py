"""`gpuguard --remote` against real ssh: two private sshd hosts on loopback ports, each
with its own fake NVML world (sshd's SetEnv gives its sessions their state file), a port
nobody listens on, and the hosts' own gpuguard run by the remote shell.

The client reads a temporary ssh config (GPUGUARD_SSH_CONFIG, i.e. `ssh -F`): each host's
port, key and a known_hosts file holding each sshd's host key; host key checking stays
on. Every remote process runs on this machine as root, so the trees the test spawns are
the hosts' processes, and the reaps are judged by each host's own gpuguard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.fakenvml import STATE_ENV, FakeGpuWorld
from tests.support.proctree import Trees, alive, stat_fields, wait_for
from tests.support.remediator_harness import GIB, spawn_orphan, start_time_of, write_config
from tests.support.servers import REPO, child_env
from tests.support.sshd import Sshd, free_port, tail

#: The hosts' gpuguard: this checkout's, by the interpreter running the tests.
REMOTE_GPUGUARD = f"{sys.executable} -m gpuguard.console"
SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Fleet:
    a: FakeGpuWorld
    b: FakeGpuWorld
    servers: dict[str, Sshd]
    config: Path
    tmp: Path

    def run(self, *args: str, cwd: Path | None = None,
            remote_command: str = REMOTE_GPUGUARD) -> subprocess.CompletedProcess[str]:
        """`gpuguard ARGS` here, with the fleet's ssh config and remote command."""
        env = child_env(NO_COLOR="1", GPUGUARD_SSH_CONFIG=str(self.config),
                        GPUGUARD_REMOTE_COMMAND=remote_command)
        env.pop(STATE_ENV, None)  # this side reads no NVML: only the hosts' worlds count
        return subprocess.run([sys.executable, "-m", "gpuguard.console", *args],
                              cwd=cwd or REPO, env=env, capture_output=True, text=True,
                              timeout=120)

    def json(self, *args: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        proc = self.run(*args, **kw)
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            raise AssertionError(f"exit {proc.returncode}, no JSON: {proc.stdout!r}\n"
                                 f"{proc.stderr}\n{self.logs()}") from None
        assert doc["schema"] == "gpuguard.remote/v1" and doc["exit_code"] == proc.returncode
        return proc.returncode, doc

    def logins(self, name: str) -> int:
        """The sessions the host's sshd has accepted so far."""
        return tail(self.servers[name].log, 10**6).count("Accepted publickey")

    def logs(self) -> str:
        return "\n".join(f"--- {n} sshd log:\n{tail(s.log)}" for n, s in self.servers.items())


def need_sshd() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the private sshd logs in as root")
    missing = [t for t in ("sshd", "ssh", "ssh-keygen") if shutil.which(t, path=SBIN_PATH) is None]
    if missing:
        why = f"not installed: {', '.join(missing)} (.ci/run installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def fleet(tmp_path: Path, fake_nvml_lib: Path) -> Iterator[Fleet]:
    """host-a: one H100; host-b: two A100s; down: a port nobody listens on."""
    need_sshd()
    a = FakeGpuWorld(tmp_path / "host-a-nvml.txt")
    a.add_gpu(0, name="NVIDIA Fake H100")
    b = FakeGpuWorld(tmp_path / "host-b-nvml.txt")
    b.add_gpu(0, name="NVIDIA Fake A100", uuid="GPU-b0")
    b.add_gpu(1, name="NVIDIA Fake A100", uuid="GPU-b1")
    servers: dict[str, Sshd] = {}
    try:
        for name, world in (("host-a", a), ("host-b", b)):
            servers[name] = Sshd(tmp_path / name, extra=[
                f"SetEnv {STATE_ENV}={world.path} LD_LIBRARY_PATH={fake_nvml_lib} "
                "GPUGUARD_EXPORTER_URL="])
        known = tmp_path / "known_hosts"
        known.write_text("".join(s.known_host + "\n" for s in servers.values()))
        blocks = [f"Host {name}\n  HostName 127.0.0.1\n  Port {s.port}\n"
                  f"  IdentityFile {s.base / 'user_key'}\n" for name, s in servers.items()]
        blocks.append(f"Host down\n  HostName 127.0.0.1\n  Port {free_port()}\n")
        config = tmp_path / "ssh_config"
        config.write_text("".join(blocks) + (
            f"Host *\n  User root\n  IdentitiesOnly yes\n  UserKnownHostsFile {known}\n"
            "  GlobalKnownHostsFile /dev/null\n  LogLevel ERROR\n"))
        yield Fleet(a, b, servers, config, tmp_path)
    finally:
        for server in servers.values():
            server.stop()


def test_status_across_two_hosts_and_one_unreachable(fleet: Fleet, trees: Trees) -> None:
    orphan = spawn_orphan(trees, fleet.a, gpu_bytes=3 * GIB)

    proc = fleet.run("--remote", "host-a,host-b", "--remote", "down", "status")
    assert proc.returncode == 10, proc.stdout + proc.stderr + fleet.logs()
    out = proc.stdout
    a, b = out.index("── host-a"), out.index("── host-b")
    assert a < b
    assert "NVIDIA Fake H100" in out[a:b] and "NVIDIA Fake A100" not in out[a:b]
    assert str(orphan.root) in out[a:b] and "orphan" in out[a:b]
    assert out[b:].count("NVIDIA Fake A100") == 2 and str(orphan.root) not in out[b:]
    down, = (line for line in out.splitlines() if line.startswith("down:"))
    assert down.startswith("down: unreachable: ssh: connect to host 127.0.0.1 port ")
    assert down.endswith("Connection refused")

    code, doc = fleet.json("--remote", "host-a,host-b,down", "status", "--json")
    assert code == 10 and [h["host"] for h in doc["hosts"]] == ["host-a", "host-b", "down"]
    host_a, host_b, gone = doc["hosts"]
    assert (host_a["exit_code"], host_a["failure"]) == (0, None)
    tree, = host_a["document"]["trees"]
    assert (tree["root_pid"], tree["root_start_time"], tree["verdict"]) == (
        orphan.root, orphan.root_start, "orphan")
    assert [g["name"] for g in host_b["document"]["gpus"]] == ["NVIDIA Fake A100"] * 2
    assert host_b["document"]["trees"] == [] and host_b["exit_code"] == 0
    assert gone["document"] is None and gone["failure"]["kind"] == "unreachable"
    assert gone["exit_code"] == 10


def test_a_remote_reap_is_a_dry_run_unless_apply(fleet: Fleet, trees: Trees) -> None:
    orphan = spawn_orphan(trees, fleet.a, gpu_bytes=2 * GIB)
    members = {orphan.root: orphan.root_start, orphan.holder: start_time_of(orphan.holder)}
    config = write_config(fleet.tmp)  # the host's policy and audit log (enforce mode)
    audit = fleet.tmp / "audit.jsonl"
    # The fake NVML reports this namespace's pids (CI runs the suite in its own namespace).
    reap = ("reap", str(orphan.root), "--config", str(config), "--allow-pid-namespace")

    proc = fleet.run("--remote", "host-a", *reap)
    assert proc.returncode == 0, proc.stdout + proc.stderr + fleet.logs()
    assert "dry run: would signal 2 process(es); nothing was sent" in proc.stdout
    assert f"on host-a alone:\n  --apply --start-time {orphan.root_start}\n" in proc.stdout
    code, doc = fleet.json("--remote", "host-a", *reap, "--json")
    remote = doc["hosts"][0]["document"]
    assert code == 0 and remote["outcome"] == "dry-run" and remote["apply"] is False
    assert remote["signals"] == [] and remote["audit_log"] == str(audit)
    for pid, started in members.items():  # nothing signalled, nothing replaced
        assert alive(pid) and stat_fields(pid)["start_time"] == started  # type: ignore[index]
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert records and all(r["manual"]["apply"] is False for r in records)

    # --apply names the process: without its start time, or on two hosts, no host is asked.
    before = fleet.logins("host-a")
    for refused in (fleet.run("--remote", "host-a", *reap, "--apply"),
                    fleet.run("--remote", "host-a,host-b", *reap, "--apply", "--start-time",
                              str(orphan.root_start))):
        assert refused.returncode == 2 and refused.stdout == ""
        assert len(refused.stderr.splitlines()) == 1
    assert fleet.logins("host-a") == before

    code, doc = fleet.json("--remote", "host-a", *reap, "--apply", "--start-time",
                           str(orphan.root_start), "--json")
    remote = doc["hosts"][0]["document"]
    assert code == 0 and (remote["apply"], remote["outcome"]) == (True, "reaped"), doc
    wait_for(lambda: not any(alive(pid) for pid in members), what="the reaped tree to go")
    applied = [json.loads(line) for line in audit.read_text().splitlines()][-1]
    assert applied["manual"]["apply"] is True and applied["outcome"] == "reaped"


@pytest.mark.parametrize("host", [
    "127.0.0.1;touch {marker}", "-oProxyCommand=touch {marker}",
    "host-a;touch${{IFS}}{marker}", "$(touch {marker})", "host-a`touch {marker}`",
    "host-a\n-oProxyCommand=touch {marker}",
])
def test_a_host_name_that_tries_injection_creates_nothing(fleet: Fleet, host: str) -> None:
    marker = fleet.tmp / "pwned"
    for args in (("--remote", host.format(marker=marker), "status"),
                 ("--remote", f"host-b,{host.format(marker=marker)}", "node-check")):
        before = fleet.logins("host-b")
        proc = fleet.run(*args, cwd=fleet.tmp)
        assert proc.returncode == 2 and proc.stdout == ""
        line, = proc.stderr.splitlines()
        assert line.startswith("gpuguard: --remote: refusing host ")
        assert fleet.logins("host-b") == before  # refused before any host was asked
    hosts_file = fleet.tmp / "hosts"
    hosts_file.write_text(f"# rack 1\nhost-b\n{host.format(marker=marker)}\n")
    proc = fleet.run("--hosts-file", str(hosts_file), "status", cwd=fleet.tmp)
    assert proc.returncode == 2 and proc.stdout == ""
    # Line 3 (or 4, where the name itself holds a newline: its own line in the file).
    assert re.match(f"gpuguard: {re.escape(str(hosts_file))}:[34]: refusing host ",
                    proc.stderr), proc.stderr
    assert not marker.exists() and not (fleet.tmp / "x").exists()


def test_arguments_reach_the_remote_gpuguard_as_the_words_they_were(fleet: Fleet) -> None:
    marker = fleet.tmp / "pwned"
    for config in (f"/nonexistent; touch {marker}", f"$(touch {marker})",
                   f"`touch {marker}`", f"a' ; touch '{marker}"):
        code, doc = fleet.json("--remote", "host-a", "status", "--json", "--config", config)
        host, = doc["hosts"]
        assert code == 2 and host["failure"]["kind"] == "failed", doc
        assert config in host["failure"]["detail"]  # the remote's config error names it
    assert not marker.exists()


def test_no_gpuguard_an_older_one_and_bad_json_are_each_named(fleet: Fleet) -> None:
    code, doc = fleet.json("--remote", "host-a,host-b", "status", "--json",
                           remote_command="/nonexistent/gpuguard")
    assert code == 9 and [h["failure"]["kind"] for h in doc["hosts"]] == ["no-gpuguard"] * 2
    assert "/nonexistent/gpuguard not found there (exit 127)" in doc["hosts"][0]["failure"][
        "detail"]

    older = fleet.tmp / "older-gpuguard"
    older.write_text(  # today's gpuguard, its status document without "trees"
        f"#!{sys.executable}\nimport json, subprocess, sys\n"
        "done = subprocess.run([sys.executable, '-m', 'gpuguard.console', *sys.argv[1:]],\n"
        "                      capture_output=True, text=True)\n"
        "doc = json.loads(done.stdout)\ndoc.pop('trees')\nprint(json.dumps(doc))\n"
        "sys.exit(done.returncode)\n")
    older.chmod(0o755)
    proc = fleet.run("--remote", "host-b,host-a", "status", remote_command=str(older))
    assert proc.returncode == 9, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("host-")]
    assert [line.split(":")[:2] for line in lines] == [["host-b", " older-gpuguard"],
                                                       ["host-a", " older-gpuguard"]]
    assert "lacks the key 'trees'" in lines[0]

    code, doc = fleet.json("--remote", "host-a", "status", "--json", remote_command="echo")
    assert code == 9 and doc["hosts"][0]["failure"]["kind"] == "bad-json"
    assert "status --json" in doc["hosts"][0]["failure"]["detail"]


def test_node_check_and_explain_per_host_and_the_worst_status(fleet: Fleet,
                                                               trees: Trees) -> None:
    orphan = spawn_orphan(trees, fleet.a, gpu_bytes=GIB)
    code, doc = fleet.json("--remote", "host-a,host-b", "node-check", "--json")
    assert code == 1 and [h["exit_code"] for h in doc["hosts"]] == [1, 0]
    assert [h["document"]["clean"] for h in doc["hosts"]] == [False, True]

    proc = fleet.run("--remote", "host-a,host-b", "--parallel", "1", "explain",
                     str(orphan.holder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = proc.stdout.index("── host-a"), proc.stdout.index("── host-b")
    assert "holds 1.0 GiB on GPU 0" in proc.stdout[a:b]
    assert "holds no GPU memory" in proc.stdout[b:]



def test_a_host_past_the_timeout_is_killed_and_named(fleet: Fleet) -> None:
    """ssh is killed at --timeout; the host reads timed-out. The remote command writes a
    line every 0.2 s for 20 s, so it ends at its next write once the connection is gone."""
    slow = "sh -c 'for i in $(seq 100); do sleep 0.2; echo .; done'"
    started = time.monotonic()
    code, doc = fleet.json("--remote", "host-b", "--timeout", "2", "node-check", "--json",
                           remote_command=slow)
    elapsed = time.monotonic() - started
    host, = doc["hosts"]
    assert code == 10 and host["failure"]["kind"] == "timed-out", doc
    assert host["failure"]["detail"].startswith("no whole answer within 2s")
    assert elapsed < 15, f"{elapsed:.1f}s: ssh was not killed at the timeout"
