"""Lesson 11's server behind a link: the update-rate model the notebook measures against."""
import pytest

from labsrc.async_parameter_server_link import WIRE_EFFICIENCY, CoreWait, model_updates_per_s


def test_one_worker_alternates_two_overlap_and_the_servers_link_caps_the_rest():
    megabit = 10**6
    one_way = 8 * 500_000 / (100 * megabit * WIRE_EFFICIENCY)  # 0.5 MB at 100 Mbit/s, framing paid
    assert model_updates_per_s(1, 500_000, 500_000, 100 * megabit) == pytest.approx(1 / (2 * one_way))
    assert model_updates_per_s(2, 500_000, 500_000, 100 * megabit) == pytest.approx(1 / one_way)
    assert model_updates_per_s(8, 500_000, 500_000, 100 * megabit) == pytest.approx(1 / one_way)
    assert model_updates_per_s(2, 500_000, 500_000, 10 * 100 * megabit) == pytest.approx(10 / one_way)
    # unequal messages: the longer direction sets the cap
    assert model_updates_per_s(4, 1_000_000, 500_000, 100 * megabit) == pytest.approx(1 / (2 * one_way))


def test_the_framing_factor_is_tcp_payload_per_ethernet_frame():
    assert WIRE_EFFICIENCY == pytest.approx((1500 - 20 - 20 - 12) / (1500 + 14))


def test_a_ranks_wait_for_a_core_is_a_share_of_its_phase():
    assert CoreWait(phase=0, workers=2, wall_s=2.0, waited_s=0.1).share == pytest.approx(0.05)
    assert CoreWait(phase=0, workers=2, wall_s=2.0, waited_s=None).share is None
