"""The HTTP side of asking a peer's JSON API: one GET under one deadline, the credentials
it carries, what the answer's status means, and each request counted.

Alertmanager's client (confirmation, pull) and Prometheus's (pull) ask the same way; only
their paths and what they make of the JSON differ. A request that fails in any way is a
RequestFailure, never a value: callers turn it into "could not ask", which is never
"firing".
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpuguard.base.compat import StrEnum
from gpuguard.base.validation import Invalid
from gpuguard.engine.alerting import bounded_http
from gpuguard.engine.alerting.polling import PollResult, retry_after_seconds

T = TypeVar("T")
#: Where a secret comes from (tokens.TokenFile): None when there is none usable now.
SecretSource = Callable[[], "bytes | None"]


class RequestResult(StrEnum):
    """How one HTTP request went (gpuguard_remediator_alertmanager_requests_total{result})."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    UNAUTHORIZED = "unauthorized"


class RequestFailure(Exception):
    """One request did not give a usable answer; `result` is its counter label, `busy`
    says the peer shed it (503, 429), `retry_after` what it asked for (seconds)."""

    def __init__(self, result: RequestResult, detail: str, *, busy: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail
        self.busy = busy
        self.retry_after = retry_after


def poll_result(failures: list[RequestFailure]) -> PollResult:
    """A failed poll's result: busy or timeout (both retried sooner) before the rest."""
    if any(f.busy for f in failures):
        return PollResult.BUSY
    if any(f.result == RequestResult.TIMEOUT for f in failures):
        return PollResult.TIMEOUT
    if failures and all(f.result == RequestResult.UNAUTHORIZED for f in failures):
        return PollResult.UNAUTHORIZED
    return PollResult.ERROR


def tls_context(ca_file: str | None, key: str) -> tuple[ssl.SSLContext | None, str | None]:
    """The context https requests use, or why there is none (`key`: the ca_file's config
    key, which the problem names)."""
    try:
        return bounded_http.tls_context(ca_file), None
    except OSError as exc:  # ssl.SSLError included: not PEM, no certificate in it
        return None, f"{key}: cannot load {ca_file}: {exc.strerror or exc}"


def _printable(text: str) -> bool:
    return all(33 <= ord(c) < 127 for c in text)


class Credentials:
    """The Authorization header a request carries: a bearer token, basic auth (a user
    name and a password file), or none. Fails closed: with a secret configured and none
    usable now the request is not sent (RequestFailure, unauthorized), since sending it
    bare would only turn a readable misconfiguration into a stream of 401s."""

    def __init__(self, *, token: SecretSource | None = None, token_path: str | None = None,
                 username: str | None = None, password: SecretSource | None = None,
                 password_path: str | None = None) -> None:
        self._token, self._token_path = token, token_path
        self._username, self._password, self._password_path = username, password, password_path

    def header(self) -> str | None:
        """`Bearer TOKEN`, `Basic BASE64`, or None without credentials."""
        if self._token is not None:
            text = self._secret(self._token, f"credentials_file {self._token_path}", "token")
            if not _printable(text):
                raise RequestFailure(RequestResult.UNAUTHORIZED,
                                     "token contains spaces or control characters")
            return f"Bearer {text}"
        if self._password is not None and self._username is not None:
            text = self._secret(self._password, f"password_file {self._password_path}",
                                "password")
            pair = f"{self._username}:{text}".encode("ascii")
            return f"Basic {base64.b64encode(pair).decode('ascii')}"
        return None

    @staticmethod
    def _secret(source: SecretSource, where: str, what: str) -> str:
        secret = source()
        if secret is None:
            why = getattr(source, "problem", None)
            raise RequestFailure(RequestResult.UNAUTHORIZED,
                                 f"no {what} from {where}" + (f" ({why})" if why else ""))
        try:
            return secret.decode("ascii")
        except UnicodeDecodeError:
            raise RequestFailure(RequestResult.UNAUTHORIZED, f"{what} is not ASCII") from None


def bearer_credentials(path: str | None) -> Credentials:
    """A bearer token re-read from `path` when it changes; no credentials for None."""
    if path is None:
        return Credentials()
    # Imported here, not at the top: the remediator's app imports the worker and the rest of
    # the service, so a top-level import would become a cycle as soon as any of those
    # imports this module.
    from gpuguard.engine.alerting.tokens import TokenFile

    return Credentials(token=TokenFile(path), token_path=path)


def basic_credentials(username: str, password_path: str) -> Credentials:
    """Basic auth: `username` and a password re-read from `password_path` when it changes."""
    from gpuguard.engine.alerting.tokens import TokenFile

    return Credentials(username=username, password=TokenFile(password_path),
                       password_path=password_path)


class JsonPeers:
    """GETs JSON from the peers of one service (HA peers: several URLs), each within
    `timeout` seconds and by the caller's deadline; counts every request by result and
    logs a peer going bad, or coming back, once. Thread-safe."""

    def __init__(self, urls: tuple[str, ...], *, timeout: float, credentials: Credentials,
                 tls: ssl.SSLContext | None, tls_problem: str | None, what: str,
                 max_body: int, log: logging.Logger,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.urls = urls
        self.timeout = timeout
        self.monotonic = monotonic
        self._credentials = credentials
        self._tls, self._tls_problem = tls, tls_problem
        self._what = what  # "alertmanager", "prometheus": the log's and the errors' word
        self._max_body = max_body
        self._log = log
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(RequestResult, 0)
        self._failing: set[str] = set()

    def request_counts(self) -> dict[str, int]:
        """Requests so far by result, every key present; "unauthorized" also counts a
        request not sent because no usable secret was there to send."""
        with self._lock:
            return dict(self._counts)

    def get(self, base: str, path: str, deadline: float, parse: Callable[[Any], T]) -> T:
        """GET base+path, decode JSON, `parse` it; count the result; RequestFailure when
        unusable (a shape `parse` refuses with Invalid included)."""
        try:
            value = parse(self._fetch_json(base + path, deadline))
        except Invalid as exc:
            failure = RequestFailure(RequestResult.ERROR, f"unexpected answer: {exc}")
        except RequestFailure as exc:
            failure = exc
        else:
            self._record(base, RequestResult.OK, "")
            return value
        self._record(base, failure.result, failure.detail)
        raise failure

    def _fetch_json(self, url: str, deadline: float) -> Any:
        """GET `url` within timeout and by `deadline` (the whole call's), as JSON."""
        limit = min(self.timeout, deadline - self.monotonic())
        if limit <= 0:
            raise RequestFailure(RequestResult.TIMEOUT, "timed out: no time left for this peer")
        if self._tls_problem is not None and url.lower().startswith("https:"):
            raise RequestFailure(RequestResult.ERROR, self._tls_problem)
        headers = {"Accept": "application/json", "User-Agent": "gpuguard-remediator"}
        authorization = self._credentials.header()
        if authorization is not None:
            headers["Authorization"] = authorization
        try:
            answer = bounded_http.get(url, headers, deadline=self.monotonic() + limit,
                                      max_body=self._max_body, monotonic=self.monotonic,
                                      context=self._tls)
        except TimeoutError:
            raise RequestFailure(RequestResult.TIMEOUT,
                                 f"timed out: no complete answer within {limit:.3g}s") from None
        except bounded_http.TooLarge as exc:
            raise RequestFailure(RequestResult.ERROR, str(exc)) from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise RequestFailure(RequestResult.ERROR, f"{type(exc).__name__}: {exc}") from None
        status = answer.status
        if status in (401, 403):
            raise RequestFailure(RequestResult.UNAUTHORIZED, f"HTTP {status}")
        if status in (429, 503):  # shed under load: pull mode retries sooner
            raise RequestFailure(RequestResult.ERROR, f"HTTP {status}", busy=True,
                                 retry_after=retry_after_seconds(
                                     answer.headers.get("Retry-After")))
        if status != 200:
            raise RequestFailure(RequestResult.ERROR, f"HTTP {status}")
        try:
            return json.loads(answer.body)
        except (ValueError, RecursionError):  # UnicodeDecodeError included; deep nesting
            raise RequestFailure(RequestResult.ERROR,
                                 f"answer is not JSON {self._what} would send") from None

    def _record(self, base: str, result: RequestResult, detail: str) -> None:
        """Count one request; log a peer going bad or coming back once, not every time."""
        with self._lock:
            self._counts[result] += 1
            was_failing = base in self._failing
            if result == RequestResult.OK:
                self._failing.discard(base)
            else:
                self._failing.add(base)
        if result == RequestResult.OK and was_failing:
            self._log.info("%s %s answers again", self._what, base)
        elif result != RequestResult.OK and not was_failing:
            self._log.warning("%s %s: %s (%s)", self._what, base, detail, result)
        elif result != RequestResult.OK:
            self._log.debug("%s %s: %s (%s)", self._what, base, detail, result)
