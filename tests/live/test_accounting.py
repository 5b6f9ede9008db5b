"""Accounting's pure functions on synthetic input: cgroup attribution, sizes, quotas,
suspects, the unattributed-memory arithmetic and the sustained-utilisation clock.

The cgroup paths are the shapes each runtime's source writes (gpuguard/engine/scan/attribution.py
cites the file for each): runc and crun expand a systemd "SLICE:PREFIX:NAME" into
"<SLICE path>/PREFIX-NAME.scope"; kubelet escapes a pod uid's "-" to "_" under the
systemd driver (pkg/kubelet/cm/cgroup_manager_linux.go, ToSystemd:
{"kubepods","burstable","pod1234-abcd-5678-efgh"} ->
/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_abcd_5678_efgh.slice).
LIVE_CGROUPS are the paths tests/live/test_exporter_live.py makes as real cgroups (where the
cgroupfs is writable): their parsing is checked here too, so a runner whose cgroupfs is
read-only (a container) loses only the kernel's part of that test.
"""

from __future__ import annotations

import time

import pytest

from gpuguard.config.accounting import (
    DEFAULT_SUSPECT_NAMES,
    DEFAULT_SUSPECT_PATTERNS,
    WHY_CMDLINE,
    WHY_COMM,
    WHY_UTILIZATION,
    Audit,
    Quotas,
    SizeError,
    SustainedUtilization,
    parse_size,
    program_names,
)
from gpuguard.engine.scan.accounting import (
    HolderFacts,
    account,
    balance,
    resolve_quota,
    track_hot,
)
from gpuguard.engine.scan.attribution import Attribution, attribute
from gpuguard.gpu.reading import GpuSample
from gpuguard.host.procfs import cgroup_paths
from gpuguard.orphans.process import Holder
from tests.pure.test_layering import IO_MODULES, REPO, imports, under

ID = "4f1c2d9e8b7a6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d"
ID2 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
UID = "8a3c9b2e-1f4d-4c7a-9b6e-2d5f8c1a0e37"
UID_ = UID.replace("-", "_")  # as kubelet's systemd driver writes it
STATIC_UID = "3a1f0c9d8e7b6a5f4e3d2c1b0a9f8e7d"  # a static pod: md5 of its manifest
GIB = 2**30

#: The runtime paths tests/live/test_exporter_live.py creates as real cgroups.
LIVE_CGROUPS = {
    "cgroupfs": f"/kubepods/burstable/pod{UID}/{ID}",  # kubelet cgroupfs, containerd
    "systemd": ("/kubepods.slice/kubepods-burstable.slice/"  # kubelet systemd, containerd
                f"kubepods-burstable-pod{UID_}.slice/cri-containerd-{ID}.scope"),
}


# -- container and pod from /proc/PID/cgroup -------------------------------------------------

RUNTIMES = {
    # Docker (moby daemon/oci_linux.go): systemd "system.slice:docker:<id>", cgroupfs /docker/<id>
    "docker-systemd-v2": (f"0::/system.slice/docker-{ID}.scope\n", ID, ""),
    "docker-systemd-v1": (f"12:pids:/system.slice/docker-{ID}.scope\n"
                          f"1:name=systemd:/system.slice/docker-{ID}.scope\n0::/\n", ID, ""),
    "docker-cgroupfs-v1": (f"4:memory:/docker/{ID}\n3:cpu,cpuacct:/docker/{ID}\n", ID, ""),
    "docker-rootless-systemd": ("0::/user.slice/user-1000.slice/user@1000.service/user.slice/"
                                f"docker-{ID}.scope\n", ID, ""),
    # containerd's CRI plugin under kubelet: systemd "<slice>:cri-containerd:<id>",
    # cgroupfs filepath.Join(parent, id)
    "containerd-kubelet-systemd-burstable": (
        "0::/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{UID_}.slice/cri-containerd-{ID}.scope\n", ID, UID),
    "containerd-kubelet-systemd-guaranteed": (
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope\n", ID, UID),
    "containerd-kubelet-cgroupfs-v1-burstable": (
        f"11:devices:/kubepods/burstable/pod{UID}/{ID}\n"
        f"10:cpu,cpuacct:/kubepods/burstable/pod{UID}/{ID}\n", ID, UID),
    "containerd-kubelet-cgroupfs-v2-besteffort": (
        f"0::/kubepods/besteffort/pod{UID}/{ID}\n", ID, UID),
    "containerd-kubelet-cgroupfs-guaranteed": (f"0::/kubepods/pod{UID}/{ID}\n", ID, UID),
    "containerd-unexpanded-systemd-path": (
        f"0::/kubepods-burstable-pod{UID_}.slice:cri-containerd:{ID}\n", ID, UID),
    # A static pod's cgroup names its manifest's hash, not its mirror pod's UID (the one
    # kube_pod_info has): no pod uid, the container still named.
    "containerd-static-pod": (f"0::/kubepods/burstable/pod{STATIC_UID}/{ID}\n", ID, ""),
    # kind, kubelet --cgroup-root=/kubelet: the root's name prefixes every slice
    "kind-cgroup-root-systemd": (
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope\n", ID, UID),
    "cgroup-root-cgroupfs": (f"0::/kubelet/kubepods/pod{UID}/{ID}\n", ID, UID),
    # CRI-O (internal/config/cgmgr): systemd <slice>/crio-<id>.scope, cgroupfs <parent>/crio-<id>
    "crio-systemd": ("0::/kubepods.slice/kubepods-besteffort.slice/"
                     f"kubepods-besteffort-pod{UID_}.slice/crio-{ID}.scope\n", ID, UID),
    "crio-cgroupfs-v1": (f"6:memory:/kubepods/besteffort/pod{UID}/crio-{ID}\n", ID, UID),
    "crio-conmon-is-not-the-container": (
        f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{ID}.scope\n", "", UID),
    # Podman (libpod getOCICgroupPath): systemd "<slice>:libpod:<id>", cgroupfs
    # /libpod_parent/libpod-<id>
    "podman-rootful-systemd": (f"0::/machine.slice/libpod-{ID}.scope\n", ID, ""),
    "podman-payload-subcgroup": (f"0::/machine.slice/libpod-{ID}.scope/container\n", ID, ""),
    "podman-rootless-systemd": ("0::/user.slice/user-1000.slice/user@1000.service/user.slice/"
                                f"libpod-{ID}.scope\n", ID, ""),
    "podman-cgroupfs-v1": (f"5:pids:/libpod_parent/libpod-{ID}\n", ID, ""),
    "podman-conmon-is-not-the-container": (
        f"0::/machine.slice/libpod-conmon-{ID}.scope\n", "", ""),
    # nerdctl (pkg/cmd/container/run_cgroup_linux.go): systemd "system.slice:nerdctl:<id>",
    # cgroupfs containerd's default /<namespace>/<id>
    "nerdctl-systemd": (f"0::/system.slice/nerdctl-{ID}.scope\n", ID, ""),
    "nerdctl-rootless-systemd": ("0::/user.slice/user-1000.slice/user@1000.service/"
                                 f"user.slice/nerdctl-{ID}.scope\n", ID, ""),
    "nerdctl-cgroupfs": (f"0::/default/{ID}\n", ID, ""),
    # Kubernetes in Docker (kind): the pod's container, not the node's
    "kind-nested": (f"0::/docker/{ID2}/kubepods/burstable/pod{UID}/{ID}\n", ID, UID),
    # Not containers
    "login-session": ("0::/user.slice/user-1000.slice/session-3.scope\n", "", ""),
    "system-service": ("0::/system.slice/ssh.service\n", "", ""),
    "root-v1": ("9:name=systemd:/\n8:pids:/\n0::/\n", "", ""),
    "id-one-digit-short": (f"0::/docker/{ID[:-1]}\n", "", ""),
    "id-uppercase": (f"0::/docker/{ID.upper()}\n", "", ""),
    # "pod" and a uid-like string outside kubepods, or not shaped like a uid, is no pod
    "pod-outside-kubepods": (f"0::/user.slice/pod{UID}/job\n", "", ""),
    "pod-slice-outside-kubepods": (f"0::/user.slice/kubepods-pod{UID_}.slice/job\n", "", ""),
    "pod-of-dashes": (f"0::/kubepods/burstable/pod{'-' * 34}/{ID}\n", ID, ""),
    "pod-32-hex-outside-kubepods": (f"0::/user.slice/pod{STATIC_UID}\n", "", ""),
    "pod-dashes-under-systemd": (
        f"0::/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{ID}.scope\n", ID, ""),
    "pod-uid-one-digit-short": (f"0::/kubepods/pod{UID[:-1]}/{ID}\n", ID, ""),
}


@pytest.mark.parametrize(("text", "container", "pod"), RUNTIMES.values(), ids=RUNTIMES.keys())
def test_container_and_pod_from_each_runtimes_cgroup(text: str, container: str,
                                                     pod: str) -> None:
    assert attribute(cgroup_paths(text)) == Attribution(container, pod)


@pytest.mark.parametrize("path", LIVE_CGROUPS.values(), ids=LIVE_CGROUPS.keys())
def test_the_live_tests_cgroups_parse_on_v1_and_v2(path: str) -> None:
    """What /proc/PID/cgroup shows for tests/live/test_exporter_live.py's real cgroups, on a
    v2 host and on a v1 host (where the memory controller shows it, systemd's "/")."""
    assert attribute(cgroup_paths(f"0::{path}\n")) == Attribution(ID, UID)
    assert attribute(cgroup_paths(f"12:name=systemd:/\n4:memory:{path}\n0::/\n")) == (
        Attribution(ID, UID))


def test_v1_picks_the_hierarchy_that_names_a_container() -> None:
    """On cgroup v1 one controller may show the container while another shows "/"."""
    text = f"9:name=systemd:/\n4:memory:/kubepods/burstable/pod{UID}\n3:pids:/docker/{ID}\n"
    assert attribute(cgroup_paths(text)) == Attribution(ID, "")
    # With no container anywhere, the pod alone still names where the process runs.
    assert attribute(cgroup_paths(f"4:memory:/kubepods/pod{UID}\n0::/\n")) == Attribution(
        "", UID)


def test_unreadable_cgroup_attributes_nothing() -> None:
    assert attribute(None) == Attribution() == attribute(())


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (0, 0), (1234, 1234), ("10GiB", 10 * GIB), ("10 GiB", 10 * GIB), ("10GB", 10 * 10**9),
    ("10 GB", 10**10), ("1.5GiB", 3 * 2**29), ("512 MiB", 512 * 2**20), ("2KB", 2000),
    ("3KiB", 3072), ("1TiB", 2**40), ("1TB", 10**12), ("7B", 7), (" 4 MB ", 4 * 10**6),
])
def test_sizes_in_bytes_and_units(value: object, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize(("value", "problem"), [
    ("10G", "unknown unit 'G'"), ("10Gi", "unknown unit 'Gi'"), ("10gib", "unknown unit"),
    ("10 gigabytes", "unknown unit"), ("10", "is not a size"), ("GiB", "is not a size"),
    ("-1GiB", "is not a size"), (-5, "must be >= 0"), (True, "byte count"),
    (1.5e9, "must be an integer number of bytes"), ("0.1B", "not a whole number of bytes"),
    (None, "must be an integer number of bytes"),
])
def test_sizes_that_are_not_sizes(value: object, problem: str) -> None:
    with pytest.raises(SizeError, match=problem):
        parse_size(value)


# -- quotas -----------------------------------------------------------------------------------


class Groups:
    """A user -> groups table that counts how often it is asked."""

    def __init__(self, table: dict[str, set[str]]) -> None:
        self.table = table
        self.asked: list[str] = []

    def __call__(self, user: str) -> frozenset[str]:
        self.asked.append(user)
        return frozenset(self.table.get(user, ()))


QUOTAS = Quotas(users=(("alice", 4 * GIB), ("*", 8 * GIB)),
                groups=(("students", 10 * GIB), ("staff", 40 * GIB), ("guests", 2 * GIB)))


def test_a_named_user_wins_over_groups_even_when_smaller() -> None:
    groups = Groups({"alice": {"staff"}})
    assert resolve_quota("alice", groups, QUOTAS) == 4 * GIB
    assert groups.asked == []  # no /etc/group lookup for a user with an entry of their own


def test_the_largest_group_quota_wins() -> None:
    groups = Groups({"bob": {"students", "staff", "guests"}, "carol": {"guests"}})
    assert resolve_quota("bob", groups, QUOTAS) == 40 * GIB
    assert resolve_quota("carol", groups, QUOTAS) == 2 * GIB  # smaller than "*": still hers


def test_everyone_else_gets_the_default_and_without_one_no_quota() -> None:
    groups = Groups({"dave": {"users"}})
    assert resolve_quota("dave", groups, QUOTAS) == 8 * GIB
    assert resolve_quota("dave", groups, Quotas(groups=(("staff", GIB),))) is None
    assert resolve_quota("dave", Groups({}), Quotas(users=(("*", 0),))) == 0  # zero is a quota


@pytest.mark.parametrize("root", ["root", "0"])
def test_the_default_quota_is_not_roots(root: str) -> None:
    """Containers mostly run as uid 0: every pod on a node sums as "root", which "*" (a
    per-person default) would put over quota as soon as the node is busy."""
    groups = Groups({root: {"root"}})
    assert resolve_quota(root, groups, QUOTAS) is None
    assert resolve_quota(root, groups, Quotas(users=((root, 64 * GIB), ("*", GIB)))) == 64 * GIB
    assert resolve_quota(root, groups, Quotas(users=(("*", GIB),),
                                              groups=(("root", 32 * GIB),))) == 32 * GIB
    assert resolve_quota("rooty", Groups({}), QUOTAS) == 8 * GIB  # a name, not a prefix


def test_groups_are_not_asked_when_no_group_has_a_quota() -> None:
    groups = Groups({"erin": {"staff"}})
    assert resolve_quota("erin", groups, Quotas(users=(("*", GIB),))) == GIB
    assert groups.asked == []


# -- suspects ---------------------------------------------------------------------------------


def test_default_names_match_the_program_a_process_runs() -> None:
    audit = Audit()
    assert audit.suspect_names == DEFAULT_SUSPECT_NAMES
    assert audit.suspect("xmrig", "xmrig --donate-level 1") == (WHY_COMM, "suspect name 'xmrig'")
    assert audit.suspect("PhoenixMiner", None) == (WHY_COMM, "suspect name 'phoenixminer'")
    # argv[0] renamed (`exec -a`): comm is the interpreter's, the command line says xmrig
    assert audit.suspect("python3", "/opt/x/xmrig -o pool:3333") == (
        WHY_CMDLINE, "suspect name 'xmrig'")
    # run by a loader or an emulator: the first word after it that is not an option
    assert audit.suspect("ld-linux-x86-64", "/lib64/ld-linux-x86-64.so.2 /tmp/.x/t-rex -a "
                         "kawpow") == (WHY_CMDLINE, "suspect name 't-rex'")
    assert audit.suspect("box64", "box64 --verbose ./lolMiner") == (
        WHY_CMDLINE, "suspect name 'lolminer'")
    assert audit.suspect("python3", "python3 train.py --epochs 10") is None
    assert audit.suspect("python3", None) is None  # an unreadable command line: comm only


@pytest.mark.parametrize(("comm", "cmdline"), [
    ("python", "python /home/alice/T-Rex/demo.py"),  # a detection model named T-Rex
    ("python", "python -m gminer_eval"),
    ("python", "python tools/xmrig_detector.py"),
    ("xmrig_detector", "./xmrig_detector --input x"),
    ("python", "python train.py --data /datasets/t-rex"),  # an argument, not a program
    ("python", "python train.py --out=/runs/xmrig"),
    ("bash", "bash -c cd /srv/ethminer-docs && make"),
], ids=["dir-named-t-rex", "module-gminer_eval", "script-xmrig_detector", "comm-prefix",
        "data-dir-t-rex", "option-value-xmrig", "bash-c-word"])
def test_default_names_are_not_found_inside_ordinary_command_lines(comm: str,
                                                                  cmdline: str) -> None:
    assert Audit().suspect(comm, cmdline) is None


def test_a_pool_url_is_suspect_whatever_the_miner_is_called() -> None:
    audit = Audit()
    assert DEFAULT_SUSPECT_PATTERNS == (r"stratum[12]?\+(tcp|ssl|tls)://",)
    url = f"suspect pattern {DEFAULT_SUSPECT_PATTERNS[0]!r}"
    assert audit.suspect("miner", "./miner --url stratum+tcp://pool:3333") == (WHY_CMDLINE, url)
    assert audit.suspect("python3", "python3 run.py -P STRATUM+SSL://w.1@eu.pool:5555") == (
        WHY_CMDLINE, url)
    assert audit.suspect("eth", "eth -P stratum2+tls://0xab.w@pool:4444") == (WHY_CMDLINE, url)
    assert audit.suspect("python3", "python3 fetch.py --url https://pool.example/x") is None


def test_long_names_match_the_kernels_cut_comm() -> None:
    """comm is cut to 15 characters; the command line keeps the whole name."""
    audit = Audit(suspect_names=("cryptonight-miner",), suspect_patterns=())
    assert audit.suspect("cryptonight-min", None) == (WHY_COMM,
                                                      "suspect name 'cryptonight-miner'")
    assert audit.suspect("python3", "cryptonight-miner2 -t 4") is None


def test_program_names() -> None:
    assert program_names("/usr/bin/python3 -u /opt/run.py --x /a/b") == ("python3", "run.py")
    assert program_names("python3 -m pkg") == ("python3",)
    assert program_names("python3 script.py /data/xmrig") == ("python3",)
    assert program_names("") == program_names(None) == ()
    assert program_names("/opt/miners/ ./") == ()  # no file names in them


def test_custom_patterns_replace_the_default_patterns_not_the_names() -> None:
    audit = Audit(suspect_patterns=("^cryptonight", "minerd$"))
    assert audit.suspect("bash", "cryptonight --threads 8") == (
        WHY_CMDLINE, "suspect pattern '^cryptonight'")
    assert audit.suspect("bash", "bash x stratum+tcp://pool:1") is None  # default pattern gone
    assert audit.suspect("xmrig", "xmrig")[0] == WHY_COMM  # names are their own key
    # A pattern is searched anywhere, as documented (unlike a name).
    assert Audit(suspect_patterns=("t-rex",)).suspect("python", "python /x/T-Rex/demo.py")
    assert Audit(suspect_names=(), suspect_patterns=()).suspect("xmrig", "xmrig") is None


def test_the_matcher_stays_linear_on_a_hostile_command_line() -> None:
    """The bounded matcher (RE2) of protect patterns: `(a+)+$` on "aaaa...!" would take
    Python's re exponential time."""
    audit = Audit(suspect_names=(), suspect_patterns=("(a+)+$",))
    hostile = "a" * 50_000 + "!"
    began = time.perf_counter()
    assert audit.suspect("python3", hostile) is None
    assert time.perf_counter() - began < 1.0


def test_the_suspect_answers_kept_stay_small_whatever_command_lines_users_run() -> None:
    """A user who runs jobs with long, unique command lines (a sweep's overrides) must
    not grow the exporter: answers are kept for comms and short command lines only, as
    the protect patterns' are (16,384 of at most 256 characters: 4 MiB at most)."""
    import gc
    import tracemalloc

    audit = Audit()
    audit.suspect("python3", "python3 warm.py")  # the matcher's own first allocations
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for job in range(1000):
            assert audit.suspect("python3", f"python3 train.py --run {job} " + "x" * 32_768) is None
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 4 * 2**20, f"{kept / 2**20:.1f} MiB kept for 1000 command lines"


# -- facts, balances and the sustained-utilisation clock --------------------------------------


def gpu(index: int = 0, *, used: int | None = 10 * GIB, util: float | None = 0.5,
        listed: bool = True) -> GpuSample:
    return GpuSample(index, f"GPU-{index}", "Fake", 80 * GIB, used, util, 40.0, 100.0,
                     processes_listed=listed)


def hold(pid: int, used: int | None, index: int = 0) -> Holder:
    return Holder(pid=pid, gpu_uuid=f"GPU-{index}", gpu_index=index, used_bytes=used, kind="C")


def fact(pid: int, user: str = "alice", comm: str = "python3", cmdline: str | None = "python3 "
         "train.py", start: int = 1000) -> HolderFacts:
    return HolderFacts(pid, start, user, comm, cmdline)


def test_unattributed_is_used_minus_what_processes_hold() -> None:
    (b,) = balance([gpu(used=10 * GIB)], [hold(1, 3 * GIB), hold(2, 4 * GIB), hold(3, GIB, 1)])
    assert (b.processes_bytes, b.processes, b.unattributed_bytes) == (7 * GIB, 2, 3 * GIB)
    assert b.why_unknown is None


def test_unattributed_is_absent_not_zero_when_a_figure_is_missing() -> None:
    one_unknown, = balance([gpu()], [hold(1, 10 * GIB), hold(2, None)])
    assert one_unknown.unattributed_bytes is None
    assert one_unknown.why_unknown == "usage of pid 2 unavailable"
    unlisted, = balance([gpu(listed=False)], [])
    assert unlisted.unattributed_bytes is None and unlisted.why_unknown == (
        "process list unavailable")
    no_used, = balance([gpu(used=None)], [hold(1, GIB)])
    assert no_used.unattributed_bytes is None and no_used.why_unknown == (
        "used memory unavailable")


def test_processes_holding_more_than_used_leave_zero_unattributed() -> None:
    (b,) = balance([gpu(used=GIB)], [hold(1, 2 * GIB)])
    assert b.unattributed_bytes == 0 and b.processes_bytes == 2 * GIB


def test_users_sum_every_holding_and_carry_their_quota() -> None:
    facts = {1: fact(1), 2: fact(2), 3: fact(3, user="bob")}
    holders = [hold(1, 3 * GIB), hold(1, 2 * GIB, 1), hold(2, None), hold(3, GIB),
               hold(99, 5 * GIB)]  # pid 99 is not in /proc: nobody's
    acc = account([gpu(), gpu(1)], holders, facts, quotas=QUOTAS, audit=Audit(),
                  groups=Groups({}), hot={}, now=0.0)
    assert [(u.user, u.used_bytes, u.quota_bytes) for u in acc.users] == [
        ("alice", 5 * GIB, 4 * GIB), ("bob", GIB, 8 * GIB)]
    acc = account([gpu()], holders, facts, quotas=Quotas(), audit=Audit(), groups=Groups({}),
                  hot={}, now=0.0)
    assert [u.quota_bytes for u in acc.users] == [None, None]


def test_root_sums_like_anyone_but_has_no_default_quota() -> None:
    facts = {1: fact(1, user="root"), 2: fact(2, user="alice"), 3: fact(3, user="root")}
    acc = account([gpu()], [hold(1, 6 * GIB), hold(2, GIB), hold(3, 6 * GIB)], facts,
                  quotas=Quotas(users=(("*", 8 * GIB),)), audit=Audit(), groups=Groups({}),
                  hot={}, now=0.0)
    assert [(u.user, u.used_bytes, u.quota_bytes) for u in acc.users] == [
        ("alice", GIB, 8 * GIB), ("root", 12 * GIB, None)]


def test_pattern_suspects_with_their_reason() -> None:
    facts = {5: fact(5, comm="xmrig", cmdline="./xmrig -o pool:3333"),
             6: fact(6, comm="python3", cmdline="nbminer -a kawpow"), 7: fact(7)}
    acc = account([gpu()], [hold(5, GIB), hold(6, GIB), hold(7, GIB)], facts,
                  quotas=Quotas(), audit=Audit(), groups=Groups({}), hot={}, now=0.0)
    assert [(s.pid, s.why) for s in acc.suspects] == [(5, WHY_COMM), (6, WHY_CMDLINE)]
    assert acc.suspects[1].detail == "command line matches suspect name 'nbminer'"
    assert acc.suspect_of(7) is None


RULE = SustainedUtilization(ratio=0.9, for_seconds=100)


def scan(hot, *, now: float, util: float, holders: list[Holder],
         facts: dict[int, HolderFacts]):
    audit = Audit(suspect_patterns=(), sustained_utilization=RULE)
    return account([gpu(util=util)], holders, facts, quotas=Quotas(), audit=audit,
                   groups=Groups({}), hot=hot, now=now)


def test_a_sole_holder_busy_for_the_whole_window_becomes_a_suspect() -> None:
    facts = {8: fact(8)}
    holders = [hold(8, GIB)]
    acc = scan({}, now=0, util=0.95, holders=holders, facts=facts)
    acc = scan(acc.hot, now=99, util=0.99, holders=holders, facts=facts)
    assert acc.suspects == ()
    acc = scan(acc.hot, now=100, util=0.9, holders=holders, facts=facts)
    (s,) = acc.suspects
    assert (s.pid, s.why) == (8, WHY_UTILIZATION) and "for 100s" in s.detail


@pytest.mark.parametrize("interruption", ["dip", "second-holder", "new-process", "no-util"])
def test_the_sustained_clock_restarts(interruption: str) -> None:
    facts = {8: fact(8), 9: fact(9)}
    holders = [hold(8, GIB)]
    acc = scan({}, now=0, util=0.95, holders=holders, facts=facts)
    if interruption == "dip":
        acc = scan(acc.hot, now=50, util=0.5, holders=holders, facts=facts)
    elif interruption == "second-holder":
        acc = scan(acc.hot, now=50, util=0.95, holders=[*holders, hold(9, GIB)], facts=facts)
    elif interruption == "new-process":  # pid 8 reused by another process
        facts = {8: fact(8, start=2000)}
    elif interruption == "no-util":
        acc = account([gpu(util=None)], holders, facts, quotas=Quotas(),
                      audit=Audit(suspect_patterns=(), sustained_utilization=RULE),
                      groups=Groups({}), hot=acc.hot, now=50)
    acc = scan(acc.hot, now=60, util=0.95, holders=holders, facts=facts)
    acc = scan(acc.hot, now=120, util=0.95, holders=holders, facts=facts)
    assert acc.suspects == ()  # busy again only since 60 (or 0 for another process)
    acc = scan(acc.hot, now=160, util=0.95, holders=holders, facts=facts)
    assert [s.pid for s in acc.suspects] == [8]


def test_the_heuristic_is_off_by_default() -> None:
    assert Audit().sustained_utilization is None
    assert track_hot({}, [gpu(util=1.0)], [hold(8, GIB)], {8: fact(8)}, None, 0.0) == {}


def test_a_pattern_suspect_is_listed_once_even_when_also_busy() -> None:
    facts = {8: fact(8, comm="ethminer", cmdline="ethminer -G")}
    audit = Audit(sustained_utilization=SustainedUtilization(ratio=0.5, for_seconds=1))
    acc = account([gpu(util=1.0)], [hold(8, GIB)], facts, quotas=Quotas(), audit=audit,
                  groups=Groups({}), hot={}, now=0)
    acc = account([gpu(util=1.0)], [hold(8, GIB)], facts, quotas=Quotas(), audit=audit,
                  groups=Groups({}), hot=acc.hot, now=10)
    assert [(s.pid, s.why) for s in acc.suspects] == [(8, WHY_COMM)]


@pytest.mark.parametrize("pure", ["gpuguard/engine/scan/accounting.py",
                                  "gpuguard/engine/scan/attribution.py",
                                  "gpuguard/engine/scan/unlisted.py",
                                  "gpuguard/config/accounting.py"])
def test_accounting_modules_do_no_io(pure: str) -> None:
    bad = [f"{pure}:{line}: {module}" for line, module, _ in imports(REPO / pure,
                                                                     with_typing_only=False)
           if under(module, IO_MODULES)]
    assert bad == []


# -- cost: what accounting adds to a scan's /proc reads ---------------------------------------


def test_accounting_reads_only_holders_and_only_once_per_process(trees, fake_gpu) -> None:
    """Against classify() alone on a cold cache, a scan adds a command-line and a cgroup
    read only for holders classify() decided before reading them (protected by comm:
    both; by nohup: the cgroup), and a warm scan adds nothing."""
    import shlex
    import sys

    from gpuguard.base.counters import Counters
    from gpuguard.engine.scan.scanner import Scanner
    from gpuguard.gpu.nvml import Nvml
    from gpuguard.host.procfs import ProcessView
    from gpuguard.orphans.classify import classify
    from gpuguard.orphans.rules_config import Rules
    from tests.support.proctree import HOLDER

    by_comm = trees.spawn(f"ln -s {shlex.quote(sys.executable)} {{dir}}/tmux && {{dir}}/tmux "
                          f"{shlex.quote(str(HOLDER))} --pidfile {{dir}}/worker & wait")
    nohup = trees.spawn("nohup {holder} --pidfile {dir}/worker >/dev/null 2>&1 & wait")
    normal = trees.spawn("{holder} --pidfile {dir}/worker & wait")
    miner = trees.spawn("exec -a xmrig {holder} --pidfile {dir}/worker & wait")
    for tree in (by_comm, nohup, normal, miner):
        fake_gpu.add_process(0, tree.pid("worker"), GIB)

    def reads(counters: Counters) -> dict[str, int]:
        return {site: cost.proc_reads for site, cost in counters.snapshot().items()
                if cost.proc_reads}

    alone = Counters()
    view = ProcessView(counters=alone)
    view.begin_scan()
    trees_alone = classify(Nvml(counters=Counters()).read().holders, view, Rules())
    reasons = {hv.reason for t in trees_alone for hv in t.holder_verdicts}
    assert {"protect-pattern", "ignores-sighup"} <= reasons
    counters = Counters()
    scanner = Scanner(rules=Rules(), nvml=Nvml(counters=Counters()), counters=counters,
                      view=ProcessView(counters=counters))
    snap = scanner.scan_once()
    assert [s.pid for s in snap.accounting.suspects] == [miner.pid("worker")]
    cold, base = reads(counters), reads(alone)
    extra = {site: cold.get(site, 0) - base.get(site, 0) for site in cold | base}
    assert {site: n for site, n in extra.items() if n} == {"proc_cmdline": 1, "proc_cgroup": 2}
    before = reads(counters)
    scanner.scan_once()
    warm = {site: n - before.get(site, 0) for site, n in reads(counters).items()}
    assert {site for site, n in warm.items() if n} <= {"proc_stat"}
