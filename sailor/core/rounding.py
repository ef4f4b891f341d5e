"""Printing a total beside its parts so that the printed parts add up to the printed total."""

from __future__ import annotations

import math
from collections.abc import Sequence


def parts_adding_up(total: float, parts: Sequence[float], decimals: int) -> tuple[str, list[str]]:
    """`total` and `parts` (non-negative, summing to `total` up to float error) as texts with
    `decimals` decimals whose printed parts add up exactly to the printed total.

    Rounding each figure on its own can break the sum by a unit in the last place (14.4622 + 0.5620 +
    0.0072 = 15.0314 printed beside an iteration of 15.0315). So the total is rounded, and the parts
    are rounded by largest remainder: each is rounded down to `decimals`, and the units still missing
    to the rounded total go one each to the parts with the largest remainders (ties to the earlier
    part). Every part is then within one unit of the last place of its own value, and the total
    is printed as `f"{total:.{decimals}f}"` prints it.
    """
    scale = 10 ** decimals
    total_text = f"{total:.{decimals}f}"
    want = round(float(total_text) * scale)  # the printed total in units of the last place
    floors = [math.floor(p * scale) for p in parts]
    missing = want - sum(floors)
    assert 0 <= missing <= len(parts), f"parts {list(parts)} do not add up to {total}"
    by_remainder = sorted(range(len(parts)), key=lambda i: (-(parts[i] * scale - floors[i]), i))
    units = list(floors)
    for i in by_remainder[:missing]:
        units[i] += 1
    return total_text, [_text(u, decimals) for u in units]


def _text(units: int, decimals: int) -> str:
    """`units` of 10**-decimals as a decimal text ("15.0315" for 150315 at 4 decimals)."""
    return f"{units / 10 ** decimals:.{decimals}f}"
