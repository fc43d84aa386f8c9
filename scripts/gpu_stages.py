"""The Python stages of scripts/gpu_check.sh, each writing one JSON line per case as it goes.

    python scripts/gpu_stages.py preflight --jsonl FILE [--device cuda]
    python scripts/gpu_stages.py identity  --jsonl FILE [--device cuda] [--num-prompts 3] ...
    python scripts/gpu_stages.py speed     --jsonl FILE [--device cuda] [--batch-size 1] ...
    pytest -p gpu_stages ...   (scripts/ on PYTHONPATH, GPU_CHECK_JSONL=FILE): one line per test

Every line is a JSON object with ``stage`` (``--stage``, or $GPU_CHECK_STAGE for pytest) and
``case``; each is appended and flushed at once, so a stage killed by its time limit keeps what it
had measured. The model is the default one (SmolLM2-135M-Instruct, 9 query heads over 3 KV
heads, head dim 64) when it is pulled into $TREESPEC_HOME, else a randomly initialised model of
its exact config (same shapes and kernels; its tokens are not the real model's, and only the
methods without heads run on it); every line says which (``model``).

preflight  the kernel at the model's head layout against the float64 plain reference, then one
           short generate through Target(attention_backend="triton") against the reference
           backend (a prefill launch and a tree launch): a few seconds, run before anything else
identity   fp32: every method's greedy tokens on the Triton backend, on the reference backend
           and from HF generate, per prompt
speed      (bf16 by default) tokens/s of HF generate and of each treespec method (Triton
           backend), per batch of prompts, then per method with the speedup over HF
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

MODEL = "smollm2-135m-instruct"
# SmolLM2-135M-Instruct's config.json as converted by `treespec models pull` (the layout the
# random stand-in gets when the real model is not there).
SMOLLM2_CONFIG = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class JsonLines:
    """Appends one JSON object per line to a file, flushed at once (nothing when path is None)."""

    def __init__(self, path: str | None, stage: str) -> None:
        self.path, self.stage = path, stage
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def write(self, **fields) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"stage": self.stage, **fields}, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# The model: the real one if pulled, else a random one of its config
# --------------------------------------------------------------------------------------------


def real_model_there() -> bool:
    from treespec import models

    return models.is_pulled(MODEL)


def random_model(dtype, device: str, layers: int | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{**SMOLLM2_CONFIG, "num_hidden_layers": layers or SMOLLM2_CONFIG["num_hidden_layers"]}
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def truncate(model, layers: int | None):
    """Keep the first ``layers`` decoder layers (the dry run: same shapes, fewer launches)."""
    if layers and layers < model.config.num_hidden_layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model


class RandomComponents:
    """treespec.bench.e2e.Components' interface over the random stand-in (no tokenizer, no heads)."""

    methods = ("none", "ngram")

    def __init__(self, config, layers: int | None) -> None:
        import torch

        from treespec import Target

        self.config = config
        self.model = self.hf_model = random_model(getattr(torch, DTYPES[config.dtype]), config.device, layers)
        self.tokenizer = SimpleNamespace(pad_token_id=0)
        self.target = Target(self.model, attention_backend=config.attention_backend,
                             linear_backend=config.linear_backend)  # fmt: skip

    def proposer(self, method: str):
        from treespec.proposers import NgramProposer

        if method == "none":
            return None
        if method == "ngram":
            return NgramProposer(max_depth=8, max_nodes=32, token_cost=0.3)
        raise ValueError(f"method {method!r} needs the real model's heads")


def components_for(args, dtype: str, backend: str):
    """(components, model description, prompts, categories) for a stage."""
    from treespec.bench.e2e import BenchConfig, Components
    from treespec.prompts import BENCH_PROMPTS, encode_prompts, read_prompt_records

    config = BenchConfig(model=MODEL, proposers=("none",), baselines=("hf",), max_new_tokens=args.max_new_tokens,
                         dtype=dtype, batch_size=args.batch_size, warmup=0, device=args.device,
                         budget=args.budget, attention_backend=backend)  # fmt: skip
    if real_model_there() and not args.random_model:
        components = Components(config)
        if args.layers:
            from treespec import Target

            truncate(components.model, args.layers)
            components.target = Target(components.model, attention_backend=backend,
                                       linear_backend=config.linear_backend)  # fmt: skip
        pairs = read_prompt_records(args.prompts) if args.prompts else list(BENCH_PROMPTS)
        pairs = pairs[: args.num_prompts]
        prompts = encode_prompts(components.tokenizer, [text for _, text in pairs])
        described = MODEL + (f" (first {args.layers} layers)" if args.layers else "")
        return components, described, prompts
    components = RandomComponents(config, args.layers)
    prompts = synthetic_prompts(args.num_prompts, components.model.config.vocab_size)
    described = f"random init, {MODEL}'s config" + (f" ({args.layers} layers)" if args.layers else "")
    return components, described, prompts


def synthetic_prompts(count: int, vocab: int) -> list[list[int]]:
    """Repetitive token ids (so that n-gram lookup finds something), 20 to 40 tokens."""
    prompts = []
    for i in range(count):
        motif = [100 + (37 * i + 11 * j) % (vocab - 100) for j in range(5 + i % 3)]
        prompts.append((motif * 8)[: 20 + (7 * i) % 21])
    return prompts


def methods_for(components, wanted: list[str]) -> list[str]:
    """The wanted methods this model can run (the random stand-in has no heads)."""
    from treespec.bench.e2e import METHODS

    unknown = [m for m in wanted if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: choose from {', '.join(METHODS)}")
    allowed = getattr(components, "methods", None)
    if allowed is None:  # the real model: the methods whose heads are shipped
        shipped = components.shipped
        needs = {"draft": ["draft"], "medusa": ["medusa"], "eagle": ["eagle"], "hybrid": ["eagle"]}
        return [m for m in wanted if all(k in shipped for k in needs.get(m, []))]
    return [m for m in wanted if m in allowed]


def environment(device: str) -> dict:
    import torch
    import transformers

    from treespec import models
    from treespec.kernels import tree_attention as ta

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "triton": triton_version, "interpreter": ta.interpreting(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "treespec_home": str(models.treespec_home()), "real_model": real_model_there(),
            "autotune": os.environ.get("TREESPEC_TRITON_AUTOTUNE", "1") != "0"}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------


def preflight(args, out: JsonLines) -> int:
    import torch

    from treespec import Target, generate
    from treespec.kernels import tree_attention as ta
    from treespec.proposers import NgramProposer

    out.write(case="environment", **environment(args.device))
    start = time.perf_counter()
    if real_model_there() and not args.random_model:
        from treespec import models

        model, _ = models.load(MODEL, dtype=torch.float32, device=args.device)
        truncate(model, args.layers)
        described = MODEL
    else:
        model, described = (
            random_model(torch.float32, args.device, args.layers),
            f"random init, {MODEL}'s config",
        )
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layout = dict(model=described, heads=heads, kv_heads=kv_heads, dim=dim, layers=config.num_hidden_layers)
    print(
        f"preflight: {described}, {heads}/{kv_heads} heads, head dim {dim}, loaded in {time.perf_counter() - start:.1f}s"
    )

    # 1. The kernel alone at this layout: a 5-node tree over a 40-token prefix, split-KV on.
    gen = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 1, 3]
    words = [sum(1 << a for a in ancestors(parents, i)) for i in range(5)]
    inputs = dict(
        q=torch.randn(5, heads, dim, generator=gen), k_cache=torch.randn(2, kv_heads, 48, dim, generator=gen),
        v_cache=torch.randn(2, kv_heads, 48, dim, generator=gen), cu_q=torch.tensor([0, 5], dtype=torch.int32),
        slots=torch.tensor([1], dtype=torch.int32), prefix_lens=torch.tensor([40], dtype=torch.int32),
        tree_mask=torch.tensor([[w] for w in words], dtype=torch.int32),
    )  # fmt: skip
    t0 = time.perf_counter()
    got = ta.tree_attention_triton(**{k: v.to(args.device) for k, v in inputs.items()}, sm_scale=dim**-0.5)
    want = ta.tree_attention_naive(**{k: v.double() if v.is_floating_point() else v for k, v in inputs.items()},
                                   sm_scale=dim**-0.5)  # fmt: skip
    error = float((got.cpu().double() - want).abs().max())
    kernel_ok = error <= 2e-5 * (1 + float(want.abs().max()))
    out.write(
        case="kernel", **layout, max_abs_error=error, ok=kernel_ok, seconds=round(time.perf_counter() - t0, 3)
    )
    print(
        f"preflight: kernel at {heads}/{kv_heads}, D {dim}: max |err| {error:.2e} ({'ok' if kernel_ok else 'MISS'})"
    )

    # 2. One short generate through the Triton backend (a prefill launch, then tree launches),
    # against the reference backend.
    prompt = ([11, 12, 13, 14, 15] * 6)[:27]
    tokens = {}
    for backend in ("reference", "triton"):
        t0 = time.perf_counter()
        target = Target(model, attention_backend=backend)
        result = generate(target, [prompt], proposer=NgramProposer(max_depth=4, max_nodes=8),
                          max_new_tokens=args.max_new_tokens, eos_token_id=[])  # fmt: skip
        tokens[backend] = result.sequences[0]
        seconds = time.perf_counter() - t0
        out.write(case="generate", backend=backend, **layout, tokens=tokens[backend], seconds=round(seconds, 3),
                  resolved_backend=target.attention_backend)  # fmt: skip
        print(
            f"preflight: generate on {backend} ({target.attention_backend}): {tokens[backend]} in {seconds:.1f}s"
        )
    same = tokens["triton"] == tokens["reference"]
    out.write(case="summary", **layout, kernel_ok=kernel_ok, triton_equals_reference=same,
              ok=kernel_ok and same, seconds=round(time.perf_counter() - start, 3))  # fmt: skip
    print(f"preflight: {'ok' if kernel_ok and same else 'FAILED'} in {time.perf_counter() - start:.1f}s")
    return 0 if kernel_ok and same else 1


def ancestors(parents: list[int], i: int) -> list[int]:
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain


def identity(args, out: JsonLines) -> int:
    """fp32 greedy: the Triton backend's tokens equal the reference backend's, and HF's."""
    from treespec import Target
    from treespec.bench.e2e import run_method

    args.budget = "fixed"  # no cost calibration: nothing here is timed
    components, described, prompts = components_for(args, "fp32", "triton")
    methods = methods_for(components, args.methods.split(","))
    triton_target = components.target
    reference_target = Target(components.model, attention_backend="reference",
                              linear_backend=components.config.linear_backend)  # fmt: skip
    configs = {
        "triton": components.config,
        "reference": replace(components.config, attention_backend="reference"),
    }
    print(
        f"identity: {described}, fp32, {len(prompts)} prompts x {args.max_new_tokens} tokens, methods {methods}"
    )
    misses = 0
    for i, prompt in enumerate(prompts):
        hf = run_method(components, "hf", [prompt], 0)["tokens"][0]
        for method in list(methods):
            got = {}
            try:
                for backend, target in (("triton", triton_target), ("reference", reference_target)):
                    components.target, components.config = target, configs[backend]
                    got[backend] = run_method(components, method, [prompt], 0)["tokens"][0]
            except Exception as exc:  # this method is left out, recorded; the others still run
                traceback.print_exc()
                out.write(case="error", model=described, method=method, prompt=i, ok=False,
                          error=f"{type(exc).__name__}: {exc}"[:2000])  # fmt: skip
                methods.remove(method)
                misses += 1
                continue
            same = got["triton"] == got["reference"]
            first = next(
                (j for j, (a, b) in enumerate(zip(got["triton"], got["reference"], strict=False)) if a != b),
                None,
            )
            out.write(case="identity", model=described, method=method, prompt=i, new_tokens=len(got["triton"]),
                      triton_equals_reference=same, triton_equals_hf=got["triton"] == hf, first_difference=first,
                      ok=same)  # fmt: skip
            misses += not same
            print(
                f"identity: prompt {i} {method:<7} triton == reference: {same}, == HF: {got['triton'] == hf}",
                flush=True,
            )
    return 1 if misses else 0


def speed(args, out: JsonLines) -> int:
    """Tokens/s of HF generate and of each treespec method on the Triton backend, per batch."""
    import statistics

    components, described, prompts = components_for(args, args.dtype, args.attention_backend)
    methods = methods_for(components, args.methods.split(","))
    order = ["hf", *methods]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    print(f"speed: {described}, {args.dtype}, batch {args.batch_size}, {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens, attention {components.target.attention_backend}, {order}")  # fmt: skip
    from treespec.bench.e2e import run_method

    config = components.config
    components.config = replace(config, max_new_tokens=min(8, config.max_new_tokens))
    failed = []
    for method in order:  # warm-up: compile, autotune, calibrate the budget
        t0 = time.perf_counter()
        try:
            run_method(components, method, [batches[0][0][:64]], 0)
        except Exception as exc:  # this method is left out, recorded; the others still run
            traceback.print_exc()
            out.write(
                case="error",
                model=described,
                method=method,
                ok=False,
                error=f"{type(exc).__name__}: {exc}"[:2000],
            )
            failed.append(method)
            continue
        out.write(case="warmup", model=described, method=method, seconds=round(time.perf_counter() - t0, 3))
    if "hf" in failed:
        raise RuntimeError("HF generate, the baseline, failed (see the error line)")
    order = [m for m in order if m not in failed]
    components.config = config
    totals = {m: {"tokens": 0, "seconds": 0.0, "outputs": []} for m in order}
    for b, batch in enumerate(batches):
        for method in order:
            r = run_method(components, method, batch, b)
            new = sum(len(t) for t in r["tokens"])
            line = dict(case="speed", model=described, method=method, batch=b, batch_size=len(batch),
                        dtype=args.dtype, new_tokens=new, seconds=round(r["seconds"], 4),
                        tokens_per_s=new / r["seconds"])  # fmt: skip
            if "steps" in r:
                line["steps"] = r["steps"]
                if r.get("accepted_lengths"):  # tokens a request commits per step (tau)
                    line["mean_accepted"] = statistics.fmean(r["accepted_lengths"])
            out.write(**line)
            totals[method]["tokens"] += new
            totals[method]["seconds"] += r["seconds"]
            totals[method]["outputs"] += r["tokens"]
            print(f"speed: batch {b} {method:<7} {line['tokens_per_s']:8.1f} tok/s", flush=True)
    hf_rate = totals["hf"]["tokens"] / totals["hf"]["seconds"]
    for method in order:
        t = totals[method]
        rate = t["tokens"] / t["seconds"]
        reference = totals["none" if "none" in totals else "hf"]["outputs"]
        same = sum(a == b for a, b in zip(t["outputs"], reference, strict=True)) / len(reference)
        out.write(case="speed_total", model=described, method=method, batch_size=args.batch_size, dtype=args.dtype,
                  attention_backend=components.target.attention_backend, tokens_per_s=rate,
                  speedup_vs_hf=rate / hf_rate, same_as_treespec_ar=same)  # fmt: skip
        print(
            f"speed: {method:<7} {rate:8.1f} tok/s, {rate / hf_rate:.2f}x HF, same as treespec AR: {same:.2f}"
        )
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------
# pytest plugin (-p gpu_stages): one line per test
# --------------------------------------------------------------------------------------------


def _pytest_out() -> JsonLines | None:
    path = os.environ.get("GPU_CHECK_JSONL")
    return JsonLines(path, os.environ.get("GPU_CHECK_STAGE", "tests")) if path else None


def pytest_runtest_logreport(report) -> None:
    out = _pytest_out()
    if out is None or (report.when != "call" and report.outcome == "passed"):
        return
    line = dict(
        case=report.nodeid, when=report.when, outcome=report.outcome, seconds=round(report.duration, 3)
    )
    if report.failed:
        line["message"] = report.longreprtext[-2000:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        line["message"] = str(report.longrepr[2])[:300]
    out.write(**line)


def pytest_collectreport(report) -> None:
    out = _pytest_out()
    if out is not None and report.failed:
        out.write(case=report.nodeid or "collection", when="collect", outcome="error",
                  message=report.longreprtext[-2000:])  # fmt: skip


def pytest_sessionfinish(session, exitstatus) -> None:
    out = _pytest_out()
    if out is not None:
        out.write(case="session", exitstatus=int(exitstatus), collected=session.testscollected,
                  failed=session.testsfailed)  # fmt: skip


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["preflight", "identity", "speed"])
    parser.add_argument("--jsonl", default=None, help="append one JSON line per case here")
    parser.add_argument("--stage", default=None, help="the lines' 'stage' field (default: WHAT)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--prompts", default=None, help="a prompt file (treespec bench's formats)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="speed: the models' dtype")
    parser.add_argument("--methods", default="none,ngram,eagle", help="comma list of treespec methods")
    parser.add_argument("--budget", default="adaptive", help="as treespec bench's --budget")
    parser.add_argument("--attention-backend", default="triton", choices=["auto", "triton", "reference", "cpu"],
                        help="speed: treespec's attention backend")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None, help="keep the model's first N layers (dry run)")
    parser.add_argument(
        "--random-model", action="store_true", help="the random stand-in even if the model is there"
    )
    args = parser.parse_args(argv)
    out = JsonLines(args.jsonl, args.stage or args.what)
    try:
        return {"preflight": preflight, "identity": identity, "speed": speed}[args.what](args, out)
    except Exception as exc:  # the error as a line too, then the traceback on stderr
        out.write(case="error", ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
