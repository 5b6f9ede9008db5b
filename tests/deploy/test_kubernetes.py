"""deploy/kubernetes and deploy/Dockerfile: what a cluster would reject or run wrong, found here.

Core objects validate offline against the Kubernetes API schemas (kubernetes-validate,
strict: an unknown field fails) for 1.30 and 1.37; the Prometheus Operator's objects,
whose schemas it does not bundle, are checked for what makes them work: selectors that
match, port names that exist, the job labels alerts/rules.yml asks for. The derived
manifests equal their sources and are fresh; the config is accepted by the programs' own
loader and the arguments by their own parsers; the capabilities the DaemonSet grants are
exercised on this kernel, as uid 0 with exactly that set, against another user's process,
and so is what daemonset.yaml says they also allow (writing the node's root-owned files).
The capability-free overlay (deploy/kubernetes-no-capabilities/) is built, validated, and
its exporter's reads and writes run as its uid without capabilities.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

from gpuguard.config import load_config
from gpuguard.exporter import cli as exporter_cli
from gpuguard.remediator import cli as remediator_cli
from tests.support.ci import require
from tests.support.proctree import environment_in_place, wait_for
from tests.support.staging import stage, staged_python

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes"
#: The capability-free exporter variant: a kustomize overlay of MANIFESTS.
NO_CAPABILITIES = REPO / "deploy" / "kubernetes-no-capabilities"
GENERATE = MANIFESTS / "generate.py"
#: The oldest Kubernetes minor still commonly run, and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.30.0", "1.37.0")
CRD_GROUP = "monitoring.coreos.com/v1"
#: What each container may do beyond uid 0 without capabilities (daemonset.yaml's comment).
EXPECTED_ADD = {
    "exporter": {"SYS_PTRACE", "DAC_READ_SEARCH", "NET_ADMIN"},
    "remediator": {"KILL", "SYS_PTRACE", "DAC_READ_SEARCH", "NET_ADMIN"},
}


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError:
        require(None, "kubernetes-validate not installed: pip install -e '.[test]'")
    return kubernetes_validate


def _objects() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) for every resource the kustomization applies, in its order."""
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    out = []
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((MANIFESTS / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


OBJECTS = _objects()


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for _, o in OBJECTS if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod() -> dict[str, Any]:
    return _one("DaemonSet")["spec"]["template"]["spec"]


def _container(name: str) -> dict[str, Any]:
    (found,) = [c for c in _pod()["containers"] if c["name"] == name]
    return found


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _mount_of(container: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The volume mount that holds `path` in `container`, and its volume."""
    mounts = [m for m in container.get("volumeMounts", [])
              if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of container {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    (volume,) = [v for v in _pod()["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ----------------------------------------------------------------- the set of manifests


def test_kustomization_applies_every_manifest_in_the_folder():
    listed = set(yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"])
    present = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present
    assert {o["metadata"].get("namespace", "gpuguard") for _, o in OBJECTS} == {"gpuguard"}


CORE = [(name, obj) for name, obj in OBJECTS if "monitoring.coreos.com" not in obj["apiVersion"]]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name,obj", CORE, ids=[f"{o['kind']}:{n}" for n, o in CORE])
def test_core_objects_validate_against_the_kubernetes_schema(name, obj, version):
    kubernetes_validate = _kubernetes_validate()
    assert kubernetes_validate.validate(obj, version, strict=True) == version.rsplit(".", 1)[0]


def test_strict_validation_rejects_a_misspelt_field():
    """The validator is not vacuous: the typo a person would make in the DaemonSet fails."""
    kubernetes_validate = _kubernetes_validate()
    broken = copy.deepcopy(_one("DaemonSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"][
        "readOnlyRootFilesytem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFilesytem"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_the_crds_are_the_prometheus_operators_kinds():
    kinds = sorted(o["kind"] for _, o in OBJECTS if o["apiVersion"] == CRD_GROUP)
    assert kinds == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]


# ------------------------------------------------------------------- scraping and jobs


def _rule_jobs() -> set[str]:
    rules = (REPO / "alerts" / "rules.yml").read_text()
    return set(re.findall(r'job="([^"]+)"', rules))


def _relabelled_job(endpoint: dict[str, Any]) -> str:
    (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    return job


def test_service_monitor_scrapes_the_exporters_as_job_gpuguard():
    service = _one("Service", "gpuguard-exporter")
    monitor = _one("ServiceMonitor")
    assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["targetPort"] == "metrics"
    assert port["port"] == _port(_container("exporter"), "metrics")
    assert endpoint["path"] == "/metrics"
    # The Service reaches the DaemonSet's pods, one endpoint per node (headless).
    assert _matches(service["spec"]["selector"], _one("DaemonSet")["spec"]["template"][
        "metadata"]["labels"])
    assert service["spec"]["clusterIP"] == "None"
    assert _relabelled_job(endpoint) == "gpuguard"


def test_pod_monitor_scrapes_the_remediators_as_job_gpuguard_remediator():
    monitor = _one("PodMonitor")
    template = _one("DaemonSet")["spec"]["template"]
    assert _matches(monitor["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert _port(_container("remediator"), endpoint["port"]) == 9878
    assert _relabelled_job(endpoint) == "gpuguard-remediator"
    # Every job the alert rules name is one these two monitors produce.
    assert _rule_jobs() == {"gpuguard", "gpuguard-remediator"}


def test_no_service_exposes_the_remediator():
    services = [o for _, o in OBJECTS if o["kind"] == "Service"]
    ports = {p["targetPort"] for s in services for p in s["spec"]["ports"]}
    assert ports == {"metrics"}


# --------------------------------------------------------------- the derived manifests


def test_prometheus_rule_groups_equal_alerts_rules_yml():
    rule = _one("PrometheusRule")
    source = yaml.safe_load((REPO / "alerts" / "rules.yml").read_text())
    assert rule["spec"]["groups"] == source["groups"]


def test_prometheus_rule_groups_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    require(promtool, "promtool not installed: apt-get install prometheus")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": _one("PrometheusRule")["spec"]["groups"]}))
    result = subprocess.run([str(promtool), "check", "rules", str(rules)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    count = sum(len(g["rules"]) for g in _one("PrometheusRule")["spec"]["groups"])
    assert f"{count} rules found" in result.stdout


def test_dashboard_configmap_carries_grafana_dashboard_json():
    configmap = _one("ConfigMap", "gpuguard-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = configmap["data"].values()
    assert json.loads(text) == json.loads((REPO / "grafana" / "dashboard.json").read_text())


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_generated_manifests_are_fresh():
    result = _generate("--check")
    assert result.returncode == 0, result.stderr


def test_a_rules_edit_without_regeneration_fails_naming_the_command(tmp_path):
    for rel in ("alerts/rules.yml", "grafana/dashboard.json",
                "deploy/kubernetes/prometheusrule.yaml",
                "deploy/kubernetes/grafana-dashboard-configmap.yaml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, tmp_path / rel)
    assert _generate("--check", "--root", str(tmp_path)).returncode == 0
    rules = tmp_path / "alerts" / "rules.yml"
    rules.write_text(rules.read_text().replace("for: 5m", "for: 7m", 1))
    result = _generate("--check", "--root", str(tmp_path))
    assert result.returncode == 1
    assert "deploy/kubernetes/prometheusrule.yaml is stale" in result.stderr
    assert "run `python deploy/kubernetes/generate.py`" in result.stderr
    assert "grafana-dashboard-configmap" not in result.stderr
    # Regenerating brings the edit into the manifest, and --check is content again.
    assert _generate("--root", str(tmp_path)).returncode == 0
    regenerated = yaml.safe_load((tmp_path / "deploy/kubernetes/prometheusrule.yaml").read_text())
    assert regenerated["spec"]["groups"] == yaml.safe_load(rules.read_text())["groups"]
    assert _generate("--check", "--root", str(tmp_path)).returncode == 0


# ----------------------------------------------------------------- the DaemonSet's pod


def test_pod_runs_in_the_hosts_pid_and_network_namespaces():
    pod = _pod()
    assert pod["hostPID"] is True  # NVML reports host pids
    assert pod["hostNetwork"] is True  # the process-events connector lives only there
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # Alertmanager's service name
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is False
    assert _one("ServiceAccount")["metadata"]["name"] == pod["serviceAccountName"]


def test_containers_see_every_gpu_without_taking_one():
    for container in _pod()["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
        resources = container["resources"]
        assert not any(k.startswith("nvidia.com/") for part in resources.values() for k in part)
        assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]


def test_security_context_drops_everything_but_the_claimed_capabilities():
    pod = _pod()
    assert pod["securityContext"]["runAsUser"] == 0  # see daemonset.yaml: ambient caps
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {c["name"] for c in pod["containers"]} == set(EXPECTED_ADD)
    for container in pod["containers"]:
        context = container["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"]
        assert set(context["capabilities"]["add"]) == EXPECTED_ADD[container["name"]]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context.get("privileged", False) is False
        assert "runAsUser" not in context or context["runAsUser"] == 0


def test_exporter_arguments_agree_with_its_config_port_and_probes():
    exporter = _container("exporter")
    assert exporter["command"] == ["gpuguard-exporter"]
    args = exporter_cli.build_parser().parse_args(exporter["args"])
    port = _port(exporter, "metrics")
    assert args.listen[1] == port == 9877
    assert args.listen[0] == "0.0.0.0"  # the Service and Prometheus reach it on the node
    assert exporter["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "metrics"}
    assert exporter["readinessProbe"]["httpGet"] == {"path": "/-/ready", "port": "metrics"}
    _, volume = _mount_of(exporter, args.config)
    assert volume["configMap"]["name"] == "gpuguard-config"
    assert Path(args.config).name in _one("ConfigMap", "gpuguard-config")["data"]
    assert args.hostname == "$(NODE_NAME)"


def test_remediator_arguments_agree_with_its_secret_port_and_probes():
    remediator = _container("remediator")
    assert remediator["command"] == ["gpuguard-remediator"]
    args = remediator_cli.build_parser().parse_args(remediator["args"])
    port = _port(remediator, "remediator")
    assert args.listen[1] == port
    assert not args.insecure_no_auth and not args.allow_pid_namespace
    # Liveness only for what a restart mends; readiness for every degraded state.
    assert remediator["livenessProbe"]["httpGet"] == {"path": "/-/healthy",
                                                      "port": "remediator"}
    assert remediator["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "remediator"}
    mount, volume = _mount_of(remediator, args.token_file)
    assert volume["secret"]["secretName"] == "gpuguard-remediator"
    assert mount["readOnly"] is True and volume["secret"]["defaultMode"] == 0o400
    assert Path(args.token_file).name == "token"
    _, volume = _mount_of(remediator, args.config)
    assert volume["configMap"]["name"] == "gpuguard-config"
    # Both name the node the same way, so alerts (hostname from the exporter) match.
    assert args.hostname == "$(NODE_NAME)"
    for container in _pod()["containers"]:
        env = {e["name"]: e for e in container["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_config_is_accepted_by_the_programs_loader_and_puts_state_on_the_node(tmp_path):
    configmap = _one("ConfigMap", "gpuguard-config")
    path = tmp_path / "gpuguard.yml"
    path.write_text(configmap["data"]["gpuguard.yml"])
    config = load_config(path)  # raises ConfigError, naming the key, on a typo
    remediate = config.remediate
    assert remediate.mode == "dry-run"
    assert remediate.alertmanager is not None and remediate.alertmanager.pull is True
    remediator = _container("remediator")
    for where in (remediate.state_dir, str(Path(remediate.audit_log).parent)):
        mount, volume = _mount_of(remediator, where)
        assert volume["hostPath"]["path"] == mount["mountPath"] == where
        assert not mount.get("readOnly", False)


def latest_release() -> str:
    """The newest released version: the CHANGELOG's first `## [X.Y.Z]` section (the
    version itself comes from it at build time; there is none in pyproject.toml)."""
    text = (REPO / "CHANGELOG.md").read_text()
    return re.findall(r"^## \[(\d+\.\d+\.\d+)\]", text, re.M)[0]


def test_image_is_this_version_and_runs_the_console_scripts():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dynamic"] == ["version"] and "version" not in project
    release = latest_release()
    images = {c["image"] for c in _pod()["containers"]}
    assert images == {f"registry.example/gpuguard:{release}"}  # no image is published
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert kustomization["images"] == [{"name": "registry.example/gpuguard",
                                        "newTag": release}]
    for container in _pod()["containers"]:
        assert container["command"][0] in project["scripts"]


# ------------------------------------------------------------------------- Dockerfile


def test_dockerfile_copies_what_the_wheel_is_built_from_and_runs_unprivileged():
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", dockerfile, re.M)) == 2  # build stage + runtime
    copied = set(re.findall(r"^COPY (?!--from)(\S+)/ ", dockerfile, re.M))
    # gpuguard/'s links point at top-level folders: each must be in the build context.
    targets = {Path(os.readlink(p)).name for p in (REPO / "gpuguard").iterdir()
               if p.is_symlink()}
    assert targets and targets | {"gpuguard"} <= copied
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignored and all(f"!{d}/" in ignored for d in copied)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert int(user[0]) != 0 and int(user[1]) != 0


# ------------------------------------------------- the capabilities, on this kernel


PROBE = """
import json, os, signal, sys
from gpuguard.host.procfs import ProcessView
pid = int(sys.argv[1])
view = ProcessView()
info = view.stat(pid)
out = {"keep": view.keep_marker(info), "detached": view.daemon_io(info)}
try:
    signal.pidfd_send_signal(os.pidfd_open(pid), 0)  # the permission check, no signal
    out["signal"] = "sent"
except PermissionError:
    out["signal"] = "EPERM"
print(json.dumps(out))
"""


@pytest.fixture
def other_users_process():
    """A process of uid 65534 with GPUGUARD_KEEP=1, cwd / and stdin /dev/null."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start another user's process and drop to a capability set")
    proc = subprocess.Popen(["sleep", "300"], user=65534, group=65534, extra_groups=[],
                            env={"PATH": os.environ["PATH"], "GPUGUARD_KEEP": "1"},
                            stdin=subprocess.DEVNULL, cwd="/", start_new_session=True)
    try:
        # Popen returns once exec has closed the child's descriptors, after it dropped to
        # uid 65534, which can be before exec has placed the new environment the probe reads.
        wait_for(lambda: environment_in_place(proc.pid), what="sleep's environment")
        (uids,) = [line.split()[1:] for line in Path(f"/proc/{proc.pid}/status").read_text()
                   .splitlines() if line.startswith("Uid:")]
        assert uids == ["65534"] * 4
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _uid0_with(caps: set[str]) -> list[str]:
    """uid 0 holding exactly `caps`, as the container runtime sets them, no new privileges."""
    setpriv = shutil.which("setpriv")
    require(setpriv, "setpriv not installed: apt-get install util-linux")
    spec = ",".join(["-all", *(f"+{c.lower()}" for c in sorted(caps))])
    return [str(setpriv), "--inh-caps", spec, "--bounding-set", spec, "--no-new-privs"]


@pytest.fixture(scope="module")
def staged() -> Iterator[tuple[str, dict[str, str]]]:
    """(python, env) that uid 0 without any capability can run, gpuguard importable: a
    copy outside the checkout, which may sit below a folder only its owner may enter."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to a capability set")
    root = Path(tempfile.mkdtemp(prefix="gpuguard-kubernetes-"))
    try:
        root.chmod(0o755)
        env = {"PATH": "/usr/bin:/bin", **stage(root)}
        python, tried = staged_python(_uid0_with(set()), env, "gpuguard.host.procfs")
        if python is None:
            require(False, f"no Python that uid 0 without capabilities may run: {tried}")
        assert python is not None
        yield python, env
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _as_uid0_with(caps: set[str], staged: tuple[str, dict[str, str]], probe: str,
                  *args: object) -> dict[str, Any]:
    """Run `probe` as uid 0 holding exactly `caps`, from /, on the staged copy."""
    python, env = staged
    result = subprocess.run([*_uid0_with(caps), python, "-c", probe, *map(str, args)],
                            env=env, capture_output=True, text=True, timeout=60, check=False,
                            cwd="/")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def _declared(container: str) -> set[str]:
    (declared,) = [set(c["securityContext"]["capabilities"]["add"])
                   for c in _pod()["containers"] if c["name"] == container]
    return declared


@pytest.mark.parametrize("container", sorted(EXPECTED_ADD))
def test_granted_capabilities_read_another_users_keep_marker(container, other_users_process,
                                                            staged):
    got = _as_uid0_with(_declared(container), staged, PROBE, other_users_process)
    assert got["keep"] is True and got["detached"] is True
    assert got["signal"] == ("sent" if container == "remediator" else "EPERM")


def test_either_capability_alone_leaves_the_keep_marker_unreadable(other_users_process, staged):
    """Why both are in the set: SYS_PTRACE passes the ptrace check but not environ's 0400
    mode, DAC_READ_SEARCH the mode but not the check; either alone, the tree would read
    `unknown` (never alerted, never reaped)."""
    got = _as_uid0_with({"SYS_PTRACE", "KILL"}, staged, PROBE, other_users_process)
    assert got["keep"] is None and got["detached"] is None
    got = _as_uid0_with({"DAC_READ_SEARCH"}, staged, PROBE, other_users_process)
    assert got["keep"] is None


#: Bind a process-events socket (NETLINK_CONNECTOR to CN_IDX_PROC), as each program does.
SUBSCRIBE = """
import errno, json, socket
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11)
try:
    sock.bind((0, 1))
    print(json.dumps({"bind": "ok"}))
except OSError as e:
    print(json.dumps({"bind": errno.errorcode[e.errno]}))
"""


@pytest.mark.parametrize("container", sorted(EXPECTED_ADD))
def test_granted_capabilities_subscribe_to_process_events(container, staged):
    """uid 0 with exactly the container's set subscribes; without NET_ADMIN the same uid
    gets EPERM on this kernel (6.18 here), so the listener would be down and killed
    launchers' trees would read session-ended (daemonset.yaml's comment)."""
    assert _as_uid0_with(_declared(container), staged, SUBSCRIBE) == {"bind": "ok"}
    without = _as_uid0_with(_declared(container) - {"NET_ADMIN"}, staged, SUBSCRIBE)
    if without == {"bind": "ok"}:
        pytest.skip("this kernel lets uid 0 without NET_ADMIN subscribe")
    assert without == {"bind": "EPERM"}


#: Append to a file through another process's root, open its memory for writing.
NODE_WRITE = """
import errno, json, os, sys
pid, path = sys.argv[1], sys.argv[2]
def attempt(target, flags, data=b""):
    try:
        fd = os.open(target, flags)
        os.write(fd, data)
        os.close(fd)
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
print(json.dumps({"file": attempt(f"/proc/{pid}/root{path}", os.O_WRONLY | os.O_APPEND,
                                  b"written by the container\\n"),
                  "mem": attempt(f"/proc/{pid}/mem", os.O_RDWR)}))
"""


@pytest.fixture
def root_process_with_a_private_file(tmp_path):
    """A root process in a mount namespace of its own, where a root-owned 0644 file lies on
    a tmpfs nobody outside sees: a node's file, as a container's mount namespace would not."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) to make a mount namespace")
    where = tmp_path / "node"
    where.mkdir()
    script = 'mount -t tmpfs node "$1" && echo root-owned > "$1/file" && chmod 644 "$1/file" ' \
             '&& echo ready && exec cat'
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             script, "sh", str(where)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        assert not (where / "file").exists()  # only inside its namespace
        yield proc.pid, where / "file"
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("container", sorted(EXPECTED_ADD))
def test_granted_capabilities_write_the_nodes_root_owned_files(
        container, root_process_with_a_private_file, staged):
    """What daemonset.yaml says about uid 0 + SYS_PTRACE + hostPID, shown: through
    /proc/PID/root a container writes a root-owned file in another mount namespace, and
    opens a root process's memory for writing. No seccomp profile can refuse these
    (open and write of a path). Without SYS_PTRACE both are refused: it is the door."""
    pid, path = root_process_with_a_private_file
    got = _as_uid0_with(_declared(container), staged, NODE_WRITE, pid, path)
    assert got == {"file": "ok", "mem": "ok"}
    assert Path(f"/proc/{pid}/root{path}").read_text() == \
        "root-owned\nwritten by the container\n"
    got = _as_uid0_with(_declared(container) - {"SYS_PTRACE"}, staged, NODE_WRITE, pid, path)
    assert got == {"file": "EACCES", "mem": "EACCES"}


# ------------------------------------------- the capability-free exporter variant


def _pointer(path: str) -> list[str | int]:
    """An RFC 6901 JSON pointer's steps (array indices as ints)."""
    steps: list[str | int] = []
    for raw in path.split("/")[1:]:
        step = raw.replace("~1", "/").replace("~0", "~")
        steps.append(int(step) if step.isdigit() else step)
    return steps


def apply_json6902(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The patch's `test` and `replace` operations (RFC 6902), the only ones it may use."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for step in parents:
            node = node[step]
        assert op["op"] in ("test", "replace"), op
        if op["op"] == "test":
            assert node[last] == op["value"], f"test of {op['path']} failed: {node[last]!r}"
        else:
            assert last in node if isinstance(node, dict) else last < len(node), op["path"]
            node[last] = copy.deepcopy(op["value"])
    return doc


def _variant() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the overlay's kustomization, the base DaemonSet with its one patch applied)."""
    kustomization = yaml.safe_load((NO_CAPABILITIES / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../kubernetes"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "DaemonSet", "name": "gpuguard"}
    ops = yaml.safe_load((NO_CAPABILITIES / patch["path"]).read_text())
    return kustomization, apply_json6902(_one("DaemonSet"), ops)


def _image_user() -> tuple[int, int]:
    (user,) = re.findall(r"^USER (\d+):(\d+)$", (REPO / "deploy" / "Dockerfile").read_text(),
                         re.M)
    return int(user[0]), int(user[1])


def test_no_capabilities_variant_changes_only_the_exporters_security_context():
    """The overlay's exporter runs as the image's non-root user, every capability dropped
    and none added; the remediator and everything else are the base's, unchanged."""
    kustomization, daemonset = _variant()
    assert set(kustomization) == {"apiVersion", "kind", "resources", "patches"}
    base = _one("DaemonSet")
    pod, base_pod = daemonset["spec"]["template"]["spec"], base["spec"]["template"]["spec"]
    exporter, remediator = pod["containers"]
    assert exporter["name"] == "exporter" and remediator == base_pod["containers"][1]
    context = exporter["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert (context["runAsUser"], context["runAsGroup"]) == _image_user()
    assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True and context["privileged"] is False
    exporter.pop("securityContext")
    base_exporter = copy.deepcopy(base_pod["containers"][0])
    base_exporter.pop("securityContext")
    assert exporter == base_exporter
    rest = copy.deepcopy(daemonset)
    rest["spec"]["template"]["spec"]["containers"] = []
    same = copy.deepcopy(base)
    same["spec"]["template"]["spec"]["containers"] = []
    assert rest == same


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_no_capabilities_variant_validates_against_the_kubernetes_schema(version):
    kubernetes_validate = _kubernetes_validate()
    _, daemonset = _variant()
    assert kubernetes_validate.validate(daemonset, version, strict=True) == \
        version.rsplit(".", 1)[0]


def test_no_capabilities_patch_refuses_a_daemonset_whose_first_container_is_not_the_exporter():
    """The patch's `test` step: it never strips the remediator's capabilities instead (and
    kustomize refuses the build, checked by hand: "testing value ... failed")."""
    swapped = copy.deepcopy(_one("DaemonSet"))
    containers = swapped["spec"]["template"]["spec"]["containers"]
    containers.reverse()
    ops = yaml.safe_load((NO_CAPABILITIES / "exporter-no-capabilities.yaml").read_text())
    with pytest.raises(AssertionError, match="test of /spec/template/spec/containers/0/name"):
        apply_json6902(swapped, ops)


def test_kustomize_builds_the_variant_as_this_file_applies_it():
    """`kubectl kustomize` (kustomize itself) gives the base's objects with exactly the
    DaemonSet above. Skipped without kubectl (CI installs none; the tests above apply
    the same patch)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the overlay is checked by applying its patch here")

    def build(folder: Path) -> list[dict[str, Any]]:
        done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    base, variant = build(MANIFESTS), build(NO_CAPABILITIES)
    ops = yaml.safe_load((NO_CAPABILITIES / "exporter-no-capabilities.yaml").read_text())
    expected = [apply_json6902(o, ops) if o["kind"] == "DaemonSet" else o for o in base]
    assert variant == expected and variant != base


def _as_user(uid: int, gid: int) -> list[str]:
    """`uid` without any capability (what the kubelet gives a non-root container)."""
    setpriv = shutil.which("setpriv")
    require(setpriv, "setpriv not installed: apt-get install util-linux")
    return [str(setpriv), f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs"]


@pytest.fixture(scope="module")
def staged_as_image_user() -> Iterator[tuple[list[str], str, dict[str, str]]]:
    """(identity, python, env): the variant's exporter uid, gpuguard importable."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another uid")
    root = Path(tempfile.mkdtemp(prefix="gpuguard-kubernetes-"))
    try:
        root.chmod(0o755)
        env = {"PATH": "/usr/bin:/bin", **stage(root)}
        identity = _as_user(*_image_user())
        python, tried = staged_python(identity, env, "gpuguard.host.procfs")
        if python is None:
            require(False, f"no Python that uid {_image_user()[0]} may run: {tried}")
        assert python is not None
        yield identity, python, env
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _as_image_user(staged: tuple[list[str], str, dict[str, str]], probe: str,
                   *args: object) -> dict[str, Any]:
    identity, python, env = staged
    result = subprocess.run([*identity, python, "-c", probe, *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


def test_variant_exporter_reads_no_marker_and_writes_no_node_file(
        other_users_process, root_process_with_a_private_file, staged_as_image_user):
    """The variant's exporter, as its uid without capabilities: another user's keep marker
    and daemon evidence read None (the tree reads unknown, never orphan), it can signal
    nothing, and the door the base's uid 0 + SYS_PTRACE opens (a root-owned file of the
    node, a root process's memory) stays shut."""
    got = _as_image_user(staged_as_image_user, PROBE, other_users_process)
    assert got == {"keep": None, "detached": None, "signal": "EPERM"}
    pid, path = root_process_with_a_private_file
    got = _as_image_user(staged_as_image_user, NODE_WRITE, pid, path)
    assert got == {"file": "EACCES", "mem": "EACCES"}
    assert Path(f"/proc/{pid}/root{path}").read_text() == "root-owned\n"
