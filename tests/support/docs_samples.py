"""README and docs-site samples from a real run: `python -m tests.support.docs_samples`.

Starts three real GPU-holding trees over the fake NVML (tests/support/fakenvml/), each with
`setsid -f` as a job started from a login: one whose launching shell is then SIGKILLed (an
orphan), one started with `nohup` whose shell is SIGKILLed too (protected), and one started
in a session of its own (normal, detached). A real exporter, started before the kills so its
process-event listener hears them, is scraped (its launcher memory is where the console
reads it); `gpuguard status` is rendered through the console's own scan and renderable
into an SVG; `gpuguard explain` and `gpuguard reap` (a dry run, then --apply, which ends
the orphan tree) run as the real command. Writes docs/assets/
and the /metrics excerpt between the README's markers. Needs gcc (the fake library) and
Linux; it signals only processes it started, by pid and start time. With `--demo` it
records `make demo`'s transcript instead (docs/assets/make-demo.txt; needs Prometheus and
Alertmanager, about a minute).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpuguard.console.evidence import EXPORTER_STATE_DIR_ENV
from tests.support.fakenvml import STATE_ENV, FakeGpuWorld, build_library
from tests.support.proctree import CHAIN, HOLDER, alive, descendants_of, stat_fields, wait_for
from tests.support.servers import REPO, Exporter, child_env

ASSETS = REPO / "docs" / "assets"
README = REPO / "README.md"
HOST = "gpu-node-7"
GIB = 2**30
#: The families the /metrics excerpt shows, in this order (the rest of a scrape: the GPU
#: gauges' siblings, the scan and inspector counters, client_python's self-metrics).
EXCERPT_FAMILIES = (
    "gpuguard_host_info",
    "gpuguard_nvml_up",
    "gpuguard_gpu_memory_used_bytes",
    "gpuguard_gpu_process_info",
    "gpuguard_gpu_process_memory_bytes",
    "gpuguard_orphan_trees",
    "gpuguard_orphan_tree_age_seconds",
    "gpuguard_orphan_tree_memory_bytes",
    "gpuguard_orphan_tree_processes",
    "gpuguard_process_events_up",
)
#: Where the SVG is shown as an image (GitHub, the docs site), the web font rich names cannot
#: load: these keep its columns aligned (rich places them for an aspect ratio of 0.61).
MONOSPACE = ("Fira Code, ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', "
             "'Liberation Mono', monospace")
BEGIN, END = "<!-- BEGIN metrics-sample (python -m tests.support.docs_samples) -->", \
    "<!-- END metrics-sample -->"


def excerpt(text: str, families: tuple[str, ...] = EXCERPT_FAMILIES) -> str:
    """The HELP, TYPE and sample lines of `families`, in that order, from one scrape."""
    blocks: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"# (?:HELP|TYPE) (\S+)", line) or re.match(r"([a-zA-Z_:][\w:]*)", line)
        if match and match.group(1) in families:
            blocks.setdefault(match.group(1), []).append(line)
    return "\n".join(line for name in families for line in blocks.get(name, [])) + "\n"


def replace_between(text: str, body: str) -> str:
    """`text` with what lies between the README's sample markers replaced by `body`."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n```text\n" + body + "```\n" + text[end:]


def run_console(env: dict[str, str], cwd: Path, *args: str) -> str:
    """`gpuguard ARGS` as a person runs it (output piped: no colour, 120 columns)."""
    proc = subprocess.run([sys.executable, "-m", "gpuguard", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"gpuguard {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return f"$ gpuguard {' '.join(args)}\n{proc.stdout}"


def render_status(hostname: str) -> tuple[str, str]:
    """`gpuguard status` through the console's own scan and renderable: (SVG, plain text)."""
    from rich.console import Console

    from gpuguard.console.config_file import load
    from gpuguard.console.render import status_renderable
    from gpuguard.console.status import new_scanner

    scanner = new_scanner(load(None))
    try:
        snap = scanner.scan_once()
    finally:
        scanner.nvml.close()
    console = Console(record=True, width=104, force_terminal=True, color_system="truecolor",
                      highlight=False, soft_wrap=False, file=io.StringIO())
    console.print(status_renderable(snap, hostname, lambda _t: None))
    text = console.export_text(clear=False)
    svg = console.export_svg(title=f"gpuguard status --hostname {hostname}").replace(
        "font-family: Fira Code, monospace", f"font-family: {MONOSPACE}")
    return svg, f"$ gpuguard status --hostname {hostname}\n{text}"


def scrape_until(exporter: Exporter, ready: Callable[[str], bool], what: str) -> str:
    import requests

    def attempt() -> str | None:
        text = requests.get(f"{exporter.url}/metrics", timeout=5).text
        return text if ready(text) else None

    return str(wait_for(attempt, timeout=30, interval=0.2, what=what))


class Planted:
    """Processes started with `setsid -f` (adopted by PID 1 or the session's subreaper, as a
    job started from a login is), each known by pid and start time; `cleanup()` kills those
    that are still the same process, with their descendants."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.known: list[tuple[int, object]] = []

    def start(self, name: str, script: str) -> Path:
        """`setsid -f bash -c SCRIPT` ({holder}, {dir} filled in); returns its folder."""
        folder = self.base / name
        folder.mkdir(parents=True)
        holder = f"{shlex.quote(sys.executable)} {shlex.quote(str(HOLDER))}"
        text = script.format(holder=holder, dir=shlex.quote(str(folder)))
        subprocess.run(["setsid", "-f", "bash", "-c", text], check=True, timeout=10,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return folder

    def pid(self, folder: Path, name: str) -> int:
        path = folder / name
        pid = int(str(wait_for(lambda: path.exists() and path.read_text().strip(),
                               what=f"pid file {path}")))
        self.known.append((pid, (stat_fields(pid) or {}).get("start_time")))
        return pid

    def same(self, pid: int) -> bool:
        now = stat_fields(pid)
        return now is not None and (pid, now["start_time"]) in self.known

    def kill(self, pid: int) -> None:
        """SIGKILL `pid` if it is still the process recorded, and wait until it is gone."""
        if self.same(pid):
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not alive(pid), what=f"pid {pid} to die")

    def cleanup(self) -> None:
        victims = {pid for pid, _ in self.known if self.same(pid)}
        for pid in list(victims):
            victims.update(descendants_of(pid))
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


#: The three trees, as a person starts them from a shell that is then killed (the first two).
ORPHAN = "echo $$ > {dir}/launcher; " + CHAIN
NOHUP = "echo $$ > {dir}/launcher; nohup {holder} --pidfile {dir}/worker >/dev/null 2>&1 & wait"
DETACHED = "exec {holder} --pidfile {dir}/worker"  # setsid -f made its session


def write(name: str, text: str) -> None:
    ASSETS.mkdir(parents=True, exist_ok=True)
    (ASSETS / name).write_text(text)
    print(f"wrote {(ASSETS / name).relative_to(REPO)}")


def plant(world: FakeGpuWorld, planted: Planted) -> dict[str, int]:
    """The three trees on two fake GPUs; their launchers still alive."""
    world.add_gpu(0, util_gpu=97, temp=61, power_mw=410_000)
    world.add_gpu(1, util_gpu=35, temp=48, power_mw=220_000)
    orphan, kept, detached = (planted.start("orphan", ORPHAN), planted.start("nohup", NOHUP),
                              planted.start("detached", DETACHED))
    pids = {"launcher": planted.pid(orphan, "launcher"), "root": planted.pid(orphan, "sh"),
            "worker": planted.pid(orphan, "worker"),
            "nohup-launcher": planted.pid(kept, "launcher"),
            "nohup-worker": planted.pid(kept, "worker"),
            "detached": planted.pid(detached, "worker")}
    world.add_process(0, pids["worker"], 12 * GIB)
    world.add_process(1, pids["nohup-worker"], 20 * GIB)
    world.add_process(1, pids["detached"], 8 * GIB)
    world.update_gpu(0, memory_used=12 * GIB)
    world.update_gpu(1, memory_used=28 * GIB)
    return pids


def reap_samples(env: dict[str, str], base: Path, root: int) -> str:
    """`gpuguard reap ROOT` (dry run), then with --apply: which ends the orphan tree."""
    (base / "audit").mkdir(mode=0o700)
    (base / "gpuguard.yml").write_text(
        "remediate:\n"
        f"  audit_log: {base}/audit/audit.jsonl\n"
        f"  state_dir: {base}/state\n"
        "  allow_root_owned: true   # the sample machine runs every job as root\n"
        "  users: {allow: ['*'], deny: []}\n")
    start = str((stat_fields(root) or {}).get("start_time"))
    return (run_console(env, base, "reap", str(root), "--config", "gpuguard.yml")
            + run_console(env, base, "reap", str(root), "--apply", "--start-time", start,
                          "--config", "gpuguard.yml"))


def demo_transcript(timeout: float = 120.0) -> str:
    """`make demo`'s own output (tests/support/demo.py), up to its "the loop is closed"
    line and its Ctrl-C clean-up; the times of day are its own."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.demo"], cwd=REPO,
                            env=child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "the loop is closed" in line:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"make demo did not close the loop in {timeout:.0f}s:\n"
                                 + "".join(lines))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return "$ make demo\n" + "".join(lines)


def main() -> int:
    if "--demo" in sys.argv[1:]:  # the demo's transcript only (needs Prometheus, Alertmanager)
        write("make-demo.txt", demo_transcript())
        return 0
    base = Path(tempfile.mkdtemp(prefix="gpuguard-docs-"))
    lib_dir = base / "lib"
    ctypes.CDLL(str(build_library(lib_dir)), mode=ctypes.RTLD_GLOBAL)  # before pynvml loads
    world = FakeGpuWorld(base / "nvml-state.txt")
    os.environ[STATE_ENV] = str(world.path)
    planted = Planted(base / "trees")
    exporter: Exporter | None = None
    try:
        pids = plant(world, planted)
        # The exporter keeps its launcher memory where the console reads it (as the shipped
        # unit's --state-dir and the console's default do on a real host).
        memory = base / "exporter-state"
        memory.mkdir(mode=0o700)
        os.environ[EXPORTER_STATE_DIR_ENV] = str(memory)
        env = world.subprocess_env(lib_dir, child_env())
        exporter = Exporter(env=env, args=["--hostname", HOST, "--state-dir", str(memory)])
        scrape_until(exporter, lambda t: "gpuguard_process_events_up 1.0" in t,
                     "the exporter's process-event listener")
        planted.kill(pids["launcher"])  # an agent stops its shell: SIGKILL
        planted.kill(pids["nohup-launcher"])
        metrics = scrape_until(
            exporter, lambda t: bool(re.search(
                r"gpuguard_orphan_tree_age_seconds\{[^}]*\} ([5-9]|\d\d)", t)),
            "the orphan tree, 5 s old")
        write("metrics-excerpt.txt", excerpt(metrics))
        svg, text = render_status(HOST)
        write("gpuguard-status.svg", svg)
        write("gpuguard-status.txt", text)
        write("gpuguard-explain.txt", run_console(env, base, "explain", str(pids["worker"])))
        write("gpuguard-reap.txt", reap_samples(env, base, pids["root"]))
        readme = README.read_text()
        if BEGIN in readme and END in readme:
            README.write_text(replace_between(readme, excerpt(metrics)))
            print(f"updated {README.relative_to(REPO)} between its metrics-sample markers")
        else:
            print(f"{README.relative_to(REPO)} has no metrics-sample markers: left as it is")
    finally:
        if exporter is not None:
            exporter.stop()
        planted.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
