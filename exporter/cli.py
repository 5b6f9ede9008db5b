"""`gpuguard-exporter`: scan in the background, serve /metrics and /healthz."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, make_wsgi_app

from gpuguard.config import load_config
from gpuguard.exporter.metrics import GpuguardCollector
from gpuguard.exporter.scanner import Scanner
from gpuguard.host.launcher_memory import LAUNCHER_MEMORY_FILE, LauncherMemory
from gpuguard.host.marks import ensure_marks_dir
from gpuguard.host.nvml import Nvml
from gpuguard.host.procevents import ProcessEvents
from gpuguard.host.procfs import ProcessView, boot_id, identity_alive, other_users_problem
from gpuguard.validation import ConfigError
from gpuguard.web.serving import (
    create_server,
    listen_address,
    positive_float,
    serve_until_signalled,
)
from gpuguard.web.webconfig import WebConfigSource

log = logging.getLogger("gpuguard.exporter")

DEFAULT_LISTEN = "0.0.0.0:9877"


parse_listen = listen_address("0.0.0.0")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpuguard-exporter",
        description="Export GPU gauges and orphaned GPU process trees to Prometheus.",
    )
    p.add_argument("--config", help="YAML config (its classify:, quotas: and audit: sections "
                                    "are used here)")
    p.add_argument("--listen", type=parse_listen, default=parse_listen(DEFAULT_LISTEN),
                   metavar="HOST:PORT", help=f"where to serve /metrics (default {DEFAULT_LISTEN})")
    p.add_argument("--web-config-file", metavar="FILE",
                   help="exporter-toolkit web config: TLS, client certificates, bcrypt basic "
                        "auth, headers (re-read when it or its certificates change); "
                        "/healthz stays open for probes")
    p.add_argument("--scan-interval", type=positive_float, default=5.0, metavar="SECONDS",
                   help="seconds between scans (default 5)")
    p.add_argument("--hostname", default=socket.gethostname(),
                   help="hostname label on gpuguard_host_info (default: this host's name)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep the launcher memory (the first reason established for each "
                        "orphan root) in DIR/launchers.json, so that a restart cannot make a "
                        "tree more reapable (default: in memory only)")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    return p


def make_app(scanner: Scanner, registry: CollectorRegistry) -> Callable:
    """WSGI app: /metrics from the registry, /healthz from the scanner's liveness."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            # Liveness is the scan thread: /metrics would keep serving a frozen snapshot.
            # Open to anyone: a status and a reason code, nothing else (the last scan's
            # time is gpuguard_last_scan_timestamp_seconds, behind /metrics' auth).
            ok = scanner.alive()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"scan-thread-stopped\n"]
        if path in ("/metrics", "/"):
            return metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]

    return app


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        web = WebConfigSource(args.web_config_file) if args.web_config_file else None
    except ConfigError as exc:
        print(f"gpuguard-exporter: config error: {exc}", file=sys.stderr)
        return 2

    # How launchers die (launcher-killed / launcher-exited); without the connector (a
    # container, an old kernel) it logs once and orphans read session-ended, as before.
    events = ProcessEvents()
    memory = LauncherMemory(
        os.path.join(args.state_dir, LAUNCHER_MEMORY_FILE) if args.state_dir else None,
        boot=boot_id(), alive=identity_alive)
    scanner = Scanner(rules=config.classify, nvml=Nvml(), interval=args.scan_interval,
                      view=ProcessView(events=events, memory=memory), quotas=config.quotas,
                      audit=config.audit)
    if (problem := ensure_marks_dir(config.classify.marks_dir)) is not None:
        log.info("%s", problem)
    registry = CollectorRegistry()
    registry.register(GpuguardCollector(scanner, hostname=args.hostname, events=events))
    host, port = args.listen
    try:
        server = create_server(make_app(scanner, registry), host=host, port=port, threads=4,
                               ident="gpuguard-exporter", web=web,
                               open_paths=lambda path: path == "/healthz")
    except OSError as exc:
        print(f"gpuguard-exporter: cannot listen on {host}:{port}: {exc.strerror}",
              file=sys.stderr)
        return 2
    if (problem := other_users_problem()) is not None:
        log.warning("%s", problem)  # a non-root exporter without its capabilities
    events.start()
    scanner.start()
    log.info("serving /metrics on http://%s:%s (scan every %gs)",
             host, server.effective_port, args.scan_interval)
    try:
        serve_until_signalled(server, log, f"listening on {host}:{server.effective_port}")
    finally:
        scanner.stop()
        events.stop()
        scanner.nvml.close()
    return 0
