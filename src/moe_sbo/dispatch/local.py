"""``local``: one rank owns every expert and nothing moves. The reference the others are checked against."""

from __future__ import annotations

from .base import Dispatcher, EPGroup, register_dispatcher
from .layout import combine_rows, group_rows_by_expert
from .records import CombineInput, DispatchHandle, DispatchInput, DispatchOutput, Pending, Traffic


@register_dispatcher
class LocalDispatcher(Dispatcher):
    """All E experts on this rank (whatever the process group): M = T, no communication."""

    name = "local"

    def __init__(self, num_experts: int, ep: EPGroup):
        super().__init__(num_experts, EPGroup())  # ignores the group: the single-rank reference

    def _launch_dispatch(self, inp: DispatchInput) -> Pending:
        x_TH = inp.x_TH
        # Every pair is local here, so R = T * K is known without a host sync.
        layout = group_rows_by_expert(
            inp.topk_ids_TK, inp.topk_weights_TK, self.num_local_experts, inp.topk_ids_TK.numel()
        )
        handle = DispatchHandle(x_TH.shape[0], x_TH.shape[1], x_TH.dtype, layout, Traffic())
        return Pending(works=[], state=x_TH, handle=handle)

    def _wait_dispatch(self, pending: Pending) -> DispatchOutput:
        handle = pending.dispatch_handle
        return self._output(pending.state[handle.layout.row_R], handle)

    def _launch_combine(self, inp: CombineInput) -> Pending:
        return Pending(works=[], state=combine_rows(inp.expert_y_RH, inp.handle.layout, inp.handle.dtype))

    def _wait_combine(self, pending: Pending):
        return pending.state
