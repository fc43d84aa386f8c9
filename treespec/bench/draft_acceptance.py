"""Which draft children are accepted more at temperature > 0: sampled (without replacement,
verified by the sampled-children rule) or top-k (verified by the deterministic rule)?

    treespec bench draft-acceptance [--prompts 1000] [--temperature 1.0] [--out FILE.json]

No useful draft model exists yet for SmolLM2 (training it is a later issue), so this uses a tiny
random target over a 32-token vocabulary and a perturbed copy of it as the draft (close, not
equal), many identical prompts in one batch, and reports tau (tokens committed per step, bonus
included) for each tree shape and child rule.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.api import generate
from treespec.proposers import DraftModelProposer
from treespec.tree import chain, full_tree


def tiny_pair(vocab: int, noise: float) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    target.generation_config.eos_token_id = None
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * noise)
    return target, draft


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=0.5, help="draft = target + noise on its output layer")
    parser.add_argument("--out", default="bench_results/draft_acceptance.json")
    args = parser.parse_args(argv)
    target, draft = tiny_pair(32, args.noise)
    results = []
    for name, shape in [("chain-3", chain(3)), ("binary-2", full_tree(2, 2)), ("ternary-2", full_tree(3, 2))]:
        for sample in (False, True):
            proposer = DraftModelProposer(draft, shape=shape, sample=sample, max_batch_size=args.prompts,
                                          max_len=32, generator=torch.Generator().manual_seed(1))  # fmt: skip
            out = generate(target, [[1, 2, 3]] * args.prompts, max_new_tokens=12,
                                    temperature=args.temperature, proposer=proposer,
                                    generator=torch.Generator().manual_seed(2))  # fmt: skip
            rule = "sampled children" if sample else "top-k children"
            results.append({"shape": name, "children": rule, "tau": out.stats.tau})
            print(f"{name:>9}  {rule:>16}: tau {out.stats.tau:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
