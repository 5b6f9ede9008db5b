"""Both daemons answer the endpoints platforms built for Prometheus probe (issue 38):
/-/healthy, /-/ready (503 until the exporter's first scan is done), POST /-/reload behind
--web.enable-lifecycle (403 without, as Prometheus) and behind what guards /metrics, and
HEAD wherever GET is served, without a body. Real daemons over HTTP on 127.0.0.1."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import requests

from tests.support.certs import Certs, make_certs
from tests.support.fakenvml import FakeGpuWorld
from tests.support.proctree import wait_for
from tests.support.remediator_harness import TOKEN, write_config
from tests.support.servers import Exporter, ServerProcess, child_env, find, parse_samples

PASSWORD = "lifecycle-secret"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
AUTH = ("prometheus", PASSWORD)


def raw(port: int, method: str, path: str, headers: str = "") -> tuple[str, bytes, bytes]:
    """(status line, head, body) of one HTTP/1.0 request: the server closes after the
    answer, so what follows the head is exactly the body it sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(f"{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n", 1)[0].decode(), head, body


def header(head: bytes, name: str) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.decode().partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def reload_gauges(url: str, **kwargs: object) -> tuple[float, float]:
    samples = parse_samples(requests.get(f"{url}/metrics", timeout=10, **kwargs).text)
    return (find(samples, "gpuguard_config_last_reload_successful")[0][1],
            find(samples, "gpuguard_config_last_reload_success_timestamp_seconds")[0][1])


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "gpuguard.yml"
    path.write_text("classify:\n  protect: [jupyter]\n")
    return path


def start_exporter(fake_gpu: FakeGpuWorld, lib: Path, *args: str) -> Exporter:
    return Exporter(env=fake_gpu.subprocess_env(lib, child_env()), args=list(args))


# ------------------------------------------------------------------------- the exporter

def test_exporter_is_ready_only_once_its_first_scan_is_done(fake_gpu: FakeGpuWorld,
                                                           fake_nvml_lib: Path) -> None:
    """Every NVML call of the first scan takes 400 ms: the exporter already serves (and
    is healthy) while /-/ready says 503; once the scan is in, 200."""
    fake_gpu.set_delay_ms(400)
    exp = start_exporter(fake_gpu, fake_nvml_lib)
    try:
        healthy = requests.get(f"{exp.url}/-/healthy", timeout=10)
        early = requests.get(f"{exp.url}/-/ready", timeout=10)
        assert healthy.status_code == 200 and healthy.text == "gpuguard-exporter is Healthy.\n"
        assert early.status_code == 503, early.text
        assert early.text == "gpuguard-exporter is not ready: the first scan is not done.\n"
        assert "gpuguard_gpu_info" not in requests.get(f"{exp.url}/metrics", timeout=10).text
        fake_gpu.set_delay_ms(0)
        ready = wait_for(lambda: (r := requests.get(f"{exp.url}/-/ready", timeout=10))
                         .status_code == 200 and r, timeout=30, what="/-/ready turning 200")
        assert ready.text == "gpuguard-exporter is Ready.\n"
        assert "gpuguard_gpu_info{" in requests.get(f"{exp.url}/metrics", timeout=10).text
        assert requests.post(f"{exp.url}/-/healthy", timeout=10).status_code == 405
    finally:
        exp.stop()


@pytest.mark.parametrize("path", ["/metrics", "/", "/healthz", "/-/healthy", "/-/ready"])
def test_exporter_answers_head_like_get_without_a_body(fake_gpu: FakeGpuWorld,
                                                      fake_nvml_lib: Path, path: str) -> None:
    exp = start_exporter(fake_gpu, fake_nvml_lib)
    try:
        wait_for(lambda: requests.get(f"{exp.url}/-/ready", timeout=10).status_code == 200,
                 what="the first scan")
        status, head, body = raw(exp.port, "HEAD", path)
        get_status, get_head, get_body = raw(exp.port, "GET", path)
        assert status == get_status and status.split()[1] == "200", (status, get_status)
        assert body == b"" and get_body != b""
        assert header(head, "Content-Type") == header(get_head, "Content-Type")
        length = header(head, "Content-Length")
        assert length is not None and int(length) > 0
        if path != "/metrics":  # the metrics change between two scrapes; the rest do not
            assert int(length) == len(get_body)
    finally:
        exp.stop()


def test_exporter_reload_is_forbidden_without_the_flag(fake_gpu: FakeGpuWorld,
                                                       fake_nvml_lib: Path) -> None:
    exp = start_exporter(fake_gpu, fake_nvml_lib)
    try:
        for method in ("POST", "PUT"):
            answer = requests.request(method, f"{exp.url}/-/reload", timeout=10)
            assert (answer.status_code, answer.text) == (403, "Lifecycle API is not enabled.\n")
        got = requests.get(f"{exp.url}/-/reload", timeout=10)
        assert (got.status_code, got.text) == (405, "Only POST or PUT requests allowed\n")
        assert reload_gauges(exp.url)[0] == 1
    finally:
        exp.stop()


def test_exporter_reload_does_what_sighup_does(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                                               config: Path) -> None:
    exp = start_exporter(fake_gpu, fake_nvml_lib, "--config", str(config),
                         "--web.enable-lifecycle")
    try:
        _, started = reload_gauges(exp.url)
        config.write_text("classify:\n  protect: [jupyter, tensorboard]\n")
        done = requests.post(f"{exp.url}/-/reload", timeout=30)
        assert (done.status_code, done.text) == (200, "")
        ok, when = reload_gauges(exp.url)
        assert ok == 1 and when > started  # answered once the reload is in effect
        config.write_text("classify:\n  protect: [\n")
        refused = requests.put(f"{exp.url}/-/reload", timeout=30)
        assert refused.status_code == 500
        assert refused.text.startswith("failed to reload config: reload failed, running "
                                       f"configuration kept: {config}: "), refused.text
        assert reload_gauges(exp.url) == (0, when)
        assert exp.proc.poll() is None
    finally:
        exp.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_exporter_reload_sits_behind_the_client_certificate_and_basic_auth(
        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, tmp_path: Path, certs: Certs) -> None:
    for name in ("server.crt", "server.key"):
        shutil.copy(certs.path(name), tmp_path / name)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                   f"  client_auth_type: RequireAndVerifyClientCert\n"
                   f"  client_ca_file: {certs.path('ca.crt')}\n"
                   f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    exp = start_exporter(fake_gpu, fake_nvml_lib, "--web.config.file", str(web),
                         "--web.enable-lifecycle")
    base = f"https://127.0.0.1:{exp.port}"
    client = (certs.path("client.crt"), certs.path("client.key"))
    ca = certs.path("ca.crt")
    try:
        # Probes: no password (the client certificate is the TLS layer's, for every path).
        wait_for(lambda: requests.get(f"{base}/-/ready", verify=ca, cert=client,
                                      timeout=10).status_code == 200, what="ready over TLS")
        assert requests.get(f"{base}/-/healthy", verify=ca, cert=client,
                            timeout=10).status_code == 200
        # The reload: as /metrics, the password and the client certificate.
        for path, method in (("/metrics", "GET"), ("/-/reload", "POST")):
            bare = requests.request(method, f"{base}{path}", verify=ca, cert=client, timeout=10)
            assert bare.status_code == 401, (path, bare.status_code)
            wrong = requests.request(method, f"{base}{path}", verify=ca, cert=client,
                                     auth=("prometheus", "nope"), timeout=10)
            assert wrong.status_code == 401, (path, wrong.status_code)
            with pytest.raises(requests.exceptions.ConnectionError):
                requests.request(method, f"{base}{path}", verify=ca, auth=AUTH, timeout=10)
        _, started = reload_gauges(base, verify=ca, cert=client, auth=AUTH)
        done = requests.post(f"{base}/-/reload", verify=ca, cert=client, auth=AUTH, timeout=30)
        assert done.status_code == 200, done.text
        assert reload_gauges(base, verify=ca, cert=client, auth=AUTH)[1] > started
    finally:
        exp.stop()


# ----------------------------------------------------------------------- the remediator

@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def start_remediator(fake_gpu: FakeGpuWorld, lib: Path, config: Path, token: Path,
                     *args: str) -> ServerProcess:
    return ServerProcess("gpuguard.remediator", [
        "--config", str(config), "--token-file", str(token), "--allow-pid-namespace", *args],
        env=fake_gpu.subprocess_env(lib, child_env()))


@pytest.fixture
def remediator_config(tmp_path: Path) -> Path:
    return write_config(tmp_path, mode="dry-run")


def test_remediator_probes_and_head(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                                    remediator_config: Path, token: Path) -> None:
    rem = start_remediator(fake_gpu, fake_nvml_lib, remediator_config, token)
    try:
        ready = requests.get(f"{rem.url}/-/ready", timeout=10)
        assert (ready.status_code, ready.text) == (200, "gpuguard-remediator is Ready.\n")
        healthy = requests.get(f"{rem.url}/-/healthy", timeout=10)
        assert (healthy.status_code, healthy.text) == (200, "gpuguard-remediator is Healthy.\n")
        for path in ("/metrics", "/", "/healthz", "/-/healthy", "/-/ready"):
            status, head, body = raw(rem.port, "HEAD", path)
            get_status, _, get_body = raw(rem.port, "GET", path)
            assert status == get_status and status.split()[1] == "200", (path, status)
            assert body == b"" and get_body != b"", path
            assert int(header(head, "Content-Length") or 0) > 0, path
        # /state keeps its bearer token, for HEAD too.
        assert raw(rem.port, "HEAD", "/state")[0].split()[1] == "401"
        status, _, body = raw(rem.port, "HEAD", "/state", f"Authorization: Bearer {TOKEN}\r\n")
        assert status.split()[1] == "200" and body == b""
        answer = requests.post(f"{rem.url}/-/reload", timeout=10)
        assert (answer.status_code, answer.text) == (403, "Lifecycle API is not enabled.\n")
    finally:
        rem.stop()


def test_remediator_reload_does_what_sighup_does(fake_gpu: FakeGpuWorld, fake_nvml_lib: Path,
                                                 remediator_config: Path, token: Path) -> None:
    rem = start_remediator(fake_gpu, fake_nvml_lib, remediator_config, token,
                           "--web.enable-lifecycle")
    try:
        _, started = reload_gauges(rem.url)
        done = requests.post(f"{rem.url}/-/reload", timeout=30)
        assert (done.status_code, done.text) == (200, "")
        assert reload_gauges(rem.url)[1] > started
        # A changed policy is refused until a restart, as on SIGHUP.
        remediator_config.write_text(remediator_config.read_text().replace("dry-run",
                                                                           "enforce"))
        refused = requests.post(f"{rem.url}/-/reload", timeout=30)
        assert refused.status_code == 500
        assert refused.text.startswith("failed to reload config: reload refused"), refused.text
        assert reload_gauges(rem.url)[0] == 0 and rem.proc.poll() is None
    finally:
        rem.stop()


def test_remediator_reload_sits_behind_the_basic_auth_of_metrics(
        fake_gpu: FakeGpuWorld, fake_nvml_lib: Path, remediator_config: Path, token: Path,
        tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    rem = start_remediator(fake_gpu, fake_nvml_lib, remediator_config, token,
                           "--web.enable-lifecycle", "--web.config.file", str(web))
    try:
        assert requests.get(f"{rem.url}/-/ready", timeout=10).status_code == 200
        assert requests.get(f"{rem.url}/-/healthy", timeout=10).status_code == 200
        bearer = {"Authorization": f"Bearer {TOKEN}"}  # /alerts' credentials, not /metrics'
        for path, method in (("/metrics", "GET"), ("/-/reload", "POST")):
            assert requests.request(method, f"{rem.url}{path}",
                                    timeout=10).status_code == 401, path
            assert requests.request(method, f"{rem.url}{path}", headers=bearer,
                                    timeout=10).status_code == 401, path
        _, started = reload_gauges(rem.url, auth=AUTH)
        done = requests.post(f"{rem.url}/-/reload", auth=AUTH, timeout=30)
        assert done.status_code == 200, done.text
        assert reload_gauges(rem.url, auth=AUTH)[1] > started
    finally:
        rem.stop()


@pytest.fixture(autouse=True)
def _no_delay_left(fake_gpu: FakeGpuWorld) -> Iterator[None]:
    yield
    fake_gpu.set_delay_ms(0)
