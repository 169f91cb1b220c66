"""How every report writes a number: one formatter for the text diff, the sign-off (text, md,
HTML), the noise report, `inspect` and the configuration matrix, so that a value reads the same
wherever it is printed.

- `number(x)`: "-" for None, "inf" / "-inf" / "nan", "0", else 3 significant digits, in
  scientific notation outside [1e-3, 1e4).
- `cosine(x)`: a cosine close to 1 as its distance from 1 ("1-1.0e-05"), where 3 or 6 digits
  would print 1 or 0.999990 and hide the difference between 1e-5 and 1e-7.
- `percent(x)`: a fraction as a percent with one decimal.
"""
from __future__ import annotations

import math


def number(x: float | int | None) -> str:
    """"-" for None, 3 significant digits, scientific outside [1e-3, 1e4)."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if math.isnan(x):
        return "nan"
    if x == 0:
        return "0"
    return f"{x:.3g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.2e}"


def cosine(x: float | None) -> str:
    """"1" when equal to 1, "1-d" (d to 2 digits) over 0.9999, else 6 decimals above 0.99."""
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if x == 1.0:
        return "1"
    if x > 0.9999:
        return f"1-{1 - x:.1e}"
    return f"{x:.6f}" if x > 0.99 else f"{x:.4g}"


def percent(x: float | None) -> str:
    """"-" for None, else one decimal of a percent."""
    return "-" if x is None else f"{x:.1%}"
