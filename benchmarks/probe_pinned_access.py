"""Can a GPU kernel (or a CUDA graph) read and write pinned host memory on this machine? The address
tables of ``low_latency``'s index graphs (``dispatch/ll_addresses.py``) rely on one of these.

Usage (GPU): ``python benchmarks/probe_pinned_access.py``. Prints, for each way, whether the values
the host wrote between replays reached the kernel and whether the device's write reached the host:
(a) a Triton kernel loading pinned memory at an offset from a device tensor (unified addressing),
(b) the pinned tensor passed to the kernel as a pointer, (c) a captured ``copy_`` host -> device of
the pinned words, then a device -> host ``copy_`` back, replayed.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["offset"])
def _read_at(anchor_ptr, offset, out_ptr):
    src = (anchor_ptr + offset.to(tl.int64) * 16).to(tl.pointer_type(tl.int64))
    v = tl.load(src + tl.arange(0, 2), cache_modifier=".cv")
    tl.store(out_ptr + tl.arange(0, 2), v)
    tl.store(src + 2, tl.sum(v))


@triton.jit
def _read_ptr(src_ptr, out_ptr):
    v = tl.load(src_ptr + tl.arange(0, 2), cache_modifier=".cv")
    tl.store(out_ptr + tl.arange(0, 2), v)
    tl.store(src_ptr + 2, tl.sum(v))


@triton.jit
def _double(src_ptr, out_ptr):
    tl.store(out_ptr + tl.arange(0, 2), tl.load(src_ptr + tl.arange(0, 2)) * 2)


def _try(name, fn) -> None:
    try:
        print(f"{name}: {fn()}")
    except Exception as err:  # noqa: BLE001 - a probe reports every failure and goes on
        print(f"{name}: FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}")


def main() -> None:
    dev = torch.device("cuda")
    anchor = torch.zeros(16, dtype=torch.uint8, device=dev)
    out = torch.zeros(2, dtype=torch.int64, device=dev)
    if len(sys.argv) == 1:
        print("torch", torch.__version__, "triton", triton.__version__)
        try:
            cc = subprocess.run(["nvidia-smi", "conf-compute", "-f"], capture_output=True, text=True, timeout=20)
            print("nvidia-smi conf-compute -f:", (cc.stdout + cc.stderr).strip())
        except Exception as err:  # noqa: BLE001
            print("nvidia-smi conf-compute:", err)

    def unified():
        host = torch.tensor([3, 4, 0, 0], dtype=torch.int64).pin_memory()
        off = (host.data_ptr() - anchor.data_ptr()) // 16
        _read_at[(1,)](anchor, off, out)
        torch.cuda.synchronize()
        return f"read {out.tolist()} (want [3, 4]), host after {host.tolist()} (want [3, 4, 7, 0])"

    def pointer():
        host = torch.tensor([5, 6, 0, 0], dtype=torch.int64).pin_memory()
        _read_ptr[(1,)](host, out)
        torch.cuda.synchronize()
        return f"read {out.tolist()} (want [5, 6]), host after {host.tolist()} (want [5, 6, 11, 0])"

    def graph_copies():
        host = torch.tensor([1, 2], dtype=torch.int64).pin_memory()
        echo = torch.zeros(2, dtype=torch.int64).pin_memory()
        table = torch.zeros(2, dtype=torch.int64, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            table.copy_(host, non_blocking=True)
            _double[(1,)](table, out)
            echo.copy_(out, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.copy_(host, non_blocking=True)
            _double[(1,)](table, out)
            echo.copy_(out, non_blocking=True)
        seen = []
        for values in ([7, 8], [9, 10]):
            host.numpy()[:] = values
            graph.replay()
            torch.cuda.synchronize()
            seen.append((out.tolist(), echo.tolist()))
        return f"{seen} (want [([14, 16], [14, 16]), ([18, 20], [18, 20])])"

    cases = {
        "a": ("(a) unified addressing, offset from a device tensor", unified),
        "b": ("(b) pinned tensor as a Triton pointer", pointer),
        "c": ("(c) captured copies host -> device -> host", graph_copies),
    }
    if len(sys.argv) > 1:
        _try(*cases[sys.argv[1]])
        return
    for key in cases:  # each in a process of its own: an illegal access poisons the CUDA context
        subprocess.run([sys.executable, __file__, key], timeout=120)


if __name__ == "__main__":
    main()
