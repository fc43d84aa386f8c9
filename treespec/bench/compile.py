"""Does ``torch.compile`` pay for a target step on this machine? HF's own forward over n new
tokens on a cached context, eager and compiled (inductor, one static shape per size), beside
treespec's eager ``Target.forward`` (default backends), at batch 1.

    treespec bench compile [--sizes 1,16] [--out bench_results/bench_compile.json]

Reports the compile time (the first call of each shape, which includes tracing and inductor's
C++ build; cached across runs in inductor's cache folder) and the median ms per forward after it.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from treespec import models
from treespec.bench.timing import median_seconds
from treespec.models import DEFAULT_MODEL
from treespec.target import Target


def median_ms(run, repeats: int, setup=None) -> float:
    return 1e3 * median_seconds(run, repeats, warmup=0, setup=setup or (lambda: None))


def _arguments(argv: list[str] | None, prog: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", default="1,16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench_results/bench_compile.json"))
    return parser.parse_args(argv)


@torch.inference_mode()
def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    args = _arguments(argv, prog)
    model, _ = models.load(args.model, dtype=torch.bfloat16)
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, args.context), generator=generator)
    prefilled = model(input_ids=context, use_cache=True, logits_to_keep=1).past_key_values
    compiled = torch.compile(model, dynamic=False)
    target = Target(model)
    cache = target.new_cache(1, args.context + 64)
    slots = torch.tensor([cache.allocate()])
    target.forward(context[0], cache, torch.tensor([0, args.context]), slots, return_hidden=False)
    cache.lengths[slots[0]] = args.context
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        tokens = torch.randint(0, vocab, (1, n), generator=generator)

        def hf(cache_copy, fn, tokens=tokens):
            fn(input_ids=tokens, past_key_values=cache_copy, use_cache=True)

        fresh = lambda: copy.deepcopy(prefilled)  # noqa: E731
        eager = median_ms(lambda c: hf(c, model), args.repeats, fresh)
        start = time.perf_counter()
        hf(fresh(), compiled)
        compile_s = time.perf_counter() - start
        hf(fresh(), compiled)  # a second call may recompile once (cache shapes)
        fast = median_ms(lambda c: hf(c, compiled), args.repeats, fresh)
        cu_q = torch.tensor([0, n])
        ours = median_ms(lambda _, t=tokens[0], cu=cu_q: target.forward(t, cache, cu, slots), args.repeats)
        row = {"new_tokens": n, "hf_eager_ms": eager, "hf_compiled_ms": fast, "compile_s": compile_s,
               "treespec_ms": ours, "treespec_backends": [target.linear_backend, target.attention_backend]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"context": args.context, "torch": torch.__version__, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
