"""The fleet's degraded links are named as often as benchmarks/links.py measured, never more."""

import pytest

from artemisd.sim.closedloop_scenario import MEASURED_LINK_NAMING, link_naming


def test_a_measured_degradation_takes_its_measured_rates():
    # A step 25 % slower needs transfers 25 % slower: a link at 80 % of its rate (20 % degraded).
    right, wrong, none = MEASURED_LINK_NAMING[20.0]
    assert link_naming(0.25) == pytest.approx((right / (right + wrong + none), wrong / (right + wrong + none)))


def test_between_two_measured_degradations_the_rates_are_linear():
    # 7.5 % degraded: halfway between the 5 % and the 10 % rows.
    low, high = link_naming(0.05 / 0.95), link_naming(0.10 / 0.90)
    assert link_naming(0.075 / 0.925) == pytest.approx(tuple((a + b) / 2 for a, b in zip(low, high)))


def test_beyond_the_measured_range_the_nearest_row_holds():
    # Less degraded than the least measured: no better than it; more than the most: no better either.
    assert link_naming(0.0) == pytest.approx(link_naming(0.05 / 0.95), abs=1e-12)
    assert link_naming(5.0) == pytest.approx(link_naming(0.40 / 0.60), abs=1e-12)
