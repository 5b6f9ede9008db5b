"""The DRM usage-stats parser and the counting over it (gpuguard/gpu/drm/fdinfo.py), on the
kernel's own examples and on captures from real drivers. Where each comes from:

- I915_DOC: Documentation/gpu/i915.rst, "i915 DRM client usage stats implementation"
  (torvalds/linux), engines only.
- I915_MEMORY: a Tiger Lake i915 client with the memory keys, as quoted in Ian Rogers'
  "[PATCH v3 4/4] proc_pid_fdinfo.5: Add DRM subsection" (linux-man / dri-devel,
  2024-11-01, Message-Id 20241101191156.1272730-4-irogers@google.com).
- XE_DOC: the DOC comment of drivers/gpu/drm/xe/xe_drm_client.c (torvalds/linux).
- AMDGPU: the example output in Tvrtko Ursulin's "[PATCH 2/2] drm/amdgpu: Use
  drm_print_memory_stats helper from fdinfo" (dri-devel, 2024-05-20, Message-ID
  20240520111338.10110-2-tursulin@igalia.com), legacy keys kept beside the new ones.
- AMDGPU_LEGACY: amdgpu before that patch, as its amdgpu_show_fdinfo() printed it
  (drm-memory-* only; the "drm-memory-gtt: \t" spacing is the driver's own).
"""

from __future__ import annotations

from gpuguard.gpu.drm.fdinfo import (
    DrmFd,
    attribute,
    busy_pids,
    marks_of,
    parse_fdinfo,
    per_process,
    size,
    vendor_of,
)

KIB = 1024

I915_DOC = """pos:    0
flags:  0100002
mnt_id: 21
drm-driver: i915
drm-pdev:   0000:00:02.0
drm-client-id:      7
drm-engine-render:  9288864723 ns
drm-engine-copy:    2035071108 ns
drm-engine-video:   0 ns
drm-engine-capacity-video:   2
drm-engine-video-enhance:   0 ns
"""

I915_MEMORY = """pos:    0
flags:  02100002
mnt_id: 26
ino:    284
drm-driver:     i915
drm-client-id:  39
drm-pdev:       0000:00:02.0
drm-total-system0:      6044 KiB
drm-shared-system0:     0
drm-active-system0:     0
drm-resident-system0:   6044 KiB
drm-purgeable-system0:  1688 KiB
drm-total-stolen-system0:       0
drm-shared-stolen-system0:      0
drm-active-stolen-system0:      0
drm-resident-stolen-system0:    0
drm-purgeable-stolen-system0:   0
drm-engine-render:      346249 ns
drm-engine-copy:        0 ns
drm-engine-video:       0 ns
drm-engine-capacity-video:      2
drm-engine-video-enhance:       0 ns
"""

XE_DOC = """pos:    0
flags:  0100002
mnt_id: 26
ino:    685
drm-driver:     xe
drm-client-id:  3
drm-pdev:       0000:03:00.0
drm-total-system:       0
drm-shared-system:      0
drm-active-system:      0
drm-resident-system:    0
drm-purgeable-system:   0
drm-total-gtt:  192 KiB
drm-shared-gtt: 0
drm-active-gtt: 0
drm-resident-gtt:       192 KiB
drm-total-vram0:        23992 KiB
drm-shared-vram0:       16 MiB
drm-active-vram0:       0
drm-resident-vram0:     23992 KiB
drm-total-stolen:       0
drm-shared-stolen:      0
drm-active-stolen:      0
drm-resident-stolen:    0
drm-cycles-rcs: 28257900
drm-total-cycles-rcs:   7655183225
drm-cycles-bcs: 0
drm-total-cycles-bcs:   7655183225
drm-cycles-vcs: 0
drm-total-cycles-vcs:   7655183225
drm-engine-capacity-vcs:        2
drm-cycles-vecs:        0
drm-total-cycles-vecs:  7655183225
drm-engine-capacity-vecs:       2
drm-cycles-ccs: 0
drm-total-cycles-ccs:   7655183225
drm-engine-capacity-ccs:        4
"""

AMDGPU = """pos:\t0
flags:\t02100002
mnt_id:\t24
ino:\t1239
drm-driver:\tamdgpu
drm-client-id:\t4
drm-pdev:\t0000:04:00.0
pasid:\t32771
drm-total-cpu:\t0
drm-shared-cpu:\t0
drm-active-cpu:\t0
drm-resident-cpu:\t0
drm-purgeable-cpu:\t0
drm-total-gtt:\t2392 KiB
drm-shared-gtt:\t0
drm-active-gtt:\t0
drm-resident-gtt:\t2392 KiB
drm-purgeable-gtt:\t0
drm-total-vram:\t44564 KiB
drm-shared-vram:\t31952 KiB
drm-active-vram:\t0
drm-resident-vram:\t44564 KiB
drm-purgeable-vram:\t0
drm-memory-vram:\t44564 KiB
drm-memory-gtt: \t2392 KiB
drm-memory-cpu: \t0 KiB
amd-memory-visible-vram:\t44564 KiB
amd-evicted-vram:\t0 KiB
amd-evicted-visible-vram:\t0 KiB
amd-requested-vram:\t44564 KiB
amd-requested-visible-vram:\t11952 KiB
amd-requested-gtt:\t2392 KiB
drm-engine-compute:\t46464671 ns
"""

AMDGPU_LEGACY = """pos:\t0
flags:\t02100002
mnt_id:\t24
ino:\t1239
pasid:\t32770
drm-driver:\tamdgpu
drm-pdev:\t0000:04:00.0
drm-client-id:\t550
drm-memory-vram:\t23048 KiB
drm-memory-gtt: \t80128 KiB
drm-memory-cpu: \t0 KiB
amd-evicted-vram:\t59648 KiB
amd-requested-vram:\t82696 KiB
drm-engine-gfx:\t301893603834 ns
drm-engine-compute:\t31641274970 ns
"""


def test_the_i915_doc_example_has_engines_and_no_memory() -> None:
    client = parse_fdinfo(I915_DOC)
    assert client is not None
    assert (client.driver, client.pdev, client.client_id) == ("i915", "0000:00:02.0", 7)
    # The capacity line is a count of engines, not an engine.
    assert client.counters == {"ns:render": 9288864723, "ns:copy": 2035071108,
                               "ns:video": 0, "ns:video-enhance": 0}
    assert client.memory_kind is None and client.memory_bytes is None


def test_an_integrated_i915_counts_every_region_it_names() -> None:
    """system0 and stolen-system0 are the host's memory: an integrated GPU has no other."""
    client = parse_fdinfo(I915_MEMORY)
    assert client is not None and client.memory_kind == "total"
    assert client.memory == {"system0": 6044 * KIB, "stolen-system0": 0}
    assert client.memory_bytes == 6044 * KIB
    assert client.counters["ns:render"] == 346249


def test_xe_counts_its_vram_and_reads_cycles_not_total_cycles_as_memory() -> None:
    client = parse_fdinfo(XE_DOC)
    assert client is not None and client.memory_kind == "total"
    # drm-total-cycles-rcs is a clock, not a region called "cycles-rcs".
    assert client.memory == {"system": 0, "gtt": 192 * KIB, "vram0": 23992 * KIB, "stolen": 0}
    assert client.memory_bytes == 23992 * KIB  # the device's own region only
    assert client.counters == {"cycles:rcs": 28257900, "cycles:bcs": 0, "cycles:vcs": 0,
                               "cycles:vecs": 0, "cycles:ccs": 0}


def test_amdgpu_prefers_total_over_the_legacy_memory_keys() -> None:
    client = parse_fdinfo(AMDGPU)
    assert client is not None and client.memory_kind == "total"
    assert client.memory_bytes == 44564 * KIB
    assert client.counters == {"ns:compute": 46464671}


def test_legacy_amdgpu_reads_drm_memory() -> None:
    client = parse_fdinfo(AMDGPU_LEGACY)
    assert client is not None and client.memory_kind == "memory"
    assert client.memory == {"vram": 23048 * KIB, "gtt": 80128 * KIB, "cpu": 0}
    assert client.memory_bytes == 23048 * KIB
    assert client.counters == {"ns:gfx": 301893603834, "ns:compute": 31641274970}


def test_resident_is_the_last_choice() -> None:
    client = parse_fdinfo("drm-driver: panfrost\ndrm-client-id: 9\n"
                          "drm-resident-memory: 3 MiB\ndrm-purgeable-memory: 1 MiB\n")
    assert client is not None and client.memory_kind == "resident"
    assert client.memory_bytes == 3 << 20 and client.pdev is None


def test_a_memory_value_that_cannot_be_read_makes_the_memory_unknown() -> None:
    client = parse_fdinfo("drm-driver: xe\ndrm-client-id: 1\ndrm-total-vram0: 12 PiB\n")
    assert client is not None and client.memory_kind is None and client.memory_bytes is None


def test_without_a_client_id_the_memory_is_not_counted() -> None:
    """Two descriptors of one client could not be told apart: counting it would double."""
    client = parse_fdinfo("drm-driver: xe\ndrm-total-vram0: 4 KiB\n")
    assert client is not None and client.client_id is None and client.memory_bytes is None


def test_a_file_that_is_no_drm_client_parses_to_none() -> None:
    assert parse_fdinfo("pos:\t0\nflags:\t0100002\nmnt_id:\t26\nino:\t1234\n") is None
    assert parse_fdinfo("") is None


def test_sizes_and_vendors() -> None:
    assert [size(v) for v in ("0", "7", "2 KiB", "3 MiB", "1 GiB", "x", "1 KB")] == \
        [0, 7, 2048, 3 << 20, 1 << 30, None, None]
    assert [vendor_of(d) for d in ("i915", "xe", "amdgpu", "panfrost")] == \
        ["intel", "intel", "amd", "panfrost"]


def fd(pid: int, start: int, n: int, text: str, pdev: str = "0000:03:00.0") -> DrmFd:
    return DrmFd(pid, start, n, pdev, parse_fdinfo(text))


def xe(client: int, vram_kib: int, rcs: int = 0) -> str:
    return (f"drm-driver: xe\ndrm-client-id: {client}\ndrm-pdev: 0000:03:00.0\n"
            f"drm-total-vram0: {vram_kib} KiB\ndrm-cycles-rcs: {rcs}\n")


def test_a_client_shared_by_fork_and_dup_counts_once_for_the_oldest_holder() -> None:
    parent, child = (100, 5000), (230, 5100)  # (pid, start time)
    fds = [fd(*child, 4, xe(7, 1024)),  # inherited by fork
           fd(*parent, 5, xe(7, 1024)), fd(*parent, 9, xe(7, 1024)),  # dup'd
           fd(*child, 6, xe(8, 512))]  # the child's own client
    owned = attribute(fds)
    assert {key: o.pid for key, o in owned.items()} == {
        ("0000:03:00.0", 7): 100, ("0000:03:00.0", 8): 230}
    uses = {(u.pid, u.pdev): (u.memory_bytes, u.clients) for u in per_process(owned)}
    assert uses == {(100, "0000:03:00.0"): (1024 * KIB, 1), (230, "0000:03:00.0"): (512 * KIB, 1)}


def test_the_oldest_holder_wins_even_with_the_higher_pid() -> None:
    """pids wrap: the parent may carry the larger number. Start time decides first."""
    owned = attribute([fd(300, 10, 3, xe(7, 1)), fd(40, 99, 3, xe(7, 1))])
    assert [o.pid for o in owned.values()] == [300]


def test_the_same_client_id_on_two_devices_is_two_clients() -> None:
    owned = attribute([fd(100, 1, 3, xe(7, 1)), fd(100, 1, 4, xe(7, 2), pdev="0000:04:00.0")])
    assert sorted(u.pdev for u in per_process(owned)) == ["0000:03:00.0", "0000:04:00.0"]


def test_unreadable_stats_make_the_process_memory_unknown() -> None:
    owned = attribute([fd(100, 1, 3, xe(7, 1)), DrmFd(100, 1, 4, "0000:03:00.0", None)])
    [use] = per_process(owned)
    assert (use.memory_bytes, use.clients) == (None, 2)


def test_busy_is_counter_growth_and_unknown_never_reads_idle() -> None:
    pdev = "0000:03:00.0"
    first = attribute([fd(100, 1, 3, xe(7, 1, rcs=50)), fd(200, 2, 3, xe(8, 1, rcs=10))])
    assert busy_pids(first, None, pdev) is None  # no previous read: cannot say
    marks = marks_of(first, {})
    second = attribute([fd(100, 1, 3, xe(7, 1, rcs=80)), fd(200, 2, 3, xe(8, 1, rcs=10)),
                        fd(300, 3, 3, xe(9, 1, rcs=0))])  # 300: first seen now
    assert busy_pids(second, marks, pdev) == frozenset({100, 300})
    # A counter that steps back stays at its mark until it passes it again.
    marks = marks_of(second, marks)
    third = attribute([fd(100, 1, 3, xe(7, 1, rcs=60))])
    assert busy_pids(third, marks, pdev) == frozenset()
    assert marks_of(third, marks)[(pdev, 7)] == {"cycles:rcs": 80}
    # A client with no engine counter at all: nobody on that GPU can be called idle.
    blind = attribute([fd(100, 1, 3, xe(7, 1, rcs=80)),
                       fd(400, 4, 3, "drm-driver: xe\ndrm-client-id: 10\n")])
    assert busy_pids(blind, marks, pdev) is None

