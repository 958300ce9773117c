"""The simulator's prediction for a layer setup before it is measured: a measured row's setup with
another count of routed experts per GPU and other token counts, through the same calibration that
validates the files (``moe_sbo.planner``). Written down before the run, it is a held-out check.

Usage (CPU): ``python benchmarks/predict_setup.py --template benchmarks/results/low_latency_eager_head_h200x1_1.json
--experts-per-gpu 16 --tokens 64 128 256 512``: one line per template row (rows with ``fixed_expert_rows``
or ``index_rows`` left out) and token count, each setup once: graph or eager, the dispatcher, experts, tokens,
predicted µs, the stages.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_sbo.planner import load_rows
from moe_sbo.planner.simulate import predict
from moe_sbo.planner.simulate_report import calibrate_simulator, setup_of
from moe_sbo.planner.simulate_rows import ResultRow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--template", type=Path, required=True, help="a result file whose layer rows to vary")
    parser.add_argument("--experts-per-gpu", type=int, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", required=True)
    args = parser.parse_args(argv)
    if args.experts_per_gpu < 1 or min(args.tokens) < 1:
        parser.error("--experts-per-gpu and every --tokens must be >= 1")
    cal = calibrate_simulator(load_rows(args.results))
    templates = [
        r
        for r in load_rows(args.template)
        if not r.get("index_rows") and not r.get("fixed_expert_rows") and setup_of(r) is not None
    ]
    if not templates:
        parser.error(
            f"{args.template} has no layer row to vary (rows with index_rows or fixed_expert_rows are left out)"
        )
    predicted = set()  # a template that measured several token counts gives each setup once
    for template in templates:
        for tokens in args.tokens:
            row = {k: v for k, v in template.row.items() if not k.startswith("t_") and "bytes_" not in k}
            experts = args.experts_per_gpu * template.ep
            row.update(experts_per_gpu=args.experts_per_gpu, num_experts=experts, tokens_per_rank=tokens)
            row.update(capacity=tokens, t_layer_us=0.0)
            setup = setup_of(ResultRow(template.file, "predicted", row, template.meta))
            assert setup is not None
            if setup in predicted:
                continue
            predicted.add(setup)
            p = predict(setup, cal)
            stages = ", ".join(f"{span.name} {span.dur_us:.0f}" for span in p.spans)
            kind = "graph" if setup.graph else "eager"
            what = f"{kind} {setup.path.dispatcher} {setup.cfg.num_experts} experts, {tokens} tokens"
            print(f"{what}: {p.t_layer_us:.0f} µs ({stages})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
