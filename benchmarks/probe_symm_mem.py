"""Probe: can PyTorch symmetric memory carry the low-latency dispatcher's fixed blocks, and how fast?

Run on >= 2 GPUs, after ``source benchmarks/gpu_env.sh`` (it puts ``src`` on the path):
``torchrun --nproc-per-node N benchmarks/probe_symm_mem.py --out DIR``

For the low-latency dispatch block of DeepSeek-V3 (``--rows`` per peer of ``--row-bytes`` bytes) it
checks, per variant, that the bytes arrive intact and that the variant can be captured in a CUDA graph,
then times graph replays (median of ``--iters``, each lined up by a barrier) beside a captured raw NCCL
``all_to_all_single`` of the same bytes:

- ``push``: each rank copies its block for peer p straight into p's symmetric receive buffer
  (``get_buffer``), then a symmetric-memory ``barrier`` (the peers' writes are visible after it);
- ``pull``: each rank writes its send blocks into its own symmetric buffer, barrier, then copies
  from every peer's buffer, then a second barrier (so the sender may reuse its buffer);
- ``all_to_all_vdev`` (NVSHMEM backend only, ``--backend NVSHMEM``): the device-split all-to-all.

Writes ``symm_mem_probe_<backend>.json`` with one row per variant (or its error), in the result-file format.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from moe_sbo.measure.timing import line_up, time_fn
from moe_sbo.streams import capture_graph


def slowest_median_us(replay, iters: int) -> float:
    """The slowest rank's median of ``replay`` (ranks lined up before every call)."""
    worst = torch.tensor([time_fn(replay, torch.device("cuda"), 3, iters, graph=False)], device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128], help="rows per peer block")
    p.add_argument("--row-bytes", type=int, default=14400, help="bytes of one row (V3 bf16 row: 14400)")
    p.add_argument("--backend", default="CUDA", choices=["CUDA", "NVSHMEM", "NCCL"])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    rows_out = []
    meta = {
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "gpu": torch.cuda.get_device_name(),
        "world": world,
        "backend": args.backend,
        "nvshmem_available": symm_mem.is_nvshmem_available(),
    }
    try:
        symm_mem.set_backend(args.backend)
    except Exception as exc:  # noqa: BLE001 - recorded, the probe goes on with the default
        meta["set_backend_error"] = repr(exc)
    for rows in args.rows:
        block = rows * args.row_bytes
        send = torch.randint(0, 255, (world, block), dtype=torch.uint8, device="cuda")
        expect = torch.empty_like(send)
        dist.all_to_all_single(expect, send)
        recv_plain = torch.empty_like(send)
        variants = {}

        def nccl() -> None:
            dist.all_to_all_single(recv_plain, send)

        variants["nccl_all_to_all_single"] = (nccl, lambda: recv_plain)

        try:
            buf = symm_mem.empty((world, block), dtype=torch.uint8, device="cuda")
            hdl = symm_mem.rendezvous(buf, group_name)
            peer_bufs = [hdl.get_buffer(peer, (world, block), torch.uint8) for peer in range(world)]

            def push() -> None:
                for peer in range(world):
                    peer_bufs[peer][rank].copy_(send[peer])
                hdl.barrier(channel=0)

            variants["symm_push"] = (push, lambda: buf)

            pull_src = symm_mem.empty((world, block), dtype=torch.uint8, device="cuda")
            hdl_src = symm_mem.rendezvous(pull_src, group_name)
            src_bufs = [hdl_src.get_buffer(peer, (world, block), torch.uint8) for peer in range(world)]
            recv_pull = torch.empty_like(send)

            def pull() -> None:
                pull_src.copy_(send)
                hdl_src.barrier(channel=0)
                for peer in range(world):
                    recv_pull[peer].copy_(src_bufs[peer][rank])
                hdl_src.barrier(channel=1)

            variants["symm_pull"] = (pull, lambda: recv_pull)
        except Exception as exc:  # noqa: BLE001
            rows_out.append(
                {"rows": rows, "variant": "symm_setup", "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
            )

        if args.backend == "NVSHMEM":
            try:
                inp = symm_mem.empty(world * block, dtype=torch.uint8, device="cuda")
                out = symm_mem.empty(world * block, dtype=torch.uint8, device="cuda")
                # torch 2.11: all_to_all_vdev(input, out, in_splits [P], out_splits_offsets [2, P], group)
                in_splits = symm_mem.empty(world, dtype=torch.int64, device="cuda").fill_(block)
                out_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device="cuda")
                for t in (inp, out, in_splits, out_splits_offsets):
                    symm_mem.rendezvous(t, group_name)
                inp.copy_(send.view(-1))

                def vdev() -> None:
                    torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, group_name)

                variants["all_to_all_vdev"] = (vdev, lambda: out.view(world, block))
            except Exception as exc:  # noqa: BLE001
                rows_out.append({"rows": rows, "variant": "vdev_setup", "error": repr(exc)})

        for name, (fn, result) in variants.items():
            row = {"rows": rows, "bytes_per_peer": block, "variant": name}
            try:
                fn()
                torch.cuda.synchronize()
                dist.barrier()
                row["eager_correct"] = bool(torch.equal(result(), expect))
                line_up(torch.device("cuda"))  # every rank captures its transfers at the same point
                graph, _ = capture_graph(fn)
                result().zero_()
                line_up(torch.device("cuda"))
                graph.replay()
                line_up(torch.device("cuda"))
                row["graph_correct"] = bool(torch.equal(result(), expect))
                row["t_graph_us"] = slowest_median_us(graph.replay, args.iters)
            except Exception as exc:  # noqa: BLE001
                row["error"] = repr(exc)
                row["trace"] = traceback.format_exc()[-2000:]
            rows_out.append(row)
            if rank == 0:
                print(json.dumps(row)[:400], flush=True)
    if rank == 0:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"symm_mem_probe_{args.backend}.json").write_text(
            json.dumps({"meta": meta, "rows": rows_out}, indent=1)
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
