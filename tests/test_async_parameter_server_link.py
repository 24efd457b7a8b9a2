"""Lesson 11's server behind a link: the update-rate model the notebook measures against."""
import pytest

from labsrc.lessons.async_parameter_server.behind_link import (WIRE_EFFICIENCY, CoreWait, judge_rates,
                                                               model_updates_per_s, phase_waits)


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


def waits(*phases):
    """CoreWait records: per phase, (wall_s, waited_s) of each of its ranks."""
    return [CoreWait(phase=phase, workers=len(ranks) - 1, wall_s=wall, waited_s=waited, rank=rank)
            for phase, ranks in enumerate(phases) for rank, (wall, waited) in enumerate(ranks)]


def test_a_phase_waits_for_a_core_as_its_ranks_together_over_its_longest_rank():
    assert phase_waits(waits([(2.0, 0.01), (1.9, 0.03)], [(4.0, 0.0), (4.0, 0.2), (3.9, 0.0)])) == \
        pytest.approx({0: 0.02, 1: 0.05})
    assert phase_waits(waits([(2.0, 0.01), (2.0, None)])) is None
    assert phase_waits([]) is None


def test_the_rates_are_judged_on_a_quiet_machine_or_where_no_phase_waited_for_cores():
    calm = waits([(2.0, 0.01), (2.0, 0.02)], [(2.0, 0.0), (2.0, 0.03), (2.0, 0.01)])
    verdict = judge_rates(calm, 0.1, probes_quiet=False, linked=True)
    assert verdict.judged and verdict.worst_wait == pytest.approx(0.02) and "did not hold" in verdict.why
    held_up = waits([(2.0, 0.01), (2.0, 0.02)], [(2.0, 0.05), (2.0, 0.03), (2.0, 0.02)])   # 5% in phase 1
    assert not judge_rates(held_up, 0.1, probes_quiet=False, linked=True).judged
    assert judge_rates(held_up, 0.1, probes_quiet=True, linked=True).judged   # nothing else competed for the cores
    assert not judge_rates(calm, 0.6, probes_quiet=True, linked=True).judged   # the rounds disagree
    # no link (the ranks share the cores and wait for each other) or no count: a busy machine cannot be judged
    for counted, linked in ((calm, False), (waits([(2.0, None), (2.0, 0.0)]), True)):
        assert judge_rates(counted, 0.1, probes_quiet=True, linked=linked).judged
        assert not judge_rates(counted, 0.1, probes_quiet=False, linked=linked).judged
