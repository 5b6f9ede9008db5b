"""Container and pod identity from a process's cgroup paths: pure, text in, ids out.

The paths come from /proc/PID/cgroup (gpuguard/host/procfs.py cgroup_paths); the
formats each runtime writes are noted at the patterns below, from their sources.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# What each runtime writes, from its source (runc and crun expand a systemd cgroup path
# "SLICE:PREFIX:NAME" to "<SLICE expanded>/PREFIX-NAME.scope"; a cgroupfs path is kept):
# - Docker: /system.slice/docker-<id>.scope, or /docker/<id> (cgroupfs).
# - containerd's CRI plugin: .../cri-containerd-<id>.scope under a .slice, else <parent>/<id>.
# - kubelet: /kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid, "_" for "-">.slice,
#   or /kubepods/<qos>/pod<uid>; guaranteed pods have no QoS level in either.
# - CRI-O: .../crio-<id>.scope or <parent>/crio-<id>. Podman: /machine.slice/libpod-<id>.scope
#   (rootless: under user@UID.service), or /libpod_parent/libpod-<id>, maybe one level deeper.
#   Their conmon scopes (crio-conmon-<id>, libpod-conmon-<id>) are not the container.
# - nerdctl: /system.slice/nerdctl-<id>.scope (rootless: user.slice); cgroupfs /<ns>/<id>.

#: A container id as the runtimes above write it: 64 hex digits.
_ID = r"[0-9a-f]{64}"
#: A path component that names a container: a runtime's scope (systemd driver), a
#: cri-containerd id in runc's "slice:prefix:name" form left unexpanded, or a bare id
#: (cgroupfs drivers); conmon scopes do not match (their id does not follow the prefix).
_CONTAINER = re.compile(
    rf"^(?:(?:docker|cri-containerd|crio|libpod|nerdctl)-(?P<scoped>{_ID})(?:\.scope)?"
    rf"|.*:cri-containerd:(?P<colon>{_ID})"
    rf"|(?P<bare>{_ID}))$"
)
#: kubelet's node-level cgroup and its QoS levels: "kubepods" (cgroupfs, under any
#: --cgroup-root), "[<root>-]kubepods[-<qos>].slice" (systemd).
_KUBEPODS = re.compile(r"^(?:kubepods|(?:[^/]+-)?kubepods(?:-[a-z]+)?\.slice)$")


def _uid(dash: str) -> str:
    """A pod UID's shape, 8-4-4-4-12 lowercase hex digits, the groups joined by `dash`."""
    return dash.join(f"[0-9a-f]{{{n}}}" for n in (8, 4, 4, 4, 12))


# A pod is taken only under kubelet's node-level cgroup ("kubepods", "kubepods.slice", a
# QoS slice "kubepods-burstable.slice"; with --cgroup-root the root's name comes first:
# kind's /kubelet.slice/kubelet-kubepods.slice/...), and only with a UID's shape (8-4-4-4-12
# hex digits, "_" for "-" under systemd): "pod" and 32 hex digits elsewhere is not one.
# Static pods: kubelet names their cgroup after the manifest's hash (32 hex digits,
# pkg/kubelet/config/common.go applyDefaults), not after the UID the API server gives
# their mirror pod (the one kube_pod_info has), so their pod_uid is "" (container_id stays).

#: A pod's cgroup: "pod<uid>" (cgroupfs), "[<root>-]kubepods[-<qos>]-pod<uid>.slice"
#: (systemd, the uid's dashes escaped to underscores).
_POD_FS = re.compile(rf"^pod(?P<uid>{_uid('-')})$")
_POD_SD = re.compile(rf"^(?:[^/]+-)?kubepods(?:-[a-z]+)?-pod(?P<uid>{_uid('_')})\.slice$")


@dataclass(frozen=True)
class Attribution:
    """The container and Kubernetes pod a process runs in; "" when none."""

    container_id: str = ""
    pod_uid: str = ""


NONE = Attribution()


def _pod_uid(part: str) -> str | None:
    match = _POD_FS.match(part) or _POD_SD.match(part)
    return None if match is None else match.group("uid").replace("_", "-")


def attribute_path(path: str) -> Attribution:
    """The deepest container component of one cgroup path, and the pod above it (a pod
    component counts only below a kubepods one)."""
    container = pod = ""
    kubepods = False
    for part in path.split("/"):
        if (match := _CONTAINER.match(part)) is not None:
            container = match.group("scoped") or match.group("colon") or match.group("bare")
            if match.group("colon"):  # "kubepods-...-pod<uid>.slice:cri-containerd:<id>":
                # a systemd slice's name is its path, so this one says it is under kubepods
                found = _POD_SD.match(part.split(":", 1)[0])
                pod = found.group("uid").replace("_", "-") if found else pod
        elif kubepods and (uid := _pod_uid(part)) is not None:
            pod, container = uid, ""  # a container above the pod is not this pod's
        elif _KUBEPODS.match(part):
            kubepods = True
    return Attribution(container, pod)


def attribute(paths: Iterable[str] | None) -> Attribution:
    """The first of a process's cgroup paths that names a container (v1 has several)."""
    fallback = NONE
    for path in paths or ():
        found = attribute_path(path)
        if found.container_id:
            return found
        if found.pod_uid and not fallback.pod_uid:
            fallback = found
    return fallback
