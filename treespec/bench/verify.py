"""Speed of tree verification against one target forward over the same tree tokens.

    treespec bench verify [--batch 8] [--nodes 64] [--vocab 49152] [--repeats 20]
                                   [--model smollm2-135m-instruct | --no-target] [--out FILE.json]

Times verify() in each mode (median of repeats) on random trees with distinct siblings, and,
in the same process, the target's forward over those B*N tree tokens on a cached prefix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from treespec.bench.timing import median_seconds
from treespec.models import DEFAULT_MODEL, load
from treespec.sampling import SamplingParams
from treespec.target import Target
from treespec.tree import TokenTree
from treespec.verify import verify


def random_trees(batch: int, nodes: int, vocab: int, gen: torch.Generator) -> TokenTree:
    """Random trees (node i hangs under a random earlier node) whose children are drawn from
    their parent's draft distribution without replacement, as a sampling drafter makes them."""
    draft_probs = torch.softmax(3 * torch.randn(batch * nodes, vocab, generator=gen), -1)
    tokens, parents = [], []
    for b in range(batch):
        par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
        toks = [0] * nodes
        for parent in range(nodes):
            kids = [i for i in range(nodes) if par[i] == parent]
            if kids:
                drawn = torch.multinomial(draft_probs[b * nodes + parent], len(kids), generator=gen)
                for kid, token in zip(kids, drawn.tolist(), strict=True):
                    toks[kid] = token
        tokens.append(toks)
        parents.append(par)
    return TokenTree.make_dummy(tokens, parents, draft_probs=draft_probs)


def median_ms(fn, repeats: int) -> float:
    return 1e3 * median_seconds(fn, repeats)


def target_forward_ms(model_name: str, tree: TokenTree, repeats: int) -> float:
    model, _ = load(model_name, dtype=torch.bfloat16)
    target = Target(model)
    batch = tree.num_requests
    cache = target.new_cache(batch, 256 + tree.num_nodes)
    slots = torch.tensor([cache.allocate() for _ in range(batch)])
    prefix = torch.randint(0, target.vocab_size, (batch * 128,))
    target.forward(prefix, cache, torch.arange(batch + 1) * 128, slots, return_hidden=False)
    cache.commit(slots.tolist(), [range(128)] * batch)
    tokens = tree.tokens % target.vocab_size

    def forward():
        target.forward(tokens, cache, tree.cu_nodes, slots, tree_mask=tree.tree_mask, depth=tree.depth)

    return median_ms(forward, max(3, repeats // 4))


def verify_ms_per_mode(tree: TokenTree, vocab: int, repeats: int, gen: torch.Generator) -> dict[str, float]:
    """Median ms of one verification of ``tree`` over random logits, per rule."""
    logits = torch.randn(tree.num_nodes, vocab, generator=gen) * 3
    sampling = SamplingParams(temperature=0.8)
    calls = {
        "greedy": lambda: verify(tree, logits, SamplingParams()),
        "deterministic": lambda: verify(tree, logits, sampling, mode="deterministic", generator=gen),
        "sampled": lambda: verify(tree, logits, sampling, mode="sampled", generator=gen),
        "sampled_top_p_0.9": lambda: verify(tree, logits, SamplingParams(0.8, top_p=0.9), mode="sampled",
                                            generator=gen),
        "typical": lambda: verify(tree, logits, sampling, mode="typical", generator=gen),
    }  # fmt: skip
    return {mode: median_ms(call, repeats) for mode, call in calls.items()}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--no-target", action="store_true", help="skip timing the target forward")
    parser.add_argument("--out", default="bench_results/verify.json")
    args = parser.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    tree = random_trees(args.batch, args.nodes, args.vocab, gen)
    results = verify_ms_per_mode(tree, args.vocab, args.repeats, gen)
    report = {"batch": args.batch, "nodes": args.nodes, "vocab": args.vocab, "verify_ms": results}
    if not args.no_target:
        report["target_forward_ms"] = target_forward_ms(args.model, tree, args.repeats)
        report["verify_over_forward"] = {m: t / report["target_forward_ms"] for m, t in results.items()}
    for mode, ms in results.items():
        ratio = (
            f"  ({ms / report['target_forward_ms']:.1%} of a target forward)" if not args.no_target else ""
        )
        print(f"verify {mode:>18}: {ms:7.2f} ms{ratio}")
    if not args.no_target:
        print(
            f"target forward over {tree.num_nodes} tree tokens ({args.model}, bf16): {report['target_forward_ms']:.1f} ms"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
