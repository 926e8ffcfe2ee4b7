"""The field machinery every section is declared with: `setting()` (a default, one line of help
and the values allowed), `Allowed` (the check), and `ConfigError`. No section lives here, and
nothing here reads a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(Exception):
    """A configuration problem, reported at startup with the offending key."""


@dataclass(frozen=True, slots=True)
class Allowed:
    """The values a setting accepts beyond its type; a list or table setting applies it to each item.
    `choices` entries ending in ":N" accept any whole number there ("cuda:N": cuda:0, cuda:1...)."""

    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive lower bound: "more than"
    choices: tuple[str, ...] = ()
    ignore_case: bool = False

    def range_text(self) -> str:
        """The numeric range in words ("1 or more", "0 to 1"); empty when there is none."""
        high = None if self.maximum is None else _number(self.maximum)
        if self.minimum is not None:
            low = _number(self.minimum)
            return f"{low} or more" if high is None else f"{low} to {high}"
        if self.above is not None:
            low = f"more than {_number(self.above)}"
            return low if high is None else f"{low} and at most {high}"
        return "" if high is None else f"{high} or less"

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused ("must be ..."), or None when it is allowed."""
        if self.choices and isinstance(value, str) and not any(self._matches(c, value) for c in self.choices):
            return f"must be one of {', '.join(self.choices)}; got {value!r}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        too_low = (self.minimum is not None and value < self.minimum) or (
            self.above is not None and value <= self.above
        )
        if too_low or (self.maximum is not None and value > self.maximum):
            return f"must be {self.range_text()}; got {value!r}"
        return None

    def _matches(self, choice: str, value: str) -> bool:
        if self.ignore_case:
            choice, value = choice.upper(), value.upper()
        if choice.endswith(":N"):
            return value == choice[:-2] or re.fullmatch(re.escape(choice[:-1]) + r"\d+", value) is not None
        return value == choice


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def setting(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    choices: tuple[str, ...] = (),
    ignore_case: bool = False,
) -> Any:
    """A config field with its default, its one line of documentation and the values it accepts
    (checked by `validate` for every setting; a numeric range is appended to the help text)."""
    allowed = Allowed(minimum, maximum, above, choices, ignore_case)
    text = allowed.range_text()
    metadata = {"help": f"{help} Allowed: {text}." if text else help, "allowed": allowed}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)
