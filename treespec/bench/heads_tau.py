"""Acceptance (tau) of trained heads through the real engine, on the dev prompts no head was
trained on: T=0, batch 1, a dynamic tree of at most 32 nodes (root included).

    treespec bench heads-tau [--kinds eagle,medusa,draft] [--heads NAME_OR_DIR ...] [--new 128]

By default it evaluates the heads shipped for the model. Writes bench_results/heads_tau.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from treespec import heads as heads_module
from treespec.api import generate
from treespec.heads.training.prompts import DEV_PROMPTS
from treespec.heads.training.train import TrainConfig, proposer_for
from treespec.models import DEFAULT_MODEL, DTYPES, load
from treespec.prompts import encode_prompts


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--kinds", default="eagle,medusa,draft")
    parser.add_argument(
        "--heads", nargs="*", default=None, help="one folder or name per kind (default: shipped)"
    )
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32")
    parser.add_argument("--out", type=Path, default=Path("bench_results/heads_tau.json"))
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    dtype = DTYPES[args.dtype]
    model, tokenizer = load(args.model, dtype=dtype)
    shipped = heads_module.shipped_for(args.model)
    names = args.heads or [shipped[k] for k in kinds]
    prompts = encode_prompts(tokenizer, DEV_PROMPTS)
    results = {}
    for kind, name in zip(kinds, names, strict=True):
        module = heads_module.load(name, dtype=dtype, target_model=model)
        lengths, start, new = [], time.perf_counter(), 0
        for prompt in prompts:
            proposer = proposer_for(TrainConfig(kind=kind), module, model)
            out = generate(model, [prompt], max_new_tokens=args.new, proposer=proposer)
            lengths += out.stats.accepted_lengths[0]
            new += len(out.sequences[0])
        results[kind] = {"head": str(name), "tau": sum(lengths) / len(lengths), "steps": len(lengths),
                         "new_tokens": new, "wall_s": time.perf_counter() - start}  # fmt: skip
        print(kind, json.dumps(results[kind]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "new_tokens": args.new,
                                    "prompts": "treespec.heads.training.prompts.DEV_PROMPTS", "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
