"""prometheus/exporter-toolkit's own web-config cases, as the spec of gpuguard's loader (#28).

Two tables, over unmodified copies of the toolkit's test data (tests/support/toolkit_testdata/,
README.md there names the commit):

- CASES, `TestYAMLFiles` in the toolkit's web/tls_config_test.go: it loads each file and
  says which the toolkit refuses (and why) and which it takes; gpuguard's
  `load_web_config` must agree on every one.
- SERVER_CASES, `TestServerBehaviour` there: it starts a server with each file and makes
  requests. Where the toolkit's server starts, gpuguard must load the file (and mean what
  the toolkit does with it); where it refuses to start, gpuguard must refuse the file,
  naming the key. What the requests see is checked too where no network is needed: TLS
  handshakes over memory BIOs with the context gpuguard would serve with, and the WSGI
  middleware (`protect`) called directly.

Where Python's ssl truly cannot do what the toolkit does, the file is in NOT_SUPPORTED and
gpuguard must refuse it saying "not supported", never load it and do something else. Where
gpuguard differs on purpose, the file is in DIFFERENCES, with the reason.
"""

from __future__ import annotations

import hashlib
import io
import re
import ssl
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gpuguard.base.validation import ConfigError
from gpuguard.exporter.cli import build_parser
from gpuguard.web.webauth import protect
from gpuguard.web.webconfig import WebConfig, load_web_config, san_allowed

TESTDATA = Path(__file__).resolve().parents[1] / "support" / "toolkit_testdata"


class Case(NamedTuple):
    name: str  #: the toolkit's name of the case
    file: str  #: under web/testdata/ (so here under TESTDATA)
    #: The toolkit's ErrorMap key for the error it expects, None where it takes the file.
    toolkit_error: str | None
    #: Where gpuguard must put the blame: its message names this key (or says this).
    blame: str | None


#: TestYAMLFiles' table, in its order (toolkit commit in TESTDATA/README.md).
CASES = (
    Case("path to config yml invalid", "somefile", "No such file", "no such file"),
    Case("empty config yml", "web_config_empty.yml", None, None),
    Case("invalid config yml (invalid structure)", "web_config_junk.yml", "YAML error",
         "must be a mapping"),
    Case("invalid config yml (invalid key)", "web_config_junk_key.yml", "YAML error",
         "tls_server_config.cert_filse"),
    Case("invalid config yml (cert path empty)", "web_config_noAuth_certPath_empty.bad.yml",
         "Invalid Cert or CertPath", "tls_server_config.cert_file"),
    Case("invalid config yml (cert empty)", "web_config_noAuth_cert_empty.bad.yml",
         "Invalid Cert or CertPath", "tls_server_config.cert"),
    Case("invalid config yml (key path empty)", "web_config_noAuth_keyPath_empty.bad.yml",
         "Invalid Key or KeyPath", "tls_server_config.key_file"),
    Case("invalid config yml (key empty)", "web_config_noAuth_key_empty.bad.yml",
         "Invalid Key or KeyPath", "tls_server_config.key"),
    Case("invalid config yml (cert path and key path empty)",
         "web_config_noAuth_certPath_keyPath_empty.bad.yml", "Invalid Cert or CertPath",
         "tls_server_config.cert_file"),
    Case("invalid config yml (cert path invalid)",
         "web_config_noAuth_certPath_invalid.bad.yml", "No such file",
         "tls_server_config.cert_file"),
    # The toolkit's file names cert_file "server.cert" (no such file) as well as key_file
    # "somefile": both fail, and the certificate is the first the toolkit reads too.
    Case("invalid config yml (key path invalid)", "web_config_noAuth_keyPath_invalid.bad.yml",
         "No such file", "tls_server_config.cert_file"),
    Case("invalid config yml (cert path and key path invalid)",
         "web_config_noAuth_certPath_keyPath_invalid.bad.yml", "No such file",
         "tls_server_config.cert_file"),
    Case("invalid config yml (invalid ClientAuth)", "web_config_noAuth.bad.yml",
         "ClientCA set without policy", "client_auth_type"),
    Case("invalid config yml (invalid ClientCAs filepath)",
         "web_config_auth_clientCAs_invalid.bad.yml", "No such file",
         "tls_server_config.client_ca_file"),
    Case("invalid config yml (invalid user list)",
         "web_config_auth_user_list_invalid.bad.yml", "Bad password", "basic_auth_users.john"),
    Case("invalid config yml (bad cipher)", "web_config_noAuth_inventedCiphers.bad.yml",
         "Unknown cipher", "tls_server_config.cipher_suites"),
    Case("invalid config yml (bad curves)", "web_config_noAuth_inventedCurves.bad.yml",
         "Unknown curve", "tls_server_config.curve_preferences"),
    Case("invalid config yml (bad TLS version)", "web_config_noAuth_wrongTLSVersion.bad.yml",
         "Unknown TLS version", "tls_server_config.min_version"),
)

#: Files the toolkit takes (and serves with) that gpuguard cannot honour with Python's ssl:
#: file -> why. None of TestYAMLFiles' files is here (every one it takes, gpuguard takes);
#: these are TestServerBehaviour's.
_NO_CURVES = ("curve_preferences: Python 3.11's ssl has only SSLContext.set_ecdh_curve, one "
              "curve, no preference list")
NOT_SUPPORTED: dict[str, str] = {
    "web_config_noAuth_allCurves.good.yml": _NO_CURVES,
    "web_config_noAuth_someCurves.good.yml": _NO_CURVES,
    "tls_config_noAuth.requireanyclientcert.good.yml": (
        "RequireAnyClientCert (and RequestClientCert): Python's ssl verifies every client "
        "certificate it asks for (CERT_OPTIONAL, CERT_REQUIRED); it has no verify callback "
        "that would take one unverified"),
}

#: What the toolkit's other tests start a server with (TestConfigReloading, TestUsers, and
#: web/handler_test.go's basic-auth tests):
#: file -> (TLS client_auth, or None for plain HTTP; how many basic-auth users).
STARTED_WITH: dict[str, tuple[ssl.VerifyMode | None, int]] = {
    "web_config_noAuth.good.yml": (ssl.CERT_OPTIONAL, 0),
    "web_config_noAuth.good.blocking.yml": (ssl.CERT_REQUIRED, 0),
    "web_config_users.good.yml": (ssl.CERT_NONE, 4),
    "web_config_users_noTLS.good.yml": (None, 4),
}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gpuguard_agrees_with_the_toolkit(case: Case) -> None:
    path = str(TESTDATA / case.file)
    if case.toolkit_error is None and case.file not in NOT_SUPPORTED:
        cfg = load_web_config(path)
        if case.file == "web_config_empty.yml":  # plain HTTP, no auth, no headers
            assert cfg.tls is None and not cfg.users and not cfg.headers
        return
    with pytest.raises(ConfigError) as refused:
        load_web_config(path)
    message = str(refused.value)
    assert "\n" not in message, "a refusal is one line"
    if case.file in NOT_SUPPORTED:
        assert "not supported" in message, NOT_SUPPORTED[case.file]
    if case.blame is not None:
        assert case.blame.lower() in message.lower(), (
            f"the toolkit refuses this for {case.toolkit_error!r}; gpuguard refused it for "
            f"something else: {message}")


@pytest.mark.parametrize("name", sorted(STARTED_WITH))
def test_files_the_toolkit_serves_with_load(name: str) -> None:
    auth, users = STARTED_WITH[name]
    cfg = load_web_config(str(TESTDATA / name))
    assert (None if cfg.tls is None else cfg.tls.client_auth) == auth
    assert len(cfg.users) == users


def test_not_supported_names_only_cases_the_toolkit_takes() -> None:
    taken = {c.file for c in CASES if c.toolkit_error is None}
    served = {c.file for c in SERVER_CASES if toolkit_serves(c)}
    assert set(NOT_SUPPORTED) <= taken | served
    refused = {c.file for c in SERVER_CASES if not toolkit_serves(c)}
    assert set(DIFFERENCES) <= refused, "a difference is a file the toolkit refuses"
    assert not set(NOT_SUPPORTED) & set(DIFFERENCES)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_copies_are_the_toolkits_unmodified() -> None:
    """Each copy is the blob README.md records for the toolkit's commit, and every file
    a case names (save `somefile`, which the toolkit names because it is absent) is here."""
    readme = (TESTDATA / "README.md").read_text()
    recorded = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{40})` \|$", readme, re.M))
    on_disk = {p.name for p in TESTDATA.iterdir()} - {"README.md"}
    assert set(recorded) == on_disk
    for name, blob in recorded.items():
        assert git_blob_id((TESTDATA / name).read_bytes()) == blob, name
    named = ({c.file for c in CASES} | {c.file for c in SERVER_CASES if c.file}
             | set(STARTED_WITH) | {"server.crt", "server.key"}
             | {f"{c.client_cert}{ext}" for c in SERVER_CASES if c.client_cert
                for ext in (".pem", ".key")})
    assert named - on_disk == {"somefile"}


# --- TestServerBehaviour ------------------------------------------------------------------

#: The toolkit's ErrorMap keys whose errors come from a request (a handshake, an HTTP
#: answer) to a server that started with the file; any other key is the server refusing
#: to start with it (ListenAndServe returns the error).
REQUEST_ERRORS = frozenset({
    "HTTP Response to HTTPS", "HTTP Request to HTTPS server", "Incompatible TLS version",
    "Handshake failure", "Invalid client cert", "Too Many Requests"})


class ServerCase(NamedTuple):
    name: str  #: the toolkit's name of the case
    file: str  #: under web/testdata/; "" is no --web.config.file at all
    #: The toolkit's ErrorMap key for the error it expects, None where it expects none.
    toolkit_error: str | None
    #: Where gpuguard's refusal must put the blame (its message names this key).
    blame: str | None = None
    # The client, as the toolkit's TestInputs describe it:
    tls_client: bool = False  #: UseTLSClient (else plain HTTP)
    client_max_tls: ssl.TLSVersion | None = None  #: ClientMaxTLSVersion
    client_ciphers: tuple[str, ...] = ()  #: CipherSuites (Go's names), in its order
    actual_cipher: str | None = None  #: ActualCipher (Go's name)
    client_cert: str | None = None  #: ClientCertificate: TESTDATA/NAME.pem and NAME.key
    requests: int = 0  #: Requests (its loop makes Requests + 1, stopping at an error)


def toolkit_serves(case: ServerCase) -> bool:
    """Whether the toolkit's server starts with the case's file."""
    return case.toolkit_error is None or case.toolkit_error in REQUEST_ERRORS


_AES128_GCM = "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"
_AES256_GCM = "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384"
_AES256_CBC = "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA"
#: Go's (IANA's) names of the suites above -> OpenSSL's, for the test's own client.
OPENSSL_NAMES = {_AES128_GCM: "ECDHE-RSA-AES128-GCM-SHA256",
                 _AES256_GCM: "ECDHE-RSA-AES256-GCM-SHA384",
                 _AES256_CBC: "ECDHE-RSA-AES256-SHA"}
_HEADERS = "http_server_config.headers."
_CLIENT_AUTH = "tls_server_config.client_auth_type"
_CURVES = "tls_server_config.curve_preferences"

#: TestServerBehaviour's table, in its order (toolkit commit in TESTDATA/README.md).
SERVER_CASES = (
    ServerCase("empty string YAMLConfigPath and default client", "", None),
    ServerCase("empty string YAMLConfigPath and TLS client", "", "HTTP Response to HTTPS",
               tls_client=True),
    ServerCase("valid tls config yml and default client", "web_config_noAuth.good.yml",
               "HTTP Request to HTTPS server"),
    ServerCase("valid tls config yml and tls client", "web_config_noAuth.good.yml", None,
               tls_client=True),
    ServerCase("valid tls config yml (cert and key inline) and tls client",
               "web_config_noAuth_tlsInline.good.yml", None, tls_client=True),
    ServerCase("valid tls config yml with TLS 1.1 client", "web_config_noAuth.good.yml",
               "Incompatible TLS version", tls_client=True,
               client_max_tls=ssl.TLSVersion.TLSv1_1),
    ServerCase("valid tls config yml with all ciphers", "web_config_noAuth_allCiphers.good.yml",
               None, tls_client=True),
    ServerCase("valid tls config yml with some ciphers",
               "web_config_noAuth_someCiphers.good.yml", None, tls_client=True,
               client_ciphers=(_AES128_GCM,)),
    ServerCase("valid tls config yml with no common cipher",
               "web_config_noAuth_someCiphers.good.yml", "Handshake failure", tls_client=True,
               client_ciphers=(_AES256_CBC,)),
    ServerCase("valid tls config yml with multiple client ciphers",
               "web_config_noAuth_someCiphers.good.yml", None, tls_client=True,
               client_ciphers=(_AES128_GCM, _AES256_GCM), actual_cipher=_AES128_GCM),
    ServerCase("valid tls config yml with multiple client ciphers, client chooses cipher",
               "web_config_noAuth_someCiphers_noOrder.good.yml", None, tls_client=True,
               client_ciphers=(_AES128_GCM, _AES256_GCM), actual_cipher=_AES128_GCM),
    ServerCase("valid tls config yml with all curves", "web_config_noAuth_allCurves.good.yml",
               None, _CURVES, tls_client=True),
    # Its client prefers CurveP521 here, CurveP384 (not the server's) in the next one.
    ServerCase("valid tls config yml with some curves", "web_config_noAuth_someCurves.good.yml",
               None, _CURVES, tls_client=True),
    ServerCase("valid tls config yml with no common curves",
               "web_config_noAuth_someCurves.good.yml", "Handshake failure", _CURVES,
               tls_client=True),
    ServerCase("valid tls config yml with non-http2 ciphers",
               "web_config_noAuth_noHTTP2.good.yml", None, tls_client=True),
    ServerCase("valid tls config yml with non-http2 ciphers but http2 enabled",
               "web_config_noAuth_noHTTP2Cipher.bad.yml", "No HTTP2 cipher", tls_client=True),
    ServerCase("valid headers config", "web_config_headers.good.yml", None),
    ServerCase("invalid X-Content-Type-Options headers config",
               "web_config_headers_content_type_options.bad.yml", "Invalid value",
               _HEADERS + "X-Content-Type-Options"),
    ServerCase("invalid X-Frame-Options headers config",
               "web_config_headers_frame_options.bad.yml", "Invalid value",
               _HEADERS + "X-Frame-Options"),
    ServerCase("HTTP header that can not be overridden",
               "web_config_headers_extra_header.bad.yml", "Invalid header",
               _HEADERS + "Content-Type"),
    ServerCase("valid tls config yml and tls client with RequireAnyClientCert (present "
               "certificate)", "tls_config_noAuth.requireanyclientcert.good.yml", None,
               _CLIENT_AUTH, tls_client=True, client_cert="client_selfsigned"),
    # The toolkit's case names the same file as the one before, not
    # tls_config_noAuth.requireanyclientcertkeyinline.good.yml (which no test names).
    ServerCase("valid tls config yml (cert from file, key inline) and tls client with "
               "RequireAnyClientCert (present certificate)",
               "tls_config_noAuth.requireanyclientcert.good.yml", None, _CLIENT_AUTH,
               tls_client=True, client_cert="client_selfsigned"),
    ServerCase("valid tls config yml and tls client with RequireAndVerifyClientCert (present "
               "certificate)", "tls_config_noAuth.requireandverifyclientcert.good.yml", None,
               tls_client=True, client_cert="client_selfsigned"),
    ServerCase("valid tls config yml and tls client with VerifyPeerCertificate (present good "
               "SAN DNS entry)", "web_config_auth_client_san.good.yaml", None, tls_client=True,
               client_cert="client2_selfsigned"),
    ServerCase("valid tls config yml and tls client with VerifyPeerCertificate (present "
               "invalid SAN DNS entries)", "web_config_auth_client_san.bad.yaml",
               "Invalid client cert", tls_client=True, client_cert="client2_selfsigned"),
    ServerCase("valid rate limiter (no rate limiter set up) that doesn't block",
               "web_config_rate_limiter_nonblocking.yaml", None, requests=10),
    ServerCase("valid rate limiter with an interval of one second",
               "web_config_rate_limiter_one_second.yaml", "Too Many Requests", requests=10),
)

#: Files the toolkit refuses that gpuguard takes, on purpose: file -> why.
DIFFERENCES: dict[str, str] = {
    "web_config_noAuth_noHTTP2Cipher.bad.yml": (
        "the toolkit refuses to start HTTP/2 (its default, http2: true) over TLS 1.2 "
        "without the suite HTTP/2 requires (TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256); "
        "gpuguard never serves HTTP/2 (waitress speaks HTTP/1.1 only; an explicit "
        "http2: true is refused), so no suite is required: it serves HTTP/1.1 over TLS "
        "with the suites given"),
}

#: What each file gpuguard loads must mean: file -> a check of the WebConfig.
MEANS: dict[str, Callable[[WebConfig], None]] = {}


def means(*files: str) -> Callable[[Callable[[WebConfig], None]], Callable[[WebConfig], None]]:
    def register(check: Callable[[WebConfig], None]) -> Callable[[WebConfig], None]:
        for name in files:
            MEANS[name] = check
        return check

    return register


def tls_of(cfg: WebConfig) -> Any:
    assert cfg.tls is not None, "the toolkit serves this file over TLS"
    return cfg.tls


@means("web_config_noAuth.good.yml")
def _verify_if_given(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.client_auth == ssl.CERT_OPTIONAL and tls.client_ca_file is None
    # The toolkit's default minimum, which refuses its TLS 1.1 client.
    assert tls.min_version == ssl.TLSVersion.TLSv1_2


@means("web_config_noAuth_tlsInline.good.yml")
def _inline_cert_and_key(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.cert_file is None and tls.key_file is None
    assert tls.cert_pem.startswith("-----BEGIN CERTIFICATE-----")
    assert tls.key_pem.startswith("-----BEGIN PRIVATE KEY-----")
    assert isinstance(tls.context(), ssl.SSLContext)


@means("web_config_noAuth_allCiphers.good.yml")
def _all_ciphers(cfg: WebConfig) -> None:
    # Its three TLS 1.3 suites are taken and ignored (all are always offered), the ten
    # TLS 1.2 ones kept, in its order.
    assert tls_of(cfg).ciphers == (
        "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384",
        "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384",
        "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
        "ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA",
        "ECDHE-RSA-AES128-SHA", "ECDHE-RSA-AES256-SHA")


@means("web_config_noAuth_someCiphers.good.yml")
def _some_ciphers(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.ciphers == ("ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384")
    assert tls.min_version == tls.max_version == ssl.TLSVersion.TLSv1_2
    assert tls.prefer_server_ciphers  # the toolkit's default


@means("web_config_noAuth_someCiphers_noOrder.good.yml")
def _some_ciphers_no_order(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.ciphers == ("ECDHE-RSA-AES256-GCM-SHA384", "ECDHE-RSA-AES128-GCM-SHA256")
    assert tls.min_version == tls.max_version == ssl.TLSVersion.TLSv1_2
    assert not tls.prefer_server_ciphers
    assert not tls.context().options & ssl.OP_CIPHER_SERVER_PREFERENCE


@means("web_config_noAuth_noHTTP2.good.yml", "web_config_noAuth_noHTTP2Cipher.bad.yml")
def _no_http2(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.ciphers == ("ECDHE-RSA-AES256-GCM-SHA384",)
    assert tls.max_version == ssl.TLSVersion.TLSv1_2


@means("web_config_headers.good.yml")
def _headers(cfg: WebConfig) -> None:
    assert cfg.tls is None
    assert dict(cfg.headers) == {
        "X-Frame-Options": "deny",
        "Strict-Transport-Security": "max-age=31536000; includeSubDomains",
        "X-Content-Type-Options": "nosniff",
        "X-XSS-Protection": "1",
        "Content-Security-Policy": "default-src 'self' *.test.example.net"}


@means("tls_config_noAuth.requireandverifyclientcert.good.yml")
def _require_and_verify(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.client_auth == ssl.CERT_REQUIRED
    assert Path(tls.client_ca_file).name == "client_selfsigned.pem"
    assert tls.allowed_sans == ()


@means("web_config_auth_client_san.good.yaml")
def _allowed_sans_good(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.client_auth == ssl.CERT_REQUIRED
    assert Path(tls.client_ca_file).name == "client2_selfsigned.pem"
    assert tls.allowed_sans == ("one", "test3", "two")


@means("web_config_auth_client_san.bad.yaml")
def _allowed_sans_bad(cfg: WebConfig) -> None:
    tls = tls_of(cfg)
    assert tls.client_auth == ssl.CERT_REQUIRED
    assert tls.allowed_sans == ("bad",)


@means("web_config_rate_limiter_nonblocking.yaml")
def _no_rate_limit(cfg: WebConfig) -> None:
    assert cfg.rate_limit is None  # interval 0: no limiter, as the toolkit
    assert cfg.tls is None and not cfg.users


@means("web_config_rate_limiter_one_second.yaml")
def _rate_limit_one_second(cfg: WebConfig) -> None:
    assert cfg.rate_limit == (1.0, 0)  # "1s", burst 0
    assert cfg.tls is None and not cfg.users


def refusal(path: str) -> str:
    with pytest.raises(ConfigError) as refused:
        load_web_config(path)
    message = str(refused.value)
    assert "\n" not in message, "a refusal is one line"
    return message


@pytest.mark.parametrize("case", SERVER_CASES, ids=[c.name for c in SERVER_CASES])
def test_gpuguard_serves_with_what_the_toolkit_serves_with(case: ServerCase) -> None:
    if not case.file:
        # No web config: the toolkit serves plain HTTP without auth, and so does gpuguard
        # (both daemons build a WebConfigSource only for a non-empty --web.config.file).
        assert not build_parser().parse_args(["--web.config.file", ""]).web_config_file
        return
    path = str(TESTDATA / case.file)
    if case.file in NOT_SUPPORTED:
        message = refusal(path)
        assert "not supported" in message, NOT_SUPPORTED[case.file]
        assert case.blame is not None and case.blame.lower() in message.lower(), message
        return
    if toolkit_serves(case) or case.file in DIFFERENCES:
        cfg = load_web_config(path)
        MEANS[case.file](cfg)
        return
    message = refusal(path)
    assert case.blame is not None and case.blame.lower() in message.lower(), (
        f"the toolkit refuses to serve with this for {case.toolkit_error!r}; gpuguard "
        f"refused it for something else: {message}")


# What requests see. The toolkit starts a server and connects to it; here the same
# exchanges run without a socket: handshakes between memory BIOs with the context
# gpuguard would serve with (what its TlsFront does with each connection), and plain
# HTTP requests through its middleware (`protect`), in front of the toolkit test's handler.

#: OpenSSL's reason for a failed handshake -> the toolkit's ErrorMap key for that failure.
SSL_REASONS = {
    "HTTP_REQUEST": "HTTP Request to HTTPS server",
    "UNSUPPORTED_PROTOCOL": "Incompatible TLS version",
    "NO_SHARED_CIPHER": "Handshake failure",
    "CERTIFICATE_VERIFY_FAILED": "Bad certificate",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "Certificate required",
}
#: An HTTP status -> the toolkit's ErrorMap key (its client sees the status text).
HTTP_ERRORS = {401: "Unauthorized", 429: "Too Many Requests"}


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> ssl.SSLObject:
    """A TLS handshake over memory BIOs; the server's end once both ends are done, or the
    ssl.SSLError of the end that gave up first."""
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    pending = [client, server]
    for _ in range(10):
        for end in list(pending):
            try:
                end.do_handshake()
                pending.remove(end)
            except ssl.SSLWantReadError:
                pass
            s_in.write(c_out.read())
            c_in.write(s_out.read())
        if not pending:
            return server
    raise AssertionError("the handshake did not finish")


def tls_client(case: ServerCase) -> ssl.SSLContext:
    """The toolkit test's client. It trusts tls-ca-chain.pem, which OpenSSL refuses for a
    server (its CAs' only extended key usage is anyExtendedKeyUsage; Go takes it): this
    one trusts the server's own certificate instead, and still checks it is the toolkit's
    server.crt, for localhost."""
    client = ssl.create_default_context(cafile=str(TESTDATA / "server.crt"))
    client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    if case.client_max_tls is not None:
        with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated: that is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            client.set_ciphers("DEFAULT:@SECLEVEL=0")  # else OpenSSL will not offer them
            client.minimum_version = ssl.TLSVersion.TLSv1
            client.maximum_version = case.client_max_tls
    if case.client_ciphers:
        client.set_ciphers(":".join(OPENSSL_NAMES[name] for name in case.client_ciphers))
    if case.client_cert:
        client.load_cert_chain(str(TESTDATA / f"{case.client_cert}.pem"),
                               str(TESTDATA / f"{case.client_cert}.key"))
    return client


def tls_request(cfg: WebConfig, case: ServerCase) -> str | None:
    tls = tls_of(cfg)
    try:
        server = handshake(tls.context(), tls_client(case))
    except ssl.SSLError as exc:
        return SSL_REASONS.get(str(exc.reason), f"handshake failed: {exc}")
    chosen = (server.cipher() or ("",))[0]
    if case.actual_cipher is not None and chosen != OPENSSL_NAMES[case.actual_cipher]:
        return f"bad cipher suite selected: {chosen}"
    if not san_allowed(server.getpeercert(), tls.allowed_sans):
        # What TlsFront does then: it closes the connection, before any answer.
        return "Invalid client cert"
    return None


def plain_request_to_tls(cfg: WebConfig) -> str | None:
    """A plain HTTP request to the TLS port: the handshake fails (TlsFront closes the
    connection; the toolkit's Go server answers a 400 saying so)."""
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = tls_of(cfg).context().wrap_bio(s_in, s_out, server_side=True)
    s_in.write(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
    try:
        server.do_handshake()
    except ssl.SSLError as exc:
        return SSL_REASONS.get(str(exc.reason), f"handshake failed: {exc}")
    return None


def hello(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """The toolkit test's handler."""
    start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
    return [b"Hello World!"]


def call(app: Callable[..., Iterable[bytes]]) -> tuple[int, dict[str, str], bytes]:
    """GET / from 127.0.0.1, without credentials: (status, headers by lower-case name, body)."""
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "QUERY_STRING": "",
               "SERVER_NAME": "localhost", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
               "REMOTE_ADDR": "127.0.0.1", "wsgi.url_scheme": "http",
               "wsgi.input": io.BytesIO(b"")}
    answer: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
        answer["status"], answer["headers"] = status, headers

    body = b"".join(app(environ, start_response))
    return (int(answer["status"].split()[0]),
            {name.lower(): value for name, value in answer["headers"]}, body)


def plain_requests(cfg: WebConfig, case: ServerCase) -> str | None:
    """The toolkit test's loop: Requests + 1 requests, stopping at the first that fails."""
    app = protect(hello, lambda: cfg)
    for _ in range(case.requests + 1):
        status, _headers, body = call(app)
        if body != b"Hello World!":
            return HTTP_ERRORS.get(status, f"HTTP {status}: {body!r}")
    return None


#: The cases whose file gpuguard loads and whose requests can be made here.
REQUEST_CASES = tuple(c for c in SERVER_CASES
                      if c.file and toolkit_serves(c) and c.file not in NOT_SUPPORTED)


@pytest.mark.parametrize("case", REQUEST_CASES, ids=[c.name for c in REQUEST_CASES])
def test_requests_see_what_the_toolkits_see(case: ServerCase) -> None:
    cfg = load_web_config(str(TESTDATA / case.file))
    if case.tls_client:
        got = tls_request(cfg, case)
    elif cfg.tls is not None:
        got = plain_request_to_tls(cfg)
    else:
        got = plain_requests(cfg, case)
    assert got == case.toolkit_error


def test_http_headers_as_the_toolkits_handler_test() -> None:
    """TestHTTPHeaders (web/handler_test.go): served with web_config_headers.good.yml,
    an answer carries these headers."""
    cfg = load_web_config(str(TESTDATA / "web_config_headers.good.yml"))
    status, headers, body = call(protect(hello, lambda: cfg))
    assert (status, body) == (200, b"Hello World!")
    for name, value in {"Strict-Transport-Security": "max-age=31536000; includeSubDomains",
                        "X-Frame-Options": "deny",
                        "X-Content-Type-Options": "nosniff",
                        "X-XSS-Protection": "1"}.items():
        assert headers.get(name.lower()) == value, name


def test_every_file_gpuguard_serves_with_has_its_meaning_checked() -> None:
    loaded = {c.file for c in SERVER_CASES if c.file and c.file not in NOT_SUPPORTED
              and (toolkit_serves(c) or c.file in DIFFERENCES)}
    assert loaded == set(MEANS)
