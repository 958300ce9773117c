"""One checkpoint read assembled into ``MoEWeights``: each tensor, read as stored, placed into its part
(router, bias, the stacked routed experts, the shared experts) in the dtype the read asks for.

``Checkpoint.read_moe_weights`` (``checkpoint.py``) decides which tensors to read and hands each one,
with its block scales when stored as FP8, to an ``Assembler``; this module never opens a file.

The hard part is FP8 experts from any stored format without a second copy of the experts: weights
stored as e4m3 in 128x128 blocks are copied byte for byte with their scales; other block sizes and
dense weights are converted one matrix at a time (a float32 copy of one matrix at most), and a gate or
up slice of the stacked ``gate_up`` tensor lands in whole 128-row blocks of its scales
(``_block_index``).
"""

from __future__ import annotations

import torch

from ..config import MoEConfig
from ..quant.fp8 import FP8_BLOCK, FP8_DTYPE, dequantize_fp8_blocks, quantize_fp8_blocks
from ..weights import MoEWeights


class Assembler:
    """Collects read tensors into the ``MoEWeights`` parts, allocating each part on first use.

    Parts, by name (a read tensor's ``target``): ``router`` [E, H] and ``bias`` [E] (float32);
    ``gate_up`` [L, 2I, H] and ``down`` [L, H, I], the routed experts; ``shared_gate_up`` [2J, H] and
    ``shared_down`` [H, J]. ``stored_block``: the checkpoint's FP8 block size (rows, columns), as its
    config's ``weight_block_size`` gives it.

    ``fp8_experts``: the routed-expert parts ``gate_up`` and ``down`` are e4m3 with their 128x128
    block scales in ``gate_up_scale`` and ``down_scale``; every other part is dense.

    ``into``: a layer's weights (``weights.layer_weights``) whose routed-expert tensors are the parts
    to read into, checked against the shape and dtype the read gives them.
    """

    ROUTED = ("gate_up", "down")

    def __init__(
        self,
        cfg: MoEConfig,
        num_local: int,
        dtype: torch.dtype | None,
        stored_block: tuple[int, int],
        fp8_experts: bool = False,
        into: MoEWeights | None = None,
    ):
        h, i, s = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
        self.shapes = {
            "router": (cfg.num_experts, h),
            "bias": (cfg.num_experts,),
            "gate_up": (num_local, 2 * i, h),
            "down": (num_local, h, i),
            "shared_gate_up": (2 * s, h),
            "shared_down": (h, s),
        }
        if fp8_experts:
            for name in self.ROUTED:
                *rows, out_features, in_features = self.shapes[name]
                self.shapes[name + "_scale"] = (*rows, -(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        self.out: dict[str, torch.Tensor] = {}
        if into is not None:
            given = {
                "gate_up": into.gate_up_proj_E2IH,
                "down": into.down_proj_EHI,
                "gate_up_scale": into.gate_up_proj_scale_inv,
                "down_scale": into.down_proj_scale_inv,
            }
            self.out.update({name: t for name, t in given.items() if t is not None})
        self.dtype = dtype
        self.stored_block, self.fp8_experts = stored_block, fp8_experts

    def put(self, target: str, index: tuple, tensor: torch.Tensor, scale_inv: torch.Tensor | None) -> None:
        """Place ``tensor`` (read as stored; ``scale_inv``: its block scales when stored as FP8) at
        ``index`` of part ``target``."""
        if self.fp8_experts and target in self.ROUTED:
            self._put_fp8(target, index, tensor, scale_inv)
            return
        if scale_inv is not None:
            tensor = dequantize_fp8_blocks(tensor, scale_inv, self.stored_block)
        if target in ("router", "bias"):
            dtype = torch.float32
        else:
            dtype = self.dtype or (torch.bfloat16 if scale_inv is not None else tensor.dtype)
        self._part(target, dtype)[index].copy_(tensor)

    def weights(self) -> MoEWeights:
        """The assembled parts (the router and both routed-expert parts must have been put)."""
        parts = self.out
        return MoEWeights(
            router_weight_EH=parts["router"],
            e_score_correction_bias_E=parts.get("bias"),
            gate_up_proj_E2IH=parts["gate_up"],
            down_proj_EHI=parts["down"],
            shared_gate_up_proj_2JH=parts.get("shared_gate_up"),
            shared_down_proj_HJ=parts.get("shared_down"),
            gate_up_proj_scale_inv=parts.get("gate_up_scale"),
            down_proj_scale_inv=parts.get("down_scale"),
        )

    def _put_fp8(self, target: str, index: tuple, tensor: torch.Tensor, scale_inv: torch.Tensor | None) -> None:
        """A routed-expert piece into the e4m3 part and its scales: one matrix at a time, so a stacked
        tensor's rows are converted one expert at a time (a float32 copy of one matrix at most)."""
        weight, scales = self._part(target, FP8_DTYPE), self._part(target + "_scale", torch.float32)
        if tensor.dim() == 3:  # rows of a stacked [L, O, U] tensor, one expert each
            matrices = [
                ((*index, row), tensor[row], None if scale_inv is None else scale_inv[row])
                for row in range(tensor.shape[0])
            ]
        else:  # one expert's [O, U] (all of down, or the gate or up rows of gate_up)
            matrices = [(index, tensor, scale_inv)]
        for matrix_index, matrix, matrix_scale in matrices:
            if matrix_scale is not None and self.stored_block == (FP8_BLOCK, FP8_BLOCK):
                q, q_scale = matrix, matrix_scale  # as stored: the bytes are copied, never widened
            else:
                if matrix_scale is not None:  # another block size: back to float32, one matrix
                    matrix = dequantize_fp8_blocks(matrix, matrix_scale, self.stored_block)
                q, q_scale = quantize_fp8_blocks(matrix)
            weight[matrix_index].copy_(q)
            scales[_block_index(matrix_index)].copy_(q_scale)

    def _part(self, target: str, dtype: torch.dtype) -> torch.Tensor:
        if target not in self.out:
            self.out[target] = torch.empty(self.shapes[target], dtype=dtype)
        part = self.out[target]
        if tuple(part.shape) != self.shapes[target] or part.dtype != dtype:  # a given ``into`` tensor
            raise ValueError(
                f"the tensor to read {target} into must be {self.shapes[target]} {dtype}, got "
                f"{tuple(part.shape)} {part.dtype}; pass the weights of a layer with these experts and dtype"
            )
        return part


def _block_index(index: tuple) -> tuple:
    """A value index into a routed-expert tensor as an index into its block scales: expert rows stay,
    slices of output features (gate or up rows, whole blocks) are counted in 128-row blocks."""
    return tuple(
        slice(item.start // FP8_BLOCK, item.stop // FP8_BLOCK) if isinstance(item, slice) else item for item in index
    )
