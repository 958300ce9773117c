"""``Config`` and the buffer size hints of DeepEP's API, as this package honours them.

DeepEP sizes NVLink and RDMA buffers up front and tunes its kernels by chunk sizes and SM counts. Here
the normal mode allocates what each call needs and the low-latency mode sizes moe-sbo's buffers from
the first dispatch's shape, so a ``Config`` changes no result and no allocation: it is accepted,
checked as DeepEP checks it, and kept for code that reads it back. The hard part is saying honestly
what a hint means when nothing is preallocated: each hint below states what its number counts.
"""

from __future__ import annotations

from dataclasses import dataclass

# The SM count DeepEP's high-throughput kernels start with (``Buffer.num_sms``); kept for code that
# reads or sets it. moe-sbo's normal mode runs NCCL collectives, whose SM use NCCL decides.
DEFAULT_NUM_SMS = 20


@dataclass(frozen=True)
class Config:
    """DeepEP's tuning config: SMs and chunk sizes of its normal-mode kernels.

    ``num_sms``: SMs of DeepEP's kernels; ``num_max_nvl_chunked_send_tokens`` /
    ``num_max_nvl_chunked_recv_tokens``: tokens per NVLink chunk sent / buffered;
    ``num_max_rdma_chunked_send_tokens`` / ``num_max_rdma_chunked_recv_tokens``: the same over RDMA.
    None of them changes a result here (the transfers are NCCL collectives); they are checked as
    DeepEP checks them, so a config that DeepEP would refuse is refused here too.
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for name in (
            "num_sms",
            "num_max_nvl_chunked_send_tokens",
            "num_max_nvl_chunked_recv_tokens",
            "num_max_rdma_chunked_send_tokens",
            "num_max_rdma_chunked_recv_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Config.{name} must be an int >= 0, got {value!r}")
        if not 0 < self.num_max_nvl_chunked_send_tokens < self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config needs 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, got "
                f"{self.num_max_nvl_chunked_send_tokens} and {self.num_max_nvl_chunked_recv_tokens}"
            )
        if not 0 < 2 * self.num_max_rdma_chunked_send_tokens <= self.num_max_rdma_chunked_recv_tokens:
            raise ValueError(
                "Config needs 0 < 2 * num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens, got "
                f"{self.num_max_rdma_chunked_send_tokens} and {self.num_max_rdma_chunked_recv_tokens}"
            )

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes to preallocate for the normal mode's intra-node transfers: 0, since moe-sbo's normal
        mode allocates each call's receive tensors itself (``Buffer(group, 0, 0)`` is enough)."""
        _check_positive(hidden_bytes=hidden_bytes, num_ranks=num_ranks)
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes to preallocate for the normal mode's inter-node transfers: 0, as
        ``get_nvl_buffer_size_hint``."""
        _check_positive(hidden_bytes=hidden_bytes, num_ranks=num_ranks)
        return 0


def default_config(num_ranks: int, num_sms: int) -> Config:
    """The config ``Buffer.get_dispatch_config`` / ``get_combine_config`` give for ``num_ranks``:
    one for every group size, since no field changes what this package does."""
    _check_positive(num_ranks=num_ranks)
    return Config(num_sms, 8, 256, 16, 128)


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of the tensors the low-latency mode keeps per shape, bf16: two per-expert receive
    layouts and two zero-copy combine buffers, each ``[num_experts / num_ranks,
    num_max_dispatch_tokens_per_rank * num_ranks, hidden]``. moe-sbo's own transfer buffers, sized by
    the top-k of the first dispatch (``LowLatencyDispatcher.buffer_bytes``), come on top of it."""
    _check_positive(
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        hidden=hidden,
        num_ranks=num_ranks,
        num_experts=num_experts,
    )
    if num_experts % num_ranks:
        raise ValueError(f"num_experts must be divisible by num_ranks, got {num_experts} and {num_ranks}")
    return 4 * num_experts * num_max_dispatch_tokens_per_rank * hidden * 2


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
