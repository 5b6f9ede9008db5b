"""Where the fleet view comes from: Prometheus's instant queries and Alertmanager's v2 API,
asked a fixed number of times whatever the number of hosts.

The HTTP edge, thin: each request is the remediator's own (`bounded_http.get`: one absolute
deadline for connect, TLS, headers and body; a size cap; no proxy, no redirects), with its
TLS context (`bounded_http.tls_context`, a CA file as `remediate.alertmanager.ca_file`) and
its secrets read as its token is (`tokens.TokenFile`: a private file, or no request). What
the answers mean is series.py's and view.py's.

Ten queries to Prometheus (QUERIES: one per family, each an instant query over every host
at once) and two requests to Alertmanager (its alerts that name a tree, its silences): a
fleet of 10,000 hosts costs what one host costs in requests, and its answers are read up
to MAX_BODY_BYTES each.
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode, urlsplit

from gpuguard.config import Config
from gpuguard.console.fleet import series
from gpuguard.console.fleet.view import TREE_FAMILIES, Answers
from gpuguard.engine.alerting import bounded_http
from gpuguard.engine.alerting.tokens import TokenFile

T = TypeVar("T")

#: The most of one answer read: 10,000 hosts with a tree each is about 4 MiB a family.
MAX_BODY_BYTES = 32 << 20
#: The whole view's bound, every request included (--timeout's default).
TIMEOUT_SECONDS = 10.0
#: The shipped rules' job names (`gpuguard assets --job`, --remediator-job).
EXPORTER_JOB = "gpuguard"
REMEDIATOR_JOB = "gpuguard-remediator"
#: How long a target that stopped answering keeps its host name in the view.
NAME_MEMORY = "1h"
USER_AGENT = "gpuguard-fleet"


class SourceProblem(ValueError):
    """Options that cannot make a request (one line: which option, what is wrong)."""


class Unanswered(Exception):
    """A request that gave no usable answer (one line: which URL, why)."""


def promql_string(text: str) -> str:
    """`text` as a PromQL double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def queries(exporter_job: str, remediator_job: str) -> dict[str, str]:
    """The instant queries of one view, by the Answers field each fills (the trees' by
    family). None names a host: each is one request for the whole fleet."""
    up = (f"up{{job={promql_string(exporter_job)}}} or "
          f"up{{job={promql_string(remediator_job)}}}")
    return {
        **{family: family for family in TREE_FAMILIES.values()},
        "host_info": "gpuguard_host_info",
        "host_info_hour": f"last_over_time(gpuguard_host_info[{NAME_MEMORY}])",
        "remediator_info": "gpuguard_remediator_info",
        "remediator_info_hour": f"last_over_time(gpuguard_remediator_info[{NAME_MEMORY}])",
        "up": up,
        "alerts": 'ALERTS{root_pid!=""}',
    }


#: Alertmanager's alerts that name a tree, in every state but resolved (API parameters).
AM_ALERTS_PARAMS = [("active", "true"), ("silenced", "true"), ("inhibited", "true"),
                    ("unprocessed", "true"), ("filter", 'root_pid=~".+"')]
AM_ALERTS_PATH = "/api/v2/alerts?" + urlencode(AM_ALERTS_PARAMS, quote_via=quote)
AM_SILENCES_PATH = "/api/v2/silences"


@dataclass(frozen=True)
class Auth:
    """How to authenticate to one server: a bearer token or basic auth (never both), and
    the CA that signs its certificate (https)."""

    credentials_file: str | None = None
    username: str | None = None
    password_file: str | None = None
    ca_file: str | None = None


@dataclass(frozen=True)
class FleetOptions:
    """What `gpuguard fleet` and `gpuguard mcp` were given (flags; the config file's
    remediate.alertmanager fills in Alertmanager when no flag names one)."""

    prometheus: str | None
    prometheus_auth: Auth = Auth()
    alertmanager: tuple[str, ...] = ()
    alertmanager_auth: Auth = Auth()
    insecure_credentials_over_http: bool = False
    exporter_job: str = EXPORTER_JOB
    remediator_job: str = REMEDIATOR_JOB
    timeout_seconds: float = TIMEOUT_SECONDS


@dataclass(frozen=True)
class Endpoint:
    """One server (Alertmanager: its HA peers, asked in order until one answers)."""

    option: str  # the flag that names it, for messages
    urls: tuple[str, ...]
    auth: Auth
    insecure_credentials_over_http: bool

    def problem(self) -> str | None:
        """Why no request may be made as configured, or None."""
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                return f"{self.option} {url!r}: not an http:// or https:// URL with a host"
            if parts.username is not None or parts.query or parts.fragment:
                return (f"{self.option} {url!r}: no credentials, query or fragment in the URL "
                        f"(use {self.option}-username and {self.option}-password-file)")
        auth = self.auth
        if auth.credentials_file and (auth.username or auth.password_file):
            return (f"{self.option}-credentials-file and basic auth "
                    f"({self.option}-username) are exclusive")
        if bool(auth.username) != bool(auth.password_file):
            return f"{self.option}-username and {self.option}-password-file go together"
        if auth.username and (":" in auth.username
                              or not all(32 < ord(c) < 127 for c in auth.username)):
            return f"{self.option}-username: printable ASCII without ':' or spaces"
        plain = [u for u in self.urls if u.lower().startswith("http://")]
        secret = auth.credentials_file or auth.password_file
        if secret and plain and not self.insecure_credentials_over_http:
            return (f"{self.option}: the credentials would be sent in clear to "
                    f"{', '.join(plain)}, to whoever holds that port; use https:// (with "
                    f"{self.option}-ca-file for a private CA), or "
                    "--insecure-credentials-over-http")
        return None


def endpoints(options: FleetOptions, config: Config) -> tuple[Endpoint, Endpoint | None]:
    """Prometheus's endpoint and Alertmanager's (None: neither a flag nor the config file's
    remediate.alertmanager names one); SourceProblem for options that cannot be used."""
    if not options.prometheus:
        raise SourceProblem("--prometheus URL is required: the Prometheus that scrapes the "
                            "exporters")
    prometheus = Endpoint("--prometheus", (options.prometheus.rstrip("/"),),
                          options.prometheus_auth, options.insecure_credentials_over_http)
    alertmanager: Endpoint | None = None
    section = config.remediate.alertmanager
    if options.alertmanager:
        alertmanager = Endpoint("--alertmanager",
                                tuple(u.rstrip("/") for u in options.alertmanager),
                                options.alertmanager_auth,
                                options.insecure_credentials_over_http)
    elif section is not None:  # the remediator's own: its URLs, token and CA
        alertmanager = Endpoint("--alertmanager", tuple(u.rstrip("/") for u in section.url),
                                Auth(credentials_file=section.credentials_file,
                                     ca_file=section.ca_file),
                                section.insecure_credentials_over_http
                                or options.insecure_credentials_over_http)
    for endpoint in (prometheus, alertmanager):
        if endpoint is not None and (why := endpoint.problem()) is not None:
            raise SourceProblem(why)
    return prometheus, alertmanager


class Connection:
    """GETs to one endpoint, all by one deadline (time.monotonic())."""

    def __init__(self, endpoint: Endpoint, deadline: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self._monotonic = monotonic
        self._context = None
        if any(u.lower().startswith("https:") for u in endpoint.urls):
            try:
                self._context = bounded_http.tls_context(endpoint.auth.ca_file)
            except OSError as exc:  # ssl.SSLError included
                raise SourceProblem(f"{endpoint.option}-ca-file: cannot load "
                                    f"{endpoint.auth.ca_file}: {exc.strerror or exc}") from None
        secret = endpoint.auth.credentials_file or endpoint.auth.password_file
        self._secret = TokenFile(secret) if secret else None

    def _authorization(self) -> str | None:
        if self._secret is None:
            return None
        value = self._secret()
        if value is None:
            raise SourceProblem(f"{self.endpoint.option}: {self._secret.problem}")
        if self.endpoint.auth.username:
            pair = self.endpoint.auth.username.encode() + b":" + value
            return "Basic " + base64.b64encode(pair).decode("ascii")
        if not all(32 < b < 127 for b in value):
            raise SourceProblem(f"{self.endpoint.option}-credentials-file: the token is not "
                                "printable ASCII without spaces")
        return f"Bearer {value.decode('ascii')}"

    def get(self, base: str, path: str, parse: Callable[[Any], T]) -> T:
        """GET base+path as JSON and `parse` it; Unanswered saying why it could not."""
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if (authorization := self._authorization()) is not None:
            headers["Authorization"] = authorization
        url = base + path
        shown = base + path.split("?", 1)[0]
        try:
            answer = bounded_http.get(url, headers, deadline=self.deadline,
                                      max_body=MAX_BODY_BYTES, monotonic=self._monotonic,
                                      context=self._context)
        except TimeoutError:
            raise Unanswered(f"{shown}: no complete answer within --timeout") from None
        except (OSError, http.client.HTTPException, ValueError, bounded_http.TooLarge) as exc:
            raise Unanswered(f"{shown}: {type(exc).__name__}: {exc}") from None
        if answer.status != 200:
            raise Unanswered(f"{shown}: HTTP {answer.status}")
        try:
            return parse(json.loads(answer.body))
        except (ValueError, RecursionError) as exc:  # series.ShapeError included
            raise Unanswered(f"{shown}: not the answer expected ({exc})"[:300]) from None


def ask_prometheus(conn: Connection, options: FleetOptions) -> dict[str, list[series.Sample]]:
    """Every query's samples; Unanswered as soon as one has none (a view without one of
    them would show a tree or a host wrong)."""
    base = conn.endpoint.urls[0]
    out = {}
    for name, expr in queries(options.exporter_job, options.remediator_job).items():
        path = "/api/v1/query?" + urlencode({"query": expr}, quote_via=quote)
        out[name] = conn.get(base, path, functools.partial(_vector_of, expr))
    return out


def _vector_of(query: str, data: Any) -> list[series.Sample]:
    return series.vector(data, query)


def ask_alertmanager(conn: Connection) -> tuple[list[series.AmAlert],
                                                 dict[str, series.Silence], list[str]]:
    """The alerts and silences of the first peer that answers; Unanswered when none does.
    Silences that cannot be had leave each silence only its id (and say so)."""
    failures = []
    for base in conn.endpoint.urls:
        try:
            alerts = conn.get(base, AM_ALERTS_PATH, series.am_alerts)
        except Unanswered as exc:
            failures.append(str(exc))
            continue
        try:
            return alerts, conn.get(base, AM_SILENCES_PATH, series.silences), []
        except Unanswered as exc:
            return alerts, {}, [f"silences unknown (who set them, until when): {exc}"]
    raise Unanswered("; ".join(failures))


def gather(options: FleetOptions, config: Config, *,
           monotonic: Callable[[], float] = time.monotonic) -> tuple[Answers, list[str]]:
    """What every source answered, and the errors that leave the view partial.
    SourceProblem for unusable options, Unanswered when Prometheus does not answer."""
    prometheus, alertmanager = endpoints(options, config)
    deadline = monotonic() + options.timeout_seconds
    got = ask_prometheus(Connection(prometheus, deadline, monotonic), options)
    errors: list[str] = []
    am: list[series.AmAlert] | None = None
    silences: dict[str, series.Silence] = {}
    am_error = None
    if alertmanager is not None:
        try:
            am, silences, errors = ask_alertmanager(Connection(alertmanager, deadline,
                                                               monotonic))
        except (Unanswered, SourceProblem) as exc:
            am_error = str(exc)
    answers = Answers(
        trees={family: got[family] for family in TREE_FAMILIES.values()},
        host_info=got["host_info"], host_info_hour=got["host_info_hour"],
        remediator_info=got["remediator_info"],
        remediator_info_hour=got["remediator_info_hour"], up=got["up"], alerts=got["alerts"],
        exporter_job=options.exporter_job, remediator_job=options.remediator_job,
        alertmanager=am, silences=silences, alertmanager_error=am_error)
    return answers, errors
