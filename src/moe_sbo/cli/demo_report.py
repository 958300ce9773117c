"""``moe-sbo demo``'s report: its tables, the node note and the closing verdict, built from the rows
``demo.summarise`` returns (one per dispatcher x overlap mode; times the slowest rank's medians). What
is hard: at 80 columns no name may be cut, so the tables go through ``measure.options.make_table``."""

from __future__ import annotations

from ..measure.options import compact, make_table, sci


def demo_table(rows: list[dict]):
    """The summary rows as a table that fits 100 columns (times: the slowest rank's medians, µs);
    with several nodes, the bytes each rank sent to other nodes beside those it sent."""
    inter = node_count(rows) > 1
    columns = [("dispatcher", "left"), ("overlap", "left"), ("|err| max/rel", "right"), ("ok", "left")]
    columns += [("= none", "left"), ("B/rank", "right"), *([("inter B", "right")] if inter else [])]
    columns += [(phase, "right") for phase in ("route", "dispatch", "experts", "combine", "layer")]
    title = "each dispatcher vs the single-rank reference (µs: slowest rank, median)"
    table = make_table(title, columns, optional=("route",))
    for r in rows:
        table.add_row(
            r["dispatcher"],
            r["overlap"],
            f"{sci(r['max_abs_err'])}/{sci(r['rel_err'])}",
            "[green]yes[/]" if r["ok"] else "[red]NO[/]",
            "yes" if r["same_as_none"] else "no",
            compact(r["bytes_sent"]),
            *([compact(r["inter_node_bytes"])] if inter else []),
            *(compact(r[k]) for k in ("t_route_us", "t_dispatch_us", "t_experts_us", "t_combine_us", "t_layer_us")),
        )
    return table


def node_count(rows: list[dict]) -> int:
    """The most nodes any dispatcher saw the ranks as (1: one node holds them all)."""
    return max((r["nodes"] for r in rows), default=1)


def nodes_note(rows: list[dict], ranks: int) -> str | None:
    """With ``node_aware`` among the dispatchers, or several nodes: the node count the dispatchers
    assumed and where it comes from."""
    if not any(r["dispatcher"] == "node_aware" for r in rows) and node_count(rows) == 1:
        return None
    num_nodes = node_count(rows)
    per_node = next(r["ranks_per_node"] for r in rows if r["nodes"] == num_nodes)
    if num_nodes == 1:
        return (
            f"nodes: 1 of {ranks} ranks, no byte crosses nodes; MOE_SBO_RANKS_PER_NODE=1 makes each rank a node"
            if ranks > 1
            else None
        )
    each = f"{per_node} rank" + ("s" if per_node > 1 else "")
    return f"nodes: {num_nodes} of {each} each (MOE_SBO_RANKS_PER_NODE or torchrun's LOCAL_WORLD_SIZE)"


def eplb_demo_table(rows: list[dict]):
    """``--eplb``: each layer's rank load before and after its rebalance, what moved, the error after."""
    columns = [("dispatcher", "left"), ("overlap", "left"), ("before", "right"), ("after", "right")]
    columns += [("moved", "right"), ("MB", "right"), ("rel L2 after", "right"), ("ok", "left")]
    table = make_table("expert load balancing: rank load max/mean", columns)
    for r in rows:
        table.add_row(
            r["dispatcher"],
            r["overlap"],
            f"{r['load_max_over_mean_before']:.2f}",
            f"{r['load_max_over_mean_after']:.2f}",
            str(r["moved_slots"]),
            f"{r['moved_bytes'] / 1e6:.3g}",
            sci(r["rel_err_after_rebalance"]),
            "[green]yes[/]" if r["ok"] else "[red]NO[/]",
        )
    return table


def verdict(rows: list[dict], device: str) -> str:
    """The closing line: how many runs match the reference, and how many equal ``none`` bitwise."""
    n = len(rows)
    ok = sum(r["ok"] for r in rows)
    same = sum(r["same_as_none"] for r in rows)
    line = f"{ok}/{n} dispatcher x overlap runs match the single-rank reference; {same}/{n} equal overlap none bitwise"
    if device == "cuda" and same < n:
        line += " (not required on CUDA: an SM budget may pick other GEMM kernels)"
    failed = [f"{r['dispatcher']}/{r['overlap']}" for r in rows if not r["ok"]]
    return line + (f"; mismatch: {', '.join(failed)}" if failed else "")
