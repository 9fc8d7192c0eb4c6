"""95 % intervals for the proportions tafl reports (the validation report, the model card, `/models`, the page):
Wilson's score interval, which stays inside [0, 1] and keeps its coverage for small counts and proportions near 0
or 1, where the normal approximation does not. Standard library only."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson(k: float, n: float, z: float = Z95) -> tuple[float, float, float]:
    """(estimate, low, high) of a proportion k / n with Wilson's score interval; NaNs for n = 0."""
    if n <= 0:
        return (math.nan, math.nan, math.nan)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (p, max(0.0, centre - half), min(1.0, centre + half))


def with_interval(p: float | None, n: int | None, digits: int = 0, inside: bool = False) -> str:
    """"93% (90–95%)": a share measured on n images with its Wilson interval ("93%; 90–95%" `inside` parentheses
    of the caller's); the share alone without n."""
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "—"
    if not n:
        return f"{100 * p:.{digits}f}%"
    _, lo, hi = wilson(p * n, n)
    span = f"{100 * lo:.{digits}f}–{100 * hi:.{digits}f}%"
    return f"{100 * p:.{digits}f}%; {span}" if inside else f"{100 * p:.{digits}f}% ({span})"
