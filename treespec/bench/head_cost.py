"""What drafting with an EAGLE head costs per step on the default model, beside the target's
forward over the tree it drafted and a single-token step: EAGLE-1 with a full and with the
reduced 8,192-token read-out it is trained with, EAGLE-3 with its own 8,192-token one, at the
31 and 8 drafted nodes the heads are measured at (treespec bench --budget fixed / 8).

    treespec bench head-cost [--model NAME] [--dtype bf16] [--new 24] [--repeats 3] [--out FILE.json]

Random heads, so every tree is full size: the cost measured is the worst case for each budget,
and it does not depend on what a head learned. Each head variant runs through
``treespec.generate`` at batch 1; the median over ``--repeats`` runs is reported. Time it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from treespec.api import generate
from treespec.heads import EagleConfig, EagleHead
from treespec.models import DEFAULT_MODEL, DTYPES, load
from treespec.prompts import DEFAULT_PROMPTS, encode_prompts
from treespec.proposers import EagleProposer

VARIANTS = {
    "eagle1-full-vocab": dict(),
    "eagle1-vocab8192": dict(draft_vocab_size=8192),
    "eagle3-vocab8192": dict(eagle3=True, draft_vocab_size=8192),
}
BUDGETS = [(8, 6, 31), (8, 6, 8)]  # (top_k, depth, total_tokens), as treespec bench drafts


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registered name or local HF folder")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/head_cost.json"))
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    model, tokenizer = load(args.model, dtype=dtype)
    vocab = model.config.vocab_size
    prompt = encode_prompts(tokenizer, DEFAULT_PROMPTS[:1])
    rows = []
    for name, options in VARIANTS.items():
        if options.get("draft_vocab_size", 0) > vocab:
            options = options | {"draft_vocab_size": vocab // 2}  # a small model's reduced read-out
        head = EagleHead(EagleConfig.from_target(model.config, **options)).to(dtype)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.02)
        for top_k, depth, total in BUDGETS:
            proposer = EagleProposer(head, model, top_k=top_k, depth=depth, total_tokens=total)
            runs = [generate(model, prompt, max_new_tokens=args.new, proposer=proposer).stats
                    for _ in range(args.repeats)]  # fmt: skip
            row = dict(head=name, top_k=top_k, depth=depth, total_tokens=total,
                       propose_ms=statistics.median(1e3 * s.propose_s / s.steps for s in runs),
                       forward_ms=statistics.median(1e3 * s.forward_s / s.steps for s in runs))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    stats = generate(model, prompt, max_new_tokens=args.new).stats
    single = 1e3 * stats.forward_s / stats.steps
    print(f"single-token step: {single:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"dtype": args.dtype, "rows": rows, "single_token_forward_ms": single}, indent=2)
    )


if __name__ == "__main__":
    main()
