"""The autoregressive engine against HF ``generate`` and a bare HF greedy loop, per dtype and
batch size (no speculation: the overhead treespec adds or saves per step).

    python scripts/bench_ar.py [--dtypes bf16,fp32] [--batch-sizes 1,4] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse

from treespec.bench_ar import ARBenchConfig, run_ar_bench
from treespec.models import DEFAULT_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_results/ar.json")
    args = parser.parse_args()
    config = ARBenchConfig(model=args.model, dtypes=tuple(args.dtypes.split(",")),
                         batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                         max_new_tokens=args.max_new_tokens, repeats=args.repeats)  # fmt: skip
    run_ar_bench(config, out_path=args.out)


if __name__ == "__main__":
    main()
