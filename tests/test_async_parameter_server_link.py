"""Lesson 11's server behind a link: the update-rate model the notebook measures against."""
import pytest

from labsrc.async_parameter_server_link import WIRE_EFFICIENCY, model_updates_per_s


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
