"""``moe-sbo bench dense-experts``' row draw (no GPU, nothing timed)."""

from __future__ import annotations

from moe_sbo.bench.dense_experts import row_counts


def test_dense_experts_draws_rows_at_random_or_evenly():
    """``--draw``: each row on a random expert (seeded by the row count), or R / L rows on every
    expert, the first R mod L one more; the counts always add up to R."""
    assert row_counts(8, 1030, "equal").tolist() == [129] * 6 + [128] * 2
    random = row_counts(8, 1024, "random")
    assert random.sum() == 1024 and random.tolist() == row_counts(8, 1024, "random").tolist()
    assert random.max() > random.min()  # 1024 rows on 8 experts at random: never all alike
