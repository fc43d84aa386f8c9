"""N-gram proposer (prompt lookup): draft by copying what followed earlier occurrences of the tail.

No model is called. For each request the context is ``tokens`` (prompt, then generated tokens)
and the root is ``tokens[-1]``.

Terminology (the words reappear in identifiers):
    tail          the context's last n tokens, for n from ``max_ngram`` down to ``min_ngram``.
    match         an earlier occurrence of the tail, named by its end position p < len - 1 (the
                  tail itself, ending at len - 1, does not count). The largest n with any match
                  wins; up to ``max_matches`` of its matches are kept, most recent (largest p)
                  first.
    continuation  ``tokens[p + 1 : p + 1 + depth]`` of a match: what followed it. Never empty,
                  since p < len - 1; shorter near the end of the context.
    support       of a trie node: how many continuations pass through it.

The continuations are merged into a trie under the root. Siblings are ordered by support, then
by recency (the most recent continuation through them first): the deterministic-children
verifier tries children in node order, so the likeliest guess goes first. ``tree=False`` keeps
only the most recent match's continuation: a chain, what Hugging Face's prompt lookup drafts.

Children are picked without any coin, so ``sampled_children`` is False and the trees carry no
``draft_probs``: the engine verifies them with the lossless deterministic-children rule.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from treespec.presets import NGRAM_TREE
from treespec.proposers.base import ProposalRequest, Proposer, StepResult
from treespec.tree import NO_PARENT, TokenTree


def scan_match_ends(tokens: list[int], *, min_ngram: int, max_ngram: int, max_matches: int) -> list[int]:
    """End positions of the earlier occurrences of the longest matching tail, most recent first.

    The plain scan: O(len * max_ngram). It is the specification the proposer's index must agree
    with (tests compare the two), and fast enough for short contexts.
    """
    last = len(tokens) - 1
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > last:  # an earlier occurrence ends at some p with n - 1 <= p < last
            continue
        tail = tokens[-n:]
        ends = (p for p in range(last - 1, n - 2, -1) if tokens[p - n + 1 : p + 1] == tail)
        found = list(itertools.islice(ends, max_matches))
        if found:
            return found
    return []


def build_trie(root: int, continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge continuations (most recent first) into one trie under ``root``; return (tokens, parents).

    Keeps the ``max_nodes`` best drafted nodes by (support desc, depth asc, recency): a child has
    at most its parent's support and is deeper, so it always ranks below its parent and the kept
    set is closed under ancestors. Nodes come out breadth first, siblings by (support desc,
    recency), so parents come before children and node order is the order to try children in.
    """
    tokens, parents, depth = [root], [NO_PARENT], [0]
    support, first = [len(continuations)], [0]  # first: rank of the most recent match through it
    child_of: dict[tuple[int, int], int] = {}  # (node, token) -> child node
    for rank, continuation in enumerate(continuations):
        node = 0
        for token in continuation:
            child = child_of.get((node, token))
            if child is None:
                child = child_of[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
                depth.append(depth[node] + 1)
                support.append(0)
                first.append(rank)
            support[child] += 1
            node = child

    ranked = sorted(range(1, len(tokens)), key=lambda i: (-support[i], depth[i], first[i]))
    children: dict[int, list[int]] = {}
    for node in sorted(ranked[:max_nodes], key=lambda i: (-support[i], first[i])):
        children.setdefault(parents[node], []).append(node)

    out_tokens, out_parents, queue = [root], [NO_PARENT], [0]
    for new_index, node in enumerate(queue):  # queue grows while we walk it: breadth first
        for child in children.get(node, ()):
            out_tokens.append(tokens[child])
            out_parents.append(new_index)
            queue.append(child)
    return out_tokens, out_parents


@dataclass
class _NgramIndex:
    """One request's context as indexed so far; it only ever grows by appending."""

    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions, ascending


@dataclass
class _Acceptance:
    """One request's drafting record for the adaptive depth: accepted drafted tokens, and steps
    whose walk stopped at a rejected draft (both slowly forgotten while it does not draft)."""

    accepted: float = 0.0
    rejected: float = 0.0

    def rate(self) -> float:
        """Per-token acceptance estimate, Laplace's rule: 1/2 before any evidence."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)


class NgramProposer(Proposer):
    """Prompt-lookup drafting, extended to trees. One n-gram index per request id.

    The index maps every n-gram (min_ngram <= n <= max_ngram) of the context to the positions
    where it ends. ``observe`` extends it with the committed tokens; ``propose`` checks that the
    request's context extends what was indexed (rebuilding it if not), so results never depend
    on ``observe`` having been called.
    """

    def __init__(
        self,
        *,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_depth: int = NGRAM_TREE["max_depth"],
        max_nodes: int = NGRAM_TREE["max_nodes"],
        max_matches: int = 8,
        tree: bool = True,
        token_cost: float = 0.0,
    ) -> None:
        """``token_cost``: what verifying one more drafted token costs, as a fraction of a whole
        target step (0 on a GPU with spare compute: always draft ``max_depth``; about 0.3 for
        SmolLM2-135M on a 2-core CPU). Above 0 each request drafts the depth d that maximises
        expected tokens per unit of cost, sum_{i<=d} a^i / (1 + token_cost * d), with its
        acceptance rate a estimated from what it committed so far (prior 1/2)."""
        for name, value in [
            ("max_ngram", max_ngram),
            ("min_ngram", min_ngram),
            ("max_depth", max_depth),
            ("max_nodes", max_nodes),
            ("max_matches", max_matches),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        if not isinstance(tree, bool):
            raise ValueError(f"tree must be a bool, got {tree!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_nodes, self.max_matches = max_depth, max_nodes, max_matches
        self.tree = tree
        if not isinstance(token_cost, (int, float)) or not 0.0 <= token_cost:
            raise ValueError(f"token_cost must be a number >= 0, got {token_cost!r}")
        self.token_cost = float(token_cost)
        self._acceptance: dict[int, _Acceptance] = {}  # request id -> its record (token_cost > 0 only)
        # A trie has at most one node per continuation token; a chain is one continuation.
        drafted_bound = max_depth * (max_matches if tree else 1)
        self.max_tree_nodes = 1 + min(
            max_nodes, drafted_bound
        )  # root included; the engine sizes its cache by it
        self._indexes: dict[int, _NgramIndex] = {}
        self._budget = (max_nodes, max_depth)  # (nodes, depth) drafted from now on: set_budget

    has_budget = True

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Draft at most ``num_nodes`` nodes, ``depth`` deep, from the next step on (within the
        ``max_nodes`` and ``max_depth`` given at construction): the adaptive budget's sizes, or
        a fixed tree smaller than the proposer's own."""
        for name, value in (("num_nodes", num_nodes), ("depth", depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self._budget = (min(num_nodes, self.max_nodes), min(depth, self.max_depth))

    @property
    def indexed_requests(self) -> list[int]:
        """Request ids that currently hold an index (until ``release``)."""
        return sorted(self._indexes)

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        """One tree per request, in order; the root alone where nothing matches."""
        if not requests:
            raise ValueError("propose needs at least one request")
        tokens, parents = [], []
        for request in requests:
            request_tokens, request_parents = self._propose_one(request)
            tokens.append(request_tokens)
            parents.append(request_parents)
        return TokenTree.from_lists(tokens, parents)

    def observe(self, result: StepResult) -> None:
        """Extend each request's index with its committed tokens (ignored for an unknown id), and
        its acceptance record with what its tree won: the accepted nodes, and whether the walk
        stopped at a node whose drafted children were all rejected."""
        for request in result.requests:
            index = self._indexes.get(request.request_id)
            if index is not None:
                self._extend(index, request.committed)
            record = self._acceptance.get(request.request_id)
            if record is not None and len(request.tree_tokens) > 1:  # the step drafted something
                record.accepted += request.num_accepted
                record.rejected += request.rejected_at_last()

    def release(self, request_id: int) -> None:
        """Drop the request's index and acceptance record."""
        self._indexes.pop(request_id, None)
        self._acceptance.pop(request_id, None)

    def _affordable_depth(self, request_id: int, depth: int) -> int:
        """The depth worth drafting given the request's acceptance so far and token_cost."""
        if self.token_cost == 0.0:
            return depth
        record = self._acceptance.setdefault(request_id, _Acceptance())
        rate = record.rate()

        def value(d: int) -> float:
            return sum(rate**i for i in range(d + 1)) / (1 + self.token_cost * d)

        best = max(range(depth + 1), key=lambda d: (value(d), -d))
        if best == 0:  # not drafting gives no evidence: forget slowly, so that it probes again
            record.accepted *= 0.9
            record.rejected *= 0.9
        return best

    def _propose_one(self, request: ProposalRequest) -> tuple[list[int], list[int]]:
        context = request.tokens
        if not context:
            raise ValueError(f"request {request.request_id} has no tokens: its root is tokens[-1]")
        max_nodes, max_depth = self._budget
        depth = min(max_depth, request.max_new - 1)  # the bonus token always comes on top
        depth = self._affordable_depth(request.request_id, depth)
        index = self._index_for(request)  # kept current even when nothing is drafted
        if depth < 1:
            return [context[-1]], [NO_PARENT]
        num_matches = self.max_matches if self.tree else 1
        ends = self._match_ends(index, num_matches)
        continuations = [context[p + 1 : p + 1 + depth] for p in ends]
        return build_trie(context[-1], continuations, max_nodes)

    def _index_for(self, request: ProposalRequest) -> _NgramIndex:
        """The request's index, brought up to ``request.tokens`` (built or rebuilt as needed)."""
        context = request.tokens
        index = self._indexes.get(request.request_id)
        if index is None or context[: len(index.tokens)] != index.tokens:  # new id, or not an extension
            index = self._indexes[request.request_id] = _NgramIndex()
        self._extend(index, context[len(index.tokens) :])
        return index

    def _extend(self, index: _NgramIndex, new_tokens: list[int]) -> None:
        """Append tokens, indexing every n-gram that ends at each new position."""
        tokens, ends = index.tokens, index.ends
        for token in new_tokens:
            tokens.append(token)
            p = len(tokens) - 1
            for n in range(self.min_ngram, min(self.max_ngram, p + 1) + 1):
                ends.setdefault(tuple(tokens[p - n + 1 :]), []).append(p)

    def _match_ends(self, index: _NgramIndex, max_matches: int) -> list[int]:
        """Same answer as :func:`scan_match_ends`, from the index: O(max_ngram + max_matches)."""
        tokens = index.tokens
        last = len(tokens) - 1
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n > last:
                continue
            ends = index.ends.get(tuple(tokens[-n:]), [])
            found = list(itertools.islice(reversed(ends), 1, 1 + max_matches))  # ends[-1] is the tail
            if found:
                return found
        return []
