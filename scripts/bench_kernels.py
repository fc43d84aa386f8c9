"""The tree-attention kernel on a GPU: correctness at real models' head layouts, then bandwidth.

    python scripts/bench_kernels.py --correctness [--jsonl FILE]      # real layouts vs float64
    python scripts/bench_kernels.py [--quick] [--out FILE.json] [--jsonl FILE]   # bandwidth
    TRITON_INTERPRET=1 python scripts/bench_kernels.py --smoke [--correctness]  # a CPU: checks the script

Both modes write one JSON line per case to ``--jsonl`` as it finishes (each line carries
``"stage": --stage``), so a run that is killed keeps what it measured; a case that misses its
tolerance, or raises, is recorded (``"ok": false``) and the others still run. The exit code is 1
when any case was not ok.

``--correctness``: the kernel against ``tree_attention_naive`` (the contract, in float64 on the
host, on the same rounded inputs) at the layouts of the models users run: 9/3 query/KV heads
(SmolLM2), 14/2 and 12/2 (Qwen2.5-0.5B and -1.5B), 32/8 (Llama 3), 4/1 (Gemma 3), 8/8. Two
launches: trees, a chain, a prefill chunk of more than 32 tokens (two mask words) and a single
token together under the ancestor bitmask, then causal chunks (no mask). Each layout at its own
head dim in fp32 runs both launches with split-KV off (one slice) and on (three); then each in
bf16, then at the other two of head dims 64, 128 and 256 in fp32, the tree launch split and the
causal one not (each combination is a compile); 9/3 at head dim 64 always in full: 62 cases.
--smoke: 9/3 in full, 32/8 and 4/1 once. On a GPU it takes one fixed block configuration
(``TREESPEC_TRITON_AUTOTUNE=0``: one compile per shape, not twelve) unless ``--tuned``.
Tolerances are the kernel tests': |out - ref| <= tol * (1 + |ref|), tol 2e-5 fp32, 2e-2 bf16.

Bandwidth (the default mode): each case first re-checks the kernel against the PyTorch reference
on the device, then times (median of triton.testing.do_bench, or of wall-clock repeats under
--smoke):
    treespec     the Triton kernel (split-KV chosen by its schedule; autotuned)
    sdpa_mask    torch SDPA over the padded batch with a dense float mask (K/V pre-gathered)
    flash_varlen flash-attn's varlen kernel, causal prefill chunks only, when installed
and reports time, achieved GB/s (K/V and Q/out bytes that must move), TFLOP/s (visible
query-key pairs only), the fraction of the device's measured copy bandwidth, and ratios.
Shapes: decode trees (prefix 1K-32K, 16-128 nodes, batch 1-64) and prefill chunks (not with
--quick); 32 query heads over 8 KV heads, head dim 128, bf16.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from treespec.kernels import tree_attention as ta

sys.path.insert(0, str(Path(__file__).parent))  # beside this script (gpu_check.sh runs python -P)
from gpu_stages import JsonLines  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
WORD = 32  # bits per tree-mask word (the attention contract)

# (query heads, KV heads, head dim, a model with that layout)
LAYOUTS = [
    (9, 3, 64, "SmolLM2-135M"),
    (14, 2, 64, "Qwen2.5-0.5B"),
    (12, 2, 128, "Qwen2.5-1.5B"),
    (32, 8, 128, "Llama-3-8B"),
    (4, 1, 256, "Gemma-3-1B"),
    (8, 8, 128, "MHA"),
]
HEAD_DIMS = (64, 128, 256)


def make_schedule(cu_q: torch.Tensor, prefix_lens: torch.Tensor, group: int, num_splits: int | None = None):
    """ta.schedule_blocks, from host lists (today's signature) or from the tensors (the older one)."""
    if "num_new" in inspect.signature(ta.schedule_blocks).parameters:
        cu = cu_q.tolist()
        num_new = [end - start for start, end in zip(cu, cu[1:], strict=False)]
        longest = max(prefix_lens.tolist(), default=0)
        return ta.schedule_blocks(num_new, longest, group, device=cu_q.device, num_splits=num_splits)
    return ta.schedule_blocks(cu_q, prefix_lens, group, num_splits=num_splits)


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_words(parents: list[int], num_words: int) -> list[list[int]]:
    """Each node's ancestor-and-self bits as int32 words (bit j of word w: node 32*w + j)."""
    rows = []
    for i in range(len(parents)):
        words, j = [0] * num_words, i
        while j >= 0:
            words[j // WORD] |= 1 << (j % WORD)
            j = parents[j]
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return rows


def depths(parents: list[int]) -> list[int]:
    d: list[int] = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


# --------------------------------------------------------------------------------------------
# Correctness at the real layouts
# --------------------------------------------------------------------------------------------


def ragged_inputs(requests, heads, kv_heads, dim, dtype, device, gen, with_mask: bool) -> dict:
    """requests: (prefix, parents) per request; cache rows in reverse slot order, one spare row."""
    num_words = max(math.ceil(len(p) / WORD) for _, p in requests)
    length = max(prefix + len(p) for prefix, p in requests) + 3
    slots_n = len(requests) + 1
    k_cache = torch.randn(slots_n, kv_heads, length, dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots_n, kv_heads, length, dim, generator=gen).to(dtype)
    total = sum(len(p) for _, p in requests)
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    cu, masks, positions = [0], [], []
    for prefix, parents in requests:
        cu.append(cu[-1] + len(parents))
        masks += ancestor_words(parents, num_words)
        positions += [prefix + d for d in depths(parents)]
    inputs = dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        cu_q=torch.tensor(cu, dtype=torch.int32),
        slots=torch.arange(len(requests), 0, -1, dtype=torch.int32),
        prefix_lens=torch.tensor([prefix for prefix, _ in requests], dtype=torch.int32),
        tree_mask=torch.tensor(masks, dtype=torch.int32) if with_mask else None,
        q_positions=torch.tensor(positions, dtype=torch.int32),
    )  # fmt: skip
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def launches(prefix: int, chunk: int, nodes: tuple[int, int, int], gen: torch.Generator) -> dict[str, list]:
    """The two launches of a layout: mixed (two trees, a chain, a prefill chunk and one token under
    the bitmask) and causal (chunks, no mask). ``chunk`` > 32: its rows need two mask words."""
    chain = lambda n: list(range(-1, n - 1))  # noqa: E731
    tree = [
        (prefix, random_parents(nodes[0], gen)),
        (prefix // 2 + 3, chain(nodes[1])),
        (0, chain(chunk)),  # a first prefill chunk, no prefix
        (prefix + 17, random_parents(nodes[2], gen)),
        (prefix - 5, [-1]),
    ]
    causal = [(0, chain(chunk)), (prefix, chain(chunk // 2 + 1)), (prefix + 3, [-1])]
    return {"tree": tree, "causal": causal}


def correctness_cases(smoke: bool) -> list[tuple[int, int, int, str, torch.dtype]]:
    """(heads, kv heads, head dim, model, dtype), in order of value: every layout at its own head
    dim in fp32, the same in bf16, then every layout at the other head dims (fp32)."""
    own = [(h, kv, d, m, torch.float32) for h, kv, d, m in LAYOUTS]
    if smoke:  # the interpreter is slow: the default model's layout, a wide group and D 256
        return [own[0], own[3], own[4]]
    bf16 = [(h, kv, d, m, torch.bfloat16) for h, kv, d, m in LAYOUTS]
    other = [(h, kv, dd, m, torch.float32) for h, kv, d, m in LAYOUTS for dd in HEAD_DIMS if dd != d]
    return own + bf16 + other


def own_dim(heads: int, kv_heads: int) -> int:
    return next(d for h, kv, d, _ in LAYOUTS if (h, kv) == (heads, kv_heads))


def run_correctness(args, device: str, out: JsonLines) -> int:
    gen = torch.Generator().manual_seed(0)
    prefix, chunk, nodes = (23, 33, (5, 3, 9)) if args.smoke else (700, 70, (13, 7, 21))
    config = "interpreter" if ta.interpreting() else (
        "autotuned" if os.environ.get("TREESPEC_TRITON_AUTOTUNE", "1") != "0" else "fixed (TREESPEC_TRITON_AUTOTUNE=0)"
    )  # fmt: skip
    print(f"correctness on {device_name(device)}, kernel configuration: {config}")
    print(
        f"{'layout':>14} {'D':>4} {'dtype':>5} {'launch':>6} {'splits':>6} {'rows':>5} {'max |err|':>10}  ok"
    )
    misses = 0
    for heads, kv_heads, dim, model, dtype in correctness_cases(args.smoke):
        first = (heads, kv_heads, dim) == LAYOUTS[0][:3]
        for launch, requests in launches(prefix, chunk, nodes, gen).items():
            if args.smoke and not first and launch != "tree":  # the interpreter is slow
                continue
            inputs = ragged_inputs(requests, heads, kv_heads, dim, dtype, device, gen, launch == "tree")
            for num_splits in (1, 3):
                # Every split-KV and launch combination at each layout's own head dim in fp32; the
                # rest (bf16, other head dims) takes the tree launch split and the causal one not:
                # each combination is a compile on a GPU. The dry run, one launch per other layout.
                full = first or (
                    dim == own_dim(heads, kv_heads) and dtype == torch.float32 and not args.smoke
                )
                if not full and num_splits != (3 if launch == "tree" else 1):
                    continue
                case = dict(case="correctness", model=model, heads=heads, kv_heads=kv_heads, dim=dim,
                            dtype=DTYPE_NAMES[dtype], launch=launch, num_splits=num_splits,
                            rows=int(inputs["q"].shape[0]), requests=len(requests), config=config)  # fmt: skip
                start = time.perf_counter()
                try:
                    case.update(check_against_naive(inputs, dtype, num_splits))
                except Exception as exc:  # recorded; the other cases still run
                    case.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
                    traceback.print_exc()
                case["seconds"] = round(time.perf_counter() - start, 3)
                out.write(**case)
                misses += not case["ok"]
                error = f"{case['max_abs_error']:10.2e}" if "max_abs_error" in case else f"{'-':>10}"
                print(f"{f'{heads}/{kv_heads} {model}':>14} {dim:>4} {case['dtype']:>5} {launch:>6} "
                      f"{num_splits:>6} {case['rows']:>5} {error}  {'ok' if case['ok'] else 'MISS ' + case.get('error', '')}",
                      flush=True)  # fmt: skip
    print(f"correctness: {misses} case(s) not ok")
    return 1 if misses else 0


def check_against_naive(inputs: dict, dtype: torch.dtype, num_splits: int) -> dict:
    heads, kv_heads = inputs["q"].shape[1], inputs["k_cache"].shape[1]
    sm_scale = inputs["q"].shape[2] ** -0.5
    schedule = make_schedule(inputs["cu_q"], inputs["prefix_lens"], heads // kv_heads, num_splits=num_splits)
    result = torch.full_like(inputs["q"], float("nan"))  # an element never written fails
    ta.tree_attention_triton(**inputs, sm_scale=sm_scale, schedule=schedule, out=result)
    host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    for name in ("q", "k_cache", "v_cache"):
        host[name] = host[name].double()
    expect = ta.tree_attention_naive(**host, sm_scale=sm_scale)
    diff = (result.cpu().double() - expect).abs()
    tol = TOLERANCE[dtype]
    excess = (diff - tol * (1 + expect.abs())).nan_to_num(float("inf"))
    return {"max_abs_error": float(diff.nan_to_num(float("inf")).max()), "tolerance": tol,
            "ok": bool(excess.max() <= 0), "splits_run": schedule.num_splits}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Bandwidth on decode-shaped trees (and prefill chunks)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    kind: str  # "tree" or "prefill"
    batch: int
    prefix: int
    nodes: int  # tree nodes, or chunk length for prefill


def cases(quick: bool, smoke: bool) -> list[Case]:
    if smoke:
        return [Case("tree", 2, 40, 9), Case("prefill", 1, 24, 16)]
    if quick:  # decode trees only, two block sizes (<= 16 and > 16 nodes): few autotuned shapes
        return [Case("tree", 1, 4096, 16), Case("tree", 1, 32768, 64), Case("tree", 16, 4096, 64),
                Case("tree", 64, 2048, 16)]  # fmt: skip
    batches, prefixes, nodes = (1, 8, 64), (1024, 8192, 32768), (16, 64, 128)
    tree = [Case("tree", b, p, n) for b in batches for p in prefixes for n in nodes]
    prefill = [Case("prefill", b, p, c) for b in (1, 4) for p in (0, 4096) for c in (512, 2048)]
    return tree + prefill


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
        words = math.ceil(case.nodes / WORD)
        tree_mask = torch.tensor(
            [row for p in parents for row in ancestor_words(p, words)], dtype=torch.int32
        )
        tree_mask = tree_mask.to(device)
        depth_t = torch.tensor([d for p in parents for d in depths(p)])
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
    schedule = make_schedule(inputs["cu_q"], inputs["prefix_lens"], heads // kv_heads)
    kernel = lambda: ta.tree_attention_triton(**inputs, sm_scale=sm_scale, schedule=schedule)  # noqa: E731
    out = kernel()
    ref = ta.tree_attention_ref(**inputs, sm_scale=sm_scale)
    error = float((out.float() - ref.float()).abs().max())
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    result = {**case.__dict__, "case": "bandwidth", "heads": heads, "kv_heads": kv_heads, "dim": dim,
              "dtype": DTYPE_NAMES[dtype], "max_abs_error": error, "tolerance": tolerance,
              "ok": error <= tolerance, "splits": schedule.num_splits}  # fmt: skip
    element = torch.finfo(dtype).bits // 8
    kv_bytes = 2 * case.batch * kv_heads * (case.prefix + case.nodes) * dim * element
    qo_bytes = 2 * case.batch * case.nodes * heads * dim * element
    flops = 4 * visible_pairs * heads * dim
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


def run_bandwidth(args, device: str, out: JsonLines) -> int:
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth(device, args.smoke)
    name = device_name(device)
    print(f"{name}: measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    out.write(case="copy_bandwidth", device=name, gb_per_s=bandwidth / 1e9)
    print(
        f"{'kind':>7} {'B':>3} {'prefix':>6} {'nodes':>5} {'splits':>6} {'ms':>8} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8}  vs sdpa  vs flash"
    )
    rows = []
    for case in cases(args.quick, args.smoke):
        try:
            r = bench_case(case, args, device, gen, bandwidth)
        except Exception as exc:  # recorded; the other cases still run
            traceback.print_exc()
            r = {
                **case.__dict__,
                "case": "bandwidth",
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
            }
        out.write(**r)
        rows.append(r)
        if "ms" not in r:
            print(f"{r['kind']:>7} {r['batch']:>3} {r['prefix']:>6} {r['nodes']:>5}  FAILED {r['error']}")
            continue
        flash = f"{r['speedup']['flash_varlen']:.2f}x" if "flash_varlen" in r["speedup"] else "-"
        print(
            f"{r['kind']:>7} {r['batch']:>3} {r['prefix']:>6} {r['nodes']:>5} {r['splits']:>6} {r['ms']['treespec']:8.3f} "
            f"{r['gb_per_s']:7.0f} {100 * r['bandwidth_fraction']:4.0f}% {r['tflop_per_s']:8.1f}  "
            f"{r['speedup']['sdpa_mask']:.2f}x  {flash}"
            + ("" if r["ok"] else f"  MISS: error {r['max_abs_error']:.2e} > {r['tolerance']}"),
            flush=True,
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"device": name, "copy_bandwidth_gb_s": bandwidth / 1e9, "cases": rows}, indent=2)
        )
        print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--correctness", action="store_true", help="the real layouts against float64")
    parser.add_argument("--tuned", action="store_true", help="--correctness with the autotuned kernel")
    parser.add_argument("--out", default="bench_results/kernels.json", help="bandwidth: the whole report")
    parser.add_argument("--jsonl", default=None, help="append one JSON line per case here, as it goes")
    parser.add_argument("--stage", default="kernels", help="the 'stage' field of each JSON line")
    parser.add_argument("--quick", action="store_true", help="bandwidth: decode trees only, 4 shapes")
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
    if args.correctness and not args.tuned:  # read at each launch (kernels/tree_attention.py)
        os.environ.setdefault("TREESPEC_TRITON_AUTOTUNE", "0")
    out = JsonLines(args.jsonl, args.stage)
    return run_correctness(args, device, out) if args.correctness else run_bandwidth(args, device, out)


if __name__ == "__main__":
    sys.exit(main())
