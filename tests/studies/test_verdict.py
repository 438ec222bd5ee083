"""The verdict module: each rule of docs/study.md ("How a verdict is read") fed its case."""

from __future__ import annotations

import pytest

from mixture_of_depths.studies import verdict as v
from mixture_of_depths.studies.verdict import Arm, best_of, compare

DENSE = Arm("dense", {0: 2.70, 1: 2.72, 2: 2.71})  # range 0.02


def test_beyond_the_spread_with_both_optima_interior_is_better_or_worse():
    low = Arm("MoD", {0: 2.60, 1: 2.61, 2: 2.62})
    high = Arm("MoD", {0: 2.80, 1: 2.81, 2: 2.79})
    got = compare(low, DENSE)
    assert got.word == v.BETTER and got.diff == pytest.approx(-0.10)
    assert got.paired == pytest.approx({0: -0.10, 1: -0.11, 2: -0.09})
    assert compare(high, DENSE).word == v.WORSE
    assert "-0.1000 nats (seeds 0, 1, 2: -0.100, -0.110, -0.090), better" in got.text()


def test_a_difference_no_larger_than_the_widest_range_is_within_the_spread():
    wide = Arm("MoD", {0: 2.50, 1: 2.85})  # range 0.35 swamps a mean gap of -0.035
    got = compare(wide, DENSE)
    assert got.word == v.WITHIN and got.spread == pytest.approx(0.35)
    # the spread is the wider arm's: a narrow challenger against a noisy baseline too
    assert compare(DENSE, wide).word == v.WITHIN


def test_the_spread_is_a_bound_not_a_margin():
    """A difference exactly the spread is within it: only a larger one decides."""
    a = Arm("a", {0: 1.0, 1: 1.5})
    b = Arm("b", {0: 1.5, 1: 2.0})  # every pair -0.5, spread 0.5
    assert compare(a, b).word == v.WITHIN


def test_fewer_than_two_shared_seeds_is_a_reading():
    one = Arm("MoD", {0: 2.0})
    got = compare(one, DENSE)
    assert got.word == v.ONE_SEED and got.diff == pytest.approx(-0.70)
    assert compare(Arm("MoD", {5: 2.0, 6: 2.1}), DENSE).diff is None  # no seed in common
    assert compare(Arm("MoD", {5: 2.0, 6: 2.1}), DENSE).word == v.ONE_SEED


def test_an_optimum_at_the_grids_edge_is_not_a_winner():
    edge = Arm("MoD M", {0: 2.5, 1: 2.5}, edge="its best size, M, is the largest tried (S, M)")
    got = compare(edge, DENSE)
    assert got.word == v.EDGE and "largest tried" in got.why
    base = Arm("dense", DENSE.seeds, edge="one size tried (XS)")
    assert compare(Arm("MoD", {0: 2.5, 1: 2.5}), base).word == v.EDGE


def test_a_baseline_tuned_to_the_end_of_its_range_is_not_bracketed():
    base = Arm("dense", DENSE.seeds, unbracketed="its best rate, 4e-3, is the highest tried")
    got = compare(Arm("MoD", {0: 2.9, 1: 2.9}), base)
    assert got.word == v.UNBRACKETED and "highest tried" in got.why
    # within the spread stays within, with the open end named beside it
    close = compare(Arm("MoD", {0: 2.71, 1: 2.71}), base)
    assert close.word == v.WITHIN and any("highest tried" in c for c in close.caveats)


def test_a_claim_about_hardware_we_do_not_have_is_not_testable():
    got = compare(Arm("MoR", {0: 1.0, 1: 1.0}), DENSE, untestable="a GPU claim, one CPU thread")
    assert got.word == v.UNTESTABLE and got.text().endswith("(a GPU claim, one CPU thread)")


def test_every_verdict_says_one_of_the_words():
    cases = [Arm("x", {0: 2.0, 1: 2.9}), Arm("y", {0: 2.0}), Arm("z", {0: 3.0, 1: 3.1})]
    assert all(compare(a, DENSE).word in v.WORDS for a in cases)


def test_best_of_a_grid_compares_the_seeds_every_point_trained_and_names_an_edge():
    # S is best on seed 0, which all three share; M's extra seed does not count
    grid = [("XS", {0: 2.9}), ("S", {0: 2.7}), ("M", {0: 2.8, 1: 2.0})]
    assert best_of(grid) == ("S", None)
    assert best_of(grid[1:]) == ("S", "its best size, S, is the smallest tried (S, M)")
    assert best_of([("S", {0: 1.0})]) == ("S", "one size tried (S)")
    rates = [(1e-3, {0: 3.1}), (2e-3, {0: 2.9}), (4e-3, {0: 2.7})]
    assert best_of(rates, "rate", ("lowest", "highest"))[1] == (
        "its best rate, 0.004, is the highest tried (0.001, 0.002, 0.004)"
    )
    with pytest.raises(ValueError, match="no seed"):
        Arm("empty", {})
