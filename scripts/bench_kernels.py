"""GPU benchmark of the tree-attention kernel against PyTorch SDPA (dense mask) and flash-attn.

    python scripts/bench_kernels.py [--out bench_results/kernels.json] [--quick]
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --smoke   # tiny shapes on a CPU: checks the script

For each case it first re-checks the kernel against the PyTorch reference on the device, then
times (median of triton.testing.do_bench, or of wall-clock repeats under --smoke):
    treespec     the Triton kernel (split-KV chosen by its schedule)
    sdpa_mask    torch SDPA over the padded batch with a dense float mask (K/V pre-gathered)
    flash_varlen flash-attn's varlen kernel, causal prefill chunks only, when installed
and reports time, achieved GB/s (K/V and Q/out bytes that must move), TFLOP/s (visible
query-key pairs only), the fraction of the device's measured copy bandwidth, and ratios.
Shapes: decode trees (prefix 1K-32K, 16-128 nodes, batch 1-64) and prefill chunks; 32 query
heads over 8 KV heads, head dim 128, bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from treespec.kernels import tree_attention as ta
from treespec.tree import pack_ancestor_mask


@dataclass(frozen=True)
class Case:
    kind: str  # "tree" or "prefill"
    batch: int
    prefix: int
    nodes: int  # tree nodes, or chunk length for prefill


def cases(quick: bool, smoke: bool) -> list[Case]:
    if smoke:
        return [Case("tree", 2, 40, 9), Case("prefill", 1, 24, 16)]
    batches, prefixes, nodes = (
        ((1, 64), (1024, 32768), (16, 128)) if quick else ((1, 8, 64), (1024, 8192, 32768), (16, 64, 128))
    )
    tree = [Case("tree", b, p, n) for b in batches for p in prefixes for n in nodes]
    prefill = [Case("prefill", b, p, c) for b in (1, 4) for p in (0, 4096) for c in (512, 2048)]
    return tree + prefill


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def make_inputs(
    case: Case, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str, gen: torch.Generator
):
    """Cache rows in reverse slot order (not contiguous), trees or causal chunks, positions."""
    total_len = case.prefix + case.nodes
    k_cache = torch.randn(case.batch, kv_heads, total_len, dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(case.batch, kv_heads, total_len, dim, generator=gen).to(dtype).to(device)
    q = torch.randn(case.batch * case.nodes, heads, dim, generator=gen).to(dtype).to(device)
    cu_q = (torch.arange(case.batch + 1) * case.nodes).int().to(device)
    slots = torch.arange(case.batch - 1, -1, -1).int().to(device)
    prefix_lens = torch.full((case.batch,), case.prefix, dtype=torch.int32, device=device)
    if case.kind == "tree":
        parents = [random_parents(case.nodes, gen) for _ in range(case.batch)]
        tree_mask = torch.cat([pack_ancestor_mask(p) for p in parents]).to(device)
        depth = []
        for par in parents:
            d: list[int] = []
            for p in par:
                d.append(0 if p < 0 else d[p] + 1)
            depth += d
        depth_t = torch.tensor(depth)
    else:
        tree_mask = None
        depth_t = torch.arange(case.nodes).repeat(case.batch)
    q_positions = (depth_t + case.prefix).int().to(device)
    inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_q=cu_q, slots=slots, prefix_lens=prefix_lens,
                  tree_mask=tree_mask, q_positions=q_positions)  # fmt: skip
    visible_pairs = int((depth_t + 1).sum()) + case.batch * case.nodes * case.prefix  # per head
    return inputs, visible_pairs


def sdpa_dense(inputs: dict, sm_scale: float):
    """The baseline: padded batch, K/V gathered once (not timed), a dense float mask."""
    plan = ta.build_plan(inputs["cu_q"], inputs["slots"], inputs["prefix_lens"], inputs["tree_mask"])
    batch, n_max, l_max = plan.visible.shape
    q = inputs["q"].view(batch, n_max, *inputs["q"].shape[1:]).transpose(1, 2)
    k = inputs["k_cache"][inputs["slots"].long(), :, :l_max].contiguous()
    v = inputs["v_cache"][inputs["slots"].long(), :, :l_max].contiguous()
    mask = torch.zeros(plan.visible.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~plan.visible, float("-inf")
    )
    mask = mask[:, None]

    def run():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True
        )

    return run


def flash_varlen(inputs: dict, case: Case, sm_scale: float):
    """flash-attn's varlen kernel for causal prefill chunks (bottom-right aligned), if installed."""
    if case.kind != "prefill" or not inputs["q"].is_cuda:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    total = case.prefix + case.nodes
    k = (
        inputs["k_cache"][inputs["slots"].long()]
        .transpose(1, 2)
        .reshape(-1, *inputs["k_cache"].shape[1:2], inputs["k_cache"].shape[3])
    )
    v = (
        inputs["v_cache"][inputs["slots"].long()]
        .transpose(1, 2)
        .reshape(-1, *inputs["v_cache"].shape[1:2], inputs["v_cache"].shape[3])
    )
    cu_k = (torch.arange(case.batch + 1, device=k.device) * total).int()

    def run():
        return flash_attn_varlen_func(
            inputs["q"], k, v, inputs["cu_q"], cu_k, case.nodes, total, softmax_scale=sm_scale, causal=True
        )

    return run


def time_ms(fn, smoke: bool) -> float:
    if smoke:  # CPU interpreter: wall clock, a couple of runs
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(device: str, smoke: bool) -> float:
    """Bytes/s of a large device copy (read + write): the roofline the kernel is held to."""
    size = (1 << 20) if smoke else (1 << 30)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), smoke)
    return 2 * size / (ms / 1000)


def bench_case(case: Case, args, device: str, gen: torch.Generator, bandwidth: float) -> dict:
    heads, kv_heads, dim = args.heads, args.kv_heads, args.dim
    dtype = torch.float32 if args.smoke else torch.bfloat16
    inputs, visible_pairs = make_inputs(case, heads, kv_heads, dim, dtype, device, gen)
    sm_scale = dim**-0.5
    schedule = ta.schedule_blocks(inputs["cu_q"], inputs["prefix_lens"], heads // kv_heads)
    kernel = lambda: ta.tree_attention_triton(**inputs, sm_scale=sm_scale, schedule=schedule)  # noqa: E731
    out = kernel()
    ref = ta.tree_attention_ref(**inputs, sm_scale=sm_scale)
    error = float((out.float() - ref.float()).abs().max())
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        raise AssertionError(f"{case}: kernel differs from the reference by {error} (> {tolerance})")
    element = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * case.batch * kv_heads * (case.prefix + case.nodes) * dim * element
    qo_bytes = 2 * case.batch * case.nodes * heads * dim * element
    flops = 4 * visible_pairs * heads * dim
    result = {**case.__dict__, "max_abs_error": error, "splits": schedule.num_splits}
    timings = {"treespec": time_ms(kernel, args.smoke)}
    timings["sdpa_mask"] = time_ms(sdpa_dense(inputs, sm_scale), args.smoke)
    flash = flash_varlen(inputs, case, sm_scale)
    if flash is not None:
        timings["flash_varlen"] = time_ms(flash, args.smoke)
    ms = timings["treespec"]
    result.update(
        ms=timings,
        gb_per_s=(kv_bytes + qo_bytes) / (ms / 1000) / 1e9,
        tflop_per_s=flops / (ms / 1000) / 1e12,
        bandwidth_fraction=(kv_bytes + qo_bytes) / (ms / 1000) / bandwidth,
        speedup={name: t / ms for name, t in timings.items() if name != "treespec"},
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench_results/kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer decode shapes")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, CPU + TRITON_INTERPRET=1: checks the script"
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    if args.smoke:
        args.heads, args.kv_heads, args.dim = 4, 2, 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.smoke and ta.interpreting()):
        raise SystemExit("bench_kernels.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth(device, args.smoke)
    rows = [bench_case(case, args, device, gen, bandwidth) for case in cases(args.quick, args.smoke)]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"{name}: measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(
        f"{'kind':>7} {'B':>3} {'prefix':>6} {'nodes':>5} {'splits':>6} {'ms':>8} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8}  vs sdpa  vs flash"
    )
    for r in rows:
        flash = f"{r['speedup']['flash_varlen']:.2f}x" if "flash_varlen" in r["speedup"] else "-"
        print(
            f"{r['kind']:>7} {r['batch']:>3} {r['prefix']:>6} {r['nodes']:>5} {r['splits']:>6} {r['ms']['treespec']:8.3f} "
            f"{r['gb_per_s']:7.0f} {100 * r['bandwidth_fraction']:4.0f}% {r['tflop_per_s']:8.1f}  "
            f"{r['speedup']['sdpa_mask']:.2f}x  {flash}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"device": name, "copy_bandwidth_gb_s": bandwidth / 1e9, "cases": rows}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
