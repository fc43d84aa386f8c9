"""Hybrid trees: the branches of several proposers merged into one trie, verified in one forward.

Typical use: an EAGLE head (or a draft model) for what the model is likely to say, plus n-gram
continuations copied from the context (long, exact runs a small head rarely guesses). Each
proposer drafts its own tree for every request; the trees are merged per request by inserting
every node's path into a trie rooted at the shared root, in proposer order, so a token both
propose is verified once. The engine verifies the merged tree like any other.

Children are chosen without looking at the verifier's coins by every member (they must all have
``sampled_children = False``), so the deterministic-children rule stays lossless on the union.
Hidden states go to the members that need them; every member hears every commit.
"""

from __future__ import annotations

import torch

from treespec.proposers.base import ProposalRequest, Proposer
from treespec.tree import TokenTree


class HybridProposer:
    sampled_children = False

    def __init__(self, *proposers: Proposer) -> None:
        if len(proposers) < 2:
            raise ValueError(f"a hybrid needs at least two proposers, got {len(proposers)}")
        if any(p.sampled_children for p in proposers):
            raise ValueError("hybrid trees need deterministic children: no member may use sampled children")
        heads = [p for p in proposers if getattr(p, "needs_hidden", False)]
        layers = {tuple(getattr(p, "hidden_layers", ()) or ()) for p in heads}
        if len(layers) > 1:
            raise ValueError(f"members ask for different target features {sorted(layers)}; at most one kind")
        self.proposers = proposers
        self.needs_hidden = bool(heads)
        self.hidden_layers = layers.pop() if layers else ()
        self.max_tree_nodes = 1 + sum(p.max_tree_nodes - 1 for p in proposers)
        vocab = {getattr(p, "vocab_size", None) for p in proposers} - {None}
        if len(vocab) > 1:
            raise ValueError(f"members have different vocabularies {sorted(vocab)}")
        if vocab:
            self.vocab_size = vocab.pop()

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        trees = [p.propose(requests) for p in self.proposers]
        merged_tokens, merged_parents = [], []
        for b, request in enumerate(requests):
            tokens, parents = [request.tokens[-1]], [-1]
            index: dict[tuple[int, int], int] = {}  # (parent in merged tree, token) -> node
            for tree in trees:
                start, stop = int(tree.cu_nodes[b]), int(tree.cu_nodes[b + 1])
                own = tree.tokens[start:stop].tolist()
                own_parents = tree.parents[start:stop].tolist()
                where = [0]  # this tree's node i -> merged node
                for i in range(1, len(own)):
                    key = (where[own_parents[i]], own[i])
                    if key not in index:
                        index[key] = len(tokens)
                        tokens.append(own[i])
                        parents.append(key[0])
                    where.append(index[key])
            merged_tokens.append(tokens)
            merged_parents.append(parents)
        return TokenTree.from_lists(merged_tokens, merged_parents)

    def observe(self, request_id: int, committed: list[int], hidden: torch.Tensor | None = None) -> None:
        for p in self.proposers:
            if getattr(p, "needs_hidden", False):
                p.observe(request_id, committed, hidden)
            else:
                p.observe(request_id, committed)

    def observe_prefill(self, request_id: int, tokens: list[int], hidden: torch.Tensor) -> None:
        for p in self.proposers:
            if getattr(p, "needs_hidden", False):
                p.observe_prefill(request_id, tokens, hidden)

    def release(self, request_id: int) -> None:
        for p in self.proposers:
            p.release(request_id)
