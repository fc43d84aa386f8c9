"""treespec's CPU kernels against the machine's limits, and where a fused step's time goes.

    treespec bench cpu-kernels [--rows 1,2,4,8,16,32,64,128] [--model smollm2-135m-instruct]
                                        [--sizes 1,8,16,32] [--out bench_results/cpu_kernels.json]

Prints, on each instruction road this CPU has (``avx2``, ``avx512bf16``):

* the machine's measured read bandwidth (``torch.sum`` over 512 MB) and each road's arithmetic
  peak (independent FMA / bf16-dot chains from registers, all threads);
* the linear kernel on one layer stack's worth of weights (all 30 gate matrices of SmolLM2-135M,
  53 MB) at each row count: ms, GB/s of weight read, GFLOP/s, and both as a share of the peaks;
* the fused decoder step on the real model at each number of new tokens, on a 300-token cached
  context, split into its phases (a build of the kernel with ``-DTREESPEC_PHASE_TIMES``, which
  times thread 0 from barrier to barrier), with the LM head and the Python around the C call,
  each phase beside its floor (``phase_floors``: its bytes at the measured bandwidth or its FLOPs
  at the road's measured peak, whichever is larger) and the step beside the floors' sum.

Run it alone on the machine: two CPU-heavy processes at once make every number meaningless.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

from treespec import models
from treespec.bench.timing import median_seconds
from treespec.kernels import cpu_kernels
from treespec.models import DEFAULT_MODEL
from treespec.target import Target


def bench_linear(rows: list[int], bandwidth: float, peak: float, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    weight = torch.randn(30 * 1536, 576).bfloat16()
    out = []
    for m in rows:
        x = torch.randn(m, 576).bfloat16()
        seconds = median_seconds(lambda x=x: cpu_kernels.linear_unchecked(x, weight, None), repeats, warmup=2)
        gbs, flops = weight.numel() * 2 / seconds, 2 * m * weight.numel() / seconds
        out.append({"rows": m, "ms": 1e3 * seconds, "GB/s": gbs / 1e9, "GFLOP/s": flops / 1e9,
                    "of_bandwidth": gbs / bandwidth, "of_peak": flops / peak})  # fmt: skip
    return out


def _fused_size(
    target: Target, cache, n: int, phases, names: list[str], timings: dict[str, list[float]], repeats: int
) -> dict:
    """One fused step of ``n`` new tokens: its time, the decoder's and LM head's calls, and the
    C stack's phases (the profiling build's counters, ``names`` as the library gives them)."""
    tokens = torch.randint(0, target.vocab_size, (n,))
    step = lambda: target.forward(tokens, cache, [0, n], [0], return_hidden=False)  # noqa: E731
    for _ in range(2):
        step()
    timings.clear()
    for i in range(16):
        phases[i] = 0.0
    total = median_seconds(step, repeats, warmup=0)
    per_phase = {f"{i:02d} {name}": 1e3 * phases[i] / repeats for i, name in enumerate(names)}
    decoder, head = statistics.median(timings["decoder"]), statistics.median(timings["lm_head"])
    return {"new_tokens": n, "step_ms": 1e3 * total, "decoder_ms": 1e3 * decoder, "lm_head_ms": 1e3 * head,
            "python_ms": 1e3 * (total - decoder - head), "phases_ms": per_phase}  # fmt: skip


def phase_floors(config, new: int, context: int, bandwidth: float, peak: float) -> dict[str, float]:
    """Each phase's floor in ms for a step of ``new`` tokens on ``context`` cached ones: the larger
    of its bytes at the measured read bandwidth and its FLOPs at the road's measured peak. The
    linear phases read their bf16 weights once (2 FLOPs per weight and row); the attention reads
    every layer's K and V (bf16) and does 4 FLOPs per query head, key and dim; the LM head is
    read out over every row. Keys: the phase names the library gives (after their number), and
    ``lm_head``."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    weights = {
        "qkv": layers * hidden * (heads + 2 * kv_heads) * head_dim,
        "o_proj": layers * heads * head_dim * hidden,
        "gate/up": layers * 2 * hidden * inter,
        "down": layers * inter * hidden,
        "lm_head": config.vocab_size * hidden,
    }
    floors = {
        name: 1e3 * max(2 * count / bandwidth, 2 * new * count / peak) for name, count in weights.items()
    }
    keys = context + new
    kv_bytes = layers * 2 * kv_heads * keys * head_dim * 2
    floors["attention"] = 1e3 * max(kv_bytes / bandwidth, layers * 4 * new * heads * keys * head_dim / peak)
    return floors


def bench_fused(
    model_name: str, sizes: list[int], context: int, repeats: int, bandwidth: float, peak: float
) -> list[dict] | str:
    lib, reason = cpu_kernels.load_library(("-DTREESPEC_PHASE_TIMES",), name="treespec_cpu_kernels_phases")
    if lib is None:
        return f"no profiling build: {reason}"
    lib.treespec_set_isa(cpu_kernels.ISAS[cpu_kernels.isa()])
    names = cpu_kernels.phase_names(lib)
    phases = (ctypes.c_double * 16).in_dll(lib, "treespec_phase_seconds")
    model, _ = models.load(model_name, dtype=torch.bfloat16)
    target = Target(model)
    if target.path != "fused":
        return f"the model runs through its modules: {target.path_reason}"
    cache = target.new_cache(1, context + max(sizes) + 8)
    prompt = torch.randint(0, target.vocab_size, (context,))
    target.forward(prompt, cache, [0, context], [0], return_hidden=False)
    cache.commit([0], [list(range(context))])
    loaded = cpu_kernels._load
    timings: dict[str, list[float]] = {}

    def timed(name, fn):
        def run(*args):
            start = time.perf_counter()
            result = fn(*args)
            timings.setdefault(name, []).append(time.perf_counter() - start)
            return result

        return run

    out = []
    original_decoder, original_linear = cpu_kernels.decoder_bf16, cpu_kernels.linear_unchecked
    try:
        cpu_kernels._load = lambda: (lib, "")  # the profiling build serves every kernel call
        cpu_kernels.decoder_bf16 = timed("decoder", original_decoder)
        cpu_kernels.linear_unchecked = timed("lm_head", original_linear)
        for n in sizes:
            out.append(_fused_size(target, cache, n, phases, names, timings, repeats))
            out[-1]["floors_ms"] = phase_floors(model.config, n, context, bandwidth, peak)
    finally:
        cpu_kernels._load = loaded
        cpu_kernels.decoder_bf16, cpu_kernels.linear_unchecked = original_decoder, original_linear
    return out


def bench_roads(rows: list[int], bandwidth: float, repeats: int) -> dict:
    """The linear kernel on every road this machine has, against its bandwidth and its peak;
    the road chosen at load is restored after."""
    chosen, roads = cpu_kernels.isa(), {}
    try:
        for road in cpu_kernels.roads():
            cpu_kernels.set_isa(road)
            peak = cpu_kernels.peak_flops(road)
            print(f"\n{road}: arithmetic peak {peak / 1e9:.0f} GFLOP/s")
            print(f"{'rows':>5} {'ms':>7} {'GB/s':>6} {'GFLOP/s':>8} {'of BW':>6} {'of peak':>7}")
            linear = bench_linear(rows, bandwidth, peak, repeats)
            for r in linear:
                print(f"{r['rows']:>5} {r['ms']:>7.2f} {r['GB/s']:>6.1f} {r['GFLOP/s']:>8.1f} "
                      f"{r['of_bandwidth']:>6.0%} {r['of_peak']:>7.0%}")  # fmt: skip
            roads[road] = {"peak_GFLOP/s": peak / 1e9, "linear": linear}
    finally:
        cpu_kernels.set_isa(chosen)
    return roads


def print_fused(fused: list[dict] | str) -> None:
    """The phases' ms per step size, each beside its floor (``phase_floors``) where it has one,
    and the whole step beside the sum of the floors."""
    if isinstance(fused, str):
        print(fused)
        return
    names = list(fused[0]["phases_ms"])
    print(
        "ms per step, and each phase's floor (its bytes at the read bandwidth or its FLOPs at the road's peak)"
    )
    print(f"{'phase':<16}" + "".join(f"{r['new_tokens']:>8} {'floor':>6}" for r in fused))

    def row(label: str, values: list[float], floors: list[float | None]) -> None:
        cells = [
            f"{v:>8.2f} {'' if f is None else f'{f:.2f}':>6}" for v, f in zip(values, floors, strict=True)
        ]
        print(f"{label:<16}" + "".join(cells))

    for name in names:
        floors = [r["floors_ms"].get(name.split(" ", 1)[1]) for r in fused]
        row(name, [r["phases_ms"][name] for r in fused], floors)
    for key in ("decoder_ms", "lm_head_ms", "python_ms"):
        row(
            key,
            [r[key] for r in fused],
            [r["floors_ms"]["lm_head"] if key == "lm_head_ms" else None for r in fused],
        )
    row("step_ms", [r["step_ms"] for r in fused], [sum(r["floors_ms"].values()) for r in fused])
    base = fused[0]["step_ms"]
    print(f"{'vs one token':<16}" + "".join(f"{r['step_ms'] / base:>8.2f} {'':>6}" for r in fused))


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", default="1,8,16,32", help="new tokens of the fused step ('' to skip)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("bench_results/cpu_kernels.json"))
    args = parser.parse_args(argv)
    if not cpu_kernels.available():
        raise SystemExit(f"treespec's CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}")
    rows = [int(r) for r in args.rows.split(",")]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    bandwidth = cpu_kernels.read_bandwidth()
    report = {"threads": torch.get_num_threads(), "read_GB/s": bandwidth / 1e9, "roads": {}}
    print(f"threads {torch.get_num_threads()}, measured read bandwidth {bandwidth / 1e9:.1f} GB/s")
    chosen = cpu_kernels.isa()
    report["roads"] = bench_roads(rows, bandwidth, args.repeats)
    if sizes:
        peak = 1e9 * report["roads"][chosen]["peak_GFLOP/s"]
        fused = bench_fused(args.model, sizes, args.context, args.repeats, bandwidth, peak)
        report["fused_step"] = fused
        print(f"\nfused step of {args.model} on the {chosen} road, {args.context} cached tokens:")
        print_fused(fused)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
