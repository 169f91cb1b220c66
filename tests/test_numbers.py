"""The one number format of every report (accucheck.numbers) at its boundaries: the text diff,
the sign-off and `inspect` print a value the same way."""
from __future__ import annotations

import math

import pytest

from accucheck.numbers import cosine, number, percent


@pytest.mark.parametrize("x, want", [
    (None, "-"), (0, "0"), (7, "7"), (3, "3"), (123456, "123456"), (math.inf, "inf"),
    (-math.inf, "-inf"), (math.nan, "nan"), (0.0, "0"), (-0.0, "0"), (1.0, "1"), (0.5, "0.5"),
    (-0.5, "-0.5"), (0.001, "0.001"), (0.0015, "0.0015"), (0.000999, "9.99e-04"),
    (0.0007, "7.00e-04"), (-0.0007, "-7.00e-04"), (1.23456, "1.23"), (6000.0, "6e+03"),
    (9990.0, "9.99e+03"), (10000.0, "1.00e+04"), (15000.0, "1.50e+04"),
    (-15000.0, "-1.50e+04"), (1.2345e-5, "1.23e-05"), (2e-300, "2.00e-300")])
def test_number_three_significant_digits_scientific_outside_1e_3_to_1e4(x, want):
    assert number(x) == want


@pytest.mark.parametrize("x, want", [
    (None, "-"), (math.nan, "nan"), (1.0, "1"), (0.99995, "1-5.0e-05"), (0.99999, "1-1.0e-05"),
    (0.9999, "0.999900"), (0.995, "0.995000"), (0.99, "0.99"), (0.5, "0.5"),
    (-0.25, "-0.25"), (0.123456, "0.1235")])
def test_cosine_shows_the_distance_from_one_near_one(x, want):
    assert cosine(x) == want


@pytest.mark.parametrize("x, want", [(None, "-"), (0.0, "0.0%"), (0.98765, "98.8%"), (1, "100.0%")])
def test_percent_one_decimal(x, want):
    assert percent(x) == want


def test_the_sign_off_and_the_diff_print_a_cosine_alike():
    """Issue 35: the diff printed 1-1.0e-05 where the sign-off printed 0.999990."""
    from accucheck.report import diff, signoff
    from accucheck.signoff import run
    assert diff.cosine is signoff.cosine is run.cosine is cosine
