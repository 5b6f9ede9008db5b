"""How both daemons serve HTTP: waitress, with limits that keep it answering under abuse.

waitress's defaults (100 connections, 120 s idle timeout) let 100 clients that open
a connection and send nothing, or half a request, stop a server from accepting
anyone for two minutes: Prometheus's scrape and Alertmanager's webhook included.
Incomplete requests never reach a worker thread (waitress buffers them in its
event loop), so the remedy is room and a short fuse: many more connections than a
scraper and an Alertmanager HA pair ever need, and idle ones closed after
IDLE_TIMEOUT_SECONDS. A flood beyond CONNECTION_LIMIT inside that time still waits
in the kernel's accept queue; put such a host behind a firewall rule.
"""

from __future__ import annotations

from typing import Any

#: Seconds a connection may sit idle (nothing received) before it is closed.
IDLE_TIMEOUT_SECONDS = 10
#: Open connections at most; kept well under the usual 1024 open-file soft limit.
CONNECTION_LIMIT = 512
#: How often waitress looks for idle connections to close.
CLEANUP_INTERVAL_SECONDS = 2


def create_server(app: Any, *, host: str, port: int, ident: str, threads: int,
                  **options: Any) -> Any:
    """A waitress server for `app` with the limits above (raises OSError if it cannot bind)."""
    from waitress import create_server as waitress_server

    return waitress_server(app, host=host, port=port, threads=threads, ident=ident,
                           channel_timeout=IDLE_TIMEOUT_SECONDS,
                           connection_limit=CONNECTION_LIMIT,
                           cleanup_interval=CLEANUP_INTERVAL_SECONDS, **options)
