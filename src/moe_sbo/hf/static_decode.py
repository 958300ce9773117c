"""Greedy decoding with fixed shapes: a preallocated KV cache and one step that a CUDA graph replays.

Legend: see ``moe_sbo/__init__.py``; here B is a rank's batch of prompts, S their (left-padded)
length and L = S + the most new tokens (the cache length).

``transformers`` ``generate`` grows its cache and rebuilds masks and positions on the host every
step, so a decode step of a small batch is host-bound: Python layers and small launches, several
times the device's work (docs/BENCHMARKS.md, whole-model generation). ``StaticDecoder`` keeps every tensor a step
touches at a fixed address and shape:

- the cache: ``transformers``' ``StaticCache`` of L positions, which writes each step's keys at its
  own device-side position counter;
- ``valid_BL``: which cache slots hold a real token of the row (the prompt's, then one per step);
  the step marks slot ``S + step`` and turns it into the additive [B, 1, 1, L] mask it hands the
  model (``transformers`` takes a 4-D mask as given, so no mask is built on the host);
- ``position_B1``: the row's number of real tokens minus one, as ``generate`` computes it from a
  left-padded attention mask;
- ``next_B1``: the greedy token, which is also the next step's input.

So one step is a pure function of those buffers, and with ``cuda_graph=True`` the first step runs
eagerly and is captured right after, and every later step replays it: one host call per token.
``generate`` keeps a model's decoder for the next batch of the same size (its prefill rewrites the
buffers in place), so a server loop captures once per batch size, not once per request. The MoE
blocks then must use a capturable dispatcher (``low_latency``): ``load_model(decode_dispatcher=...)``
gives them one for decode steps while prefill keeps the main one. A rank without prompts makes the same MoE calls
through ``IdleDecoder``, with one masked-out row, captured the same way, so its buffer sets and
barriers stay in step with the busy ranks' replays.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..dispatch.low_latency import mask_padding_tokens
from ..streams import capture_graph


class StaticDecoder:
    """One rank's greedy decoding of a batch of B prompts: ``prefill`` a batch, then ``step`` per new token.

    ``model``: a ``transformers`` causal LM (from ``load_model``); ``blocks``: its expert-parallel
    MoE blocks, switched to their decode dispatcher for the steps; ``max_len`` (L) sizes the cache
    (prompt width + new tokens). A decoder serves any later batch of B prompts that fits in L
    (``fits``): ``prefill`` rewrites its buffers in place, so a captured step replays as it is.
    """

    def __init__(self, model: Any, blocks: list, batch: int, max_len: int, device: torch.device, *, cuda_graph: bool):
        from transformers import StaticCache

        self.model, self.blocks, self.run_step = model, blocks, GraphedStep(cuda_graph)
        self.batch, self.max_len = batch, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.valid_BL = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.slot_1 = torch.zeros(1, dtype=torch.long, device=device)  # the cache slot the next step writes
        self.position_B1 = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.next_B1 = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slot = 0  # the same slot on the host, to refuse a step past the cache
        self._dtype = next(model.parameters()).dtype
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x keeps the old name, deprecated)
        cache_kwarg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self._cache_arg = {cache_kwarg: self.cache}

    def fits(self, batch: int, width: int, max_new_tokens: int, cuda_graph: bool) -> bool:
        """Whether a batch of ``batch`` prompts padded to ``width`` can decode here."""
        same_loop = (batch, cuda_graph) == (self.batch, self.run_step.cuda_graph)
        return same_loop and width + max_new_tokens <= self.max_len

    def _mask(self, allowed_BQL: torch.Tensor) -> torch.Tensor:
        """The additive mask [B, 1, Q, L] the model's attention adds: 0 where allowed, the dtype's
        lowest elsewhere (never -inf, so a padded query row with nothing allowed stays finite)."""
        low = torch.finfo(self._dtype).min
        return torch.zeros(allowed_BQL.shape, dtype=self._dtype, device=allowed_BQL.device).masked_fill_(
            ~allowed_BQL, low
        )[:, None]

    def prefill(self, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor) -> torch.Tensor:
        """Runs the left-padded prompts [B, S] (eager; prefill sizes vary) into an emptied cache;
        returns the first new tokens [B, 1] (a fixed buffer: copy it to keep it)."""
        width = input_ids_BS.shape[1]
        device = input_ids_BS.device
        self.cache.reset()
        self.valid_BL.zero_()
        self.valid_BL[:, :width] = attention_mask_BS.bool()
        self.slot, self.slot_1[0] = width, width
        self.position_B1.copy_(attention_mask_BS.long().sum(-1, keepdim=True) - 1)
        causal_SL = torch.arange(self.max_len, device=device)[None, :] <= torch.arange(width, device=device)[:, None]
        allowed_BSL = causal_SL[None] & self.valid_BL[:, None, :]
        positions_BS = (self.valid_BL[:, :width].long().cumsum(-1) - 1).clamp_(min=0)
        logits = self.model(
            input_ids=input_ids_BS,
            attention_mask=self._mask(allowed_BSL),
            position_ids=positions_BS,
            use_cache=True,
            logits_to_keep=1,
            **self._cache_arg,
        ).logits
        self.next_B1.copy_(logits[:, -1:].argmax(-1))
        return self.next_B1

    def _step(self) -> None:
        """One token for every row, from the buffers to the buffers (what a graph captures)."""
        self.valid_BL.index_fill_(1, self.slot_1, True)
        self.position_B1.add_(1)
        with decode_dispatchers(self.blocks):
            logits = self.model(
                input_ids=self.next_B1,
                attention_mask=self._mask(self.valid_BL[:, None, :]),
                position_ids=self.position_B1,
                use_cache=True,
                **self._cache_arg,
            ).logits
        self.next_B1.copy_(logits[:, -1:].argmax(-1))
        self.slot_1.add_(1)

    def step(self) -> torch.Tensor:
        """The next token of every row [B, 1] (a fixed buffer: copy it to keep it)."""
        if self.slot >= self.max_len:
            raise RuntimeError(f"the cache holds {self.max_len} positions and all are used; prefill a new batch")
        self.slot += 1
        self.run_step(self._step)
        return self.next_B1


class IdleDecoder:
    """A rank without prompts: each step calls every MoE block once, as a busy rank's step does,
    through the blocks' decode dispatchers: a fixed-capacity (graph-capturable) one gets one row
    whose routing is masked out (nothing is sent or received for it; a graph needs a row to
    capture), another 0 rows. Captured and replayed like ``StaticDecoder`` under ``cuda_graph``."""

    def __init__(self, blocks: list, hidden: int, dtype: torch.dtype, device: torch.device, *, cuda_graph: bool):
        self.blocks, self.run_step = blocks, GraphedStep(cuda_graph)
        self.x_11H = torch.zeros(1, 1, hidden, dtype=dtype, device=device)
        self.no_tokens = torch.zeros((), dtype=torch.int64, device=device)

    def _step(self) -> None:
        with decode_dispatchers(self.blocks):
            for block in self.blocks:
                dispatcher = block.decode_dispatcher
                if not dispatcher.graph_capturable:  # a variable-size dispatcher takes 0 rows as they are
                    block(self.x_11H[:, :0])
                    continue
                with dispatcher.hooks.scope() as hooks:
                    hooks.register("pre_dispatch", mask_padding_tokens(self.no_tokens))
                    block(self.x_11H)

    def step(self) -> None:
        self.run_step(self._step)


class GraphedStep:
    """Runs a decoder's step eagerly, or, with ``cuda_graph``, captures it on its first call
    (``streams.capture_graph``: that call's one warm-up run on a side stream is the step itself, so
    lazy buffers and Triton compiles happen outside the graph) and replays the graph on every
    later call."""

    def __init__(self, cuda_graph: bool):
        self.cuda_graph = cuda_graph
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, step: Callable[[], None]) -> None:
        if not self.cuda_graph:
            step()
        elif self.graph is None:
            self.graph, _ = capture_graph(step, warmup=1)
        else:
            self.graph.replay()

    def release(self) -> None:
        """Drops the graph now: it holds its step (``capture_graph`` keeps it alive), whose decoder
        holds this, a cycle that would otherwise wait for the garbage collector."""
        self.graph = None


@contextmanager
def decode_dispatchers(blocks: list) -> Iterator[None]:
    """Within: each block forwards through its decode dispatcher (``ExpertParallelMoE.decoding``)."""
    for block in blocks:
        block.decoding = True
    try:
        yield
    finally:
        for block in blocks:
            block.decoding = False
