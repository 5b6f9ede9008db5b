"""Basic authentication and response headers from the web config, as WSGI middleware.

bcrypt is slow on purpose (tens of milliseconds a check), so a successful check is
remembered by (user, SHA-256 of the password, hash): Prometheus scraping every few
seconds costs one bcrypt check, not one per scrape (exporter-toolkit caches the same
way). An unknown user (or a password longer than bcrypt reads) is checked against a
dummy hash of the configured cost, so that the answer takes as long as for a known one.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import bcrypt

from gpuguard.exporter.webconfig import WebConfig

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
CACHE_SIZE = 256
#: bcrypt reads at most 72 bytes of a password; bcrypt >= 5 refuses longer ones.
BCRYPT_MAX_PASSWORD = 72


def _cost(hashed: bytes) -> int:
    return int(hashed.split(b"$")[2])


@functools.lru_cache(maxsize=32)
def _dummy(cost: int) -> bytes:
    """A hash to check against for unknown users, at the cost of the real ones."""
    return bcrypt.hashpw(b"gpuguard", bcrypt.gensalt(rounds=cost))


class BasicAuth:
    """Checks `Authorization: Basic` against the current web config's users."""

    def __init__(self) -> None:
        self._ok: OrderedDict[tuple[str, bytes, bytes], None] = OrderedDict()
        self._lock = threading.Lock()

    def allows(self, config: WebConfig, header: str | None) -> bool:
        if not config.users:
            return True
        user, password = _credentials(header)
        if user is None or password is None:
            return False
        hashed = config.users.get(user)
        digest = hashlib.sha256(password).digest()
        key = (user, digest, hashed or b"")
        with self._lock:
            if hashed is not None and key in self._ok:
                self._ok.move_to_end(key)
                return True
        if hashed is None or len(password) > BCRYPT_MAX_PASSWORD:
            # As slow as a real check: no telling unknown users (or long guesses) apart.
            bcrypt.checkpw(b"x", _dummy(_cost(hashed or max(config.users.values(),
                                                              key=_cost))))
            return False
        if not bcrypt.checkpw(password, hashed):
            return False
        with self._lock:
            self._ok[key] = None
            while len(self._ok) > CACHE_SIZE:
                self._ok.popitem(last=False)
        return True


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
            exempt: Callable[[str], bool] = lambda path: False) -> WSGIApp:
    """`app` behind the web config's basic auth (paths for which `exempt` is true are
    open: health checks, and endpoints with their own credentials), with its headers
    added to every answer."""
    auth = BasicAuth()

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        config = current()

        def start(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            return start_response(status, [*headers, *config.headers], *rest)

        path = environ.get("PATH_INFO", "")
        if not exempt(path) and not auth.allows(config, environ.get("HTTP_AUTHORIZATION")):
            body = json.dumps({"error": "unauthorized"}).encode()
            start("401 Unauthorized", [("Content-Type", "application/json"),
                                       ("Content-Length", str(len(body))),
                                       ("WWW-Authenticate", 'Basic realm="gpuguard"')])
            return [body]
        return app(environ, start)

    return wrapped
