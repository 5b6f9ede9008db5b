"""`gpuguard run`'s tiers: finding the cgroup v2 leaf's place, and when --require refuses."""

from __future__ import annotations

from gpuguard.launch.cgroup import cgroup_dir, own_cgroup, v2_mount
from gpuguard.launch.options import Options, below
from gpuguard.launch.tiers import Hold, refusal

HYBRID = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 25 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
37 35 0:32 / /sys/fs/cgroup/systemd rw,nosuid shared:11 - cgroup cgroup rw,xattr,name=systemd
"""


def test_the_v2_mount_is_found_among_v1_ones_and_its_escapes_read() -> None:
    assert v2_mount(HYBRID) == ("/", "/sys/fs/cgroup/unified")
    assert v2_mount("40 1 0:9 /sub /mnt/my\\040cg rw - cgroup2 none rw\n") == ("/sub",
                                                                               "/mnt/my cg")
    assert v2_mount(HYBRID.replace("cgroup2 cgroup2", "tmpfs tmpfs")) is None


def test_own_cgroup_is_the_0_line() -> None:
    assert own_cgroup("12:pids:/x\n0::/user.slice/session-1.scope\n") == \
        "/user.slice/session-1.scope"
    assert own_cgroup("12:pids:/x\n1:name=systemd:/\n") is None  # a v1-only host


def test_a_cgroup_is_placed_under_the_mount_of_its_subtree_only() -> None:
    assert cgroup_dir(("/", "/sys/fs/cgroup"), "/") == "/sys/fs/cgroup"
    assert cgroup_dir(("/", "/sys/fs/cgroup"), "/a/b") == "/sys/fs/cgroup/a/b"
    assert cgroup_dir(("/a", "/mnt"), "/a/b") == "/mnt/b"
    assert cgroup_dir(("/a", "/mnt"), "/ab") is None  # not below the mount's root
    assert cgroup_dir(("/", "/sys/fs/cgroup"), "a (deleted)") is None


def test_require_refuses_below_its_tier_and_tier_anything_else() -> None:
    assert below("subreaper", "cgroup") and below("pidns", "cgroup")
    assert not below("cgroup", "pidns") and not below("subreaper", None)
    weak = Hold("subreaper", "no cgroup: read-only")
    assert refusal(weak, Options(require="cgroup")) == (
        "--require cgroup: this host gives the subreaper tier (no cgroup: read-only)")
    assert refusal(weak, Options(require="subreaper")) is None
    assert refusal(Hold("pidns"), Options(require="pidns")) is None
    assert refusal(Hold("cgroup"), Options(tier="pidns")) == (
        "--tier pidns: this host gives the cgroup tier")
    assert refusal(Hold("subreaper"), Options(tier="subreaper", require="cgroup")) == (
        "--require cgroup: --tier subreaper is below it")
