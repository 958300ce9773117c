"""Result files name the code they ran on: ``source_digest`` changes with any source byte or path."""

from __future__ import annotations

from pathlib import Path

from moe_sbo.measure.results import result_meta, source_digest


def test_source_digest_follows_content_and_paths(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    assert first == source_digest(tmp_path) and len(first) == 12 and int(first, 16) >= 0
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    second = source_digest(tmp_path)
    assert second != first
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "c.py")  # same bytes, another path
    assert source_digest(tmp_path) != second


def test_result_meta_carries_the_digest_of_this_package():
    meta = result_meta(device="cpu", world_size=1)
    assert meta["source_sha"] == source_digest()
