"""Packing copies of weighted items into bins of exactly ``slots`` items each, no bin holding two
copies of one item, keeping the heaviest bin light: the step the ``global`` and ``hierarchical``
placements (``placement.py``) end in, with replicas of experts as the items and ranks as the bins
(``hierarchical`` first packs expert groups onto nodes). Pure Python on lists; no torch.

The hard part is packing under the two constraints at once: every bin gets exactly ``slots`` items,
and no bin holds two copies of one item. Heaviest-first greedy packing (longest processing time, LPT)
can paint itself into a corner under both: the last free slots may all sit on bins that already hold
the item whose copies are left. ``pack_items`` places all copies of an item at once and checks, with
the Gale-Ryser condition (``_items_left_fit``), that the items left can still be placed; when they
could not, it moves copies towards the bins with the most free slots, a choice that always keeps a
solvable packing solvable. Swaps between the heaviest bin and the others then lower its load.
"""

from __future__ import annotations


def pack_items(weights: list[float], copies: list[int], num_bins: int, slots: int) -> list[list[int]]:
    """Put ``copies[i]`` copies of item i (each weighing ``weights[i]``) into ``num_bins`` bins of exactly
    ``slots`` items, no bin holding two copies of one item, keeping the heaviest bin light.

    Heaviest item first (ties: lowest index), its copies onto the lightest bins with a free slot (ties:
    lowest bin): the same as placing the copies one at a time, each onto the lightest bin that has a
    free slot and no copy yet. Needs ``sum(copies) == num_bins * slots`` and every count <= num_bins.
    """
    free = [slots] * num_bins
    bin_load = [0.0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    # left_with_copies[c]: items not placed yet that have c copies (the Gale-Ryser check reads it).
    left_with_copies = [0] * (num_bins + 1)
    for count in copies:
        left_with_copies[count] += 1
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        count = copies[item]
        left_with_copies[count] -= 1
        open_bins = sorted((b for b in range(num_bins) if free[b]), key=lambda b: (bin_load[b], b))
        chosen = open_bins[:count]
        while not _items_left_fit(free, chosen, left_with_copies):
            # Trade the chosen bin with the fewest free slots for an unchosen one with more: the bins with
            # the most free slots always leave a solvable rest (the exchange step of Gale-Ryser's proof),
            # so this ends there at the latest.
            out = min(chosen, key=lambda b: (free[b], -bin_load[b], -b))
            into = max((b for b in open_bins if b not in chosen), key=lambda b: (free[b], -bin_load[b], -b))
            if free[into] <= free[out]:
                raise RuntimeError(
                    "packing: no bins leave the remaining items placeable (a bug: the rest was solvable)"
                )
            chosen[chosen.index(out)] = into
        for b in chosen:
            free[b] -= 1
            bin_load[b] += weights[item]
            bins[b].append(item)
    _improve_by_swaps(bins, bin_load, weights)
    return bins


def _items_left_fit(free: list[int], chosen: list[int], left_with_copies: list[int]) -> bool:
    """Gale-Ryser: after one slot of each ``chosen`` bin is used, can the items left (``left_with_copies``)
    fill the free slots with no bin holding two copies of one item? (A 0/1 matrix with row sums ``free``
    and column sums ``copies`` exists iff, for every k, the k largest row sums add up to at most
    sum over items of min(copies, k).)"""
    taken = set(chosen)
    rows = sorted((f - (b in taken) for b, f in enumerate(free)), reverse=True)
    # columns_at_least[k]: items left with >= k copies; sum_i min(copies_i, k) = sum_{j<=k} columns_at_least[j].
    columns_at_least = [0] * (len(left_with_copies) + 1)
    for count in range(len(left_with_copies) - 1, 0, -1):
        columns_at_least[count] = columns_at_least[count + 1] + left_with_copies[count]
    row_sum = column_room = 0
    for k, row in enumerate(rows, start=1):
        row_sum += row
        column_room += columns_at_least[k] if k < len(columns_at_least) else 0
        if row_sum > column_room:
            return False
    return True


def _improve_by_swaps(bins: list[list[int]], bin_load: list[float], weights: list[float]) -> None:
    """Swap one item of the heaviest bin with a lighter item of another bin while that lowers the heaviest.

    Each swap picks, over all other bins, the pair of items whose exchange leaves the larger of the two
    bins lightest. Slot counts stay; a swap that would put two copies of an item into one bin is
    skipped. Every swap lowers the sorted bin loads lexicographically, so the loop ends.
    """
    num_bins = len(bins)
    # Below this a load difference is rounding, not an improvement (and would let swaps cycle).
    tolerance = 1e-12 * max(sum(bin_load), 1.0)
    for _ in range(16 * sum(len(b) for b in bins)):  # a bound for safety; far more than ever used
        heavy = max(range(num_bins), key=lambda b: (bin_load[b], -b))
        best: tuple[float, int, int, int] | None = None  # (new max of the pair, other bin, heavy pos, other pos)
        for other in sorted(range(num_bins), key=lambda b: (bin_load[b], b)):
            gap = bin_load[heavy] - bin_load[other]
            if other == heavy or gap <= tolerance:
                continue
            heavy_items, other_items = set(bins[heavy]), set(bins[other])
            for i, a in enumerate(bins[heavy]):
                for j, b in enumerate(bins[other]):
                    moved = weights[a] - weights[b]
                    if moved <= tolerance or moved >= gap - tolerance or a in other_items or b in heavy_items:
                        continue
                    pair_max = max(bin_load[heavy] - moved, bin_load[other] + moved)
                    if best is None or pair_max < best[0]:
                        best = (pair_max, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        a, b = bins[heavy][i], bins[other][j]
        bins[heavy][i], bins[other][j] = b, a
        moved = weights[a] - weights[b]
        bin_load[heavy] -= moved
        bin_load[other] += moved
