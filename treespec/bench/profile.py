"""Where one target step's time goes: ``torch.profiler`` over ``Target.forward`` at batch 1 on a
cached context, for each linear backend and each number of new tokens, grouped into kinds of work.

    treespec bench profile [--sizes 1,16] [--linear-backends auto,fp32-kmajor]
                                   [--out bench_results/profile_step.json]

Each (backend, size) runs ``--warmup`` untimed forwards, then ``--repeats`` forwards under the
profiler; times are per forward. Operators are grouped by their name (self CPU time, so nothing
is counted twice): ``linear`` (treespec's kernels and PyTorch's matrix products), ``attention``,
``norm / rotary / activation / elementwise`` (the small eager operations around them) and
``other``. The rest of the wall time (``python``) is what no operator accounts for: Python, the
dispatcher and module calls. The JSON holds the groups and the 25 heaviest operators.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from treespec import models
from treespec.kernels import cpu_kernels
from treespec.models import DEFAULT_MODEL
from treespec.target import Target

GROUPS = (
    ("linear", ("treespec_linear", "linear_bf16", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul",
                "aten::bmm", "mkl", "onednn")),
    ("attention", ("tree_attention", "attention", "aten::_scaled_dot_product", "aten::softmax", "aten::_softmax")),
    ("norm", ("rms", "aten::rsqrt", "aten::pow", "aten::mean", "aten::norm")),
    ("rotary", ("rotary", "aten::cos", "aten::sin", "aten::neg", "aten::cat")),
    ("activation", ("aten::silu", "aten::gelu", "aten::sigmoid")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::copy_", "aten::to",
                     "aten::_to_copy", "aten::contiguous", "aten::clone", "aten::fill_", "aten::zero_")),
)  # fmt: skip


def label_kernels() -> None:
    """treespec's CPU kernels are ctypes calls, invisible to the profiler: wrap each in a
    ``record_function`` so its time is its own (``treespec::...``), not Python's."""
    for name, label in (("linear_many_unchecked", "treespec_linear"), ("linear_unchecked", "treespec_linear"),
                        ("tree_attention_bf16", "treespec::tree_attention")):  # fmt: skip
        inner = getattr(cpu_kernels, name)

        def wrapped(*args, _inner=inner, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _inner(*args, **kwargs)

        setattr(cpu_kernels, name, wrapped)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def profile_forward(target: Target, size: int, context: int, repeats: int, warmup: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    cache = target.new_cache(1, context + size)
    slots = [cache.allocate()]  # host lists, as the engine's step passes them
    prompt = torch.randint(0, target.vocab_size, (context,), generator=generator)
    target.forward(prompt, cache, [0, context], slots, return_hidden=False)
    cache.lengths[slots[0]] = context
    tokens = torch.randint(0, target.vocab_size, (size,), generator=generator)
    cu_q = [0, size]

    def run() -> None:
        target.forward(tokens, cache, cu_q, slots, return_hidden=False)

    for _ in range(warmup):
        run()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            walls.append(time.perf_counter() - start)
    ops = defaultdict(float)
    calls = defaultdict(int)
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep") or event.self_cpu_time_total <= 0:
            continue
        ops[event.key] += event.self_cpu_time_total / 1e3 / repeats  # ms per forward
        calls[event.key] += event.count // repeats
    groups = defaultdict(float)
    for name, ms in ops.items():
        groups[group_of(name)] += ms
    # The profiler's own bookkeeping inflates the wall time a little; report both.
    wall = 1e3 * sorted(walls)[len(walls) // 2]
    groups["python"] = max(wall - sum(groups.values()), 0.0)
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_ms": wall, "ops_per_forward": sum(calls.values()), "groups_ms": dict(groups),
            "top_ops": [{"op": k, "ms": v, "calls": calls[k]} for k, v in top]}  # fmt: skip


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", default="1,16", help="new tokens, comma list (default: %(default)s)")
    parser.add_argument("--linear-backends", default="auto,fp32-kmajor",
                        help="comma list; with fp32-kmajor and native the attention backend is the "
                        "reference one, as before the CPU kernels (default: %(default)s)")  # fmt: skip
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_results/profile_step.json"))
    args = parser.parse_args(argv)
    label_kernels()
    model, _ = models.load(args.model, dtype=torch.bfloat16)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    for backend in args.linear_backends.split(","):
        attention = "auto" if backend in ("auto", "bf16-kernel") else "reference"
        target = Target(model, linear_backend=backend, attention_backend=attention)
        for size in sizes:
            with torch.inference_mode():
                row = profile_forward(target, size, args.context, args.repeats, args.warmup)
            row.update(linear_backend=backend, attention_backend=attention, new_tokens=size)
            results.append(row)
            groups = "  ".join(
                f"{k} {v:.1f}" for k, v in sorted(row["groups_ms"].items(), key=lambda kv: -kv[1])
            )
            print(f"{backend:>12} + {attention:<9} {size:>3} tokens: {row['wall_ms']:6.1f} ms, "
                  f"{row['ops_per_forward']} ops | {groups}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context": args.context, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
