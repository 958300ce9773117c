"""Hugging Face safetensors checkpoints: one MoE layer's weights, each rank reading only its experts.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Tensor names, with P = ``model.layers.{n}.mlp.``, as the published
DeepSeek-V2/V3/R1, Kimi-K2 and Qwen3-MoE files and ``transformers`` 5's ``save_pretrained`` spell them::

    P gate.weight                             [E, H]   router
    P gate.e_score_correction_bias            [E]      noaux_tc routing (DeepSeek-V3/R1, Kimi-K2)
    P experts.{e}.gate_proj.weight            [I, H]
    P experts.{e}.up_proj.weight              [I, H]
    P experts.{e}.down_proj.weight            [H, I]
    P shared_experts.gate_proj.weight         [J, H]   DeepSeek only (J = I * n_shared_experts)
    P shared_experts.up_proj.weight           [J, H]
    P shared_experts.down_proj.weight         [H, J]

or, in place of the per-expert tensors, stacked ones as ``transformers`` 5 holds them in memory:
``P experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``P experts.down_proj`` [E, H, I].
Any of these weights may be stored as float8 e4m3 beside a float32 ``{name}_scale_inv`` holding one
scale per 128x128 block (DeepSeek-V3/R1's published format); they are dequantised on load, unless
the routed experts are read for FP8 experts (``fp8_experts=True``): those then keep their stored
bytes and scales (dense-stored ones are quantised, one tensor read at a time). This module plans,
checks and makes the reads; ``assembly.py`` puts each tensor read into its part of ``MoEWeights``.

The hard part is reading little: a rank opens only the files holding its own experts (and the router
and shared experts every rank needs) and reads from them only its tensors, or its rows of a stacked
tensor. ``safe_open`` memory-maps each file, so bytes not read are never paged in; ``ReadReport``
says what was opened and read. Every name, shape, dtype and scale is checked against the file
headers before any tensor data is read, so a broken checkpoint fails before any collective.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import MoEConfig
from ..layer import MoELayer
from ..quant.fp8 import FP8_BLOCK, sizes_off_blocks
from ..weights import MoEWeights, layer_weights
from .assembly import Assembler
from .config import config_from_hf, model_family, moe_layer_indices, resolve_moe_layer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STORED_FP8 = "F8_E4M3"  # safetensors' name of float8 e4m3
# safetensors dtype names of the float formats a weight may be stored in, and their sizes.
STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, STORED_FP8: 1}
DEFAULT_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class ReadReport:
    """What one ``Checkpoint.read_moe_weights`` call opened and read.

    ``files``: safetensors files opened, relative to the checkpoint directory, in opening order;
    ``tensors``: names of the tensors read (a stacked tensor read in part is listed once);
    ``bytes_read``: tensor bytes read, as stored (an FP8 weight counts 1 B per element, plus its scales).
    """

    layer: int
    expert_ids: range
    files: tuple[str, ...]
    tensors: tuple[str, ...]
    bytes_read: int

    def as_dict(self) -> dict:
        return {
            "layer": self.layer,
            "experts": [self.expert_ids.start, self.expert_ids.stop],
            "files": list(self.files),
            "tensors": len(self.tensors),
            "bytes_read": self.bytes_read,
        }


@dataclass(frozen=True)
class _Piece:
    """One tensor to read: ``name`` in ``file`` must have ``shape``; ``rows`` (stacked tensors) picks
    this rank's experts; the result goes to ``target[index]`` of the assembled ``MoEWeights``."""

    name: str
    file: str
    shape: tuple[int, ...]
    target: str
    index: tuple = ()
    rows: slice | None = None
    what: str = ""  # for error messages: "expert 3 of layer 1", ...


class Checkpoint:
    """A Hugging Face model directory: ``config.json`` plus safetensors, single-file or sharded.

    Construction reads ``config.json`` and the index (or the single file's header) and nothing else.
    ``moe_config`` is the ``MoEConfig`` of the model's MoE layers; ``moe_layers`` their indices.
    """

    def __init__(self, path: str | Path):
        if importlib.util.find_spec("safetensors") is None:
            raise ValueError("reading checkpoints needs the safetensors package; pip install 'moe-sbo[hf]'")
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(
                f"checkpoint must be a directory holding config.json and safetensors files, got {self.path} "
                f"({'not a directory' if self.path.exists() else 'does not exist'})"
            )
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"{config_path} is missing; a checkpoint directory needs the model's config.json "
                "(save_pretrained writes it, the Hub ships it) next to its safetensors files"
            )
        try:
            self.hf_config: dict = json.loads(config_path.read_text())
            self.model_type = model_family(self.hf_config)
            self.moe_config: MoEConfig = config_from_hf(self.hf_config, name=self.path.name)
        except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{config_path}: {err}") from None
        self.moe_layers = moe_layer_indices(self.hf_config)
        self.fp8_block = tuple(
            (self.hf_config.get("quantization_config") or {}).get("weight_block_size", DEFAULT_FP8_BLOCK)
        )
        self.weight_map, self.map_source = _weight_map(self.path)

    def resolve_layer(self, layer: int | None) -> int:
        """``layer`` checked to be an MoE layer (``None``: the first one); the error names config.json."""
        try:
            return resolve_moe_layer(self.hf_config, layer)
        except ValueError as err:
            raise ValueError(f"{self.path / 'config.json'}: {err}") from None

    def validate_layer(self, layer: int | None) -> int:
        """Check every tensor of MoE layer ``layer`` (all experts) against the file headers, reading
        no tensor data; returns the layer index (``None``: the first MoE layer)."""
        layer = self.resolve_layer(layer)
        self._read(self._pieces(layer, range(self.moe_config.num_experts)), None)
        return layer

    @torch.no_grad()
    def read_moe_weights(
        self,
        layer: int,
        expert_ids: range | None = None,
        dtype: torch.dtype | None = None,
        *,
        fp8_experts: bool = False,
        into: MoEWeights | None = None,
    ) -> tuple[MoEWeights, ReadReport]:
        """The weights of MoE layer ``layer``: router, shared experts, and routed experts ``expert_ids``.

        ``expert_ids`` (default: all E) must be contiguous: the routed tensors come back with one row
        per id, ``[L, 2I, H]`` and ``[L, H, I]``, as ``MoELayer.load_weights(expert_ids=...)`` takes them.
        ``dtype``: of the expert and shared weights (default: as stored, FP8 dequantised to bfloat16).
        The router weight and bias come back in float32, the precision routing is computed in.

        ``fp8_experts``: the two routed-expert tensors come back as float8 e4m3 with one float32 scale
        per 128x128 block in ``gate_up_proj_scale_inv`` [L, 2I/128, H/128] and ``down_proj_scale_inv``
        [L, H/128, I/128], as ``MoELayer(expert_dtype="fp8")`` holds them (``dtype`` then applies to
        the shared experts only). FP8-stored weights with 128x128 blocks are copied as stored, byte
        for byte, never widened; other block sizes are dequantised and requantised at 128, and dense
        weights quantised, one tensor read at a time. H and I must be multiples of 128.

        ``into``: tensors to read the routed experts straight into (``weights.layer_weights(layer)``
        of a layer with these experts), so a rank never holds its experts twice; they must have the
        shapes and dtypes the read returns.

        Only files holding the requested tensors are opened (``ReadReport``); bad names, shapes or
        missing FP8 scales raise ``ValueError`` naming the file and tensor, before any data is read.
        """
        layer = self.resolve_layer(layer)
        num_experts = self.moe_config.num_experts
        if fp8_experts:
            self._check_fp8_sizes()
        expert_ids = range(num_experts) if expert_ids is None else expert_ids
        if (
            not isinstance(expert_ids, range)
            or expert_ids.step != 1
            or not (0 <= expert_ids.start < expert_ids.stop <= num_experts)
        ):
            raise ValueError(f"expert_ids must be a contiguous range inside [0, {num_experts}), got {expert_ids!r}")
        pieces = self._pieces(layer, expert_ids)
        sink = Assembler(self.moe_config, len(expert_ids), dtype, self.fp8_block, fp8_experts, into)
        files, names, nbytes = self._read(pieces, sink)
        return sink.weights(), ReadReport(layer, expert_ids, files, names, nbytes)

    def _check_fp8_sizes(self) -> None:
        """``ValueError`` unless the routed experts tile into whole 128x128 blocks: gate and up rows are
        stacked into one tensor, so their scales are too, and a partial block of gate rows has no
        row of its own in the stacked scales."""
        bad = sizes_off_blocks(self.moe_config.hidden_size, self.moe_config.moe_intermediate_size)
        if bad:
            raise ValueError(
                f"{self.path / 'config.json'}: FP8 experts need hidden_size and moe_intermediate_size that are "
                f"multiples of {FP8_BLOCK} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block), got {bad}; read this "
                "model with fp8_experts=False (dense experts)"
            )

    # ---- the plan: which tensors, where ---------------------------------------------------------

    def _pieces(self, layer: int, expert_ids: range) -> list[_Piece]:
        cfg = self.moe_config
        e, h, i, s = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
        prefix = f"model.layers.{layer}.mlp."
        where = f"layer {layer}"

        def piece(name: str, shape: tuple[int, ...], target: str, index: tuple = (), rows=None, what=where):
            name = prefix + name
            if name not in self.weight_map:
                raise ValueError(
                    f"{self.map_source}: tensor {name} ({what}) is missing; the checkpoint is incomplete "
                    f"or not a {self.model_type} model of this config.json"
                )
            return _Piece(name, self.weight_map[name], shape, target, index, rows, what)

        pieces = [piece("gate.weight", (e, h), "router")]
        if cfg.topk_method == "noaux_tc":  # required: a zero bias would silently pick other experts
            pieces.append(piece("gate.e_score_correction_bias", (e,), "bias"))
        if prefix + "experts.gate_up_proj" in self.weight_map:  # stacked, as transformers holds them
            rows = slice(expert_ids.start, expert_ids.stop)
            pieces += [
                piece("experts.gate_up_proj", (e, 2 * i, h), "gate_up", rows=rows),
                piece("experts.down_proj", (e, h, i), "down", rows=rows),
            ]
        else:
            for row, expert in enumerate(expert_ids):  # gate rows first in gate_up, as transformers stacks them
                what, name = f"expert {expert} of layer {layer}", f"experts.{expert}."
                pieces += [
                    piece(name + "gate_proj.weight", (i, h), "gate_up", (row, slice(0, i)), what=what),
                    piece(name + "up_proj.weight", (i, h), "gate_up", (row, slice(i, 2 * i)), what=what),
                    piece(name + "down_proj.weight", (h, i), "down", (row,), what=what),
                ]
        if s:
            what, name = f"shared experts of layer {layer}", "shared_experts."
            pieces += [
                piece(name + "gate_proj.weight", (s, h), "shared_gate_up", (slice(0, s),), what=what),
                piece(name + "up_proj.weight", (s, h), "shared_gate_up", (slice(s, 2 * s),), what=what),
                piece(name + "down_proj.weight", (h, s), "shared_down", what=what),
            ]
        return pieces

    # ---- reading --------------------------------------------------------------------------------

    def _read(self, pieces: list[_Piece], sink: Assembler | None) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        """Check ``pieces`` against the file headers, then (with a ``sink``) read them into it.

        Returns (files opened, tensors read, bytes read). Files are opened once each, in the order
        the pieces first need them; all checks run before the first byte of tensor data is read.
        """
        opened: dict[str, tuple[object, set[str]]] = {}  # file -> (open file, its tensor names)
        with contextlib.ExitStack() as stack:

            def check(p: _Piece) -> str:
                if p.file not in opened:
                    path = self.path / p.file
                    if not path.is_file():
                        raise ValueError(f"{path} is missing; {self.map_source} places {p.name} there")
                    f = stack.enter_context(_open(path))
                    opened[p.file] = (f, set(f.keys()))
                return self._check_header(*opened[p.file], p)

            plan = []  # (piece, stored dtype, scale piece and its stored dtype, or None)
            for p in pieces:
                stored = check(p)
                scale = self._scale_piece(p) if stored == STORED_FP8 else None
                plan.append((p, stored, (scale, check(scale)) if scale is not None else None))
            if sink is None:
                return tuple(opened), (), 0
            names, nbytes = [], 0
            for p, stored, scaled in plan:
                tensor, scale_inv = self._load_alone(p), None
                nbytes += tensor.numel() * STORED_BYTES[stored]
                if scaled is not None:
                    scale, scale_stored = scaled
                    scale_inv = self._load_alone(scale)
                    nbytes += scale_inv.numel() * STORED_BYTES[scale_stored]
                    names.append(scale.name)
                sink.put(p.target, p.index, tensor, scale_inv)
                names.append(p.name)
            return tuple(opened), tuple(names), nbytes

    def _load_alone(self, p: _Piece) -> torch.Tensor:
        """``p`` read through its own short-lived mapping of the file: the pages it touched are
        unmapped when it returns, so the host holds the copy, not the copy plus the file's pages."""
        with _open(self.path / p.file) as f:
            return _load(f, p)

    def _check_header(self, f, names: set[str], p: _Piece) -> str:
        """The stored dtype of ``p`` after checking it exists with the expected shape in its file."""
        if p.name not in names:
            raise ValueError(
                f"{self.path / p.file}: tensor {p.name} ({p.what}) is missing, though {self.map_source} places it there"
            )
        header = f.get_slice(p.name)
        shape, stored = tuple(header.get_shape()), header.get_dtype()
        if shape != p.shape:
            cfg = self.moe_config
            raise ValueError(
                f"{self.path / p.file}: tensor {p.name} must have shape {p.shape}, got {shape}; config.json "
                f"says hidden_size={cfg.hidden_size}, moe_intermediate_size={cfg.moe_intermediate_size}, "
                f"{cfg.num_experts} routed and {cfg.num_shared_experts} shared experts: the weights do not match it"
            )
        if stored not in STORED_BYTES:
            raise ValueError(
                f"{self.path / p.file}: tensor {p.name} must be stored as one of "
                f"{sorted(STORED_BYTES)}, got {stored}; quantised formats other than "
                "FP8 e4m3 with 128x128 block scales are not supported"
            )
        return stored

    def _scale_piece(self, p: _Piece) -> _Piece:
        """The block-scale tensor of FP8 weight ``p``: [..., ceil(out/128), ceil(in/128)] float32."""
        name = p.name + "_scale_inv"
        if name not in self.weight_map:
            raise ValueError(
                f"{self.path / p.file}: tensor {p.name} ({p.what}) is float8 e4m3 but its block scale "
                f"{name} is missing from {self.map_source}; FP8 weights need their weight_scale_inv"
            )
        b_out, b_in = self.fp8_block
        shape = (*p.shape[:-2], math.ceil(p.shape[-2] / b_out), math.ceil(p.shape[-1] / b_in))
        return _Piece(name, self.weight_map[name], shape, p.target, p.index, p.rows, p.what)


def _weight_map(path: Path) -> tuple[dict[str, str], str]:
    """tensor name -> file (relative to ``path``), and the file that says so (for error messages)."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"]), str(index)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{index} must be JSON with a weight_map of tensor name -> file, got an error: {err}"
            ) from None
    single = path / SINGLE_FILE
    if single.is_file():
        with _open(single) as f:  # the header only
            return {name: SINGLE_FILE for name in f.keys()}, str(single)
    found = sorted(p.name for p in path.glob("*.safetensors"))
    raise ValueError(
        f"{path} must hold {SINGLE_FILE} or {INDEX_FILE}, got neither"
        + (f" (safetensors files without an index: {found[:4]})" if found else " (no safetensors files)")
        + "; save the model with save_pretrained, or download the index with the shards"
    )


def _open(path: Path):
    """``safe_open(path)``; a truncated or corrupt file (a download or save cut short) or one that
    cannot be read is a ``ValueError`` naming it and the fix, not a traceback from the Rust reader."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{path} must be a complete safetensors file, got an error reading it: {err}; the file is "
            "truncated or corrupt (a download or save cut short?): download or save it again"
        ) from None


def _load(f, p: _Piece) -> torch.Tensor:
    """Read ``p`` from open file ``f``: the whole tensor, or only its ``rows`` (a memory-mapped slice)."""
    return f.get_tensor(p.name) if p.rows is None else f.get_slice(p.name)[p.rows]


class LayerLoader:
    """Gives ``MoELayer``s the weights of one MoE layer of a checkpoint, each reading only its own
    experts (``layer.local_expert_ids``); layers with the same experts, dtype and expert format
    share one read.

    ``loader(layer)`` loads and returns ``layer``; ``loader.reports`` lists every read made.
    Experts are read in the layer's dtype (FP8 dequantised in float32, then cast once); a layer
    with FP8 experts (``expert_dtype="fp8"``) gets its routed experts in e4m3 with their block
    scales, as stored (``read_moe_weights(fp8_experts=True)``), and its shared experts in its dtype.
    """

    def __init__(self, checkpoint: Checkpoint, layer_index: int):
        self.checkpoint, self.layer_index = checkpoint, layer_index
        self.expert_reports: list[ReadReport] = []  # the reads of ``expert_source``, one expert each
        self._reads: dict[tuple[Sequence[int], torch.dtype, bool], tuple[MoEWeights, ReadReport]] = {}

    def __call__(self, layer: MoELayer) -> MoELayer:
        experts, key = layer.local_expert_ids, self._key(layer)
        if not isinstance(experts, range):  # replicas or a moved placement: one read per slot's expert
            for slot, expert in enumerate(experts):
                weights = self._read_expert(layer, expert)
                layer.experts.set_expert(slot, *_expert_rows(weights))
            _load_replicated(layer, weights)  # every read holds the router and the shared experts
            return layer
        if key not in self._reads:  # the first such layer is read into directly: one copy of its experts
            self._reads[key] = self.checkpoint.read_moe_weights(
                self.layer_index,
                experts,
                dtype=layer.dtype,
                fp8_experts=layer.experts.fp8,
                into=layer_weights(layer),  # on a GPU too: the host holds one read piece at a time
            )
        layer.load_weights(self._reads[key][0], expert_ids=experts)
        return layer

    def expert_source(self, layer: MoELayer) -> Callable[[int], tuple[torch.Tensor, ...]]:
        """Routed experts one at a time, for elastic EP's restore (``launch.elastic.ExpertSource``):
        ``source(e)`` reads expert e alone (and the layer's router and shared experts, which every read
        holds) in ``layer``'s dtype and expert format and returns ``RoutedExperts.set_expert``'s
        arguments: (gate_up [2I, H], down [H, I]), plus their block scales for FP8 experts. Each read
        is appended to ``expert_reports``."""

        return lambda expert: _expert_rows(self._read_expert(layer, expert))

    def _read_expert(self, layer: MoELayer, expert: int) -> MoEWeights:
        """Routed expert ``expert`` alone (with the router and shared experts), in ``layer``'s formats."""
        weights, report = self.checkpoint.read_moe_weights(
            self.layer_index, range(expert, expert + 1), dtype=layer.dtype, fp8_experts=layer.experts.fp8
        )
        self.expert_reports.append(report)
        return weights

    def report(self, layer: MoELayer) -> ReadReport:  # a contiguous layer's one read
        """The read that gave ``layer`` its weights."""
        return self._reads[self._key(layer)][1]

    @staticmethod
    def _key(layer: MoELayer) -> tuple[Sequence[int], torch.dtype, bool]:
        return layer.local_expert_ids, layer.dtype, layer.experts.fp8

    @property
    def reports(self) -> list[ReadReport]:
        return [report for _, report in self._reads.values()]


def _expert_rows(weights: MoEWeights) -> tuple[torch.Tensor, ...]:
    """A one-expert read's ``RoutedExperts.set_expert`` arguments (with block scales for FP8 experts)."""
    scales = weights.gate_up_proj_scale_inv, weights.down_proj_scale_inv
    rows = (weights.gate_up_proj_E2IH[0], weights.down_proj_EHI[0])
    return rows if scales[0] is None or scales[1] is None else (*rows, scales[0][0], scales[1][0])


@torch.no_grad()
def _load_replicated(layer: MoELayer, weights: MoEWeights) -> None:
    """The weights every rank holds alike (router, shared experts) from a read of any expert."""
    layer.router.weight.copy_(weights.router_weight_EH)
    if weights.e_score_correction_bias_E is not None:
        layer.router.e_score_correction_bias.copy_(weights.e_score_correction_bias_E)
    shared = layer.shared_experts
    if shared is not None and weights.shared_gate_up_proj_2JH is not None and weights.shared_down_proj_HJ is not None:
        shared.gate_up_proj.copy_(weights.shared_gate_up_proj_2JH)
        shared.down_proj.copy_(weights.shared_down_proj_HJ)
