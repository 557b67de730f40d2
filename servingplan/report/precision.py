"""How many digits a measured number earns. On a machine whose speed moved more than 10% during the run
(servingplan/profile/measure.py's speed trace), a third significant digit claims more than the data
hold: such numbers, and every figure derived from the measured step times (costs, speed-ups, capacities),
get two significant digits."""
from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

from servingplan.profile.measure import SPEED_MOVED_WARNING

# significant digits when the speed held within SPEED_MOVED_WARNING, and when it moved more
STEADY_DIGITS = 3
MOVED_DIGITS = 2


def measured_digits(moved_pct: float | None) -> int:
    """Significant digits for numbers measured on this machine, given how far its speed moved (percent,
    max - min over the median; None when the run measured nothing, e.g. an imported cost model)."""
    if moved_pct is None:
        return STEADY_DIGITS
    if not math.isfinite(moved_pct) or moved_pct < 0:
        raise ValueError(f"moved_pct = {moved_pct!r}: must be a finite non-negative percentage")
    return MOVED_DIGITS if moved_pct > 100 * SPEED_MOVED_WARNING else STEADY_DIGITS


def significant(value: float, digits: int) -> str:
    """`value` rounded half away from zero to `digits` significant digits, in plain notation with thousands
    separators (0.00579 -> "0.0058", 16.5 -> "17", 12345 -> "12,000" at two digits)."""
    if digits < 1:
        raise ValueError(f"digits = {digits!r}: must be at least 1")
    if not math.isfinite(value):
        raise ValueError(f"value = {value!r}: only a finite number has significant digits")
    if value == 0:
        return "0"
    exact = Decimal(repr(float(value)))
    rounded = exact
    for _ in range(2):  # a second pass when rounding carries into a new digit (9.96 -> 10)
        rounded = exact.quantize(Decimal(1).scaleb(rounded.adjusted() - digits + 1), rounding=ROUND_HALF_UP)
    return f"{rounded:,f}"
