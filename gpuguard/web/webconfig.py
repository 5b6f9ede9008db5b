"""The exporter-toolkit web configuration file (`--web.config.file`), for both daemons.

The format node_exporter and dcgm-exporter read (`tls_server_config`,
`http_server_config`, `basic_auth_users`). What the toolkit documents is honoured or
refused at start-up, never silently ignored. `WebConfigSource` re-reads the file and
its certificates when they change (and on SIGHUP); a broken edit, or one that would
weaken a guard (weakenings(): the one rule of what a reload may not do), keeps the last
good one. Why: docs/design.md, Contracts (web config).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuguard.base.reload import ReloadRefused
from gpuguard.base.validation import (
    CONFIG_FILE,
    At,
    ConfigError,
    boolean,
    integer,
    mapping,
    parse_yaml,
    string,
    string_list,
)
from gpuguard.web.ratelimit import go_duration

log = logging.getLogger("gpuguard.webconfig")

#: client_auth_type values (Go's tls.ClientAuthType names) -> what Python's ssl can do.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
CLIENT_AUTH_UNSUPPORTED = ("RequestClientCert", "RequireAnyClientCert",
                           "RequireClientCert")  # the toolkit's old name of RequireAny...
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: Go's TLS 1.2 cipher suite names -> OpenSSL's. (Go, like Python, does not let TLS 1.3
#: suites be chosen.)
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
}
#: The response headers the toolkit lets a web config set.
HEADERS = ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options",
           "X-XSS-Protection", "Strict-Transport-Security")
#: A bcrypt hash's form (checked without running bcrypt: a reload must stay cheap).
BCRYPT_HASH = re.compile(r"\$2[abxy]?\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
#: Seconds between checks of the files' identities (a stat of each, per connection).
RECHECK_SECONDS = 0.25  # the toolkit's own reload test waits 250 ms


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str | None
    key_file: str | None
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    client_ca_file: str | None = None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion | None = None
    ciphers: tuple[str, ...] = ()
    prefer_server_ciphers: bool = True  # the toolkit's default
    #: A verified client certificate must name one of these (DNS, email, IP or URI SAN).
    allowed_sans: tuple[str, ...] = ()
    #: Inline PEM (the toolkit's `cert` and `key`), in place of the files.
    cert_pem: str | None = field(default=None, repr=False)
    key_pem: str | None = field(default=None, repr=False)

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        """load_cert_chain reads only files: inline PEM goes to files in a fresh 0700
        directory of ours (no other user can read them), removed once loaded."""
        if self.cert_pem is None and self.key_pem is None:
            ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
            return
        private = tempfile.mkdtemp(prefix="gpuguard-tls-")
        try:
            cert, key = self.cert_file, self.key_file
            for name, pem in (("cert.pem", self.cert_pem), ("key.pem", self.key_pem)):
                if pem is None:
                    continue
                path = os.path.join(private, name)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as out:
                    out.write(pem)
                cert, key = (path, key) if name == "cert.pem" else (cert, path)
            ctx.load_cert_chain(str(cert), str(key))
        finally:
            shutil.rmtree(private, ignore_errors=True)

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)

    def context(self) -> ssl.SSLContext:
        """A server context; raises ssl.SSLError or OSError for unusable files."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.min_version
        if self.max_version is not None:
            ctx.maximum_version = self.max_version
        if self.ciphers:
            ctx.set_ciphers(":".join(self.ciphers))
        self._load_chain(ctx)
        if self.prefer_server_ciphers:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.verify_mode = self.client_auth
        if self.client_ca_file:
            ctx.load_verify_locations(cafile=self.client_ca_file)
        elif self.client_auth != ssl.CERT_NONE:
            # As the toolkit: no client_ca_file means the system's CAs.
            ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
        return ctx


@dataclass(frozen=True)
class WebConfig:
    """One reading of the file: TLS (or None), bcrypt users (or none), extra headers."""

    source: str
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()
    #: rate_limit: (seconds per request, burst); None when off (no interval).
    rate_limit: tuple[float, int] | None = None


def _file(base: Path) -> Callable[[At, Any], str]:
    def check(at: At, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise at.error("must be a file name")
        full = (base / value) if not os.path.isabs(value) else Path(value)
        try:
            with open(full, "rb"):
                pass
        except OSError as exc:
            raise at.error(f"cannot read {full}: {exc.strerror}") from None
        return str(full)

    return check


def _unsupported(why: str) -> Callable[[At, Any], None]:
    def check(at: At, value: Any) -> None:
        raise at.error(f"not supported: {why}")

    return check


def _tls(base: Path) -> Callable[[At, Any], TlsConfig]:
    def check(at: At, value: Any) -> TlsConfig:
        got = mapping(at, value, {
            "cert_file": _file(base),
            "key_file": _file(base),
            "client_auth_type": _client_auth,
            "client_ca_file": _file(base),
            "min_version": _version,
            "max_version": _version,
            "cipher_suites": _ciphers,
            "prefer_server_cipher_suites": boolean,
            "cert": lambda at, v: string(at, v, non_empty=True),
            "key": lambda at, v: string(at, v, non_empty=True),
            "curve_preferences": _unsupported("Python's ssl cannot choose curves"),
            "client_allowed_sans": string_list,
        })
        for inline, named in (("cert", "cert_file"), ("key", "key_file")):
            if inline in got and named in got:
                raise at.child(inline).error(f"give {inline} or {named}, not both")
            if inline not in got and named not in got:
                raise at.child(named).error(f"is required for TLS (or an inline {inline})")
        low, high = got.get("min_version"), got.get("max_version")
        if low is not None and high is not None and high < low:
            raise at.child("max_version").error("is below min_version: no handshake could "
                                                "succeed")
        auth = got.get("client_auth_type", ssl.CERT_NONE)
        if auth != ssl.CERT_NONE and "client_ca_file" not in got:
            log.warning("%s: no client_ca_file: client certificates are verified against "
                        "the system's CAs (any certificate they signed is accepted)", at.key)
        if got.get("client_allowed_sans") and auth == ssl.CERT_NONE:
            raise at.child("client_allowed_sans").error("needs client certificates: set "
                                                        "client_auth_type")
        if "client_ca_file" in got and auth == ssl.CERT_NONE:
            raise at.child("client_auth_type").error("client_ca_file is set but "
                                                     "client_auth_type is NoClientCert: say "
                                                     "how to use it")
        tls = TlsConfig(
            cert_file=got.get("cert_file"), key_file=got.get("key_file"), client_auth=auth,
            cert_pem=got.get("cert"), key_pem=got.get("key"),
            client_ca_file=got.get("client_ca_file"),
            min_version=got.get("min_version", ssl.TLSVersion.TLSv1_2),
            max_version=got.get("max_version"), ciphers=got.get("cipher_suites", ()),
            prefer_server_ciphers=got.get("prefer_server_cipher_suites", True),
            allowed_sans=tuple(got.get("client_allowed_sans", ())),
        )
        try:
            tls.context()
        except (ssl.SSLError, OSError) as exc:
            raise at.error(f"unusable certificate, key or CA: {exc}") from None
        return tls

    return check


def _client_auth(at: At, value: Any) -> ssl.VerifyMode:
    if value in CLIENT_AUTH_UNSUPPORTED:
        raise at.error(f"{value} is not supported: Python's ssl verifies every client "
                       "certificate it asks for; use VerifyClientCertIfGiven or "
                       "RequireAndVerifyClientCert")
    if value not in CLIENT_AUTH:
        raise at.error(f"must be one of {', '.join(CLIENT_AUTH)}, got {value!r}")
    return CLIENT_AUTH[value]


def _version(at: At, value: Any) -> ssl.TLSVersion:
    if value not in TLS_VERSIONS:
        raise at.error(f"must be one of {', '.join(TLS_VERSIONS)}, got {value!r}")
    return TLS_VERSIONS[value]


#: TLS 1.3's suites: the toolkit accepts and ignores them (Go, like OpenSSL through
#: Python's ssl, always offers all three), so a config copied from it loads here too.
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384",
                "TLS_CHACHA20_POLY1305_SHA256")


def _ciphers(at: At, value: Any) -> tuple[str, ...]:
    names = string_list(at, value)
    unknown = [n for n in names if n not in CIPHER_SUITES and n not in TLS13_SUITES]
    if unknown:
        raise at.error(f"{unknown[0]!r} is not a TLS 1.2 suite this server can offer (TLS "
                       "1.3 suites are accepted and ignored)")
    if ignored := [n for n in names if n in TLS13_SUITES]:
        log.warning("%s: %s ignored: TLS 1.3 suites cannot be chosen (all are offered)",
                    at.key, ", ".join(ignored))
    return tuple(CIPHER_SUITES[n] for n in names if n in CIPHER_SUITES)


def _rate_limit(at: At, value: Any) -> tuple[float, int] | None:
    got = mapping(at, value, {
        "interval": _duration,
        "burst": lambda at, v: integer(at, v, minimum=0),
    })
    interval = got.get("interval", 0.0)
    return (interval, got.get("burst", 0)) if interval > 0 else None


def _duration(at: At, value: Any) -> float:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value * 1e-9  # a bare number is nanoseconds, as Go's time.Duration
    try:
        return go_duration(string(at, value))
    except ValueError as exc:
        raise at.error(str(exc)) from None


def _http(at: At, value: Any) -> tuple[tuple[str, str], ...]:
    got = mapping(at, value, {
        "headers": _headers,
        "http2": _no_http2,
    })
    return got.get("headers", ())


def _no_http2(at: At, value: Any) -> None:
    if value is not False:
        raise at.error("HTTP/2 is not supported: set false or leave it out")


#: Headers whose values the toolkit restricts (exact values, as it compares them).
HEADER_VALUES = {"X-Content-Type-Options": ("nosniff",),
                 "X-Frame-Options": ("deny", "sameorigin")}


def _scalar_text(value: Any) -> str | None:
    """A YAML scalar as the toolkit's map[string]string reads it: `X-XSS-Protection: 1`
    is the string "1"; a mapping or list is no header value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    return None


def _headers(at: At, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise at.error("must be a mapping of header to value")
    out = []
    for name, raw in value.items():
        if name not in HEADERS:
            raise at.child(name).error(f"must be one of {', '.join(HEADERS)}")
        text = _scalar_text(raw)
        if text is None or "\n" in text or "\r" in text:
            raise at.child(name).error("must be a one-line string")
        allowed = HEADER_VALUES.get(name)
        if allowed is not None and text not in allowed:
            raise at.child(name).error(f"must be one of {', '.join(allowed)}, got {text!r}")
        out.append((name, text))
    return tuple(out)


def _users(at: At, value: Any) -> dict[str, bytes]:
    if not isinstance(value, dict):
        raise at.error("must be a mapping of user name to bcrypt hash")
    out = {}
    for user, hashed in value.items():
        where = at.child(user)
        if not isinstance(user, str) or not user or ":" in user:
            raise where.error("a user name must be a non-empty string without ':'")
        if not isinstance(hashed, str):
            raise where.error("must be a bcrypt hash")
        if BCRYPT_HASH.fullmatch(hashed) and hashed.startswith("$2$"):
            # Go's bcrypt (the toolkit's) verifies the original scheme; Python's refuses
            # every login against it ("Invalid salt"), which would answer 500 each time.
            raise where.error("$2$ bcrypt hashes are not supported (Python's bcrypt cannot "
                              "verify them); rehash it as $2b$ (htpasswd -nbBC 10 USER PW)")
        if not BCRYPT_HASH.fullmatch(hashed):
            raise where.error("is not a bcrypt hash ($2a$/$2b$/$2y$, cost, 53 characters of "
                              "salt and hash)")
        out[user] = hashed.encode()
    return out


def parse_web_config(text: str, *, source: str) -> WebConfig:
    base = Path(source).resolve().parent
    got = mapping(At(CONFIG_FILE, source=source), parse_yaml(text, source=source) or {}, {
        "tls_server_config": _tls(base),
        "http_server_config": _http,
        "basic_auth_users": _users,
        "rate_limit": _rate_limit,
    })
    return WebConfig(source=source, tls=got.get("tls_server_config"),
                     users=got.get("basic_auth_users", {}),
                     headers=got.get("http_server_config", ()),
                     rate_limit=got.get("rate_limit"))


def load_web_config(path: str) -> WebConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(path, "(file)", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "(file)", f"cannot read: {exc}") from None
    return parse_web_config(text, source=path)


def _identity(path: str) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


class WebConfigSource:
    """The current web config and TLS context, re-read when a file they come from changes.

    `current()` is called per connection (TLS) and per request (auth); it stats the
    files at most once per RECHECK_SECONDS. A re-read that fails keeps what was last
    good: a half-written certificate during rotation must not take the endpoint down.
    """

    def __init__(self, path: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._config = load_web_config(path)
        self._context = self._config.tls.context() if self._config.tls else None
        self._seen = self._identities(self._config)
        self._checked = clock()
        self._failed: tuple[object, ...] | None = None

    def _identities(self, config: WebConfig) -> tuple[object, ...]:
        files = (self.path, *(config.tls.files() if config.tls else ()))
        return tuple(_identity(f) for f in files)

    def current(self) -> tuple[WebConfig, ssl.SSLContext | None]:
        with self._lock:
            now = self._clock()
            if now - self._checked >= RECHECK_SECONDS:
                self._checked = now
                self._refresh()
            return self._config, self._context

    def reload(self) -> None:
        """SIGHUP: re-read the file now, changed or not; ReloadRefused when it is refused
        (the last good one is kept, as on a refused re-read)."""
        with self._lock:
            self._checked = self._clock()
            problem = self._refresh(force=True)
        if problem is not None:
            raise ReloadRefused(f"web config {self.path}: {problem}")

    def _refresh(self, *, force: bool = False) -> str | None:
        """Take the file when it changed (or when forced); the problem when refused."""
        seen = self._identities(self._config)
        if not force and (seen == self._seen or seen == self._failed):
            return None
        try:
            config = load_web_config(self.path)
            context = config.tls.context() if config.tls else None
        except (ConfigError, ssl.SSLError, OSError) as exc:
            self._failed = seen
            log.error("web config %s: keeping the last good one: %s", self.path, exc)
            return str(exc)
        after = self._identities(config)
        if after[0] != seen[0]:
            # The file changed while it was read: a torn read may have lost keys. Read it
            # again at the next check (a SIGHUP's reload says so and keeps the last good).
            return "the file changed while it was read; keeping the last good one" \
                if force else None
        refusals = list(weakenings(self._config, config))
        if self._config.tls is None and config.tls is not None:
            # Not a weakening, but not live either: the TLS front is built at start.
            refusals.append("TLS cannot be switched on without a restart")
        if refusals:
            problem = "; ".join(refusals)
            self._failed = seen
            log.error("web config %s: refused, keeping the last good one: %s", self.path,
                      problem)
            return problem
        self._config, self._context = config, context
        self._seen, self._failed = after, None
        log.info("web config %s reloaded", self.path)
        return None


#: The subject alternative names the toolkit compares (cert.DNSNames, EmailAddresses,
#: IPAddresses, URIs), as ssl's getpeercert() names their kinds. The others it gives are
#: no string to compare: a directoryName (DirName) is a tuple of RDNs, an otherName reads
#: '<unsupported>', a registeredID an OID.
_SAN_KINDS = frozenset({"DNS", "email", "IP Address", "URI"})


def san_allowed(peercert: Mapping[str, Any] | None, allowed: tuple[str, ...]) -> bool:
    """Whether a verified client certificate (ssl's getpeercert() dict) names one of
    `allowed` in a DNS, email, IP or URI subject alternative name, as the toolkit
    compares them (IP addresses by value); any other kind never matches, never raises."""
    if not allowed:
        return True
    if not peercert:
        return False
    wanted = {_san_key(name) for name in allowed}
    return any(_san_key(entry[1]) in wanted for entry in peercert.get("subjectAltName", ())
               if isinstance(entry, tuple) and len(entry) == 2 and entry[0] in _SAN_KINDS
               and isinstance(entry[1], str))


def _san_key(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name.strip()))
    except ValueError:
        return name



#: How much each client_auth_type asks of a client, weakest first.
_CLIENT_AUTH_STRENGTH = {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1, ssl.CERT_REQUIRED: 2}
_CLIENT_AUTH_NAMES = {mode: name for name, mode in CLIENT_AUTH.items()}
_VERSION_NAMES = {version: name for name, version in TLS_VERSIONS.items()}
_SUITE_NAMES = {openssl: go for go, openssl in CIPHER_SUITES.items()}


def weakenings(old: WebConfig, new: WebConfig) -> tuple[str, ...]:
    """Every way `new` in place of `old` would let in a client, a login or a protocol that
    `old` keeps out, one line each naming its key: what a reload may not do.

    A guard comes down only with a restart: a reload that lowers one is what a file
    caught half-written, or an edit of the wrong copy, looks like. What changes without
    widening is fine: rotated certificates, keys, CA files and passwords, and anything
    stricter. The list and its reasons are docs/web-config.md's, Reloads.
    """
    found: list[str] = []
    if old.tls is not None and new.tls is None:
        found.append("TLS cannot be switched off without a restart (tls_server_config "
                     "removed)")
    if old.users and not new.users:
        # Also what a file caught half-written looks like: never fail open.
        found.append("basic auth cannot be switched off without a restart "
                     "(basic_auth_users removed)")
    elif old.users and (added := sorted(set(new.users) - set(old.users))):
        found.append(f"basic_auth_users cannot gain users without a restart (added: "
                     f"{', '.join(added)})")
    if old.tls is not None and new.tls is not None:
        found += _tls_weakenings(old.tls, new.tls)
    return tuple(found)


def _tls_weakenings(old: TlsConfig, new: TlsConfig) -> list[str]:
    found: list[str] = []
    if _CLIENT_AUTH_STRENGTH[new.client_auth] < _CLIENT_AUTH_STRENGTH[old.client_auth]:
        found.append(f"client_auth_type cannot be weakened from "
                     f"{_CLIENT_AUTH_NAMES[old.client_auth]} to "
                     f"{_CLIENT_AUTH_NAMES[new.client_auth]} without a restart")
    if old.client_ca_file and not new.client_ca_file and new.client_auth != ssl.CERT_NONE:
        found.append("client_ca_file cannot be dropped without a restart (client "
                     "certificates would be verified against every CA the system trusts)")
    if old.allowed_sans:
        kept = {_san_key(name) for name in old.allowed_sans}
        if not new.allowed_sans:
            found.append("client_allowed_sans cannot be dropped without a restart (every "
                         "verified client certificate would get in)")
        elif added := [n for n in new.allowed_sans if _san_key(n) not in kept]:
            found.append(f"client_allowed_sans cannot be widened without a restart "
                         f"(added: {', '.join(added)})")
    if new.min_version < old.min_version:
        found.append(f"min_version cannot be lowered from {_VERSION_NAMES[old.min_version]} "
                     f"to {_VERSION_NAMES[new.min_version]} without a restart")
    if old.ciphers:
        if not new.ciphers:
            found.append("cipher_suites cannot be dropped without a restart (every TLS 1.2 "
                         "suite OpenSSL offers would be allowed)")
        elif added := [c for c in new.ciphers if c not in old.ciphers]:
            found.append(f"cipher_suites cannot be widened without a restart (added: "
                         f"{', '.join(_SUITE_NAMES.get(c, c) for c in added)})")
    return found
