"""`gpuguard fleet`: every orphan tree on every host, from the Prometheus that scrapes the
exporters and the Alertmanager it alerts, with each tree's alert (firing, pending,
silenced by whom and until when, inhibited) and each host's exporter and remediator.

Read-only, and never on a host: a fixed number of requests whatever the fleet's size
(sources.py). The joins are pure (view.py), the table is table.py's, the JSON document
contract.FLEET_EPILOG's. To look at one host, `gpuguard explain` on it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from gpuguard.config import Config
from gpuguard.console.config_file import load
from gpuguard.console.contract import (
    EXIT_OK,
    EXIT_SOURCE_DOWN,
    EXIT_USAGE,
    FLEET_SCHEMA,
    PROG,
    Failure,
)
from gpuguard.console.fleet.sources import (
    Auth,
    FleetOptions,
    SourceProblem,
    Unanswered,
    endpoints,
    gather,
)
from gpuguard.console.fleet.table import fleet_renderable
from gpuguard.console.fleet.view import FleetView, build_view, fleet_json
from gpuguard.console.render import make_console, print_json


def options_from_args(args: argparse.Namespace) -> FleetOptions:
    """The fleet flags (cli's add_fleet_sources) as options."""

    def auth(prefix: str) -> Auth:
        return Auth(credentials_file=getattr(args, f"{prefix}_credentials_file"),
                    username=getattr(args, f"{prefix}_username"),
                    password_file=getattr(args, f"{prefix}_password_file"),
                    ca_file=getattr(args, f"{prefix}_ca_file"))

    return FleetOptions(
        prometheus=args.prometheus, prometheus_auth=auth("prometheus"),
        alertmanager=tuple(u for given in args.alertmanager or () for u in given.split(",")
                           if u),
        alertmanager_auth=auth("alertmanager"),
        insecure_credentials_over_http=args.insecure_credentials_over_http,
        exporter_job=args.exporter_job, remediator_job=args.remediator_job,
        timeout_seconds=args.timeout)


@dataclass(frozen=True)
class Collected:
    """One look at the fleet: its `document` (`fleet --json`'s), and the `view` behind it
    (None when Prometheus did not answer: `unanswered` says why, and the document too)."""

    document: dict[str, Any]
    view: FleetView | None
    alertmanager: str | None
    errors: list[str]
    unanswered: str | None = None


def collect(options: FleetOptions, config: Config) -> Collected:
    """Ask every source once and join the answers; Failure (exit 2) for unusable options."""
    try:
        prometheus, alertmanager = endpoints(options, config)
        am_url = ", ".join(alertmanager.urls) if alertmanager is not None else None
        answers, errors = gather(options, config)
    except SourceProblem as exc:
        raise Failure(EXIT_USAGE, str(exc)) from None
    except Unanswered as exc:
        down = f"Prometheus did not answer: {exc}"
        document = {"schema": FLEET_SCHEMA, "taken_at": time.time(),
                    "sources": {"prometheus": prometheus.urls[0], "alertmanager": am_url,
                                "alertmanager_error": None},
                    "errors": [down], "hosts": [], "trees": [], "stray_alerts": []}
        return Collected(document, None, am_url, [down], down)
    view = build_view(answers)
    return Collected(fleet_json(view, schema=FLEET_SCHEMA, taken_at=time.time(),
                                prometheus=prometheus.urls[0], alertmanager=am_url,
                                errors=errors), view, am_url, errors)


def cmd_fleet(args: argparse.Namespace) -> int:
    got = collect(options_from_args(args), load(args.config))
    if args.json:
        print_json(got.document)
    elif got.view is not None:
        make_console().print(fleet_renderable(got.view, alertmanager=got.alertmanager,
                                              errors=got.errors))
    if got.unanswered is not None:
        print(f"{PROG}: {got.unanswered}", file=sys.stderr)
        return EXIT_SOURCE_DOWN
    return EXIT_OK
