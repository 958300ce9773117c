"""``moe-sbo plan --plot``: the planner's batch sweep drawn (matplotlib, the ``[plot]`` extra), per-a2a
time and required per-GPU bandwidth against the batch, one line per machine of ``planner.HARDWARE``
(machines with the same link numbers share one); matplotlib is imported only when one is drawn."""

from __future__ import annotations

from pathlib import Path

from .. import planner


def write_plot(plan: planner.Plan, path: Path) -> None:
    """PNG: batch vs per-a2a time (left) and vs required per-GPU bandwidth (right), hardware as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inp = plan.inputs
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if b >= inp.micro_batches]
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.8))

    # Machines with the same link numbers (H100, H200) draw one line, named after all of them.
    by_numbers: dict[tuple, list[str]] = {}
    for name, hw in planner.HARDWARE.items():
        by_numbers.setdefault((hw.nvlink_GBps, hw.nic_GBps, hw.gpus_per_node, hw.latency_us), []).append(name)
    links = {"/".join(names): planner.datasheet_link(planner.HARDWARE[names[0]]) for names in by_numbers.values()}
    if plan.link.source.startswith("calibrated"):
        links = {"calibrated": plan.link, **links}
    for name, link in links.items():
        points = planner.sweep_batches(inp, batches, link)
        ax_time.plot(
            batches,
            [p.micro_batch_a2a_us if inp.micro_batches == 2 else p.t_combine_us for p in points],
            marker="o",
            ms=3,
            label=f"{name} ({link.nvlink_GBps:g} GB/s)",
        )
    window_us = (inp.attn_us - inp.moe_us) / 2
    ax_time.axhline(window_us, color="k", ls="--", label=f"TBO budget (T - t)/2 = {window_us:g} us")
    ax_time.set(
        xscale="log",
        yscale="log",
        xlabel="batch (tokens per GPU)",
        ylabel="slower all-to-all per " + ("micro-batch" if inp.micro_batches == 2 else "batch") + " (us)",
        title=f"{inp.model.name} EP{inp.ep}: all-to-all time",
    )
    ax_time.legend(fontsize=7)

    points = planner.sweep_batches(inp, batches, plan.link)
    ax_bw.plot(batches, [p.required_GBps_per_gpu for p in points], marker="o", ms=3, label="byte model: step / TPOT")
    ax_bw.plot(
        batches,
        [p.seed_required_GBps_per_gpu for p in points],
        marker="s",
        ms=3,
        ls=":",
        label="published convention: step / TPOT",
    )
    tbo = [(p.batch, p.tbo_required_GBps) for p in points if p.tbo_required_GBps is not None]
    if tbo and inp.micro_batches == 2:
        ax_bw.plot(*zip(*tbo), marker="^", ms=3, label="to meet the TBO budget")
    for name, link in links.items():
        ax_bw.axhline(link.nvlink_GBps, ls="--", lw=0.8, color="grey")
        ax_bw.annotate(f"{name} {link.nvlink_GBps:.4g} GB/s", (batches[0], link.nvlink_GBps), fontsize=7, va="bottom")
    ax_bw.set(
        xscale="log",
        yscale="log",
        xlabel="batch (tokens per GPU)",
        ylabel="required GB/s per GPU",
        title=f"TPOT {inp.tpot_ms:g} ms, {plan.bytes.layers} layers",
    )
    ax_bw.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
