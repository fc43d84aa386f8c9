"""Routed proposers: each request drafted by the member it chose, several members in one engine.

A server that offers more than one way to draft (an EAGLE head for chat, n-gram lookup for a
request that edits a long document) keeps one engine and one batch: :class:`RoutedProposer`
holds the members by name, :meth:`RoutedProposer.route` gives a request its member before the
request's first step (else it takes the default), and every call is passed on per member: each
``propose`` groups the requests by member and returns their trees in the requests' order,
``observe`` and ``observe_prefill`` reach the request's own member only, ``release`` frees it
there. The members keep their own state (caches, n-gram indexes) per request, so a request's
tree is the one its member alone would draft for it.

The members must agree on what the engine reads once for the whole batch: how children are
chosen (``sampled_children``), the vocabulary and, among those that read the target's
features, which layers. ``set_budget`` sizes every member that has a budget.
"""

from __future__ import annotations

import torch

from treespec.proposers.base import ProposalRequest, Proposer, StepResult
from treespec.tree import TokenTree


class RoutedProposer(Proposer):
    def __init__(self, members: dict[str, Proposer], default: str) -> None:
        """``members`` by the name a request chooses them with; ``default`` the member of a
        request that is not routed."""
        if not isinstance(members, dict) or not members:
            raise ValueError(f"a routed proposer needs a non-empty dict of members, got {members!r}")
        for name, member in members.items():
            if not isinstance(name, str) or not isinstance(member, Proposer):
                raise TypeError(
                    f"members must map names (str) to Proposers, got {name!r}: {type(member).__name__}"
                )
        if default not in members:
            raise ValueError(f"the default member must be one of {sorted(members)}, got {default!r}")
        children = {m.sampled_children for m in members.values()}
        if len(children) > 1:
            raise ValueError(
                "members choose children differently (sampled and not): one rule verifies a batch"
            )
        heads = [m for m in members.values() if m.needs_hidden]
        layers = {m.hidden_layers for m in heads}
        if len(layers) > 1:
            raise ValueError(f"members ask for different target features {sorted(layers)}; at most one kind")
        vocab = {m.vocab_size for m in members.values()} - {None}
        if len(vocab) > 1:
            raise ValueError(f"members have different vocabularies {sorted(vocab)}")
        self.members, self.default = dict(members), default
        self.sampled_children = children.pop()
        self.needs_hidden = bool(heads)
        self.hidden_layers = layers.pop() if layers else ()
        self.vocab_size = vocab.pop() if vocab else None
        self.has_budget = any(m.has_budget for m in members.values())
        limits = [m.max_batch_size for m in members.values() if m.max_batch_size is not None]
        self.max_batch_size = min(limits) if limits else None
        contexts = [m.max_context for m in members.values() if m.max_context is not None]
        self.max_context = min(contexts) if contexts else None
        self._route: dict[int, str] = {}  # request id -> member name (absent: the default)

    @property
    def max_tree_nodes(self) -> int:  # a member's budget may change its own
        return max(m.max_tree_nodes for m in self.members.values())

    def route(self, request_id: int, name: str | None) -> None:
        """Draft request ``request_id`` with member ``name`` (None: the default). Before the
        request's first step: its member keeps its state from the prefill on."""
        if name is not None and name not in self.members:
            raise ValueError(f"proposer must be one of {sorted(self.members)}, got {name!r}")
        self._route[request_id] = name or self.default

    def member_of(self, request_id: int) -> str:
        """The name of the member that drafts for ``request_id``."""
        return self._route.get(request_id, self.default)

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        groups: dict[str, list[int]] = {}
        for b, request in enumerate(requests):
            groups.setdefault(self.member_of(request.request_id), []).append(b)
        trees, order = [], []
        for name, members in groups.items():
            trees.append(self.members[name].propose([requests[b] for b in members]))
            order += members
        self.catch_up_s = sum(self.members[name].catch_up_s for name in groups)
        if len(trees) == 1:
            return trees[0]
        return TokenTree.concat(trees).select(sorted(range(len(order)), key=order.__getitem__))

    def observe(self, result: StepResult) -> None:
        groups: dict[str, list] = {}
        for request in result.requests:
            groups.setdefault(self.member_of(request.request_id), []).append(request)
        for name, requests in groups.items():
            self.members[name].observe(StepResult(requests))

    def observe_prefill(self, request_id: int, tokens: list[int], hidden: torch.Tensor) -> None:
        member = self.members[self.member_of(request_id)]
        if member.needs_hidden:
            member.observe_prefill(request_id, tokens, hidden)

    def release(self, request_id: int) -> None:
        self.members[self._route.pop(request_id, self.default)].release(request_id)

    def set_budget(self, num_nodes: int, depth: int) -> None:
        for member in self.members.values():
            if member.has_budget:
                member.set_budget(num_nodes, depth)

    def drafting_paths(self) -> dict[str, str]:
        return {name: path for m in self.members.values() for name, path in m.drafting_paths().items()}
