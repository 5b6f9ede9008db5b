"""`gpuguard-remediator`: the Alertmanager webhook that may reap orphan GPU trees.

Start-up refuses, in one line on stderr, anything that would make the remediator
unsafe or silently useless. Exit status 2 (the unit never restarts it: a person must
change something first): a bad config or flag, no token (unless --insecure-no-auth,
and then only on loopback), a path others could tamper with, a state file that does
not parse. Exit status 3 (the unit restarts it): a state directory or audit log that
cannot be used now (read-only, full, an I/O error), or a port that is taken; a state
directory that can be read first gets its crash recovery, so what an interrupted reap
left stopped is continued before the exit. Served by waitress, threaded, one process:
the queue, the worker and the dedupe ledger must live in one process.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import ProcessCollector

from gpuguard.base import build, logformat
from gpuguard.base.flags import add_common
from gpuguard.base.reload import EarlyHangups, Reloader, ReloadRefused
from gpuguard.base.validation import ConfigError
from gpuguard.config import Config, load_config
from gpuguard.config.remediate import PrometheusConfig
from gpuguard.engine.reap.audit import UnsafePathError
from gpuguard.engine.state.ledger import LedgerError, StateUnavailable
from gpuguard.host.events.privilege import release_net_admin
from gpuguard.host.platform import PLATFORM, Platform
from gpuguard.host.procfs import other_users_problem
from gpuguard.web.lifecycle import PROBES, Lifecycle, with_lifecycle
from gpuguard.web.serving import create_server, listen_address, serve_until_signalled
from gpuguard.web.webconfig import WebConfigSource

if TYPE_CHECKING:
    from gpuguard.remediator.service import Remediator

log = logging.getLogger("gpuguard.remediator")

PROG = "gpuguard-remediator"
DEFAULT_LISTEN = "127.0.0.1:9878"
TOKEN_ENV = "GPUGUARD_TOKEN_FILE"
HTTP_THREADS = 4


#: Paths the web config's basic auth leaves alone: they carry the bearer token (one
#: Authorization header cannot carry both), or are probes.
OWN_AUTH_PATHS = ("/alerts", "/state", "/healthz")

parse_listen = listen_address("127.0.0.1")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Alertmanager webhook receiver that reaps orphaned GPU process trees "
                    "when an alert fires and the policy (remediate: section) allows it.",
    )
    p.add_argument("--config", required=True, metavar="FILE",
                   help="YAML config; its classify: and remediate: sections are used")
    add_common(p, program=PROG, default_listen=DEFAULT_LISTEN, parse_listen=parse_listen,
               listen_help="where to serve /alerts, /state, /metrics and /healthz",
               web_help="exporter-toolkit web config: TLS, client certificates, basic auth "
                        "(for /metrics: /alerts and /state keep their bearer token, "
                        "/healthz stays open), headers; re-read when it or its "
                        "certificates change, and on SIGHUP")
    p.add_argument("--token-file", metavar="FILE",
                   help=f"bearer token Alertmanager must send (or env {TOKEN_ENV}); "
                        "re-read when it changes")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="accept requests without a token (loopback listeners only)")
    p.add_argument("--allow-pid-namespace", action="store_true",
                   help="start outside the host PID namespace (only where NVML reports this "
                        "namespace's pids, e.g. a test rig); NVML reports host pids, so "
                        "elsewhere pids would name the wrong processes")
    p.add_argument("--hostname", default=socket.gethostname(), metavar="NAME",
                   help="this host's name as the alerts' hostname label spells it "
                        "(default: this host's name)")
    return p


#: Exit statuses: a person must change something (never restarted by the units) ...
EXIT_CONFIG = 2
#: ... or it may work on the next try (a full or read-only disk, a port still taken).
EXIT_RETRY = 3


def _fail(message: str, status: int = EXIT_CONFIG) -> int:
    print(logformat.failure(PROG, message), file=sys.stderr, flush=True)
    return status


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _state_failure(exc: Exception) -> int:
    """The exit for a state directory or audit log that cannot be used: 3 (restarted)
    when it may work on the next try, 2 when a person must change something."""
    if isinstance(exc, StateUnavailable):
        return _fail(f"state error: {exc}; exiting for a restart", EXIT_RETRY)
    if isinstance(exc, UnsafePathError):
        return _fail(f"unsafe path: {exc}")
    if isinstance(exc, LedgerError):
        return _fail(f"state error: {exc}")
    assert isinstance(exc, OSError)
    where = exc.filename or "state_dir/audit_log"
    if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink planted at the audit log
        return _fail(f"unsafe path: {where}: {exc.strerror}")
    return _fail(f"cannot use {where}: {exc.strerror}; exiting for a restart", EXIT_RETRY)


def _start(service: Remediator, server: Any) -> int | None:
    """Start the service (crash recovery first); the exit status if it may not run."""
    try:
        service.start()
    except (StateUnavailable, OSError) as exc:  # recovery ran; nothing else may start
        server.close()
        service.stop()
        return _state_failure(exc)
    return None


def _prometheus_problem(prom: PrometheusConfig | None) -> str | None:
    """Why remediate.prometheus cannot be used as configured (a secret file, a CA file),
    checked once at start like the Alertmanager token; None when it can."""
    if prom is None:
        return None
    from gpuguard.engine.alerting.tokens import TokenFile

    secrets = [("remediate.prometheus.credentials_file", prom.credentials_file)]
    if prom.basic_auth is not None:
        secrets.append(("remediate.prometheus.basic_auth.password_file",
                        prom.basic_auth.password_file))
    for key, path in secrets:
        if path is not None and (source := TokenFile(path))() is None:
            return f"{key}: {source.problem}"
    if prom.ca_file is not None:
        from gpuguard.engine.alerting.prometheus import tls_context

        return tls_context(prom.ca_file)[1]
    return None


def reload_config(path: str, running: Config,
                  web: WebConfigSource | None) -> Callable[[], None]:
    """SIGHUP's reload: the web config is re-read; the config file is checked, and a
    changed policy is refused until a restart (the ledger, the audit log and the worker
    were built from it; a half-applied policy is worse than an old one)."""

    def reload() -> None:
        config = load_config(path)
        # Only the sections the remediator uses: an edit of the exporter's quotas: or
        # audit: in a shared file is not a change here.
        if (config.classify, config.remediate) != (running.classify, running.remediate):
            raise ReloadRefused(f"{path}: the classify: or remediate: section changed; the "
                                "remediator takes a new policy only at a restart "
                                "(`systemctl reload` or `restart gpuguard-remediator`; the "
                                "web config was not reloaded either)")
        if web is not None:
            web.reload()

    return reload


def remediator_lifecycle(service: Remediator, reloader: Reloader, enabled: bool) -> Lifecycle:
    """/-/healthy fails only for what a restart mends (Status.liveness_problem, whatever
    /healthz answers first; the liveness probe), /healthz for every degraded state;
    /-/ready waits for the state: the ledger loaded, what a crash left settled, then the
    worker started (Remediator.start)."""

    def healthy() -> tuple[bool, str]:
        if (mends := service.liveness_problem()) is not None:
            return False, mends
        ok, code, _ = service.healthy()
        return True, f"{PROG} is Healthy." + ("" if ok else f" (/healthz: {code})")

    def ready() -> tuple[bool, str]:
        if not service.worker.alive():
            return False, f"{PROG} is not ready: its state is not loaded, or its worker stopped."
        return True, f"{PROG} is Ready."

    return Lifecycle(healthy=healthy, ready=ready,
                     reload=reloader.attempt if enabled else None)


def main(argv: list[str] | None = None, platform: Platform = PLATFORM) -> int:
    """`platform`: the back-end this process runs on, chosen once (gpuguard.host.platform)."""
    args = build_parser().parse_args(argv)
    hangups = EarlyHangups()
    logformat.configure(args.log_level, args.log_format)
    log.debug("%s", platform.raise_open_file_limit())  # a reap holds a pidfd per member
    try:
        config = load_config(args.config)
        web = WebConfigSource(args.web_config_file) if args.web_config_file else None
    except ConfigError as exc:
        return _fail(f"config error: {exc}")
    host, port = args.listen
    token_path = args.token_file or os.environ.get(TOKEN_ENV) or None
    if token_path is None and not args.insecure_no_auth:
        return _fail(f"refusing to start without a bearer token: pass --token-file FILE "
                     f"(or set {TOKEN_ENV}), or --insecure-no-auth")
    if token_path is not None and args.insecure_no_auth:
        return _fail("--insecure-no-auth and a token file exclude each other; pick one")
    if args.insecure_no_auth and not _loopback(host):
        return _fail(f"--insecure-no-auth is only allowed on a loopback address, not {host}")
    if platform.outside_host_pid_namespace() and not args.allow_pid_namespace:
        return _fail("refusing to start outside the host PID namespace: NVML reports host "
                     "pids, which name other processes here (run with hostPID / --pid=host, "
                     "or pass --allow-pid-namespace if NVML reports this namespace's pids)")

    from gpuguard.engine.alerting.tokens import TokenFile
    from gpuguard.remediator.app import AlertsIntake, create_app
    from gpuguard.remediator.service import build_remediator

    token = None
    if token_path is not None:
        token = TokenFile(token_path)
        if token() is None:
            return _fail(token.problem or f"token file {token_path} is unusable")
    else:
        log.warning("--insecure-no-auth: POST /alerts accepts requests without a token")

    credentials = config.remediate.alertmanager and config.remediate.alertmanager.credentials_file
    if credentials:
        # Checked here, once, like the token: at kill time an unusable one only refuses.
        am_token = TokenFile(credentials)
        if am_token() is None:
            return _fail(f"remediate.alertmanager.credentials_file: {am_token.problem}")
    am = config.remediate.alertmanager
    if am is not None and am.ca_file is not None:
        from gpuguard.engine.alerting.alertmanager import tls_context

        if (problem := tls_context(am.ca_file)[1]) is not None:
            return _fail(problem)  # at kill time it would only refuse every reap
    if (problem := _prometheus_problem(config.remediate.prometheus)) is not None:
        return _fail(problem)  # pull mode would only fail every poll

    if (problem := other_users_problem(signal=True)) is not None:
        log.warning("%s", problem)  # a non-root remediator without its capabilities

    # Windows has no process-events connector (and no launcher evidence to hear). The
    # subscription comes before any other thread: it needs CAP_NET_ADMIN, dropped right
    # after it, and a thread started earlier would keep its own copy. It acts on nothing.
    events = platform.process_events() if platform.process_events is not None else None
    if events is not None:
        events.start(after_subscribe=release_net_admin)
    try:
        # Nothing runs (no recovery, no worker, no poller) before the port is ours: a
        # second instance that cannot bind must not act on the same state.
        service = build_remediator(config, hostname=args.hostname, platform=platform,
                                   events=events)
    except (LedgerError, UnsafePathError, OSError) as exc:
        if events is not None:
            events.stop()
        return _state_failure(exc)
    reloader = Reloader(PROG, reload_config(args.config, config, web), log=log)
    app = with_lifecycle(create_app(service, token=token, collectors=(
        reloader, build.BuildInfoCollector(), ProcessCollector(registry=None))),
        remediator_lifecycle(service, reloader, args.enable_lifecycle))
    # Without a token (--insecure-no-auth) /state has no credentials of its own.
    own_auth = (*(OWN_AUTH_PATHS if token is not None else ("/alerts", "/healthz")), *PROBES)
    try:
        server = create_server(app, host=host, port=port, threads=HTTP_THREADS,
                               ident=PROG, web=web, body=AlertsIntake(service.intake, token),
                               open_paths=lambda path: path in own_auth)
    except OSError as exc:
        service.stop()
        return _fail(f"cannot listen on {host}:{port}: {exc.strerror}", EXIT_RETRY)
    hangups.hand_to(reloader)
    if (status := _start(service, server)) is not None:
        return status
    log.info("mode %s, host %s, policy %s", config.remediate.mode, args.hostname, config.source)
    try:
        serve_until_signalled(server, log, f"listening on {host}:{server.effective_port}",
                              on_hup=reloader.request)
    finally:
        service.stop()
        service.nvml.close()  # type: ignore[attr-defined]
    return 0
