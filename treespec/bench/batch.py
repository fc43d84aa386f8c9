"""Large-batch throughput of the engine, as the data stages use it: B requests (the training
prompts, chat template applied) prefill together, then decode ``--new`` tokens each.

    treespec bench batch [--batch 64] [--dtype bf16] [--new 40]
    treespec bench batch --temperature 1 --top-p 0.95 --sampler inverse-cdf  # Magpie's

Prints the prefill rate and the median decode step (tokens per second at that batch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from treespec import models
from treespec.engine import Engine
from treespec.heads.training.corpus import chat_ids
from treespec.heads.training.prompts import train_prompts
from treespec.models import DEFAULT_MODEL, DTYPES
from treespec.sampling import SamplingParams
from treespec.target import Target


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--new", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--sampler", choices=["hf", "inverse-cdf"], default="hf",
                        help="the engine's sampler (the data stages use inverse-cdf)")  # fmt: skip
    args = parser.parse_args(argv)
    sampling = SamplingParams(args.temperature, None, args.top_p)
    model, tokenizer = models.load(args.model, dtype=DTYPES[args.dtype])
    target = Target(model)
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in train_prompts()[: args.batch]]
    engine = Engine(target, max_batch_size=args.batch, max_len=max(map(len, prompts)) + args.new,
                    generator=torch.Generator().manual_seed(0), sampler=args.sampler)  # fmt: skip
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=args.new, eos_token_id=[], sampling=sampling)
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    prefill = sum(map(len, prompts))
    step = statistics.median(times[1:])
    print(f"{args.dtype} batch {args.batch}, {sampling}, sampler {args.sampler}, linear {target.linear_backend}: prefill {prefill} tokens in "
          f"{times[0]:.1f} s ({prefill / times[0]:.0f} tokens/s); decode step {1e3 * step:.0f} ms "
          f"({args.batch / step:.0f} tokens/s)")  # fmt: skip


if __name__ == "__main__":
    main()
