"""Basic authentication and response headers from the web config, as WSGI middleware.

bcrypt is slow on purpose, so what logins cost is bounded here whoever sends how many
(docs/design.md, Principles, 3): successes and failures are remembered, each client
address (IPv6 by /64, all of 127.0.0.0/8 as one) has a budget of failed checks, one
bcrypt check runs at a time, and an unknown user is checked against a fixed dummy hash.
Why each: docs/design.md, Cost rules (HTTP under abuse).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuguard.web.ratelimit import TokenBucket
from gpuguard.web.webconfig import WebConfig

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
#: Successes remembered (least recently used goes first).
CACHE_SIZE = 256
#: Failures remembered, and for how long.
NEGATIVE_CACHE_SIZE = 4096
NEGATIVE_TTL_SECONDS = 60.0
#: Failed bcrypt checks a client address may cost at once, and the seconds that earn one more.
FAILURE_BURST = 10
FAILURE_REFILL_SECONDS = 6.0
#: Client addresses whose failures are counted (least recently failed goes first).
CLIENTS_TRACKED = 4096
#: bcrypt reads at most 72 bytes of a password; bcrypt >= 5 refuses longer ones.
BCRYPT_MAX_PASSWORD = 72
#: What an unknown user's password is checked against: bcrypt of a random string at cost
#: 10 (exporter-toolkit's choice), fixed so that no request ever pays for making one.
DUMMY_HASH = b"$2b$10$J.BTm5kx8oyBrIayUk4Pne62tyOsh86X2FM.rlA5MzTf9Gycluo4m"

#: Every IPv4 loopback address, one client for the failure budget.
LOOPBACK = "127.0.0.0/8"

ALLOW, DENY, THROTTLE = "allow", "deny", "throttle"


@dataclass(frozen=True)
class Verdict:
    outcome: str  # ALLOW, DENY or THROTTLE
    retry_after: int = 0  # seconds, for THROTTLE

    @property
    def allowed(self) -> bool:
        return self.outcome == ALLOW


ALLOWED, DENIED = Verdict(ALLOW), Verdict(DENY)
#: SHA-256 of the user name and of the password, the hash it was checked on: fixed-size
#: keys, so a cache entry costs the same whatever a client puts in its header.
_Key = tuple[bytes, bytes, bytes]


def cache_key(user: str, password: bytes, hashed: bytes | None) -> _Key:
    return (hashlib.sha256(user.encode("utf-8", "surrogateescape")).digest(),
            hashlib.sha256(password).digest(), hashed or b"")


def client_key(address: str) -> str:
    """Whose failures a request's are: its IPv4 address, or its IPv6 address's /64 (one
    host holds a whole /64), all of 127.0.0.0/8 as one (any local user can send from
    each of its 16 million addresses); anything else (a Unix socket's "localhost") as it
    is. IPv4 is not grouped by /24: honest clients behind one would spend each other's
    budget."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is None:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        ip = ip.ipv4_mapped
    return LOOPBACK if ip.is_loopback else str(ip)


def _checkpw(password: bytes, hashed: bytes) -> bool:
    """bcrypt's check, imported at the first login: a daemon without basic auth users never
    maps the library (docs/exporter.md, Memory)."""
    import bcrypt

    return bool(bcrypt.checkpw(password, hashed))


class BasicAuth:
    """Checks `Authorization: Basic` against the current web config's users, at a
    bounded cost (docs/design.md, Cost rules, HTTP under abuse). Thread-safe."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 checkpw: Callable[[bytes, bytes], bool] | None = None) -> None:
        self._clock = clock
        self._checkpw = checkpw if checkpw is not None else _checkpw
        self._ok: OrderedDict[_Key, None] = OrderedDict()
        self._bad: OrderedDict[_Key, float] = OrderedDict()  # -> when it is forgotten
        self._clients: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at
        self._lock = threading.Lock()  # the tables above
        self._bcrypt = threading.Lock()  # one check at a time

    def known(self, config: WebConfig, header: str | None) -> bool:
        """True when this request passes without a bcrypt check (no users configured,
        or its credentials succeeded before): cheap, for deciding where to run it."""
        if not config.users:
            return True
        key = _key(config, header)
        if key is None or not key[2]:
            return False
        with self._lock:
            return key in self._ok

    def allows(self, config: WebConfig, header: str | None, client: str = "") -> bool:
        return self.check(config, header, client).allowed

    def check(self, config: WebConfig, header: str | None, client: str = "") -> Verdict:
        if not config.users:
            return ALLOWED
        user, password = _credentials(header)
        if user is None or password is None:
            return DENIED  # nothing to check: costs nothing, counts for nothing
        hashed = config.users.get(user)
        key = cache_key(user, password, hashed)
        who = client_key(client)
        with self._lock:
            now = self._clock()
            if hashed is not None and key in self._ok:
                self._ok.move_to_end(key)
                return ALLOWED
            forget_at = self._bad.get(key)
            if forget_at is not None:
                if forget_at > now:
                    return DENIED
                del self._bad[key]
            wait = self._spend(who, now)  # before the check: concurrent ones count too
            if wait > 0:
                return Verdict(THROTTLE, retry_after=max(1, math.ceil(wait)))
        ok = self._bcrypt_check(password, hashed)
        with self._lock:
            if ok:
                self._refund(who)
                self._ok[key] = None
                while len(self._ok) > CACHE_SIZE:
                    self._ok.popitem(last=False)
            else:
                self._bad[key] = self._clock() + NEGATIVE_TTL_SECONDS
                self._bad.move_to_end(key)
                while len(self._bad) > NEGATIVE_CACHE_SIZE:
                    self._bad.popitem(last=False)
        return ALLOWED if ok else DENIED

    def _bcrypt_check(self, password: bytes, hashed: bytes | None) -> bool:
        with self._bcrypt:
            try:
                if hashed is None or len(password) > BCRYPT_MAX_PASSWORD:
                    # As slow as a real check: unknown users (and long guesses) look alike.
                    self._checkpw(password[:BCRYPT_MAX_PASSWORD], DUMMY_HASH)
                    return False
                return bool(self._checkpw(password, hashed))
            except ValueError:  # a hash bcrypt cannot use: nobody gets in with it
                return False

    def _spend(self, who: str, now: float) -> float:
        """Take one failure from `who`'s allowance; 0, or the seconds until there is one."""
        tokens, at = self._clients.pop(who, (float(FAILURE_BURST), now))
        tokens = min(float(FAILURE_BURST), tokens + max(0.0, now - at) / FAILURE_REFILL_SECONDS)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) * FAILURE_REFILL_SECONDS
        self._clients[who] = (tokens, now)
        while len(self._clients) > CLIENTS_TRACKED:
            self._clients.popitem(last=False)
        return wait

    def _refund(self, who: str) -> None:
        """A success does not count against its address."""
        if who in self._clients:
            tokens, at = self._clients[who]
            self._clients[who] = (min(float(FAILURE_BURST), tokens + 1.0), at)


def _key(config: WebConfig, header: str | None) -> _Key | None:
    user, password = _credentials(header)
    if user is None or password is None:
        return None
    return cache_key(user, password, config.users.get(user))


def _credentials(header: str | None) -> tuple[str | None, bytes | None]:
    if not header or not header[:6].lower() == "basic ":
        return None, None
    try:
        raw = base64.b64decode(header[6:].strip(), validate=True)
    except (binascii.Error, ValueError):
        return None, None
    user, sep, password = raw.partition(b":")
    if not sep:
        return None, None
    try:
        return user.decode("utf-8"), password
    except UnicodeDecodeError:
        return None, None


def protect(app: WSGIApp, current: Callable[[], WebConfig], *,
            exempt: Callable[[str], bool] = lambda path: False,
            auth: BasicAuth | None = None) -> WSGIApp:
    """`app` behind the web config's basic auth (paths for which `exempt` is true are
    open: health checks, and endpoints with their own credentials), with its headers
    added to every answer. `auth` is shared with whoever routes requests by it."""
    auth = auth if auth is not None else BasicAuth()
    # As the toolkit: the limiter is built once, from the config the server started with.
    limit = current().rate_limit
    bucket = TokenBucket(*limit) if limit is not None else None

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        config = current()

        def start(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            return start_response(status, [*headers, *config.headers], *rest)

        path = environ.get("PATH_INFO", "")
        if exempt(path):
            return app(environ, start)
        # Authentication first: anonymous requests must not spend the bucket of those
        # who authenticate (issue 48); failed logins have their own budget per address.
        verdict = auth.check(config, environ.get("HTTP_AUTHORIZATION"),
                             environ.get("REMOTE_ADDR") or "")
        if verdict.outcome == THROTTLE:
            body = json.dumps({"error": "too many failed logins from this address; retry "
                                        f"in {verdict.retry_after} s"}).encode()
            start("429 Too Many Requests", [("Content-Type", "application/json"),
                                            ("Content-Length", str(len(body))),
                                            ("Retry-After", str(verdict.retry_after))])
            return [body]
        if not verdict.allowed:
            body = json.dumps({"error": "unauthorized"}).encode()
            start("401 Unauthorized", [("Content-Type", "application/json"),
                                       ("Content-Length", str(len(body))),
                                       ("WWW-Authenticate", 'Basic realm="gpuguard"')])
            return [body]
        if bucket is not None and not bucket.allow():
            body = json.dumps({"error": "too many requests (the web config's rate_limit)"}
                              ).encode()
            start("429 Too Many Requests", [("Content-Type", "application/json"),
                                            ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, start)

    return wrapped
