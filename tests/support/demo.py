"""`make demo`: the whole loop on a machine without a GPU, narrated as it happens.

Starts a fake GPU, plants an orphaned tree (bash killed under sh -> python),
runs the exporter, the remediator (enforce), Alertmanager and Prometheus on
127.0.0.1, and prints the alert firing, the reap, and the resolution: what the reap did
is read from the remediator's final audit record (its outcome, the GPU bytes it found
freed), never from what the demo itself writes into the fake GPU. Ctrl-C stops
everything it started and removes its folder (/tmp/gpuguard-demo-*).
"""

from __future__ import annotations

import ctypes
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.support.fakenvml import FakeGpuWorld, build_library
from tests.support.proctree import CHAIN, Trees, alive, become_subreaper
from tests.support.promstack import missing_binaries, start_loop
from tests.support.servers import child_env

HOST = "demo-node"


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')}  {message}", flush=True)


def main() -> int:
    why = missing_binaries()
    if why:
        print(f"make demo: {why}", file=sys.stderr)
        return 1
    become_subreaper()
    base = Path(tempfile.mkdtemp(prefix="gpuguard-demo-"))
    try:
        return run(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        print(f"removed {base}", flush=True)


def reaped(record: dict) -> str:
    """The REAPED line, from the final audit record alone."""
    members = " and ".join(f"{m.get('comm')} {m.get('pid')}"
                           for m in (record.get("tree") or {}).get("members") or [])
    before = (record.get("tree") or {}).get("gpu_bytes")
    after, reclaimed = record.get("gpu_bytes_after"), record.get("reclaimed_bytes")
    why = f" ({record['outcome_reason']})" if record.get("outcome_reason") else ""
    line = (f"REAPED        outcome {record.get('outcome')}{why}: {members}; reclaimed_bytes "
            f"{reclaimed} (GPU bytes {before} before the signals, {after} at the re-read "
            "right after)")
    if reclaimed == 0 and after:
        line += ("; the fake driver still listed the dead processes then, so the record "
                 "claims nothing freed")
    return line


def run(base: Path) -> int:
    lib_dir = base / "lib"
    ctypes.CDLL(str(build_library(lib_dir)), mode=ctypes.RTLD_GLOBAL)
    world = FakeGpuWorld(base / "nvml-state.txt")
    world.add_gpu(0, name="NVIDIA Fake H100 (demo)")
    trees = Trees(base / "trees")
    running: list = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        tree = trees.spawn(CHAIN)
        worker, root = tree.pid("worker"), tree.pid("sh")
        world.add_process(0, worker, 12 * 2**30)
        world.update_gpu(0, memory_used=12 * 2**30, util_gpu=97)
        say(f"planted a tree: bash (pid {tree.launcher.pid}) -> sh ({root}) -> python ({worker}),"
            " holding 12 GiB on the fake GPU")
        tree.kill_launcher()
        say(f"killed the launching bash: sh {root} and its worker are now orphans")

        env = world.subprocess_env(lib_dir, child_env())
        loop = start_loop(base, env, hostname=HOST, scan_interval=1, for_seconds=5,
                          orphan_age_seconds=10, term_timeout_seconds=3)
        running.append(loop)
        exporter, remediator, recorder = loop.exporter, loop.remediator, loop.recorder
        am, prom, audit = loop.alertmanager, loop.prometheus, loop.audit_log
        say(f"exporter      {exporter.url}/metrics")
        say(f"remediator    {remediator.url}/healthz  (audit log {audit})")
        say(f"Prometheus    {prom.url}/alerts")
        say(f"Alertmanager  {am.url}/#/alerts")
        say("demo rules: GPUOrphanTree fires after 10 s of orphan age + for: 5s")

        seen: set[str] = set()
        audit_lines = 0
        while True:
            for alert in prom.firing("GPUOrphanTree"):
                key = f"firing:{alert['labels']['root_pid']}"
                if key not in seen:
                    seen.add(key)
                    lbl = alert["labels"]
                    say(f"ALERT FIRING  GPUOrphanTree root_pid={lbl['root_pid']} comm={lbl['comm']}"
                        f" user={lbl['user']} reason={lbl['reason']}")
            if audit.exists():
                lines = audit.read_text().splitlines()
                for line in lines[audit_lines:]:
                    record = json.loads(line)
                    decision = record.get("decision") or {}
                    if record.get("phase") != "final":  # written ahead: names who, not how
                        members = ", ".join(str(m["pid"]) for m in record["tree"]["members"])
                        say(f"REMEDIATOR    audit record before any signal: {members}")
                        continue
                    say(f"REMEDIATOR    {decision.get('action')} ({decision.get('reason')}): "
                        f"{decision.get('detail')}; kill path {record.get('kill_path')}, "
                        f"outcome {record.get('outcome')}")
                    if record.get("outcome") is not None:
                        say(reaped(record))
                        if record.get("outcome") == "reaped":
                            seen.add("gone")
                audit_lines = len(lines)
            if "freed" not in seen and "gone" in seen and not alive(root) and not alive(worker):
                # What a driver does once the processes are gone; the demo does it for the
                # fake one, after the remediator's own re-read (its record says what that saw).
                seen.add("freed")
                world.remove_process(worker)
                world.update_gpu(0, memory_used=0, util_gpu=0)
                say(f"FAKE DRIVER   sh {root} and python {worker} have exited: the demo drops "
                    "their 12 GiB from the fake GPU, as a driver would")
            for alert in recorder.alerts(lambda a: a["status"] == "resolved"):
                key = f"resolved:{alert['labels'].get('root_pid')}"
                if key not in seen:
                    seen.add(key)
                    say(f"RESOLVED      {alert['labels'].get('alertname')} "
                        f"root_pid={alert['labels'].get('root_pid')}")
                    # Narrate only what happened: this tree's orphan alert resolved after
                    # its reap, not some other alert (a start-up one) resolving.
                    if (alert["labels"].get("alertname") == "GPUOrphanTree"
                            and alert["labels"].get("root_pid") == str(root)
                            and "gone" in seen):
                        say("the loop is closed; Ctrl-C to stop (URLs above stay up until "
                            "then)")
            time.sleep(0.5)
    except KeyboardInterrupt:
        say("stopping everything the demo started")
    finally:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short (and leave servers).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for thing in reversed(running):
            thing.stop()
        trees.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
