"""Hybrid trees: the branches of several proposers merged into one trie, verified in one forward.

Typical use: an EAGLE head (or a draft model) for what the model is likely to say, plus n-gram
continuations copied from the context (long, exact runs a small head rarely guesses). Each
proposer drafts its own tree for every request; the trees are merged per request by inserting
every node's path into a trie rooted at the shared root, in proposer order, so a token both
propose is verified once. The engine verifies the merged tree like any other.

Children are chosen without looking at the verifier's coins by every member (they must all have
``sampled_children = False``), so the deterministic-children rule stays lossless on the union.
Hidden states go to the members that need them; every member hears every commit. When every
member has a settable budget, so has the hybrid: the adaptive budget then sizes every member's
trees at once and learns from the merged trees (``treespec bench --proposer hybrid``).
"""

from __future__ import annotations

import torch

from treespec.proposers.base import ProposalRequest, Proposer, RequestResult, StepResult
from treespec.tree import TokenTree, host_structure


class HybridProposer(Proposer):
    def __init__(self, *proposers: Proposer) -> None:
        if len(proposers) < 2:
            raise ValueError(f"a hybrid needs at least two proposers, got {len(proposers)}")
        if any(not isinstance(p, Proposer) for p in proposers):
            raise TypeError("every member of a hybrid must be a treespec.proposers.Proposer")
        if any(p.sampled_children for p in proposers):
            raise ValueError("hybrid trees need deterministic children: no member may use sampled children")
        heads = [p for p in proposers if p.needs_hidden]
        layers = {p.hidden_layers for p in heads}
        if len(layers) > 1:
            raise ValueError(f"members ask for different target features {sorted(layers)}; at most one kind")
        vocab = {p.vocab_size for p in proposers} - {None}
        if len(vocab) > 1:
            raise ValueError(f"members have different vocabularies {sorted(vocab)}")
        self.proposers = proposers
        self.needs_hidden = bool(heads)
        self.hidden_layers = layers.pop() if layers else ()
        self.vocab_size = vocab.pop() if vocab else None
        self.max_tree_nodes = 1 + sum(p.max_tree_nodes - 1 for p in proposers)
        self.has_budget = all(p.has_budget for p in proposers)  # then one budget sizes them all
        limits = [p.max_batch_size for p in proposers if p.max_batch_size is not None]
        self.max_batch_size = min(limits) if limits else None
        contexts = [p.max_context for p in proposers if p.max_context is not None]
        self.max_context = min(contexts) if contexts else None
        self._where: dict[int, list[list[int]]] = {}  # request id -> per member: its node i -> merged node

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        trees = [p.propose(requests) for p in self.proposers]
        self.catch_up_s = sum(p.catch_up_s for p in self.proposers)  # what the budget leaves out of drafting
        own = host_structure(trees)  # at most one host sync, for the members that draft on the device
        merged_tokens, merged_parents = [], []
        for b, request in enumerate(requests):
            tokens, parents = [request.tokens[-1]], [-1]
            index: dict[tuple[int, int], int] = {}  # (parent in merged tree, token) -> node
            self._where[request.request_id] = []
            for cu, member_tokens, member_parents in own:
                start, stop = cu[b], cu[b + 1]
                where = [0]  # this member's node i -> merged node
                for i in range(1, stop - start):
                    key = (where[member_parents[start + i]], member_tokens[start + i])
                    if key not in index:
                        index[key] = len(tokens)
                        tokens.append(member_tokens[start + i])
                        parents.append(key[0])
                    where.append(index[key])
                self._where[request.request_id].append(where)
            merged_tokens.append(tokens)
            merged_parents.append(parents)
        return TokenTree.from_lists(merged_tokens, merged_parents)

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Every member drafts at most ``num_nodes`` nodes, ``depth`` deep (within its own
        sizes): one adaptive budget sizes the merged tree, judged by what the merged trees win."""
        for p in self.proposers:
            p.set_budget(num_nodes, depth)

    def observe(self, result: StepResult) -> None:
        """Each member hears the step in terms of its own tree: its nodes on the accepted path."""
        per_member: list[list[RequestResult]] = [[] for _ in self.proposers]
        for request in result.requests:
            where = self._where.pop(request.request_id, None)  # None: the first token after prefill
            for m, results in enumerate(per_member):
                results.append(request if where is None else _restrict(request, where[m]))
        for member, results in zip(self.proposers, per_member, strict=True):
            member.observe(StepResult(results))

    def observe_prefill(self, request_id: int, tokens: list[int], hidden: torch.Tensor) -> None:
        for p in self.proposers:
            if p.needs_hidden:
                p.observe_prefill(request_id, tokens, hidden)

    def drafting_paths(self) -> dict[str, str]:
        return {name: path for p in self.proposers for name, path in p.drafting_paths().items()}

    def release(self, request_id: int) -> None:
        self._where.pop(request_id, None)
        for p in self.proposers:
            p.release(request_id)


def _restrict(result: RequestResult, own: list[int]) -> RequestResult:
    """The step as one member saw it: ``own[i]`` is the merged node of the member's node i."""
    merged_to_own = {node: i for i, node in enumerate(own)}
    accepted = []
    for node in result.accepted:  # the accepted path, cut where it leaves the member's tree
        if node not in merged_to_own:
            break
        accepted.append(merged_to_own[node])
    tokens = [result.tree_tokens[node] for node in own]
    parents = [-1] + [merged_to_own[result.tree_parents[node]] for node in own[1:]]
    return RequestResult(result.request_id, tokens, parents, accepted, result.committed, result.hidden)
