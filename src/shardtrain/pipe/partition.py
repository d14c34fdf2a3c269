"""How a list of layers is cut into pipeline stages: ``parts`` holds ``stages + 1``
boundaries, stage s owning the items ``parts[s]`` to ``parts[s + 1] - 1``.

Both rules give DeepSpeed's boundaries for the same inputs (a script keeps its stages when
it moves over): :func:`partition_uniform` spreads the remainder over the first stages;
:func:`partition_balanced` picks, stage by stage from the front, the cut that keeps the
spread between the heaviest and the lightest stage so far smallest (the later cut on a tie).
"""
from __future__ import annotations

import math
from typing import List, Sequence

__all__ = ["partition_uniform", "partition_balanced"]


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """Equal counts, the first ``num_items % num_parts`` parts one item larger; with fewer
    items than parts, one item each and the rest empty."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> List[int]:
    """Contiguous parts whose weight sums are as even as the rule above finds them."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[j][i]: (spread, heaviest, lightest, cut) of the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen = best[j][i]
            for k in range(i):
                _, heavy, light, _ = best[j - 1][k]
                last = prefix[i] - prefix[k]
                hi, lo = max(heavy, last), min(light, last)
                if hi - lo <= chosen[0]:
                    chosen = (hi - lo, hi, lo, k)
            best[j][i] = chosen
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(best[j][parts[-1]][3])
    return parts[::-1]
