"""Smoke test of ``moe-sbo bench generate``: its CPU mode (``--tiny`` dims, one rank, the static
decode loop, a few tokens) runs in a subprocess, exits 0 and writes ``generate.json`` with a
``transformers`` row and a moe-sbo row. It checks that the mode works, not what it measures
(benchmarks are not tests)."""

from __future__ import annotations

import json

from bench_modes import run_mode


def test_cpu_smoke_writes_both_rows(tmp_path):
    run_mode(
        *("generate", "--out", str(tmp_path), "--device", "cpu", "--tiny", "--decode", "static", "--ranks", "1"),
        *("--layers", "2", "--experts", "16", "--vocab", "500", "--batch", "2", "--prompt-len", "8"),
        *("--new-tokens", "4", "--repeats", "1", "--compare-tokens", "4"),
        timeout=300,
    )
    result = json.loads((tmp_path / "generate.json").read_text())
    assert result["meta"]["device"] == "cpu"
    baseline, ours = result["rows"]
    assert (baseline["impl"], ours["impl"], ours["decode"], ours["dispatcher"]) == (
        "transformers",
        "moe-sbo",
        "static",
        "local",
    )
    for row in (baseline, ours):
        assert row["prefill_ms"] > 0 and row["tpot_ms"] > 0 and row["tokens_per_s"] > 0, row
        assert len(row["token_ids"]) == 2 and all(len(ids) == 4 for ids in row["token_ids"]), row
    assert isinstance(ours["same_tokens"], bool) and ours["tpot_speedup"] > 0
