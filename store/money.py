"""Money as decimals: costs are computed and summed with `Decimal` and kept to the
nano-dollar, so a total of many tiny request costs reads 0.000052, not 5.199999999999997e-05.
SQLite stores them as REAL; every value written or summed is rounded to NANO_USD first.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

NANO_USD = Decimal("0.000000001")
NUM_DECIMALS = 9


def to_usd(value: float | int | str | Decimal) -> Decimal:
    """The value as a Decimal rounded to the nano-dollar (floats read through their repr)."""
    return Decimal(str(value)).quantize(NANO_USD, rounding=ROUND_HALF_EVEN)


def cost_usd(tokens_and_prices: Iterable[tuple[int, float]]) -> Decimal:
    """Sum of tokens x USD-per-million-tokens, exact, then rounded to the nano-dollar."""
    total = sum((Decimal(tokens) * Decimal(str(price)) for tokens, price in tokens_and_prices), Decimal(0))
    return to_usd(total / Decimal(1_000_000))


def sum_usd(values: Iterable[float | None]) -> float:
    """A JSON-ready sum of stored costs: decimal addition, rounded to the nano-dollar."""
    return float(sum((to_usd(v) for v in values if v is not None), Decimal(0)))


def format_usd(value: float | Decimal | None) -> str:
    """Plain decimal notation, never an exponent: $0, $0.000052, $1.25, $1,234.50."""
    if value is None:
        return "none"
    try:
        amount = to_usd(value)
    except InvalidOperation:  # 1e19 or more (a budget stored before MAX_BUDGET_USD): too many digits for nanos
        return f"${Decimal(str(value)):,f}"
    if amount == 0:
        return "$0"
    if abs(amount) >= Decimal("0.01"):
        return f"${amount:,.2f}" if amount == amount.quantize(Decimal("0.01")) else f"${amount.normalize():,f}"
    return f"${amount.normalize():f}"
