"""`gpuguard-exporter`: scan in the background, serve /metrics and /healthz."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app

from gpuguard.base import build, logformat
from gpuguard.base.flags import add_common, served_url
from gpuguard.base.reload import EarlyHangups, Reloader
from gpuguard.base.validation import ConfigError
from gpuguard.config import Config, load_config
from gpuguard.engine.scan.orphan_clock import ORPHAN_CLOCK_FILE, OrphanClock
from gpuguard.engine.scan.scanner import Scanner, platform_scanner
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.gpu.vendors import BACKENDS, Choice, choose
from gpuguard.host.allocator import one_malloc_arena
from gpuguard.host.events.listener import ProcessEvents
from gpuguard.host.events.privilege import release_net_admin
from gpuguard.host.launcher_memory import LAUNCHER_MEMORY_FILE, LauncherMemory
from gpuguard.host.platform import PLATFORM, Platform
from gpuguard.host.procfs import SCAN_THREAD_TURNS, ProcessView, boot_id, identity_alive
from gpuguard.host.registrar import Registrar, start_registrar
from gpuguard.web.landing import landing_page
from gpuguard.web.lifecycle import PROBES, Lifecycle, with_lifecycle
from gpuguard.web.serving import (
    create_server,
    listen_address,
    positive_float,
    serve_until_signalled,
)

if TYPE_CHECKING:
    from gpuguard.web.webconfig import WebConfigSource

log = logging.getLogger("gpuguard.exporter")

DEFAULT_LISTEN = "0.0.0.0:9877"


parse_listen = listen_address("0.0.0.0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpuguard-exporter",
        description="Export GPU gauges and orphaned GPU process trees to Prometheus.",
    )
    p.add_argument("--config", help="YAML config (its classify:, quotas:, audit: and "
                                    "accounting: sections are used here)")
    add_common(p, program="gpuguard-exporter", default_listen=DEFAULT_LISTEN,
               parse_listen=parse_listen, listen_help="where to serve the metrics",
               web_help="exporter-toolkit web config: TLS, client certificates, bcrypt basic "
                        "auth, headers (re-read when it or its certificates change, and on "
                        "SIGHUP); /healthz stays open for probes")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", type=_telemetry_path,
                   default="/metrics", metavar="PATH",
                   help="where the metrics are served (default /metrics)")
    p.add_argument("--collector.gpu", dest="collector_gpu", default=True,
                   action=argparse.BooleanOptionalAction,
                   help="the per-GPU gauges (info, memory, utilization, temperature, power), "
                        "which dcgm-exporter also exports (default on)")
    for backend in BACKENDS:  # node_exporter's spelling, one per GPU back-end
        p.add_argument(f"--collector.{backend.name}", dest=f"collector_{backend.name}",
                       default=None, action=argparse.BooleanOptionalAction,
                       help=f"read GPUs through the {backend.name} back-end (default: where "
                            "its library or devices are found; docs/gpu-vendors.md)")
    p.add_argument("--collector.processes", dest="collector_processes", default=True,
                   action=argparse.BooleanOptionalAction,
                   help="the per-process series gpuguard_gpu_process_info and "
                        "gpuguard_gpu_process_memory_bytes (default on); orphan trees, "
                        "accounting and the exporter's own metrics stay either way")
    p.add_argument("--scan-interval", type=positive_float, default=5.0, metavar="SECONDS",
                   help="seconds between scans (default 5)")
    p.add_argument("--hostname", default=socket.gethostname(),
                   help="hostname label on gpuguard_host_info (default: this host's name)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep the launcher memory (the first reason established for each "
                        "orphan root) in DIR/launchers.json, so that a restart cannot make a "
                        "tree more reapable, and each orphan root's first sighting in "
                        "DIR/orphans.json, so that a restart does not set "
                        "gpuguard_orphan_tree_age_seconds back to 0 (default: in memory only)")
    return p


def _telemetry_path(value: str) -> str:
    if not value.startswith("/") or value in ("/", "/healthz") or value.startswith("/-/") or any(
            c in value for c in "?# "):
        raise argparse.ArgumentTypeError(
            f"expected an absolute path other than /, /healthz and /-/..., got {value!r}")
    return value


def make_app(scanner: Scanner, registry: CollectorRegistry,
             telemetry_path: str = "/metrics",
             registrar: Callable[[], str | None] | None = None) -> Callable:
    """WSGI app: the metrics from the registry, /healthz from the scanner's liveness and
    the registrar's health (`registrar`: None, or a code when it does not serve), and a
    landing page at / linking to the metrics (as exporter-toolkit's)."""
    metrics_app = make_wsgi_app(registry)
    landing = landing_page("gpuguard-exporter", "GPU gauges and orphaned GPU process trees "
                           "for Prometheus.", build.version(),
                           [(telemetry_path, "Metrics"), ("/healthz", "Health")])

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            # Liveness is the scan thread: /metrics would keep serving a frozen snapshot.
            # Open to anyone: a status and a reason code, nothing else (the last scan's
            # time is gpuguard_last_scan_timestamp_seconds, behind /metrics' auth).
            # The registrar's too: while it does not serve, `gpuguard keep` and `gpuguard
            # run` fail for every user on the host.
            problem = ("scan-thread-stopped" if not scanner.alive()
                       else registrar() if registrar is not None else None)
            status = "200 OK" if problem is None else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [f"{problem or 'ok'}\n".encode()]
        if path == telemetry_path:
            return metrics_app(environ, start_response)
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [landing]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [f"not found: try {telemetry_path} or /healthz\n".encode()]

    return app


#: Open without the web config's basic auth: the probes.
OPEN_PATHS = ("/healthz", *PROBES)


def exporter_lifecycle(scanner: Scanner, reloader: Reloader, enabled: bool) -> Lifecycle:
    """/-/healthy is /healthz's answer (the scan thread); /-/ready waits for the first
    scan, before which /metrics has no GPU to show, and goes 503 again if the scan thread
    stops (/metrics would show the last scan for ever)."""

    def healthy() -> tuple[bool, str]:
        ok = scanner.alive()
        return ok, "gpuguard-exporter is Healthy." if ok else "scan-thread-stopped"

    def ready() -> tuple[bool, str]:
        if scanner.latest is None:
            return False, "gpuguard-exporter is not ready: the first scan is not done."
        if not scanner.alive():
            return False, "gpuguard-exporter is not ready: the scan thread stopped."
        return True, "gpuguard-exporter is Ready."

    return Lifecycle(healthy=healthy, ready=ready,
                     reload=reloader.attempt if enabled else None)


def reload_config(args: argparse.Namespace, scanner: Scanner, web: WebConfigSource | None,
                  platform: Platform = PLATFORM) -> Callable[[], None]:
    """SIGHUP's reload: the config file's classify:, quotas:, audit: and accounting:
    sections take effect from the next scan; the web config is re-read. A bad file changes
    nothing."""

    def reload() -> None:
        config = load_config(args.config)
        if web is not None:
            web.reload()
        if problem := platform.registrations.prepare(config.classify.marks_dir):
            log.info("%s", problem)
        scanner.reconfigure(rules=config.classify, quotas=config.quotas, audit=config.audit,
                           accounting=config.accounting.idle,
                           unlisted=config.accounting.unlisted)

    return reload


def main(argv: list[str] | None = None, platform: Platform = PLATFORM) -> int:
    """`platform`: the back-end this process runs on, chosen once (gpuguard.host.platform)."""
    args = build_parser().parse_args(argv)
    hangups = EarlyHangups()
    logformat.configure(args.log_level, args.log_format)
    # Before any thread starts: the threads' own arenas were 1.3 MiB (gpuguard/host/allocator.py).
    log.debug("%s", one_malloc_arena())
    # Scrapes, the connector and /proc reads: the soft limit is the default 1,024 otherwise.
    log.debug("%s", platform.raise_open_file_limit())
    try:
        config = load_config(args.config)
        web = _web_config(args.web_config_file) if args.web_config_file else None
    except ConfigError as exc:
        print(logformat.failure("gpuguard-exporter", f"config error: {exc}"), file=sys.stderr)
        return 2

    gpus = gpu_choice(args)
    events, scanner = _scanner(args, config, platform, gpus)
    if events is not None:
        # First, before any other thread: the subscription needs CAP_NET_ADMIN, dropped
        # right after it, and a thread started earlier would keep its own copy.
        events.start(after_subscribe=release_net_admin)
    if problem := platform.registrations.prepare(config.classify.marks_dir):
        log.info("%s", problem)
    # A new classify.marks_dir takes a restart here; where its directory could not be
    # made, prepare has said why registrations are off (and none is expected).
    registrar = platform.registrations.registrar(config.classify.marks_dir)
    registrar_health = registrar.health if registrar is not None else None
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname=args.hostname, events=events,
                                        gpu=args.collector_gpu,
                                        processes=args.collector_processes,
                                        registrar=registrar_health,
                                        inactive_backends=gpus.inactive))
    reloader = Reloader("gpuguard-exporter", reload_config(args, scanner, web, platform),
                        log=log)
    for collector in (reloader, build.BuildInfoCollector(), ProcessCollector(registry=None)):
        registry.register(collector)
    host, port = args.listen
    app = with_lifecycle(make_app(scanner, registry, args.telemetry_path, registrar_health),
                         exporter_lifecycle(scanner, reloader, args.enable_lifecycle))
    try:
        server = create_server(app, host=host, port=port, threads=4,
                               ident="gpuguard-exporter", web=web,
                               open_paths=lambda path: path in OPEN_PATHS)
    except OSError as exc:
        if events is not None:
            events.stop()
        print(logformat.failure("gpuguard-exporter",
                                f"cannot listen on {host}:{port}: {exc.strerror}"),
              file=sys.stderr)
        return 2
    if (problem := platform.other_users_problem()) is not None:
        log.warning("%s", problem)  # a non-root exporter without its capabilities
    hangups.hand_to(reloader)
    if registrar is not None:
        _start_registrar(registrar)
    scanner.start()
    tls = web is not None and web.current()[0].tls is not None
    log.info("serving %s on %s (scan every %gs)", args.telemetry_path, served_url(
        host, server.effective_port, tls=tls, path=""), args.scan_interval)
    try:
        serve_until_signalled(server, log, f"listening on {host}:{server.effective_port}",
                              on_hup=reloader.request)
    finally:
        if registrar is not None:
            registrar.stop()
        scanner.stop()
        if events is not None:
            events.stop()
        scanner.nvml.close()
    return 0


def _web_config(path: str) -> WebConfigSource:
    """The web config's source: its readers load only for a daemon given one (0.4 MiB of RSS)."""
    from gpuguard.web.webconfig import WebConfigSource

    return WebConfigSource(path)


def _start_registrar(registrar: Registrar) -> None:
    """The exporter serves `gpuguard keep` and `gpuguard run` registrations (it runs on
    every host); what keeps it from serving is logged and on /healthz."""
    _, problem = start_registrar(registrar.directory, registrar)
    if problem is not None:
        log.warning("%s: gpuguard keep and gpuguard run cannot register", problem)
    elif registrar.health() is None:
        log.info("registrations served at %s", registrar.socket_path)


def gpu_choice(args: argparse.Namespace) -> Choice:
    """The GPU back-ends the --collector.BACKEND flags ask for."""
    return choose({b.name: getattr(args, f"collector_{b.name}") for b in BACKENDS})


def _scanner(args: argparse.Namespace, config: Config, platform: Platform,
             gpus: Choice) -> tuple[ProcessEvents | None, Scanner]:
    """The scanner of this platform, and the process-event listener it reads where the
    platform has one (Linux)."""
    if platform.process_events is None:
        # Windows: psutil's process table and its rules; no kernel process events (it
        # cannot say how a launcher went) and no launcher memory (nothing to remember).
        return None, platform_scanner(platform, rules=config.classify, quotas=config.quotas,
                                      audit=config.audit, accounting=config.accounting,
                                      interval=args.scan_interval, gpus=gpus)
    # How launchers die (launcher-killed / launcher-exited); without the connector (a
    # container, an old kernel) it logs once and orphans read session-ended, as before.
    events: ProcessEvents = platform.process_events()
    memory = LauncherMemory(
        os.path.join(args.state_dir, LAUNCHER_MEMORY_FILE) if args.state_dir else None,
        boot=boot_id(), alive=identity_alive)
    # Orphan ages that outlive a restart: no firing GPUOrphanTree resolves and re-fires.
    clock = OrphanClock(
        os.path.join(args.state_dir, ORPHAN_CLOCK_FILE) if args.state_dir else None,
        boot=boot_id())
    scanner = platform_scanner(platform, rules=config.classify, quotas=config.quotas,
                               audit=config.audit, accounting=config.accounting,
                               interval=args.scan_interval,
                               view=lambda: ProcessView(events=events, memory=memory,
                                                        thread_turns=SCAN_THREAD_TURNS),
                               orphan_clock=clock, watch=events.watch, gpus=gpus)
    # An exit on a holder's chain (its launcher's, its own) wakes an early scan.
    events.on_watched_exit(scanner.wake)
    return events, scanner
