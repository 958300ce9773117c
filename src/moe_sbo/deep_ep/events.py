"""``EventOverlap``: DeepEP's handle on "the work this call queued", over moe-sbo's CUDA events.

Every call of this package queues its work on the caller's current stream (NCCL moves the bytes on
its own stream and the current stream waits for it, as ``moe_sbo.dispatch`` does), so an event
recorded at the end of a call marks its outputs ready. On CPU there are no streams: the work is done
when the call returns, and the event is ``None``, a completed no-op. The hard part is keeping the two
meanings of "wait" apart: ``current_stream_wait`` orders the GPU streams and never blocks the host.
"""

from __future__ import annotations

from typing import Any

import torch

from ..streams import record_event


class EventOverlap:
    """A recorded CUDA event (``event``; ``None``: nothing to wait for, as on CPU) and tensors kept
    alive until it is waited on (``extra_tensors``, DeepEP's substitute for ``record_stream`` that
    CUDA graphs accept)."""

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple[Any, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event (CUDA; the host does not block). No-op without one.

        Sync: queues a wait on the current stream; CUDA-graph safe."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> EventOverlap:
        """``with event:`` runs the block's work beside the event's, then the current stream waits for
        it at the end of the block (as DeepEP's)."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.current_stream_wait()


def capture_event(device: torch.device | None = None) -> EventOverlap:
    """An event recorded now on the current stream of ``device`` (default: the current CUDA device
    when CUDA is in use), or a completed no-op on CPU."""
    if device is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return EventOverlap(record_event(device))


def wait_previous(previous_event: EventOverlap | None) -> None:
    """Make the current stream wait for ``previous_event`` (DeepEP's ``previous_event`` argument)."""
    if previous_event is not None:
        if not isinstance(previous_event, EventOverlap):
            raise TypeError(
                f"previous_event must be an EventOverlap (from Buffer.capture() or a previous call), got "
                f"{type(previous_event).__name__}"
            )
        previous_event.current_stream_wait()


def finish(device: torch.device, async_finish: bool, tensors: tuple[Any, ...] = ()) -> EventOverlap:
    """The event a call returns: recorded on the current stream when ``async_finish`` (CUDA), holding
    ``tensors``; otherwise an event with nothing to wait for (the work is already ordered on the
    current stream)."""
    if not async_finish:
        return EventOverlap()
    return EventOverlap(record_event(device), tensors)
