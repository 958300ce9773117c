"""Whole models: a ``transformers`` causal LM whose MoE blocks are expert-parallel over gloo ranks
generates token for token what ``transformers`` ``generate`` does on one process, for each family,
at EP2 and EP4, with skewed and empty ranks (checkpoints written by ``transformers`` itself)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe_sbo.hf.generate as generate_module
from hf_blocks import make_hf_model
from moe_sbo.hf.generate import generate
from moe_sbo.hf.model import ExpertParallelMoE, load_model

FAMILIES = ["deepseek_v3", "deepseek_v2", "qwen3_moe"]
NEW_TOKENS = 8
# Rank r's prompts: different counts and lengths per rank (left-padded into one batch on each).
PROMPTS_EP2 = [[[1, 5, 9, 3], [7, 2]], [[4, 4, 4, 4, 4, 4]]]
PROMPTS_EP4 = [[[11, 3, 2]], [[9, 9], [2, 30, 41, 5, 6], [8]], [], [[60, 61, 62, 63, 1, 2, 3]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        make_hf_model(family, seed=3).save_pretrained(path)
        paths[family] = str(path)
    return paths


def reference_ids(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """``transformers``' own greedy ``generate`` on one process, padded rows cut after end-of-sequence."""
    from transformers import AutoModelForCausalLM

    if not prompts:
        return []
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def _generate_rank(device, path, prompts_per_rank, dispatcher, options, eos_token_id=None, decode="transformers"):
    # The static loop decodes with a second dispatcher: low_latency with the fused kernels (Triton's
    # interpreter on CPU), as CUDA-graph decode does on GPU; prefill keeps ``dispatcher``.
    decode_options = {"max_tokens_per_rank": 4, "kernels": "triton"}
    model = load_model(
        path,
        dispatcher=dispatcher,
        dispatcher_options=options,
        decode_dispatcher="low_latency" if decode == "static" else None,
        decode_dispatcher_options=decode_options if decode == "static" else None,
    )
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    result = generate(model, prompts_per_rank[dist.get_rank()], NEW_TOKENS, eos_token_id=eos_token_id, decode=decode)
    local = [b.moe.experts.gate_up_proj.shape[0] for b in blocks]
    return result.token_ids, result.forwards, [b.calls for b in blocks], local


def _check(results, path, prompts_per_rank, world):
    steps = {forwards for _, forwards, _, _ in results}
    assert len(steps) == 1 and 1 <= steps.pop() <= NEW_TOKENS  # every rank the same forwards, empty ones too
    for rank, (token_ids, forwards, calls, local) in enumerate(results):
        assert token_ids == reference_ids(path, prompts_per_rank[rank]), f"rank {rank}"
        assert all(c == forwards for c in calls)
        assert all(n == 16 // world for n in local)  # each rank holds only its share of the 16 experts


def test_generation_stops_on_every_rank_once_every_prompt_has_ended(ranks4, checkpoints):
    # Each prompt's first new token, taken as end-of-sequence: every prompt ends at step 1, so
    # every rank (the empty one too) makes exactly one forward.
    path = checkpoints["deepseek_v3"]
    firsts = sorted({ids[0] for prompts in PROMPTS_EP4 for ids in reference_ids(path, prompts)})
    results = ranks4.run(_generate_rank, path, PROMPTS_EP4, "alltoall", None, firsts)
    for rank, (token_ids, forwards, calls, _) in enumerate(results):
        assert forwards == 1 and all(c == 1 for c in calls), (rank, forwards, calls)
        assert all(len(ids) == 1 and ids[0] in firsts for ids in token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_generates_what_transformers_generates(ranks2, checkpoints, family):
    results = ranks2.run(_generate_rank, checkpoints[family], PROMPTS_EP2, "alltoall", None)
    _check(results, checkpoints[family], PROMPTS_EP2, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_ep4_with_an_empty_rank_generates_what_transformers_generates(ranks4, checkpoints, family):
    results = ranks4.run(_generate_rank, checkpoints[family], PROMPTS_EP4, "alltoall", None)
    _check(results, checkpoints[family], PROMPTS_EP4, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_decode_loop_generates_what_transformers_generates(ranks4, checkpoints, family):
    # The fixed-shape loop CUDA graphs replay (static cache, 4-D mask, decode dispatcher): every
    # family, skewed prompt counts and lengths, and an empty rank that joins through its masked row.
    results = ranks4.run(_generate_rank, checkpoints[family], PROMPTS_EP4, "alltoall", None, None, "static")
    _check(results, checkpoints[family], PROMPTS_EP4, 4)


def test_static_decode_loop_stops_on_every_rank_once_every_prompt_has_ended(ranks2, checkpoints):
    path = checkpoints["deepseek_v3"]
    firsts = sorted({ids[1] for prompts in PROMPTS_EP2 for ids in reference_ids(path, prompts)})
    results = ranks2.run(_generate_rank, path, PROMPTS_EP2, "alltoall", None, firsts, "static")
    # Every prompt ends by its second token; the check is read one step late, so the loop makes at
    # most one forward more (on every rank alike) and cuts the tokens after each end.
    assert len({forwards for _, forwards, _, _ in results}) == 1
    for rank, (token_ids, forwards, calls, _) in enumerate(results):
        assert forwards <= 3 and all(c == forwards for c in calls), (rank, forwards, calls)
        assert all(ids[-1] in firsts and len(ids) <= 2 for ids in token_ids)  # cut after its end-of-sequence token


def _repeated_rank(device, path):
    # Three generations on one model: the decoder is kept when every rank's batch fits it, and
    # rebuilt on every rank when one rank's does not (rank 0's batch grows in the third).
    options = {"max_tokens_per_rank": 4, "kernels": "triton"}
    model = load_model(path, dispatcher="alltoall", decode_dispatcher="low_latency", decode_dispatcher_options=options)
    batches = [PROMPTS_EP2[dist.get_rank()], PROMPTS_EP2[dist.get_rank()][::-1]]
    batches.append(PROMPTS_EP4[1] if dist.get_rank() == 0 else PROMPTS_EP2[1])
    out, decoders = [], []
    for prompts in batches:
        out.append(generate(model, prompts, NEW_TOKENS, decode="static").token_ids)
        decoders.append(model.moe_sbo_decoder)
    return out, [decoders[1] is decoders[0], decoders[2] is decoders[1]], batches


def test_static_decoder_is_kept_for_batches_that_fit_and_rebuilt_on_every_rank_otherwise(ranks2, checkpoints):
    path = checkpoints["deepseek_v3"]
    for out, kept, batches in ranks2.run(_repeated_rank, path):
        assert kept == [True, False]
        for token_ids, prompts in zip(out, batches):
            assert token_ids == reference_ids(path, prompts)


def test_stop_checks_are_read_at_once_after_prefill_then_one_step_late():
    # The static loops' schedule (hf/model.py _run_steps): the host enqueues step i + 1 before it
    # waits for step i's stop check, so the check that says every prompt has ended (step 3's here)
    # leaves exactly one step more (4), and every check is read, in order.
    from moe_sbo.hf.generate import _run_steps, _StepCheck

    log: list[str] = []
    running = [True, True, True, False, True, True]

    class Agree:
        def start_anyone(self, still: bool) -> _StepCheck:
            index = sum(entry.startswith("check") for entry in log)
            log.append(f"check{index}")
            return _StepCheck(lambda: log.append(f"read{index}") or still)

    class Clock:
        def token(self, done) -> None:
            log.append("token")

    def run_step(step: int) -> bool:
        log.append(f"step{step}")
        return running[step]

    _run_steps(run_step, Agree(), len(running), Clock())
    assert log == [
        "step0", "check0", "token", "read0",
        "step1", "check1",
        "step2", "check2", "token", "read1",
        "step3", "check3", "token", "read2",
        "step4", "check4", "token", "read3",
        "token", "read4",
    ]  # fmt: skip


def test_step_clock_times_tokens_by_their_device_events():
    # On CUDA a token's time is its check's event, timed from the start event: when the device
    # finished it, not when the host (a step ahead) read it. Events stand in here.
    from moe_sbo.hf.generate import _StepClock

    class Event:
        def __init__(self, ms: float):
            self.ms = ms

        def elapsed_time(self, other: Event) -> float:
            return other.ms - self.ms

    steps = []
    clock = _StepClock(torch.device("cpu"), lambda: steps.append(1))
    clock.put(None)
    clock._start = Event(100.0)  # as start() records it on CUDA
    for ms in (105.0, 107.5, 110.0):
        clock.token(Event(ms))
    start, *tokens = clock.times()
    assert tokens == pytest.approx([start + 0.005, start + 0.0075, start + 0.010]) and len(steps) == 3


def _over_capacity_rank(device, path):
    model = load_model(path, dispatcher="alltoall", decode_dispatcher="low_latency",
                       decode_dispatcher_options={"max_tokens_per_rank": 2, "kernels": "torch"})  # fmt: skip
    prompts = [[[1, 2]], [[3], [4], [5]]][dist.get_rank()]
    try:
        generate(model, prompts, 4, decode="static")
    except ValueError as err:
        return str(err)
    return "no error"


def test_more_prompts_than_the_decode_capacity_are_refused_on_every_rank(ranks2, checkpoints):
    for message in ranks2.run(_over_capacity_rank, checkpoints["deepseek_v3"]):
        assert "a rank has 3 prompts" in message and "max_tokens_per_rank = 2" in message


def test_cuda_graph_decode_is_refused_off_cuda_and_without_a_capturable_dispatcher(checkpoints):
    model = load_model(checkpoints["deepseek_v3"], dispatcher="local")
    with pytest.raises(ValueError, match="needs a graph-capturable decode dispatcher; this model decodes with 'local'"):
        generate(model, [[1, 2]], 2, decode="cuda_graph")
    options = {"max_tokens_per_rank": 2, "kernels": "torch"}
    model = load_model(checkpoints["deepseek_v3"], decode_dispatcher="low_latency", decode_dispatcher_options=options)
    with pytest.raises(ValueError, match="captures CUDA graphs; the model is on cpu"):
        generate(model, [[1, 2]], 2, decode="cuda_graph")
    with pytest.raises(ValueError, match="decode must be one of"):
        generate(model, [[1, 2]], 2, decode="graph")


def test_low_latency_dispatcher_generates_the_same(ranks2, checkpoints):
    options = {"max_tokens_per_rank": 16, "kernels": "torch"}
    results = ranks2.run(_generate_rank, checkpoints["deepseek_v3"], PROMPTS_EP2, "low_latency", options)
    _check(results, checkpoints["deepseek_v3"], PROMPTS_EP2, 2)


def test_one_rank_reads_only_its_experts_and_no_whole_model(checkpoints, monkeypatch):
    from moe_sbo.hf import checkpoint as checkpoint_module

    reads = []
    original = checkpoint_module.Checkpoint.read_moe_weights

    def spy(self, layer, expert_ids=None, dtype=None, **kw):
        reads.append(expert_ids)
        return original(self, layer, expert_ids, dtype, **kw)

    monkeypatch.setattr(checkpoint_module.Checkpoint, "read_moe_weights", spy)
    model = load_model(checkpoints["qwen3_moe"], dispatcher="local")
    assert reads == [range(0, 16)]  # one MoE layer, one read (a one-rank group owns every expert)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())


def test_bad_input_is_refused(checkpoints, tmp_path, monkeypatch):
    model = load_model(checkpoints["deepseek_v3"], dispatcher="local")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, [[1, 2]], 0)
    with pytest.raises(ValueError, match="at least one token id"):
        generate(model, [[1, 2], []], 2)
    # Ids outside the vocabulary are named with its size; on one rank, without any collective.
    vocab = model.config.vocab_size
    monkeypatch.setattr(generate_module, "_StepAgreement", None)  # the first collective: never reached
    for bad in (vocab, -1):
        message = f"prompts must hold ids in [0, {vocab}) (the model's vocab_size), got {bad} in prompt 1; "
        with pytest.raises(ValueError, match=re.escape(message)):
            generate(model, [[1, 2], [3, bad]], 2)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["deepseek_v3"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the files hold 2 layers
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_model(broken, dispatcher="local")


# ---- moe-sbo generate ---------------------------------------------------------------------------------


def _save_word_tokenizer(path, words: list[str]) -> dict[str, int]:
    """A word-level tokenizer (word i -> id i + 2) saved beside the model, as a Hub model ships one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(path)
    return vocab


@pytest.mark.parametrize("family, mla", [("qwen3_moe", "absorbed"), ("deepseek_v3", "transformers")])
def test_cli_generates_prompt_ids_as_transformers(checkpoints, tmp_path, family, mla):
    from moe_sbo.cli.main import main

    out = tmp_path / "gen.json"
    argv = ["generate", "--checkpoint", checkpoints[family], "--ranks", "2", "--max-new-tokens", str(NEW_TOKENS)]
    argv += ["--prompt-ids", "1,5,9,3", "--prompt-ids", "2,2", "--prompt-ids", "7", "--json", str(out), "--mla", mla]
    assert main(argv) == 0

    result = json.loads(out.read_text())
    assert result["meta"]["mla"] == mla
    prompts = [[1, 5, 9, 3], [2, 2], [7]]
    # Prompt i ran on rank i mod 2, batched with that rank's other prompts.
    expected = reference_ids(checkpoints[family], [prompts[0], prompts[2]]) + reference_ids(
        checkpoints[family], [prompts[1]]
    )
    got = {row["prompt"]: row["token_ids"] for row in result["rows"]}
    assert [got[0], got[2], got[1]] == expected
    assert len({r["forwards"] for r in result["ranks"]}) == 1  # both ranks in step
    assert all(r["tpot_s"] > 0 and r["prefill_s"] > 0 for r in result["ranks"])


def test_cli_text_prompts_go_through_the_checkpoints_tokenizer(checkpoints, tmp_path, capsys):
    import shutil

    from transformers import AutoTokenizer

    from moe_sbo.cli.main import main

    path = tmp_path / "with_tokenizer"
    shutil.copytree(checkpoints["deepseek_v3"], path)
    vocab = _save_word_tokenizer(path, ["the", "experts", "are", "parallel", "tokens"])
    out = tmp_path / "gen.json"
    argv = ["generate", "--checkpoint", str(path), "--ranks", "2", "--max-new-tokens", str(NEW_TOKENS)]
    argv += ["--json", str(out)]
    assert main([*argv, "--prompt", "the experts are"]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["prompt_ids"] == [vocab[w] for w in "the experts are".split()]
    assert row["token_ids"] == reference_ids(str(path), [row["prompt_ids"]])[0]
    text = AutoTokenizer.from_pretrained(path).decode(row["token_ids"], skip_special_tokens=True)
    assert f"prompt 0: {text}" in capsys.readouterr().out  # the new tokens printed as text
    assert main([*argv, "--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "--prompts-file must be a readable text file" in capsys.readouterr().err


def test_cli_refuses_bad_prompts_before_any_rank_starts(checkpoints, capsys):
    from moe_sbo.cli.main import main

    base = ["generate", "--checkpoint", checkpoints["deepseek_v2"], "--ranks", "2"]
    assert main([*base, "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer" in err and "--prompt-ids" in err
    assert main([*base, "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main([*base, "--prompt-ids", "1,999999999"]) == 2
    assert "vocab_size" in capsys.readouterr().err
    assert main([*base, "--prompt-ids", "1", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    assert main([*base, "--prompt-ids", "1", "--device", "cpu", "--decode", "cuda_graph"]) == 2
    assert "--decode cuda_graph needs CUDA" in capsys.readouterr().err


def test_cli_under_torchrun(checkpoints, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "gen.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "moe_sbo"]
    cmd += ["generate", "--checkpoint", checkpoints["deepseek_v3"], "--device", "cpu", "--max-new-tokens", "4"]
    cmd += ["--prompt-ids", "1,5,9,3", "--prompt-ids", "4,4,4,4,4,4", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    for row in result["rows"]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v3"]).eval()
        ids = torch.tensor([row["prompt_ids"]])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
        eos = model.generation_config.eos_token_id
        assert row["token_ids"] == (ref[: ref.index(eos) + 1] if eos in ref else ref)


def _mismatched_rank(device, path):
    model = load_model(path, dispatcher="alltoall")
    try:
        generate(model, [[1, 2, 3]], [4, 6][dist.get_rank()])
    except ValueError as err:
        return str(err)
    return "no error"


def _bad_id_on_rank_0(device, path, bad):
    model = load_model(path, dispatcher="alltoall")
    prompts = [[[1, 2], [3, bad]], [[4, 5, 6]]][dist.get_rank()]
    try:
        generate(model, prompts, 2)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_an_id_outside_the_vocabulary_on_one_rank_is_refused_on_every_rank(ranks2, checkpoints, bad):
    """Rank 0's prompt holds a bad id, rank 1's are good: both raise rank 0's ValueError (rank 1 was
    left waiting in a collective for rank 0, which failed with gloo's "Connection closed")."""
    vocab = json.loads((Path(checkpoints["qwen3_moe"]) / "config.json").read_text())["vocab_size"]
    starts = ranks2.starts
    expected = (
        f"the prompts of rank 0 must hold ids in [0, {vocab}) (the model's vocab_size), got {bad} in prompt 1; "
        "use ids of the model's tokenizer"
    )
    assert ranks2.run(_bad_id_on_rank_0, checkpoints["qwen3_moe"], bad) == [expected, expected]
    assert ranks2.starts == starts  # no rank failed, so the ranks were not started again


def test_a_different_max_new_tokens_per_rank_is_refused_on_every_rank(ranks2, checkpoints):
    for message in ranks2.run(_mismatched_rank, checkpoints["qwen3_moe"]):
        assert "max_new_tokens must be the same on every rank, got values from 4 to 6" in message
