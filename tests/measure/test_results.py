"""Result files name the code they ran on (``source_digest`` changes with any source byte or path)
and the environment; on standard output a result file is one whole document."""

from __future__ import annotations

import json
from pathlib import Path

from moe_sbo.measure.environment import torch_cuda
from moe_sbo.measure.results import STDOUT, ResultFile, result_meta, source_digest


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


def test_result_meta_records_the_environment():
    """What --version reports, in every result file: moe-sbo, Python, torch, Triton, CUDA, NCCL."""
    import platform

    import torch

    import moe_sbo

    meta = result_meta(device="cpu", world_size=1)
    assert meta["moe_sbo"] == moe_sbo.__version__ and meta["python"] == platform.python_version()
    assert meta["torch"] == torch.__version__ and meta["cuda"] == torch.version.cuda
    assert "triton" in meta and "nccl" in meta


def test_torch_cuda_from_its_tag():
    assert torch_cuda("2.5.1+cu124") == "12.4" and torch_cuda("2.9.0+cu128") == "12.8"
    assert torch_cuda("2.13.0+cpu") is None and torch_cuda(None) is None


def test_a_result_file_on_standard_output_is_written_once_whole(capsys, tmp_path):
    """``--out -``: the steps do not write (a pipe would get one document per step); ``save`` at the
    end writes the whole document once. A file is rewritten after every step, its folder made then."""
    results = ResultFile(STDOUT, {"command": "x"})
    for step in range(3):
        results.add_step(lambda step=step: [{"step": step}], {"step": step})
        assert capsys.readouterr().out == ""
    results.save()
    assert json.loads(capsys.readouterr().out) == {"meta": {"command": "x"}, "rows": [{"step": s} for s in range(3)]}
    path = tmp_path / "new" / "rows.json"
    in_file = ResultFile(path, {})
    in_file.add_step(lambda: [{"step": 0}], {})
    assert json.loads(path.read_text())["rows"] == [{"step": 0}]
