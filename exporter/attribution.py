"""Container and pod identity from a process's cgroup paths: pure, text in, ids out.

What each runtime writes, taken from its source. runc and crun turn a systemd cgroup
path "SLICE:PREFIX:NAME" into "<SLICE expanded>/PREFIX-NAME.scope"; a cgroupfs path is
used as it is.

- Docker (moby, daemon/oci_linux.go WithCgroups): systemd driver
  "system.slice:docker:<id>" -> /system.slice/docker-<id>.scope; cgroupfs driver
  filepath.Join("/docker", id) -> /docker/<id>.
- containerd's CRI plugin (internal/cri/server/podsandbox/helpers_linux.go
  getCgroupsPath): a parent ending in .slice gives "<slice>:cri-containerd:<id>" ->
  .../cri-containerd-<id>.scope; any other parent filepath.Join(parent, id).
- kubelet (pkg/kubelet/cm/cgroup_manager_linux.go): CgroupName{"kubepods", "burstable",
  "pod<uid>"}.ToSystemd() -> /kubepods.slice/kubepods-burstable.slice/
  kubepods-burstable-pod<uid, "-" escaped to "_">.slice; ToCgroupfs() ->
  /kubepods/burstable/pod<uid>. Guaranteed pods have no QoS level in either.
- CRI-O (internal/config/cgmgr): systemd "<slice path>/crio-<id>.scope", cgroupfs
  "<parent>/crio-<id>"; its conmon sits in crio-conmon-<id>.scope: not the container.
- Podman (libpod/container_internal_linux.go getOCICgroupPath): systemd
  "<slice>:libpod:<id>" -> /machine.slice/libpod-<id>.scope (rootless: under
  user@UID.service/user.slice/), cgroupfs "/libpod_parent/libpod-<id>"; conmon in
  libpod-conmon-<id>.scope. The payload may sit one level deeper (.../container).

/proc/PID/cgroup has one line per hierarchy on cgroup v1 ("N:controllers:/path") and
one line on v2 ("0::/path"); procfs.ProcessView.cgroup() keeps the paths.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: A container id as the runtimes above write it: 64 hex digits.
_ID = r"[0-9a-f]{64}"
#: A path component that names a container: a runtime's scope (systemd driver), a
#: cri-containerd id in runc's "slice:prefix:name" form left unexpanded, or a bare id
#: (cgroupfs drivers); conmon scopes do not match (their id does not follow the prefix).
_CONTAINER = re.compile(
    rf"^(?:(?:docker|cri-containerd|crio|libpod)-(?P<scoped>{_ID})(?:\.scope)?"
    rf"|.*:cri-containerd:(?P<colon>{_ID})"
    rf"|(?P<bare>{_ID}))$"
)
#: A pod's cgroup: "pod<uid>" (cgroupfs) or "kubepods[-<qos>]-pod<uid>.slice" (systemd,
#: with the uid's dashes escaped to underscores). Static pods' uids are 32 hex digits.
_POD = re.compile(
    r"^(?:pod(?P<fs>[0-9a-f-]{32,36})"
    r"|kubepods(?:-[a-z]+)?-pod(?P<sd>[0-9a-f_]{32,36})\.slice)$"
)


@dataclass(frozen=True)
class Attribution:
    """The container and Kubernetes pod a process runs in; "" when none."""

    container_id: str = ""
    pod_uid: str = ""


NONE = Attribution()


def cgroup_paths(text: str) -> tuple[str, ...]:
    """The paths of /proc/PID/cgroup's lines, v1 ("N:ctrl:/p") and v2 ("0::/p") alike."""
    paths = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths.append(parts[2])
    return tuple(paths)


def _pod_uid(part: str) -> str | None:
    match = _POD.match(part)
    if match is None:
        return None
    return match.group("fs") or match.group("sd").replace("_", "-")


def attribute_path(path: str) -> Attribution:
    """The deepest container component of one cgroup path, and the pod above it."""
    container = pod = ""
    for part in path.split("/"):
        if (match := _CONTAINER.match(part)) is not None:
            container = match.group("scoped") or match.group("colon") or match.group("bare")
            if match.group("colon"):  # "kubepods-...-pod<uid>.slice:cri-containerd:<id>"
                pod = _pod_uid(part.split(":", 1)[0]) or pod
        elif (uid := _pod_uid(part)) is not None:
            pod, container = uid, ""  # a container above the pod is not this pod's
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
