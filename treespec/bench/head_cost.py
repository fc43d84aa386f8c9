"""What drafting with an EAGLE head costs per step on the default model, beside the target's
forward over the tree it drafted and a single-token step: EAGLE-1 with a full and with the
reduced 8,192-token read-out it is trained with, EAGLE-3 with its own 8,192-token one (on its
default path and through its modules), at the 31 and 8 drafted nodes the heads are measured at
(treespec bench --budget fixed / 8). Each row names the path the head drafted on.

    treespec bench head-cost [--model NAME] [--dtype bf16] [--new 24] [--repeats 3] [--out FILE.json]

Random heads, so every tree is full size: the cost measured is the worst case for each budget,
and it does not depend on what a head learned. Each head variant runs through
``treespec.generate`` at batch 1; the median over ``--repeats`` runs is reported. Time it alone.

Then, on every instruction road the CPU has, each phase of one EAGLE-1 pass (fc, q/k/v, o,
gate/up, down, the 8,192-column read-out) at ``--phase-rows`` rows (a level runs top_k rows:
4 for an 8-node tree, 8 for 31) against its floor: the larger of its weight bytes at the read
bandwidth measured over a buffer the size of one pass's weights (they stay in the last-level
cache from level to level) and its FLOPs at the road's measured peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from treespec.api import generate
from treespec.bench.timing import median_seconds
from treespec.heads import EagleConfig, EagleHead
from treespec.kernels import cpu_kernels
from treespec.models import DEFAULT_MODEL, DTYPES, load
from treespec.prompts import DEFAULT_PROMPTS, encode_prompts
from treespec.proposers import EagleProposer

# name -> (the head's config options, the proposer's options): each head on its default path (one
# C call per tree where the CPU kernels serve it), and EAGLE-3 through its modules beside it
VARIANTS = {
    "eagle1-full-vocab": (dict(), dict()),
    "eagle1-vocab8192": (dict(draft_vocab_size=8192), dict()),
    "eagle3-vocab8192": (dict(eagle3=True, draft_vocab_size=8192), dict()),
    "eagle3-vocab8192-modules": (dict(eagle3=True, draft_vocab_size=8192), dict(fused=False)),
}
BUDGETS = [(8, 6, 31), (8, 6, 8)]  # (top_k, depth, total_tokens), as treespec bench drafts


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registered name or local HF folder")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/head_cost.json"))
    parser.add_argument(
        "--phase-rows", default="1,4,8", help="rows per pass for the phase table (comma list)"
    )
    parser.add_argument("--phases-only", action="store_true", help="skip the drafting runs")
    args = parser.parse_args(argv)
    phase_rows = [int(r) for r in args.phase_rows.split(",")]
    if any(r < 1 for r in phase_rows):
        raise SystemExit(f"--phase-rows must be positive row counts, got {args.phase_rows!r}")
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    model, tokenizer = load(args.model, dtype=dtype)
    vocab = model.config.vocab_size
    prompt = encode_prompts(tokenizer, DEFAULT_PROMPTS[:1])
    rows = []
    for name, (options, proposer_options) in VARIANTS.items() if not args.phases_only else ():
        if options.get("draft_vocab_size", 0) > vocab:
            options = options | {"draft_vocab_size": vocab // 2}  # a small model's reduced read-out
        head = EagleHead(EagleConfig.from_target(model.config, **options)).to(dtype)
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.02)
        for top_k, depth, total in BUDGETS:
            proposer = EagleProposer(head, model, top_k=top_k, depth=depth, total_tokens=total,
                                     **proposer_options)  # fmt: skip
            runs = [generate(model, prompt, max_new_tokens=args.new, proposer=proposer).stats
                    for _ in range(args.repeats)]  # fmt: skip
            row = dict(head=name, path=proposer.path, top_k=top_k, depth=depth, total_tokens=total,
                       propose_ms=statistics.median(1e3 * s.propose_s / s.steps for s in runs),
                       forward_ms=statistics.median(1e3 * s.forward_s / s.steps for s in runs))  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    stats = generate(model, prompt, max_new_tokens=args.new).stats
    single = 1e3 * stats.forward_s / stats.steps
    print(f"single-token step: {single:.1f} ms")
    phases = phase_table(EagleConfig.from_target(model.config), min(8192, vocab), phase_rows, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dtype": args.dtype, "rows": rows, "single_token_forward_ms": single,
                                    "phases": phases}, indent=2))  # fmt: skip


def phase_shapes(config: EagleConfig, readout_rows: int) -> dict[str, tuple[int, int]]:
    """(outputs, inputs) of each matrix of one EAGLE-1 pass."""
    hidden, heads, kv, dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    return {"fc": (hidden, 2 * hidden), "qkv": ((heads + 2 * kv) * dim, hidden), "o": (hidden, heads * dim),
            "gate+up": (2 * config.intermediate_size, hidden), "down": (hidden, config.intermediate_size),
            "read-out": (readout_rows, hidden)}  # fmt: skip


def phase_table(config: EagleConfig, readout_rows: int, row_counts: list[int], repeats: int) -> list[dict]:
    """Each phase's ms at each row count on every road, beside its floor; printed and returned."""
    if not cpu_kernels.available():
        print(f"phases: treespec's CPU kernels are unavailable ({cpu_kernels.unavailable_reason()})")
        return []
    # the pass's weights fit in a last-level cache and nothing runs between levels: the floor reads
    # them at the bandwidth of a buffer of their size, not of one far larger than the caches
    pass_bytes = sum(2 * n * k for n, k in phase_shapes(config, readout_rows).values())
    bandwidth, out = cpu_kernels.read_bandwidth(megabytes=max(1, round(pass_bytes / 2**20)), repeats=21), []
    previous = cpu_kernels.isa()
    try:
        for road in cpu_kernels.roads():
            cpu_kernels.set_isa(road)
            peak = cpu_kernels.peak_flops(road)
            print(f"road {road}: peak {peak / 1e9:.0f} GFLOP/s, read bandwidth {bandwidth / 1e9:.1f} GB/s over "
                  f"{pass_bytes / 1e6:.1f} MB (one pass's weights)")  # fmt: skip
            for rows in row_counts:
                out += [_phase(name, shape, rows, road, peak, bandwidth, repeats)
                        for name, shape in phase_shapes(config, readout_rows).items()]  # fmt: skip
                level = [r for r in out if r["road"] == road and r["rows"] == rows]
                ms, floor = sum(r["ms"] for r in level), sum(r["floor_ms"] for r in level)
                print(f"  {rows:3d} rows  one pass {ms:6.3f} ms, floor {floor:6.3f} ms ({floor / ms:.0%}): "
                      + ", ".join(f"{r['phase']} {r['ms']:.3f}/{r['floor_ms']:.3f}" for r in level))  # fmt: skip
    finally:
        cpu_kernels.set_isa(previous)
    return out


def _phase(name: str, shape: tuple[int, int], rows: int, road: str, peak: float, bandwidth: float,
           repeats: int) -> dict:  # fmt: skip
    outputs, inputs = shape
    weight = (torch.randn(outputs, inputs) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, inputs).to(torch.bfloat16)
    seconds = median_seconds(
        lambda: cpu_kernels.linear_unchecked(x, weight, None, fp32_out=True), max(repeats, 5) * 4
    )
    flops, weight_bytes = 2 * rows * outputs * inputs, 2 * outputs * inputs
    floor = max(weight_bytes / bandwidth, flops / peak)
    return {"road": road, "rows": rows, "phase": name, "ms": 1e3 * seconds, "floor_ms": 1e3 * floor,
            "gflops": flops / seconds / 1e9, "weight_mb": weight_bytes / 1e6}  # fmt: skip


if __name__ == "__main__":
    main()
