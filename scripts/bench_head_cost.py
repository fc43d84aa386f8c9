"""What drafting with an EAGLE head costs per step on the default model, beside the target's
forward over the tree it drafted and a single-token step.

    python scripts/bench_head_cost.py [--dtype bf16] [--new 24] [--out FILE.json]

Random heads (nothing trained ships yet), so every tree is full size: the cost measured is the
worst case for each budget. Each head variant runs through ``treespec.generate`` at batch 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import treespec
from treespec.heads import EagleConfig, EagleHead
from treespec.models import load
from treespec.prompts import DEFAULT_PROMPTS, encode_prompts
from treespec.proposers import EagleProposer

VARIANTS = {
    "eagle1": dict(),
    "eagle3-vocab8192": dict(eagle3=True, draft_vocab_size=8192),
    "eagle3-full-vocab": dict(eagle3=True),
}
BUDGETS = [(8, 5, 31), (4, 4, 15)]  # (top_k, depth, total_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("bench_results/head_cost.json"))
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    model, tokenizer = load("smollm2-135m-instruct", dtype=dtype)
    prompt = encode_prompts(tokenizer, DEFAULT_PROMPTS[:1])
    rows = []
    for name, options in VARIANTS.items():
        head = EagleHead(EagleConfig.from_target(model.config, **options)).to(dtype)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.02)
        for top_k, depth, total in BUDGETS:
            proposer = EagleProposer(head, model, top_k=top_k, depth=depth, total_tokens=total)
            stats = treespec.generate(model, prompt, max_new_tokens=args.new, proposer=proposer).stats
            row = dict(head=name, top_k=top_k, depth=depth, total_tokens=total,
                       propose_ms=1e3 * stats.propose_s / stats.steps,
                       forward_ms=1e3 * stats.forward_s / stats.steps)  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    stats = treespec.generate(model, prompt, max_new_tokens=args.new).stats
    single = 1e3 * stats.forward_s / stats.steps
    print(f"single-token step: {single:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"dtype": args.dtype, "rows": rows, "single_token_forward_ms": single}, indent=2)
    )


if __name__ == "__main__":
    main()
