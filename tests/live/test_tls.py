"""Both daemons behind an exporter-toolkit web config: TLS, client certificates, basic auth,
certificate rotation, and real Prometheus scraping over TLS. Certificates come from
the `openssl` binary (tests/support/certs.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import bcrypt
import pytest
import requests

from tests.support.certs import Certs, make_certs
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import CHAIN, Trees, alive, wait_for
from tests.support.promstack import LoopTls, require_binaries, start_loop
from tests.support.servers import REPO, Exporter, ServerProcess, child_env

PASSWORD = "scrape-secret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def web_config(d: Path, certs: Certs, *, client_auth: str = "RequireAndVerifyClientCert",
               extra_tls: str = "") -> str:
    """A web config in `d` with its own copies of the server certificate (to rotate)."""
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), d / name)
    path = d / "web.yml"
    path.write_text(f"""
tls_server_config:
  cert_file: server.crt
  key_file: server.key
  client_auth_type: {client_auth}
  client_ca_file: {certs.path("ca.crt")}
{extra_tls}http_server_config:
  headers:
    Strict-Transport-Security: max-age=31536000
basic_auth_users:
  prometheus: '{HASH}'
""")
    return str(path)


@pytest.fixture
def tls_exporter(tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib):
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    exp = Exporter(env=env, args=["--web-config-file", web_config(tmp_path, certs)],
                   scan_interval=0.2)
    yield exp
    exp.stop()


def get(exp: Exporter, certs: Certs, path: str = "/metrics", *, client: str | None = "client",
        auth: tuple[str, str] | None = ("prometheus", PASSWORD)) -> requests.Response:
    cert = (certs.path(f"{client}.crt"), certs.path(f"{client}.key")) if client else None
    return requests.get(f"https://127.0.0.1:{exp.port}{path}", verify=certs.path("ca.crt"),
                        cert=cert, auth=auth, timeout=10)


def test_scrape_over_tls_with_client_certificate_and_basic_auth(tls_exporter: Exporter,
                                                                certs: Certs) -> None:
    ok = wait_for(lambda: (r := get(tls_exporter, certs)).status_code == 200 and
                  b"gpuguard_gpu_info" in r.content and r, what="a scrape over TLS")
    assert ok.headers["Strict-Transport-Security"] == "max-age=31536000"
    wrong = get(tls_exporter, certs, auth=("prometheus", "nope"))
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"].startswith("Basic")
    assert get(tls_exporter, certs, auth=None).status_code == 401
    # Probes need no password (a client certificate is still a TLS matter).
    assert get(tls_exporter, certs, "/healthz", auth=None).status_code == 200


def test_client_allowed_sans_close_other_clients_before_any_answer(
        tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib) -> None:
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    config = web_config(tmp_path, certs,
                        extra_tls="  client_allowed_sans: [prometheus.example]\n")
    exp = Exporter(env=env, args=["--web-config-file", config], scan_interval=0.2)
    try:
        named = wait_for(lambda: (r := get(exp, certs, client="named")).status_code == 200
                         and r, what="a scrape by the client the SAN names")
        assert "gpuguard_" in named.text
        with pytest.raises(requests.exceptions.ConnectionError):
            get(exp, certs, client="client")  # verified, but names no allowed SAN
        assert get(exp, certs, client="named").status_code == 200  # the server lives on
    finally:
        exp.stop()


def test_a_directory_name_san_is_refused_or_allowed_by_its_strings_never_a_crash(
        tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib) -> None:
    """Issue 48: a client certificate whose first SAN is a directoryName (ssl gives it as
    a tuple of RDNs, not a string) crashed the allowed-SAN check; the connection was left
    unanswered and the log took a traceback. Only the string kinds the toolkit compares
    (DNS, email, IP, URI) count: a directoryName whose CN is an allowed name is not one."""
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    config = web_config(tmp_path, certs,
                        extra_tls="  client_allowed_sans: [prometheus.example]\n")
    exp = Exporter(env=env, args=["--web-config-file", config], scan_interval=0.2)
    try:
        named = wait_for(lambda: (r := get(exp, certs, client="dirname-named")).status_code
                         == 200 and r, what="a scrape allowed by the DNS SAN after a dirName")
        assert "gpuguard_" in named.text
        with pytest.raises(requests.exceptions.ConnectionError):
            get(exp, certs, client="dirname")  # its only SAN is no string: not allowed
        wait_for(lambda: any("no allowed subject alternative name" in ln
                             for ln in exp.stderr_lines), what="the refusal's log line")
        assert get(exp, certs, client="named").status_code == 200  # the server lives on
        assert not [ln for ln in exp.stderr_lines if "Traceback" in ln or "Error" in ln], \
            exp.stderr_lines
        assert exp.proc.poll() is None
    finally:
        exp.stop()


def test_a_reload_that_drops_client_allowed_sans_is_refused_and_the_old_list_holds(
        tmp_path: Path, certs: Certs, fake_gpu: FakeGpuWorld, fake_nvml_lib) -> None:
    """Issue 36: a reload that weakened client_auth_type or dropped client_ca_file was
    refused, one that dropped client_allowed_sans was taken. Every weakening is one rule
    now (webconfig.weakenings): refused, named in the log, the old list in force."""
    env = fake_gpu.subprocess_env(fake_nvml_lib, child_env())
    sans = "  client_allowed_sans: [prometheus.example]\n"
    config = web_config(tmp_path, certs, extra_tls=sans)
    exp = Exporter(env=env, args=["--web-config-file", config], scan_interval=0.2)
    try:
        wait_for(lambda: get(exp, certs, client="named").status_code == 200,
                 what="a scrape by the client the SAN names")
        with pytest.raises(requests.exceptions.ConnectionError):
            get(exp, certs, client="client")  # verified, but names no allowed SAN
        Path(config).write_text(Path(config).read_text().replace(sans, ""))
        exp.proc.send_signal(signal.SIGHUP)
        line = wait_for(lambda: next((ln for ln in exp.stderr_lines
                                      if "reload refused" in ln), None),
                        what="the refused reload's log line")
        assert "client_allowed_sans cannot be dropped" in line, line
        answer = get(exp, certs, client="named")
        assert answer.status_code == 200
        assert "gpuguard_config_last_reload_successful 0.0" in answer.text
        with pytest.raises(requests.exceptions.ConnectionError):
            get(exp, certs, client="client")  # still refused: the old list holds
        assert exp.proc.poll() is None
    finally:
        exp.stop()


def test_the_start_up_line_names_the_scheme_served(tls_exporter: Exporter) -> None:
    line = wait_for(lambda: next((ln for ln in tls_exporter.stderr_lines
                                  if "serving /metrics on" in ln), None),
                    what="the start-up line")
    assert f"https://127.0.0.1:{tls_exporter.port}" in line and "http://" not in line, line


@pytest.mark.parametrize("client", [None, "expired", "stranger"],
                         ids=["no-client-cert", "expired", "wrong-ca"])
def test_handshake_refused_without_a_valid_client_certificate(tls_exporter: Exporter,
                                                              certs: Certs,
                                                              client: str | None) -> None:
    with pytest.raises(requests.exceptions.RequestException) as err:
        get(tls_exporter, certs, client=client)
    assert isinstance(err.value, (requests.exceptions.SSLError,
                                  requests.exceptions.ConnectionError))
    assert get(tls_exporter, certs).status_code == 200  # the server lives on


def test_plain_http_to_the_tls_port_gets_no_answer(tls_exporter: Exporter) -> None:
    with socket.create_connection(("127.0.0.1", tls_exporter.port), timeout=15) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = s.recv(65536)
    assert b"gpuguard" not in data and not data.startswith(b"HTTP/1.1 200")


def served_certificate(port: int, certs: Certs) -> bytes:
    ctx = ssl.create_default_context(cafile=certs.path("ca.crt"))
    ctx.load_cert_chain(certs.path("client.crt"), certs.path("client.key"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(path: str) -> bytes:
    return ssl.PEM_cert_to_DER_cert(Path(path).read_text())


def test_rotated_certificate_is_served_to_the_next_connection(tls_exporter: Exporter,
                                                               certs: Certs,
                                                               tmp_path: Path) -> None:
    assert served_certificate(tls_exporter.port, certs) == der_of(certs.path("server.crt"))
    for name in ("crt", "key"):  # as a deploy tool would: a new file renamed into place
        shutil.copy(certs.path(f"server2.{name}"), tmp_path / f"new.{name}")
        (tmp_path / f"new.{name}").replace(tmp_path / f"server.{name}")
    wait_for(lambda: served_certificate(tls_exporter.port, certs)
             == der_of(certs.path("server2.crt")), what="the rotated certificate")
    assert tls_exporter.proc.poll() is None


@pytest.mark.parametrize("edit, problem", [
    ("basic_auth_users:\n  alice: plain\n", "basic_auth_users.alice: is not a bcrypt hash"),
    ("tls_server_config:\n  client_auth_type: RequireAnyClientCert\n",
     "RequireAnyClientCert is not supported"),
])
def test_bad_web_config_is_a_one_line_start_up_error(tmp_path: Path, edit: str,
                                                     problem: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(edit)
    (tmp_path / "gpuguard.yml").write_text("{}\n")
    (tmp_path / "token").write_text("t0ken\n")
    remediator = ["--config", str(tmp_path / "gpuguard.yml"), "--token-file",
                  str(tmp_path / "token")]
    for module, args in (("gpuguard.exporter", []), ("gpuguard.remediator", remediator)):
        done = subprocess.run([sys.executable, "-m", module, *args, "--web-config-file",
                               str(path), "--listen", "127.0.0.1:0"], cwd=REPO,
                              env=child_env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (module, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and problem in lines[0] and str(path) in lines[0], done.stderr


@pytest.mark.slow
def test_whole_loop_over_tls_reaps(fake_nvml_lib: Path, tmp_path: Path, certs: Certs) -> None:
    # Prometheus scrapes both daemons over TLS (client certificate, basic auth);
    # Alertmanager delivers to the remediator over TLS with its bearer token; the orphan
    # tree is reaped as in tests/e2e/test_e2e.py.
    require_binaries()
    world = FakeGpuWorld(tmp_path / "nvml-state.txt")
    world.add_gpu(0)
    trees = Trees(tmp_path / "trees")
    loop = None
    try:
        tree = trees.spawn(CHAIN)
        world.add_process(0, tree.pid("worker"), 2**31)
        members = [tree.pid("sh"), tree.pid("worker")]
        tree.kill_launcher()
        web_dir = tmp_path / "web"
        web_dir.mkdir()
        password = tmp_path / "password"
        password.write_text(PASSWORD)
        tls = LoopTls(web_config=web_config(web_dir, certs), ca_file=certs.path("ca.crt"),
                      cert_file=certs.path("client.crt"), key_file=certs.path("client.key"),
                      username="prometheus", password_file=str(password))
        env = world.subprocess_env(fake_nvml_lib, child_env())
        (tmp_path / "loop").mkdir()
        loop = start_loop(tmp_path / "loop", env, hostname="tls-node", scan_interval=0.5,
                          for_seconds=1, orphan_age_seconds=1, term_timeout_seconds=2, tls=tls)
        prom = loop.prometheus
        for job in ("gpuguard", "gpuguard-remediator"):
            wait_for(lambda job=job: [r for r in prom.query(f'up{{job="{job}"}}')
                                      if r["value"][1] == "1"],
                     timeout=30, what=f"Prometheus scraping {job} over TLS")
        # The remediator: /metrics behind basic auth, /state behind its bearer token only.
        url = loop.remediator.url
        kw = dict(verify=certs.path("ca.crt"), timeout=10,
                  cert=(certs.path("client.crt"), certs.path("client.key")))
        assert requests.get(f"{url}/metrics", **kw).status_code == 401
        assert requests.get(f"{url}/metrics", auth=("prometheus", PASSWORD),
                            **kw).status_code == 200
        state = requests.get(f"{url}/state", headers={
            "Authorization": "Bearer loop-secret-token"}, **kw)
        assert state.status_code == 200, state.text
        try:
            wait_for(lambda: not any(alive(p) for p in members), timeout=90,
                     what="the orphan tree to be reaped over TLS")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nalertmanager:\n{loop.alertmanager.log_tail()}\n"
                                 f"remediator:\n{loop.remediator.stderr()}") from None
        assert str(members[0]) in loop.audit_log.read_text()
    finally:
        if loop is not None:
            loop.stop()
        trees.cleanup()


def test_shipped_examples_are_valid(tmp_path: Path, certs: Certs) -> None:
    # deploy/web-config.yml, with its tls/ files in place, loads; its placeholder hash is
    # "change-me" (as its comment says).
    (tmp_path / "tls").mkdir()
    for src, dst in (("server.crt", "server.crt"), ("server.key", "server.key"),
                     ("ca.crt", "clients-ca.crt")):
        shutil.copy(certs.path(src), tmp_path / "tls" / dst)
    shutil.copy(REPO / "deploy" / "web-config.yml", tmp_path / "web-config.yml")
    from gpuguard.web.webconfig import load_web_config
    web = load_web_config(str(tmp_path / "web-config.yml"))
    assert web.tls is not None and web.tls.client_auth == ssl.CERT_REQUIRED
    assert bcrypt.checkpw(b"change-me", web.users["prometheus"])
    # deploy/prometheus-scrape.yml passes promtool with its files in place.
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool not installed: apt-get install prometheus")
        pytest.skip("promtool not installed")
    text = (REPO / "deploy" / "prometheus-scrape.yml").read_text()
    for name, src in (("ca.crt", "ca.crt"), ("client.crt", "client.crt"),
                      ("client.key", "client.key")):
        text = text.replace(f"/etc/prometheus/gpuguard/{name}", certs.path(src))
    (tmp_path / "password").write_text(PASSWORD)
    text = text.replace("/etc/prometheus/gpuguard/password", str(tmp_path / "password"))
    (tmp_path / "prometheus.yml").write_text(text)
    done = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_a_token_state_falls_under_basic_auth(tmp_path: Path, certs: Certs) -> None:
    # --insecure-no-auth (loopback only): /state has no bearer token of its own, so a
    # web config's basic auth guards it; /healthz stays open.
    (tmp_path / "gpuguard.yml").write_text(
        f"remediate:\n  state_dir: {tmp_path / 'state'}\n"
        f"  audit_log: {tmp_path / 'state' / 'audit.jsonl'}\n")
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    remediator = ServerProcess("gpuguard.remediator", [
        "--config", str(tmp_path / "gpuguard.yml"), "--insecure-no-auth",
        "--allow-pid-namespace", "--web-config-file", str(web)], env=child_env())
    try:
        url = remediator.url
        assert requests.get(f"{url}/state", timeout=10).status_code == 401
        assert requests.get(f"{url}/state", auth=("prometheus", PASSWORD),
                            timeout=10).status_code == 200
        assert requests.get(f"{url}/healthz", timeout=10).status_code in (200, 503)
    finally:
        remediator.stop()
