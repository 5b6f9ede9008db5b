"""gpuguard.web.slots: a per-address share of a front's connections, the quietest giving
way to a newcomer, and whose slots a client address takes (issue 48)."""

from __future__ import annotations

from gpuguard.web.slots import Slots, client_key


def test_an_address_over_its_share_gives_up_its_own_quietest_slot() -> None:
    slots: Slots[str] = Slots(8, share=2)
    quiet = {"a1": 5.0, "a2": 1.0, "b1": 9.0}
    assert slots.admit("a1", "A", quiet.get) == (True, None)
    assert slots.admit("a2", "A", quiet.get) == (True, None)
    assert slots.admit("b1", "B", quiet.get) == (True, None)
    # B's connection is quieter still, but A pays for A's flood.
    assert slots.admit("a3", "A", lambda c: quiet.get(c, 0.0)) == (True, "a1")
    assert slots.held_by("A") == 2 and len(slots) == 3


def test_a_full_front_gives_the_quietest_slot_and_never_a_busy_one() -> None:
    slots: Slots[str] = Slots(2, share=2)
    slots.admit("x", "A", lambda c: 0.0)
    slots.admit("y", "B", lambda c: 0.0)
    busy = {"x": None, "y": None}
    assert slots.admit("z", "C", busy.get) == (False, None)  # all being served
    assert slots.admit("z", "C", {"x": None, "y": 3.0}.get) == (True, "y")
    slots.release("z")
    slots.release("z")  # again is harmless
    assert len(slots) == 1 and slots.held_by("C") == 0


def test_share_defaults_to_a_quarter_of_the_limit() -> None:
    assert Slots(512).share == 128
    assert Slots(2).share == 1


def test_client_key_groups_an_ipv6_host_by_its_64_and_unmaps_ipv4() -> None:
    assert client_key("2001:db8:1:2:aaaa::1") == client_key("2001:db8:1:2:bbbb::9")
    assert client_key("2001:db8:1:2::1") != client_key("2001:db8:1:3::1")
    assert client_key("::ffff:10.0.0.7") == "10.0.0.7" == client_key("10.0.0.7")
    assert client_key("localhost") == "localhost"
