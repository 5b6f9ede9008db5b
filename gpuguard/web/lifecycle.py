"""Prometheus's lifecycle endpoints, on both daemons: /-/healthy, /-/ready and /-/reload.

Platforms built for Prometheus and Alertmanager probe these paths, answered as Prometheus
answers them: /-/healthy is the daemon's liveness (503 only for what of /healthz a restart
mends), /-/ready turns 200 once the daemon has what it serves (the exporter's first scan,
the remediator's state) and is 503 before; both are open to probes, as /healthz is. POST
or PUT /-/reload does what SIGHUP does and answers its outcome (200, or 500 with the
reason), but only with --web.enable-lifecycle; without it 403 "Lifecycle API is not
enabled.", as Prometheus. It is not exempt from the web config's authentication: it sits
behind what guards /metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

HEALTHY, READY, RELOAD = "/-/healthy", "/-/ready", "/-/reload"
#: The probes: open without credentials, as /healthz.
PROBES = (HEALTHY, READY)
#: Prometheus's answer to a reload without --web.enable-lifecycle (403).
NOT_ENABLED = "Lifecycle API is not enabled."

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True)
class Lifecycle:
    """What the endpoints ask the daemon. `healthy` and `ready`: (ok, the line to answer);
    `reload`: None when --web.enable-lifecycle is off, else a reload now that answers
    None on success or why it was not taken (Reloader.attempt)."""

    healthy: Callable[[], tuple[bool, str]]
    ready: Callable[[], tuple[bool, str]]
    reload: Callable[[], str | None] | None


def with_lifecycle(app: WSGIApp, lifecycle: Lifecycle) -> WSGIApp:
    """`app` with the three paths answered in front of it (HEAD arrives here as GET:
    serving.answer_head_as_get)."""

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path in PROBES:
            if method != "GET":
                return _text(start_response, "405 Method Not Allowed", "Method Not Allowed",
                             ("Allow", "GET, HEAD"))
            ok, line = (lifecycle.healthy if path == HEALTHY else lifecycle.ready)()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable", line)
        if path == RELOAD:
            if method not in ("POST", "PUT"):
                return _text(start_response, "405 Method Not Allowed",
                             "Only POST or PUT requests allowed", ("Allow", "POST, PUT"))
            if lifecycle.reload is None:
                return _text(start_response, "403 Forbidden", NOT_ENABLED)
            problem = lifecycle.reload()
            if problem is not None:
                return _text(start_response, "500 Internal Server Error",
                             f"failed to reload config: {problem}")
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8"),
                                      ("Content-Length", "0")])
            return [b""]
        return app(environ, start_response)

    return wsgi


def _text(start_response: Callable[..., Any], status: str, line: str,
          *headers: tuple[str, str]) -> Iterable[bytes]:
    body = f"{line}\n".encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body))), *headers])
    return [body]
