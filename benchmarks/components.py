"""The cost of Table 3 for 2025's components: each mini2025/<row> model's training step against the 2017 base.

Every row's model (experiment=mini2025/<row>: mini/base's sizes with one component changed) trains on the
same Multi30k batches as `aiayn-train` makes them, in this one process, every batch stepped by each row in
turn after a warm-up (rotating order). Prints each row's parameters, training FLOPs per real token and
tokens/s, and its speed over base's: the median of the per-round ratios with their range.
Usage: python benchmarks/components.py [--data ../shared/data/multi30k] [--rows base swiglu ...]
       [--steps 6] [--rounds 3]
The final line is JSON.
"""

from __future__ import annotations

import json
from statistics import median

import torch

from aiayn.config.compose import compose_run_config
from aiayn.config.plan import module_settings
from aiayn.model import count_parameters
from train_throughput import our_step
from workload import (
    benchmark_parser,
    machine,
    model_flops,
    parse_counts,
    prepare_process,
    race,
    ratio_spread,
    real_tokens,
    spread_batches,
)

ROWS = ["base", "grouped_query", "multi_query", "gelu", "swiglu", "rms_norm", "pre_ln", "rope", "alibi", "t5"]
ROWS += ["shaw", "deep_shallow", "modern"]


def main() -> None:
    parser = benchmark_parser(__doc__, steps=6, rounds=3, steps_help="training batches per round")
    parser.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS, help="mini2025 rows; base is always raced")
    args = parse_counts(parser)
    prepare_process()
    print(machine())
    rows = ["base", *(row for row in args.rows if row != "base")]
    common = ["logger=none", f"data.root={args.data}", *args.overrides]
    configs = {row: compose_run_config([f"experiment=mini2025/{row}", *common]) for row in rows}
    batches = spread_batches(configs["base"], args.steps)  # every row's corpus and batching are base's
    steps, results = {}, {}
    for row, cfg in configs.items():
        torch.manual_seed(0)
        settings = module_settings(cfg)
        module = settings.build().train()
        steps[row] = our_step(module)
        tokens = sum(real_tokens(batch) for batch in batches)
        results[row] = {
            "params": count_parameters(module.model),
            "flops_per_token": round(model_flops(settings.model, batches) / tokens),
        }
    speeds = race(steps, batches, args.rounds)
    print(f"{'row':<16}{'parameters':>12}{'FLOPs/token':>14}{'tokens/s':>10}{'vs base (median, range)':>28}")
    for row in rows:
        result = results[row]
        result["tokens_per_s"] = round(median(speeds[row]))
        spread = ratio_spread(speeds[row], speeds["base"])
        result["vs_base"], result["vs_base_range"] = spread["median"], [spread["min"], spread["max"]]
        ratio = f"{spread['median']:.3f} ({spread['min']:.3f}-{spread['max']:.3f})"
        line = f"{row:<16}{result['params']:>12,}{result['flops_per_token']:>14,}{result['tokens_per_s']:>10}"
        print(f"{line}{ratio:>28}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
