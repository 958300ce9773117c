"""Which kernels run: the one gate for Triton (does it import, can it run on these tensors), the one
vocabulary every component with a kernel choice takes, and the lane counts of Triton kernel axes.

The vocabulary: ``kernels="auto" | "torch" | "triton" | <backend name>``. ``"auto"`` runs the Triton
kernels on CUDA tensors where Triton imports and torch's ops elsewhere; ``"triton"`` asks for the
Triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``, Triton's interpreter, as
the CPU tests run them) and is refused where they cannot run; ``"torch"`` runs torch's ops
everywhere. A component with more than one implementation besides torch's names them too (the routed
experts' GEMM routes, ``experts.select``). The router, the routed experts, SwiGLU, ``gather_sum``,
the ``low_latency`` dispatcher and EPLB's per-forward work all take ``kernels=`` and ask
``use_triton`` (or ``triton_runs_on``) here.

Why a root module: the gate is read by the rooms of the core that have Triton kernels (``routing``,
``experts``, ``dispatch``, ``eplb``), so it must sit below all of them, and the root is the core's
floor. The widths of Triton kernel axes (``lanes``), which the kernels of those rooms share, live here
too rather than in a root module of their own: the root stays at ten modules, and what every Triton
kernel of the package needs to know is in one place.

The hard part is that the answer must not depend on import order or on which kernel module was
imported first: ``HAS_TRITON`` is decided once, here, by importing Triton itself; a kernel module
(``routing.kernel``, ``quant.kernels``, ...) is imported only where it is true.

Lanes: a kernel axis over ``n`` things (ranks, top-k slots, expert groups) is a power of two wide,
the lanes past ``n`` masked. Compiled Triton 3.6 mis-compiled such an axis one lane wide: on an
H200, ``low_latency``'s pack pass lost the ids of half its rows at one rank (P = 1), where Triton's
CPU interpreter got them right, and two lanes fixed it. So no axis is narrower than two lanes; the
extra one is masked like any pad (the GPU tests hold the one-rank and top-1 cases to the torch path).
"""

from __future__ import annotations

import torch

from . import env

try:
    import triton  # noqa: F401  (imported for the fact that it imports)

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRITON = False

KERNEL_CHOICES = ("auto", "torch", "triton")


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read by ``env``)."""
    return env.triton_interpreting()


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on ``device``'s tensors: Triton imports, and the device is CUDA or
    Triton's CPU interpreter is on."""
    return HAS_TRITON and (device.type == "cuda" or interpreting())


def check_kernels(kernels: str, name: str = "kernels", backends: tuple[str, ...] = ()) -> None:
    """Refuse a ``kernels`` value outside ``KERNEL_CHOICES`` and the component's own ``backends``."""
    choices = KERNEL_CHOICES + backends
    if kernels not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {kernels!r}")


def triton_refusal(name: str, kernels: str, device: torch.device) -> str:
    """Why ``kernels`` (a Triton kernel asked for by name) cannot run on ``device``, with the fix."""
    missing = "" if HAS_TRITON else " and Triton does not import here (pip install triton)"
    return (
        f"{name}={kernels!r} needs Triton and CUDA tensors (or TRITON_INTERPRET=1, Triton's CPU interpreter), "
        f"got {device.type} tensors{missing}; use {name}='auto' or 'torch'"
    )


def use_triton(kernels: str, device: torch.device, name: str = "kernels") -> bool:
    """Whether a component with the choice ``kernels`` runs its Triton kernels on ``device``:
    ``"auto"`` on CUDA where Triton imports, ``"triton"`` wherever Triton runs (``ValueError`` where
    it does not: ``triton_runs_on``), ``"torch"`` never. ``name``: the option's name in messages."""
    check_kernels(kernels, name)
    if kernels == "torch":
        return False
    if kernels == "auto":
        return HAS_TRITON and device.type == "cuda"
    if not triton_runs_on(device):
        raise ValueError(triton_refusal(name, kernels, device))
    return True


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n`` <= 1), as ``triton.next_power_of_2``."""
    return 1 << max(int(n) - 1, 0).bit_length()


def lanes(n: int) -> int:
    """The lanes of a kernel axis over ``n`` things: the next power of two, at least 2."""
    return max(next_power_of_2(max(int(n), 1)), 2)
