"""The exporter-toolkit web config: parsing, refusals, reloads, basic auth."""

from __future__ import annotations

import base64
import os
import shutil
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import bcrypt
import pytest

from gpuguard.base.reload import ReloadRefused
from gpuguard.base.validation import ConfigError
from gpuguard.web.webauth import BasicAuth
from gpuguard.web.webconfig import (
    RECHECK_SECONDS,
    WebConfig,
    WebConfigSource,
    load_web_config,
    parse_web_config,
    san_allowed,
    weakenings,
)
from tests.support.certs import Certs, make_certs

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def write(d: Path, text: str) -> str:
    path = d / "web.yml"
    path.write_text(text)
    return str(path)


def tls_block(certs: Certs, extra: str = "") -> str:
    return ("tls_server_config:\n"
            f"  cert_file: {certs.path('server.crt')}\n"
            f"  key_file: {certs.path('server.key')}\n" + extra)


def test_full_config_is_read(tmp_path: Path, certs: Certs) -> None:
    shutil.copy(certs.path("server.crt"), tmp_path / "s.crt")
    shutil.copy(certs.path("server.key"), tmp_path / "s.key")
    shutil.copy(certs.path("ca.crt"), tmp_path / "ca.crt")
    cfg = load_web_config(write(tmp_path, f"""
tls_server_config:
  cert_file: s.crt            # relative to the web config's directory
  key_file: s.key
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: ca.crt
  min_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]
http_server_config:
  headers:
    Strict-Transport-Security: max-age=31536000
basic_auth_users:
  prometheus: '{HASH}'
"""))
    assert cfg.tls is not None and cfg.tls.cert_file == str(tmp_path / "s.crt")
    assert cfg.tls.client_auth == ssl.CERT_REQUIRED
    assert cfg.tls.min_version == ssl.TLSVersion.TLSv1_3
    assert cfg.tls.ciphers == ("ECDHE-ECDSA-AES128-GCM-SHA256",)
    assert cfg.headers == (("Strict-Transport-Security", "max-age=31536000"),)
    assert set(cfg.users) == {"prometheus"}
    ctx = cfg.tls.context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("body", "key", "problem"),
    [
        ("tls_server_config:\n  cert_file: {crt}\n", "tls_server_config.key_file",
         "is required"),
        ("tls_server_config:\n  cert_file: {crt}\n  key_file: nope.key\n",
         "tls_server_config.key_file", "cannot read"),
        ("{tls}  client_auth_type: RequestClientCert\n  client_ca_file: {ca}\n",
         "tls_server_config.client_auth_type", "RequestClientCert is not supported"),
        ("{tls}  client_auth_type: Sometimes\n", "tls_server_config.client_auth_type",
         "must be one of"),
        ("{tls}  min_version: SSL3\n", "tls_server_config.min_version", "must be one of"),
        ("{tls}  min_version: TLS13\n  max_version: TLS12\n", "tls_server_config.max_version",
         "is below min_version"),
        ("{tls}  prefer_server_cipher_suites: banana\n",
         "tls_server_config.prefer_server_cipher_suites", "must be true or false"),
        ("{tls}  client_auth_type: RequireClientCert\n  client_ca_file: {ca}\n",
         "tls_server_config.client_auth_type", "RequireClientCert is not supported"),
        ("basic_auth_users:\n  alice: '$2b$10$short'\n", "basic_auth_users.alice",
         "not a bcrypt hash"),
        ("{tls}  cipher_suites: [TLS_NOT_A_SUITE]\n", "tls_server_config.cipher_suites",
         "is not a TLS 1.2 suite"),
        ("http_server_config:\n  headers: {{X-Content-Type-Options: sniff}}\n",
         "http_server_config.headers.X-Content-Type-Options", "must be one of nosniff"),
        ("http_server_config:\n  headers: {{X-Frame-Options: allow}}\n",
         "http_server_config.headers.X-Frame-Options", "must be one of deny, sameorigin"),
        ("{tls}  curve_preferences: [X25519]\n", "tls_server_config.curve_preferences",
         "not supported"),
        ("{tls}  colour: blue\n", "tls_server_config.colour", "unknown key"),
        ("tls_server_config:\n  cert_file: {key}\n  key_file: {key}\n", "tls_server_config",
         "unusable certificate"),
        ("http_server_config:\n  headers: {{X-Powered-By: me}}\n",
         "http_server_config.headers.X-Powered-By", "must be one of"),
        ("http_server_config:\n  http2: true\n", "http_server_config.http2", "not supported"),
        ("basic_auth_users:\n  alice: hunter2\n", "basic_auth_users.alice", "not a bcrypt hash"),
        # The original scheme: Go's bcrypt verifies it, Python's answers every login 500.
        ("basic_auth_users:\n  alice: '$2$10$" + "J" * 53 + "'\n", "basic_auth_users.alice",
         "$2$ bcrypt hashes are not supported"),
        ("basic_auth_users: [alice]\n", "basic_auth_users", "must be a mapping"),
        ("nope: 1\n", "nope", "unknown key"),
        ("tls_server_config: [\n", "line 2", "invalid YAML"),
    ],
)
def test_errors_name_file_key_problem(tmp_path: Path, certs: Certs, body: str, key: str,
                                      problem: str) -> None:
    text = body.format(tls=tls_block(certs), crt=certs.path("server.crt"),
                       key=certs.path("server.key"), ca=certs.path("ca.crt"))
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_web_config(path)
    assert err.value.path == path and err.value.key == key, str(err.value)
    assert problem in err.value.problem, str(err.value)
    assert "\n" not in str(err.value)


def test_what_the_toolkit_accepts_loads_here_too(tmp_path: Path, certs: Certs,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """exporter-toolkit's semantics (issue 28): no client_ca_file means the system's CAs;
    TLS 1.3 suite names are accepted and ignored (with a warning); a YAML integer header
    value is its text; prefer_server_cipher_suites: false lets the client choose."""
    text = tls_block(certs) + (
        "  client_auth_type: RequireAndVerifyClientCert\n"
        "  cipher_suites: [TLS_AES_128_GCM_SHA256, TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"
        "  prefer_server_cipher_suites: false\n"
        "http_server_config:\n  headers:\n    X-XSS-Protection: 1\n"
        "    X-Frame-Options: deny\n    X-Content-Type-Options: nosniff\n")
    with caplog.at_level("WARNING"):
        cfg = load_web_config(write(tmp_path, text))
    assert cfg.tls is not None and cfg.tls.client_ca_file is None
    assert cfg.tls.ciphers == ("ECDHE-ECDSA-AES128-GCM-SHA256",)
    assert ("X-XSS-Protection", "1") in cfg.headers
    ctx = cfg.tls.context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    system = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    system.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    assert ctx.cert_store_stats() == system.cert_store_stats()  # the system's CAs
    assert not ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    assert load_web_config(write(tmp_path, tls_block(certs))).tls.context().options \
        & ssl.OP_CIPHER_SERVER_PREFERENCE  # type: ignore[union-attr]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "TLS_AES_128_GCM_SHA256 ignored" in messages and "system's CAs" in messages


def test_an_inline_certificate_and_key_load_and_leave_nothing_behind(
        tmp_path: Path, certs: Certs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The toolkit's `cert` and `key`: the PEM goes to a 0700 directory of ours only for
    load_cert_chain, then is removed."""
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    def block(name: str) -> str:
        return "\n".join("    " + line for line in Path(certs.path(name)).read_text().splitlines())

    text = (f"tls_server_config:\n  cert: |\n{block('server.crt')}\n"
            f"  key: |\n{block('server.key')}\n")
    cfg = load_web_config(write(tmp_path, text))
    assert cfg.tls is not None and cfg.tls.files() == ()
    assert "BEGIN" not in repr(cfg.tls)  # the key never reaches a log line
    cfg.tls.context()
    assert list(scratch.iterdir()) == []
    both = text + f"  cert_file: {certs.path('server.crt')}\n"
    with pytest.raises(ConfigError, match="give cert or cert_file, not both"):
        load_web_config(write(tmp_path, both))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"web.yml: \(file\): no such file"):
        load_web_config(str(tmp_path / "web.yml"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_changed_files_are_picked_up_and_a_bad_edit_keeps_the_last_good(
        tmp_path: Path, certs: Certs) -> None:
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)
    path = write(tmp_path, "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    clock = Clock()
    source = WebConfigSource(path, clock=clock)
    first = source.current()[1]
    assert first is not None
    # Rotation: new certificate and key in place (as a deploy tool would write them).
    for name in ("crt", "key"):
        shutil.copy(certs.path(f"server2.{name}"), tmp_path / f"server.{name}.new")
        os.replace(tmp_path / f"server.{name}.new", tmp_path / f"server.{name}")
    assert source.current()[1] is first  # checked at most once per RECHECK_SECONDS
    clock.now += RECHECK_SECONDS
    second = source.current()[1]
    assert second is not None and second is not first
    # A broken edit (users with a bad hash) is logged and the last good config stays.
    with open(path, "a") as fh:
        fh.write("basic_auth_users:\n  alice: plain\n")
    clock.now += RECHECK_SECONDS
    assert source.current()[1] is second and not source.current()[0].users
    # Fixed: picked up.
    Path(path).write_text(Path(path).read_text().replace("plain", f"'{HASH}'"))
    clock.now += RECHECK_SECONDS
    assert set(source.current()[0].users) == {"alice"}


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_basic_auth_checks_bcrypt_and_caches_only_successes(tmp_path: Path) -> None:
    cfg = load_web_config(write(tmp_path, f"basic_auth_users:\n  alice: '{HASH}'\n"))
    auth = BasicAuth()
    assert auth.allows(cfg, basic("alice", "s3cret"))
    assert auth.allows(cfg, basic("alice", "s3cret"))  # from the cache
    assert not auth.allows(cfg, basic("alice", "wrong"))
    assert not auth.allows(cfg, basic("bob", "s3cret"))
    assert not auth.allows(cfg, None)
    assert not auth.allows(cfg, "Bearer abc")
    assert not auth.allows(cfg, "Basic !!!")
    # A changed hash for the same user: the cached success does not carry over.
    other = load_web_config(write(
        tmp_path, "basic_auth_users:\n  alice: '"
        + bcrypt.hashpw(b"new", bcrypt.gensalt(rounds=4)).decode() + "'\n"))
    assert not auth.allows(other, basic("alice", "s3cret"))
    assert auth.allows(other, basic("alice", "new"))
    # No users: no authentication asked.
    assert auth.allows(load_web_config(write(tmp_path, "{}\n")), None)


def test_a_reload_never_switches_basic_auth_off(tmp_path: Path) -> None:
    # A file caught half-written (or emptied) reads as "no users": that must not open
    # the endpoint. Removing authentication takes a restart.
    path = write(tmp_path, f"basic_auth_users:\n  alice: '{HASH}'\n")
    clock = Clock()
    source = WebConfigSource(path, clock=clock)
    Path(path).write_text("")
    clock.now += RECHECK_SECONDS
    assert set(source.current()[0].users) == {"alice"}
    Path(path).write_text("{}\n")
    clock.now += RECHECK_SECONDS
    assert set(source.current()[0].users) == {"alice"}


@pytest.mark.parametrize(("before", "after"), [
    ("RequireAndVerifyClientCert", "NoClientCert"),
    ("RequireAndVerifyClientCert", "VerifyClientCertIfGiven"),
    ("VerifyClientCertIfGiven", "NoClientCert"),
])
def test_a_reload_never_weakens_client_certificate_checks(tmp_path: Path, certs: Certs,
                                                          before: str, after: str) -> None:
    # Like basic auth: dropping (or relaxing) client certificates takes a restart. A
    # rotated CA, or asking more, is picked up.
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)

    def tls(auth: str) -> str:
        ca = f"  client_ca_file: {certs.path('ca.crt')}\n" if auth != "NoClientCert" else ""
        return (f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                f"  client_auth_type: {auth}\n{ca}")

    path = write(tmp_path, tls(before))
    clock = Clock()
    source = WebConfigSource(path, clock=clock)
    mode = source.current()[1].verify_mode  # type: ignore[union-attr]
    Path(path).write_text(tls(after))
    clock.now += RECHECK_SECONDS
    config, context = source.current()
    assert config.tls is not None and context is not None
    assert context.verify_mode == mode and config.tls.client_auth == mode
    Path(path).write_text(tls("RequireAndVerifyClientCert") + "# stricter: fine\n")
    clock.now += RECHECK_SECONDS
    assert source.current()[1].verify_mode == ssl.CERT_REQUIRED  # type: ignore[union-attr]


def test_a_reload_never_drops_the_client_ca_for_the_system_store(tmp_path: Path,
                                                                certs: Certs) -> None:
    """Without client_ca_file every CA the system trusts may sign a client: a reload
    that drops it widens who gets in, so it waits for a restart, like other weakenings."""
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)
    base = ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
            "  client_auth_type: RequireAndVerifyClientCert\n")
    path = write(tmp_path, base + f"  client_ca_file: {certs.path('ca.crt')}\n")
    clock = Clock()
    source = WebConfigSource(path, clock=clock)
    Path(path).write_text(base)
    clock.now += RECHECK_SECONDS
    assert source.current()[0].tls.client_ca_file == certs.path("ca.crt")  # type: ignore[union-attr]
    with pytest.raises(ReloadRefused, match="client_ca_file cannot be dropped"):
        source.reload()


def test_long_passwords_and_unknown_users_are_refused_as_slowly_as_wrong_ones(
        tmp_path: Path) -> None:
    # Unknown users and long passwords are checked against a fixed cost-10 dummy
    # (exporter-toolkit's): as slow as a wrong password for a user with a cost-10 hash.
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=10)).decode()
    cfg = load_web_config(write(tmp_path, f"basic_auth_users:\n  alice: '{hashed}'\n"))
    auth = BasicAuth()
    assert not auth.allows(cfg, basic("alice", "y" * 100))  # bcrypt >= 5 would raise
    timings = {}
    for who, password in (("alice", "wrong"), ("nobody", "wrong"), ("alice", "x" * 100)):
        began = time.perf_counter()
        assert not auth.allows(cfg, basic(who, password))
        timings[(who, len(password))] = time.perf_counter() - began
    slowest, fastest = max(timings.values()), min(timings.values())
    assert fastest > slowest / 3, timings  # one bcrypt check at cost 10 each


# -- weakenings(): the one rule of what a reload may not do ----------------------------


def parsed(tmp_path: Path, text: str) -> WebConfig:
    return parse_web_config(text, source=str(tmp_path / "web.yml"))


def tls_with(certs: Certs, body: str = "", *, server: str = "server") -> str:
    return ("tls_server_config:\n"
            f"  cert_file: {certs.path(server + '.crt')}\n"
            f"  key_file: {certs.path(server + '.key')}\n" + body)


def client_certs(certs: Certs, extra: str = "", *, ca: str = "ca",
                 auth: str = "RequireAndVerifyClientCert") -> str:
    return f"  client_auth_type: {auth}\n  client_ca_file: {certs.path(ca + '.crt')}\n" + extra


OTHER_HASH = bcrypt.hashpw(b"other", bcrypt.gensalt(rounds=4)).decode()


@pytest.mark.parametrize(("before", "after", "weakening"), [
    # TLS itself.
    (lambda c: tls_with(c), lambda c: "{}\n", "TLS cannot be switched off"),
    (lambda c: "{}\n", lambda c: tls_with(c), None),  # stricter (refused elsewhere: not live)
    (lambda c: tls_with(c), lambda c: tls_with(c, server="server2"), None),  # rotation
    # Basic auth.
    (lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n", lambda c: "{}\n",
     "basic auth cannot be switched off"),
    (lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n",
     lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n  bob: '{OTHER_HASH}'\n",
     "basic_auth_users cannot gain users without a restart (added: bob)"),
    (lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n",
     lambda c: f"basic_auth_users:\n  bob: '{HASH}'\n", "added: bob"),  # a rename adds
    (lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n",
     lambda c: f"basic_auth_users:\n  alice: '{OTHER_HASH}'\n", None),  # password rotation
    (lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n  bob: '{OTHER_HASH}'\n",
     lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n", None),  # a login removed
    (lambda c: "{}\n", lambda c: f"basic_auth_users:\n  alice: '{HASH}'\n", None),  # on
    # Client certificates.
    (lambda c: tls_with(c, client_certs(c)),
     lambda c: tls_with(c, client_certs(c, auth="VerifyClientCertIfGiven")),
     "client_auth_type cannot be weakened from RequireAndVerifyClientCert to "
     "VerifyClientCertIfGiven"),
    (lambda c: tls_with(c, client_certs(c)), lambda c: tls_with(c),
     "client_auth_type cannot be weakened from RequireAndVerifyClientCert to NoClientCert"),
    (lambda c: tls_with(c, client_certs(c)),
     lambda c: tls_with(c, "  client_auth_type: RequireAndVerifyClientCert\n"),
     "client_ca_file cannot be dropped"),
    (lambda c: tls_with(c, client_certs(c)), lambda c: tls_with(c, client_certs(c, ca="other-ca")),
     None),  # a CA rotated: a different CA file is no wider by itself
    (lambda c: tls_with(c, client_certs(c, auth="VerifyClientCertIfGiven")),
     lambda c: tls_with(c, client_certs(c)), None),  # asking more
    # client_allowed_sans: a removed list is widest, a superset wider, a subset narrower.
    (lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [a.example]\n")),
     lambda c: tls_with(c, client_certs(c)), "client_allowed_sans cannot be dropped"),
    (lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [a.example]\n")),
     lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [a.example, b.example]\n")),
     "client_allowed_sans cannot be widened without a restart (added: b.example)"),
    (lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [a.example]\n")),
     lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [b.example]\n")),
     "added: b.example"),  # replaced: the new name gets in
    (lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [a.example, b.example]\n")),
     lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [b.example]\n")), None),
    (lambda c: tls_with(c, client_certs(c)),
     lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: [a.example]\n")), None),
    (lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: ['::1']\n")),
     lambda c: tls_with(c, client_certs(c, "  client_allowed_sans: ['0:0:0:0:0:0:0:1']\n")),
     None),  # the same address, written otherwise (compared by value, as the check does)
    # Protocol versions and suites.
    (lambda c: tls_with(c, "  min_version: TLS13\n"), lambda c: tls_with(c),
     "min_version cannot be lowered from TLS13 to TLS12"),  # absent: TLS12
    (lambda c: tls_with(c), lambda c: tls_with(c, "  min_version: TLS13\n"), None),
    (lambda c: tls_with(c, "  max_version: TLS12\n"), lambda c: tls_with(c), None),
    (lambda c: tls_with(c, "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"),
     lambda c: tls_with(c), "cipher_suites cannot be dropped"),
    (lambda c: tls_with(c, "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"),
     lambda c: tls_with(c, "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, "
                           "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n"),
     "cipher_suites cannot be widened without a restart (added: "
     "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384)"),
    (lambda c: tls_with(c, "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, "
                           "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n"),
     lambda c: tls_with(c, "  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256]\n"),
     None),
    (lambda c: tls_with(c), lambda c: tls_with(c, "  prefer_server_cipher_suites: false\n"),
     None),  # whose order wins among suites both allow
    # Neither an access guard nor kept from start: applied as read.
    (lambda c: "http_server_config:\n  headers:\n    X-Frame-Options: deny\n",
     lambda c: "{}\n", None),
])
def test_weakenings_names_each_guard_a_reload_would_lower(
        tmp_path: Path, certs: Certs, before: Callable[[Certs], str],
        after: Callable[[Certs], str], weakening: str | None) -> None:
    got = weakenings(parsed(tmp_path, before(certs)), parsed(tmp_path, after(certs)))
    if weakening is None:
        assert got == ()
    else:
        assert len(got) == 1 and weakening in got[0], got
    # Back again is no weakening, unless names were replaced (new ones either way).
    if weakening is not None and not weakening.startswith("added:"):
        assert weakenings(parsed(tmp_path, after(certs)), parsed(tmp_path, before(certs))) == ()


def test_a_reload_that_weakens_several_guards_is_refused_naming_each(
        tmp_path: Path, certs: Certs, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)
    sans = "  client_allowed_sans: [prometheus.example]\n"
    strict = ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
              + client_certs(certs, sans) + "  min_version: TLS13\n"
              f"basic_auth_users:\n  alice: '{HASH}'\n")
    path = write(tmp_path, strict)
    clock = Clock()
    source = WebConfigSource(path, clock=clock)
    Path(path).write_text(strict.replace(sans, "")
                          .replace("  min_version: TLS13\n", "")
                          + f"  bob: '{OTHER_HASH}'\n")
    with caplog.at_level("ERROR", logger="gpuguard.webconfig"), \
            pytest.raises(ReloadRefused) as refused:
        source.reload()
    for said in (str(refused.value), caplog.text):
        for key in ("client_allowed_sans cannot be dropped", "min_version cannot be lowered",
                    "basic_auth_users cannot gain users"):
            assert key in said, said
    (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "keeping the last good one" in line
    config = source.current()[0]  # the old one stays in force
    assert config.tls is not None and config.tls.allowed_sans == ("prometheus.example",)
    assert config.tls.min_version == ssl.TLSVersion.TLSv1_3 and set(config.users) == {"alice"}
    clock.now += RECHECK_SECONDS
    assert source.current()[0] is config  # nor taken by the next check of the files


def test_a_reload_never_switches_tls_on(tmp_path: Path, certs: Certs) -> None:
    """Not a weakening, but the TLS front is built at start: switching it on waits."""
    path = write(tmp_path, "{}\n")
    source = WebConfigSource(path)
    Path(path).write_text(tls_with(certs))
    with pytest.raises(ReloadRefused, match="TLS cannot be switched on without a restart"):
        source.reload()
    assert source.current()[0].tls is None


#: A directoryName SAN as ssl's getpeercert() gives it: RDNs, not a string.
DIRNAME = ("DirName", ((("organizationName", "gpuguard test"),),
                       (("commonName", "prometheus.example"),)))


@pytest.mark.parametrize(("sans", "allowed"), [
    ((DIRNAME,), False),  # crashed: AttributeError, 'tuple' object has no attribute 'strip'
    ((DIRNAME, ("DNS", "prometheus.example")), True),
    ((DIRNAME, ("email", "ops@example.com")), False),
    (((("othername", "<unsupported>"),) + (("Registered ID", "prometheus.example"),)), False),
    ((("URI", "spiffe://prometheus.example"),), False),
    ((("IP Address", "0:0:0:0:0:0:0:1"),), True),  # by value, as the toolkit's ip.String()
    ((("URI", "prometheus.example"),), True),
])
def test_sans_compare_only_the_string_kinds_the_toolkit_compares(sans: tuple,
                                                                 allowed: bool) -> None:
    """DNS, email, IP and URI, as exporter-toolkit's VerifyPeerCertificate; a
    directoryName, an otherName or a registeredID never match, and never raise."""
    peer = {"subjectAltName": sans}
    assert san_allowed(peer, ("prometheus.example", "::1")) is allowed
