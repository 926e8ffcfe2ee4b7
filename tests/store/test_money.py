"""Money is computed and summed as decimals and printed without exponents."""

from __future__ import annotations

from decimal import Decimal

from store.money import cost_usd, format_usd, sum_usd


def test_costs_are_exact_decimals_to_the_nano_dollar():
    assert cost_usd([(13, 1.0), (0, 0.5), (13, 3.0)]) == Decimal("0.000052")
    assert cost_usd([(1, 0.0001)]) == Decimal("0")  # below a nano-dollar rounds away


def test_sums_of_float_costs_do_not_drift():
    floats = [1.3e-05] * 4
    assert sum(floats) == 5.2e-05 or repr(sum(floats)) != "5.2e-05"  # what float addition may give
    assert sum_usd(floats) == 5.2e-05 and sum_usd([0.1] * 3) == 0.3


def test_format_usd_never_uses_an_exponent():
    assert format_usd(5.199999999999997e-05) == "$0.000052"
    assert format_usd(0) == "$0" and format_usd(None) == "none"
    assert format_usd(5) == "$5.00" and format_usd(1234.5) == "$1,234.50"
    assert format_usd(0.0123456) == "$0.0123456"
    assert "e" not in format_usd(1e-7)
