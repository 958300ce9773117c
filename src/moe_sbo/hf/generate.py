"""Generation with a whole expert-parallel model (``model.load_model``'s) on every rank of the group.

Legend: see ``moe_sbo/__init__.py``; here B is a rank's batch of prompts and S their (padded) length.

The hard part is keeping ranks in step. Every MoE call is a collective, so every rank must make the
same number of them, in the same order, whatever its prompts. ``generate`` therefore stops every rank
at the same step: after each forward one all-reduce says whether any prompt on any rank is still
running (a prompt that reached its end-of-sequence token is finished, and its later tokens are dropped
from the result, as ``transformers`` would pad them), and a rank with no prompts makes the same MoE
calls with 0 tokens and the same all-reduce. Three decode loops: ``transformers``' own ``generate``, a
static KV cache, and that cache's step replayed from a CUDA graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import DECODE_LOOPS
from .model import ExpertParallelMoE, moe_blocks
from .static_decode import IdleDecoder, StaticDecoder


@dataclass
class Generation:
    """One rank's result: ``token_ids`` per prompt (the new tokens, cut after end-of-sequence),
    ``prefill_s`` (prompt to first token), ``step_s`` (each later token's time), and ``forwards``."""

    token_ids: list[list[int]]
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    forwards: int = 0

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        return sum(self.step_s) / len(self.step_s) if self.step_s else 0.0


class _StepClock:
    """The time of each new token. As a ``transformers`` streamer, ``put`` is called with the prompt,
    then once per generated token, and stamps the host's clock after a device sync. The static
    loops call ``start`` once, then ``token`` with each token's CUDA event (recorded when its step
    and stop check are done), so a token's time is when the device finished it, not when the host,
    a step ahead, looked. ``on_step`` runs after each new token; ``times()``: start, then each token."""

    def __init__(self, device: torch.device, on_step: Callable[[], None] | None):
        self.device, self.on_step = device, on_step
        self.stamps: list[float] = []
        self._start: torch.cuda.Event | None = None
        self._events: list[torch.cuda.Event] = []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        if len(self.stamps) > 1 and self.on_step is not None:
            self.on_step()

    def end(self) -> None:
        pass

    def start(self) -> None:
        """The static loops' start: a synced host stamp and, on CUDA, the event tokens are timed from."""
        self.put(None)
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def token(self, done: torch.cuda.Event | None) -> None:
        """A token is done: at ``done`` on the device, or now (no event: off CUDA)."""
        if done is not None and self._start is not None:
            self._events.append(done)
            if self.on_step is not None:
                self.on_step()
        else:
            self.put(None)

    def times(self) -> list[float]:
        if not self._events:
            return self.stamps
        assert self._start is not None
        return [self.stamps[0]] + [self.stamps[0] + self._start.elapsed_time(e) / 1e3 for e in self._events]


def check_prompt_ids(prompts: list[list[int]], vocab_size: int, what: str = "prompts") -> None:
    """Every prompt non-empty, every id in ``[0, vocab_size)``; else ``ValueError`` naming the first
    bad id (``what``: the name the caller knows them by, e.g. ``--prompt-ids``)."""
    for index, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"{what} must each hold at least one token id, got an empty prompt {index}; drop it")
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"{what} must hold ids in [0, {vocab_size}) (the model's vocab_size), got {bad} in prompt {index}; "
                "use ids of the model's tokenizer"
            )


def _check_prompts_on_every_rank(prompts: list[list[int]], vocab_size: int, blocks: list[ExpertParallelMoE]) -> None:
    """``check_prompt_ids`` on this rank's prompts, and the first failing rank's ``ValueError`` raised
    on every rank. Ranks hold different prompts: a rank that raised alone would leave the others
    waiting for it in the next collective until its socket closed. One all-gather of the messages,
    the first collective ``generate`` makes (one rank, or no group: none)."""
    ep = blocks[0].moe.dispatcher.ep if blocks else None
    if ep is None or ep.size == 1:
        check_prompt_ids(prompts, vocab_size)
        return
    mine: str | None = None
    try:
        check_prompt_ids(prompts, vocab_size, what=f"the prompts of rank {ep.rank}")
    except ValueError as err:
        mine = str(err)
    messages: list[str | None] = [None] * ep.size
    dist.all_gather_object(messages, mine, group=ep.group)
    first = next((message for message in messages if message is not None), None)
    if first is not None:
        raise ValueError(first)


@torch.no_grad()
def generate(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int = 0,
    on_step: Callable[[], None] | None = None,
    decode: str = "transformers",
) -> Generation:
    """Greedy generation of up to ``max_new_tokens`` for this rank's ``prompts`` (token ids; may be
    empty), in step with the other ranks: every rank makes the same number of forwards.

    Prompts are left-padded into one batch, as ``transformers`` batches them; ``eos_token_id``
    (default: the model's) ends a prompt's output, which is then cut after it, as ``transformers``
    ``generate`` returns it. Generation stops when every prompt on every rank has ended (one
    one-element all-reduce per step decides it; the static loops read it a step late, so they may
    make one forward more, on every rank alike) or after ``max_new_tokens``, which must be the same
    on every rank. ``model``: from ``load_model`` (a ``transformers`` causal LM).

    ``decode``: ``"transformers"``: ``model.generate`` (a growing cache, eager); ``"static"``: our
    own loop over a preallocated cache with fixed-shape steps through the blocks' decode
    dispatchers (``static_decode.py``), eager; ``"cuda_graph"``: the same steps, captured once per
    rank and replayed (CUDA, and a graph-capturable decode dispatcher such as ``low_latency``). Every
    rank must pass the same value. The three give the same greedy tokens (on CPU in float32, the
    same as ``transformers``; the graph replays exactly the static loop's kernels).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if decode not in DECODE_LOOPS:
        raise ValueError(f"decode must be one of {DECODE_LOOPS}, got {decode!r}")
    blocks = moe_blocks(model)
    device = next(model.parameters()).device
    if decode == "cuda_graph":
        _check_graphable(blocks, device)
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    _check_prompts_on_every_rank(prompts, model.get_input_embeddings().num_embeddings, blocks)
    agree = _StepAgreement(blocks, device)
    # Before any MoE call: a mismatch would hang.
    agree.same_everywhere("max_new_tokens", max_new_tokens)
    agree.same_everywhere("decode", DECODE_LOOPS.index(decode))
    if decode != "transformers":
        _check_decode_capacity(blocks, len(prompts), agree)
    if not prompts:
        return _idle(blocks, model, max_new_tokens, device, on_step, agree, decode)
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = _StepClock(device, on_step)
    calls_before = [b.calls for b in blocks]
    if decode == "transformers":
        new = _transformers_generate(model, input_ids, attention_mask, max_new_tokens, pad_token_id, clock, agree, eos)
    else:
        new = _static_generate(model, blocks, input_ids, attention_mask, max_new_tokens, clock, agree, eos, decode)
    token_ids = [_cut_after_eos(row, eos) for row in new]
    forwards = blocks[0].calls - calls_before[0] if blocks else len(new[0])
    if decode == "cuda_graph":
        forwards = len(new[0])  # replays make no Python calls; the count of tokens is the count of steps
    if forwards != len(new[0]) or forwards != agree.steps:  # transformers changed how generate steps
        raise RuntimeError(
            f"generate made {forwards} forwards for {len(new[0])} new tokens and {agree.steps} stop checks; "
            "ranks would fall out of step"
        )
    stamps = clock.times()
    return Generation(token_ids, stamps[1] - stamps[0], [b - a for a, b in zip(stamps[1:], stamps[2:])], forwards)


def _transformers_generate(model, input_ids, attention_mask, max_new_tokens, pad_token_id, clock, agree, eos):
    """``model.generate``, with every rank stopping at the same step; the new ids [B][steps]."""
    # transformers' own end-of-sequence stop is per rank; ours waits for every rank (_AllEnded), so
    # the model's eos is lifted for the call and a prompt's tokens after its end are dropped later.
    width = input_ids.shape[1]
    saved_eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=pad_token_id,
            streamer=clock,
            stopping_criteria=[_AllEnded(agree, eos, width)],
        )
    finally:
        model.generation_config.eos_token_id = saved_eos
    return out[:, width:].tolist()


def _static_generate(model, blocks, input_ids, attention_mask, max_new_tokens, clock, agree, eos, decode):
    """``StaticDecoder``'s prefill and steps (replayed from a graph under ``cuda_graph``), each
    followed by the stop agreement (``_run_steps``); the new ids [B][steps]."""
    batch, width = input_ids.shape
    cuda_graph = decode == "cuda_graph"
    decoder = _reusable_decoder(
        model, agree, lambda d: isinstance(d, StaticDecoder) and d.fits(batch, width, max_new_tokens, cuda_graph)
    )
    if decoder is None:
        decoder = StaticDecoder(model, blocks, batch, width + max_new_tokens, input_ids.device, cuda_graph=cuda_graph)
        model.moe_sbo_decoder = decoder
    clock.start()
    eos_E = torch.tensor(sorted(eos), dtype=torch.long, device=input_ids.device)
    ended_B = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    tokens: list[torch.Tensor] = []

    def run_step(step: int) -> torch.Tensor:
        next_B1 = decoder.prefill(input_ids, attention_mask) if step == 0 else decoder.step()
        tokens.append(next_B1.clone())
        ended_B.logical_or_(torch.isin(next_B1[:, 0], eos_E))
        return ~ended_B.all()

    _run_steps(run_step, agree, max_new_tokens, clock)
    return torch.cat(tokens, dim=1).tolist()


def _run_steps(run_step: Callable[[int], torch.Tensor], agree: _StepAgreement, max_steps: int, clock) -> None:
    """Runs ``run_step(0)`` (the prefill), ``run_step(1)``, ... (each returns whether a prompt here
    is still running, a bool tensor on the device), each followed by the stop check of every rank.
    The prefill's check is read at once; each later one a step late: step i + 1 is enqueued before
    the host waits for step i's check, so the GPU does not idle between steps for a host round
    trip. When step i's check says every prompt on every rank has ended, step i + 1, already
    enqueued, is the last (one more forward than needed, on every rank alike; its tokens come after
    every prompt's end and are cut). Each token goes to ``clock`` with its check's event."""
    checks: list[_StepCheck] = []
    for step in range(max_steps):
        checks.append(agree.start_anyone(run_step(step)))
        if step == 1:
            continue
        check = checks[0] if step == 0 else checks[step - 1]
        clock.token(check.done)
        if not check.answer():
            break
    if len(checks) > 1:
        clock.token(checks[-1].done)
        checks[-1].answer()


@dataclass
class _StepCheck:
    """A stop check in flight: ``answer()`` waits for it; ``done``: its CUDA event (None off CUDA)."""

    answer: Callable[[], bool]
    done: torch.cuda.Event | None = None


def _reusable_decoder(model: Any, agree: _StepAgreement, fits: Callable[[Any], bool]) -> Any:
    """The decoder the model kept from its last generation when it ``fits`` on this rank and on
    every other (one all-reduce: if any rank must build a new one, every rank does, so their first
    steps warm up and capture together and their decode buffers stay in step); else None."""
    kept = getattr(model, "moe_sbo_decoder", None)
    if agree.anyone(kept is None or not fits(kept)):
        if kept is not None:
            kept.run_step.release()
        model.moe_sbo_decoder = None  # frees its graph and cache before the next one is built
        return None
    return kept


def _check_graphable(blocks: list[ExpertParallelMoE], device: torch.device) -> None:
    """``ValueError`` (before any collective) unless CUDA-graph decode can run here."""
    for block in blocks:
        dispatcher = block.decode_dispatcher
        if not dispatcher.graph_capturable:
            raise ValueError(
                f"decode='cuda_graph' needs a graph-capturable decode dispatcher; this model decodes with "
                f"{dispatcher.name!r}. Load it with load_model(..., decode_dispatcher='low_latency', "
                "decode_dispatcher_options={'max_tokens_per_rank': N}) (N >= prompts per rank)"
            )
    if device.type != "cuda":
        raise ValueError(
            f"decode='cuda_graph' captures CUDA graphs; the model is on {device}. Use decode='static' "
            "(the same steps, eager) off CUDA"
        )


def _check_decode_capacity(blocks: list[ExpertParallelMoE], batch: int, agree: _StepAgreement) -> None:
    """``ValueError`` on every rank when any rank has more prompts than a fixed-capacity decode
    dispatcher takes per forward (one all-reduce, so no rank is left waiting in a transfer)."""
    largest = agree.largest(batch)
    for block in blocks:
        dispatcher = block.decode_dispatcher
        capacity = dispatcher.capacity
        if capacity is not None and largest > capacity:
            raise ValueError(
                f"a rank has {largest} prompts, but the decode dispatcher {dispatcher.name!r} takes at most "
                f"max_tokens_per_rank = {capacity} tokens per forward; raise max_tokens_per_rank to {largest} "
                "or give each rank fewer prompts"
            )


class _StepAgreement:
    """After each forward, whether any rank of the MoE layers' group still has a prompt running:
    one one-element all-reduce (MAX) per step on every rank, busy or idle, in the same order as the
    MoE calls, so it can never cross them. One rank (or no group) decides alone."""

    def __init__(self, blocks: list[ExpertParallelMoE], device: torch.device):
        ep = blocks[0].moe.dispatcher.ep if blocks else None
        # ``ep.group`` None means the default group; a one-rank group needs no agreement.
        self.group: Any = ep.group if ep is not None and ep.size > 1 else None
        self.collective = ep is not None and ep.size > 1
        self.device, self.steps = device, 0
        # Where ``start_anyone``'s answers land on the host, in turn: at most two checks are unread
        # at once (``_run_steps`` reads each one step late), so a slot is read before it is reused.
        self._answers = torch.zeros(2, dtype=torch.int32, pin_memory=True) if device.type == "cuda" else None

    def same_everywhere(self, name: str, value: int) -> None:
        """``ValueError`` on every rank unless ``value`` is the same on all of them (one all-reduce)."""
        if not self.collective:
            return
        extremes = torch.tensor([value, -value], dtype=torch.int64, device=self.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        largest, smallest = extremes[0].item(), -extremes[1].item()
        if largest != smallest:
            raise ValueError(
                f"{name} must be the same on every rank, got values from {smallest} to {largest}; "
                "pass every rank the same value (ranks must make the same number of forwards)"
            )

    def largest(self, value: int) -> int:
        """The largest ``value`` over the ranks (one all-reduce)."""
        if not self.collective:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def anyone(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one all-reduce)."""
        return bool(self.largest(int(flag)))

    def start_anyone(self, running: torch.Tensor) -> _StepCheck:
        """``anyone_running`` of a bool tensor on the device, without waiting: the all-reduce is
        enqueued on the current stream and its answer copied to pinned host memory; the check's
        ``answer()`` waits for it (CUDA; on CPU the answer is ready on return)."""
        self.steps += 1
        flag = running.reshape(1).to(torch.int32)
        if self.collective:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if self._answers is None:
            return _StepCheck(lambda: bool(flag[0]))
        host = self._answers[self.steps % 2 : self.steps % 2 + 1]
        host.copy_(flag, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record()

        def answer() -> bool:
            done.synchronize()
            return bool(host[0])

        return _StepCheck(answer, done)

    def anyone_running(self, running_here: bool) -> bool:
        """``anyone``, counted as one step's stop check."""
        self.steps += 1
        return self.anyone(running_here)


class _AllEnded:
    """A ``transformers`` stopping criterion: stop every row once every prompt on every rank has
    produced an end-of-sequence token (``_StepAgreement``)."""

    def __init__(self, agree: _StepAgreement, eos: set[int], prompt_width: int):
        self.agree, self.eos, self.width = agree, eos, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        new = input_ids[:, self.width :]
        ended = torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
        for token in self.eos:
            ended |= (new == token).any(dim=1)
        stop = not self.agree.anyone_running(not bool(ended.all()))
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def _idle(
    blocks: list[ExpertParallelMoE],
    model: Any,
    max_steps: int,
    device: torch.device,
    on_step: Callable[[], None] | None,
    agree: _StepAgreement,
    decode: str,
) -> Generation:
    """A rank without prompts: each forward's MoE calls with 0 tokens (with ``IdleDecoder`` for the
    static and graph loops' steps) and its stop check, until every rank has ended or ``max_steps``."""
    dtype = blocks[0].moe.dtype if blocks else torch.get_default_dtype()
    empty = torch.empty(1, 0, model.config.hidden_size, dtype=dtype, device=device)
    idle = None
    if decode != "transformers":  # as a busy rank's decoder: kept, or built on every rank at once
        cuda_graph = decode == "cuda_graph"
        idle = _reusable_decoder(
            model, agree, lambda d: isinstance(d, IdleDecoder) and d.run_step.cuda_graph == cuda_graph
        )
        if idle is None:
            idle = IdleDecoder(blocks, model.config.hidden_size, dtype, device, cuda_graph=cuda_graph)
            model.moe_sbo_decoder = idle
    if idle is not None:  # the busy ranks' steps and stop checks, in the same order (_run_steps)
        nobody = torch.zeros((), dtype=torch.bool, device=device)

        def run_step(step: int) -> torch.Tensor:
            if step == 0:
                for block in blocks:
                    block(empty)
            else:
                idle.step()
            return nobody

        clock = _StepClock(device, on_step)
        clock.start()
        _run_steps(run_step, agree, max_steps, clock)
        return Generation([], forwards=agree.steps)
    for _ in range(max_steps):
        for block in blocks:
            block(empty)
        if on_step is not None:
            on_step()
        if not agree.anyone_running(False):
            break
    return Generation([], forwards=agree.steps)


def prefill_tokens(prompts: list[list[int]]) -> int:
    """Tokens one rank's prefill carries through each MoE layer: its prompts, left-padded to the
    longest (as ``generate`` batches them); what a fixed-capacity prefill dispatcher must hold."""
    return len(prompts) * max((len(p) for p in prompts), default=0)


def _cut_after_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row
