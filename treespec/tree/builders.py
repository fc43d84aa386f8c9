"""Builders: per-request tokens on a static shape or an EAGLE-2 dynamic tree, flattened into a
:class:`TokenTree`; the sizes a dynamic tree can take."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from treespec.tree.masks import NO_PARENT, ancestors_and_depth, pack_bits
from treespec.tree.shapes import TreeShape
from treespec.tree.token_tree import TokenTree, TreeHost, most_children


def dynamic_capacity(top_k: int, depth: int) -> int:
    """Drafted nodes an EAGLE-2 dynamic tree can rerank: the root's top_k children, then top_k
    children of each of the top_k frontier nodes at every further level."""
    return top_k + (depth - 1) * top_k * top_k


def check_dynamic_budget(
    top_k: int,
    depth: int,
    num_nodes: int,
    *,
    vocab: int,
    names: tuple[str, str, str] = ("top_k", "depth", "num_nodes"),
) -> None:
    """Refuse an EAGLE-2 dynamic tree that cannot exist: it needs 1 <= top_k <= the vocabulary
    it ranks (``vocab``), depth >= 1 and 1 <= num_nodes <= :func:`dynamic_capacity`. ``names``:
    what the caller calls the three (a proposer's own argument names)."""
    capacity = dynamic_capacity(top_k, depth) if top_k >= 1 and depth >= 1 else 0
    if not (1 <= top_k <= vocab and depth >= 1 and 1 <= num_nodes <= capacity):
        k, d, n = names
        raise ValueError(
            f"a dynamic tree needs 1 <= {k} <= the vocabulary it ranks ({vocab}), {d} >= 1 and 1 <= {n} <= "
            f"{k} + ({d} - 1) * {k}^2; got {k}={top_k}, {d}={depth}, {n}={num_nodes}"
        )


def fit_dynamic_budget(
    top_k: int, max_depth: int, max_nodes: int, num_nodes: int, depth: int
) -> tuple[int, int]:
    """(depth, num_nodes) of a dynamic tree for a requested budget, within the sizes a proposer
    was built for: nodes clamped to [1, max_nodes]; depth clamped to [1, max_depth] and to the
    node count (n nodes reach depth n at most: no idle levels, each costs a drafting pass), then
    deepened while it cannot hold the nodes; nodes cut to what that depth holds."""
    nodes = max(1, min(num_nodes, max_nodes))
    depth = max(1, min(depth, max_depth, nodes))
    while depth < max_depth and dynamic_capacity(top_k, depth) < nodes:
        depth += 1
    return depth, min(nodes, dynamic_capacity(top_k, depth))


def budget_top_k(max_top_k: int, num_nodes: int) -> int:
    """The frontier width of a dynamic tree of ``num_nodes`` drafted nodes: round(sqrt(2 n)),
    at most ``max_top_k`` (8 nodes: 4, 16: 6, 31: 8). Every level runs that many nodes through
    the head; a wider frontier for a small tree costs rows its nodes rarely use (on SmolLM2 with
    the shipped EAGLE head, 8 nodes at top_k 4 committed 2.19 tokens a step, at top_k 8 2.18,
    docs/results/2026-12-06-drafting-at-its-floor.md)."""
    return max(1, min(max_top_k, round(math.sqrt(2 * max(num_nodes, 1)))))


def _pack_trees(
    tokens: torch.Tensor,  # [B, M] long
    parents: torch.Tensor,  # [B, M] long, within the request, -1 at node 0, parents before children
    max_depth: int,
    draft_probs: torch.Tensor | None = None,  # [B, M, V]
    *,
    distinct: bool = False,
    max_children: int | None = None,
) -> TokenTree:
    """Deduplicate siblings, then flatten B trees of M candidate nodes into a TokenTree.

    A node repeating the token of an earlier sibling (lower index) is dropped with its whole
    subtree, so requests may end up with different sizes. Host syncs: the widest request (mask
    width) and boolean-mask flattening. ``distinct``: the caller guarantees distinct siblings
    (children taken from one top-k row): every tree keeps its M nodes and nothing is read from
    the device.
    """
    num_trees, num_nodes = tokens.shape
    anc, depth = ancestors_and_depth(parents, max_depth)  # [B, M, M], [B, M]
    if distinct:
        host = TreeHost((num_nodes,) * num_trees, max_depth, max_children=max_children)
        cu_nodes = torch.arange(num_trees + 1, device=tokens.device) * num_nodes
        probs = None if draft_probs is None else draft_probs.flatten(0, 1)
        mask = pack_bits(anc).flatten(0, 1)
        flat = (tokens.flatten(), parents.flatten(), depth.flatten())
        return TokenTree(*flat, cu_nodes, mask, probs, host)
    earlier = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=tokens.device).tril(-1)
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & earlier  # [B, M(node), M(other)]
    duplicate = (earlier_sibling & (tokens[:, :, None] == tokens[:, None, :])).any(-1)  # [B, M]
    keep = ~(anc & duplicate[:, None, :]).any(-1)  # no duplicate among a node's ancestors-and-self

    new_index = keep.long().cumsum(1) - 1  # [B, M] index within the request's kept nodes
    new_parents = torch.where(parents >= 0, new_index.gather(1, parents.clamp(min=0)), NO_PARENT)
    sizes = keep.sum(1)  # [B]
    cu_nodes = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    widest = int(sizes.max()) if num_trees else 1  # host sync
    # Move each kept column to its new index; dropped columns go to a spare last column.
    column = torch.where(keep, new_index, num_nodes)[:, None, :].expand(-1, num_nodes, -1)
    visible = anc.new_zeros(num_trees, num_nodes, num_nodes + 1).scatter_(2, column, anc & keep[:, None, :])
    mask = pack_bits(visible[..., :widest])  # [B, M, W]
    probs = None if draft_probs is None else draft_probs[keep]
    return TokenTree(tokens[keep], new_parents[keep], depth[keep], cu_nodes, mask[keep], probs)


def build_static_tree(
    shape: TreeShape,
    root_tokens: torch.Tensor,
    candidates: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    distinct: bool = False,
) -> TokenTree:
    """Put per-depth top-k candidates on a static shape, Medusa's way, for B requests at once.

    The node with path p gets ``candidates[b, len(p) - 1, p[-1]]``: depth d's candidates do not
    depend on the parent (one top-k per Medusa head). Siblings are distinct ranks of one top-k
    row; if a row repeats a token, the later sibling and its whole subtree are dropped for that
    request only, so requests can come out with different sizes.

    Pass ``draft_probs`` only when each candidates row was *sampled* from it (without
    replacement, in rank order) and verify with ``mode="sampled"``: that rule is exact only then.
    Top-k candidates (Medusa) need none: the default ``deterministic`` rule is exact for them.
    ``distinct``: every candidates row holds distinct tokens (a top-k), so nothing is dropped,
    every request gets the whole shape, and nothing is read from the device.

    Shape:
        root_tokens [B] long, candidates [B, D, K] long with D >= shape.max_depth and
        K > shape.max_rank, draft_probs [B, D, V] or None (row d is the distribution the
        depth-(d+1) candidates came from) -> TokenTree; node t's draft_probs row is
        draft_probs[b, depth(t)], zeros where depth(t) >= D
    """
    if root_tokens.dim() != 1 or candidates.dim() != 3 or candidates.shape[0] != root_tokens.shape[0]:
        raise ValueError(
            f"need root_tokens [B] and candidates [B, D, K], got {tuple(root_tokens.shape)} "
            f"and {tuple(candidates.shape)}"
        )
    batch, num_depths, k = candidates.shape
    if num_depths < shape.max_depth or k <= shape.max_rank:
        raise ValueError(
            f"candidates [B, D={num_depths}, K={k}] cannot fill a shape of depth {shape.max_depth} "
            f"and max rank {shape.max_rank}: need D >= depth and K > max rank"
        )
    device = candidates.device
    depth = torch.tensor(shape.depth, device=device)  # [N]
    ranks = torch.tensor(shape.ranks, device=device)
    node_tokens = candidates[:, depth[1:] - 1, ranks[1:]]  # [B, N - 1]
    tokens = torch.cat([root_tokens[:, None].to(node_tokens.dtype), node_tokens], 1).long()  # [B, N]
    parents = torch.tensor(shape.parents, device=device).expand(batch, -1)
    rows = None
    if draft_probs is not None:
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (batch, num_depths):
            raise ValueError(
                f"draft_probs must be [B={batch}, D={num_depths}, V], got {tuple(draft_probs.shape)}"
            )
        rows = draft_probs[:, depth.clamp(max=num_depths - 1)]  # [B, N, V]
        rows = rows * (depth < num_depths)[None, :, None]  # nodes at depth D have no drafted children
    widest = max(most_children([shape.parents]), 1)
    return _pack_trees(tokens, parents, shape.max_depth, rows, distinct=distinct, max_children=widest)


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic trees
# --------------------------------------------------------------------------------------------

ExpandFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""expand(step, frontier_tokens [B, K], parent_slots [B, K]) -> next-token log-probs [B, K, V]."""


def _stable_top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, ties to the lower index. [B, P] -> [B, k]"""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]


def _grow_pool(
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    expand: ExpandFn,
    top_k: int,
    depth: int,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft every candidate node, in drafting order (the id layout of build_dynamic_tree).

    Returns tokens, cumulative log-prob scores and parent ids, each [B, P] with
    P = 1 + K + (depth - 1) * K * K; id 0 is the root (score 0, parent -1).
    """
    batch, k = root_tokens.shape[0], top_k
    score_dtype = torch.promote_types(root_logprobs.dtype, torch.float32)
    frontier_scores, frontier_tokens = root_logprobs.to(score_dtype).topk(k, dim=-1)  # [B, K]
    if token_ids is not None:  # columns of a reduced read-out -> token ids
        frontier_tokens = token_ids[frontier_tokens]
    frontier_ids = torch.arange(1, k + 1, device=root_tokens.device).repeat(batch, 1)  # [B, K]
    parent_slots = torch.full_like(frontier_ids, NO_PARENT)  # the first frontier's parent: the root
    tokens = [root_tokens[:, None].long(), frontier_tokens]
    scores = [frontier_scores.new_zeros(batch, 1), frontier_scores]
    parents = [torch.full_like(frontier_ids[:, :1], NO_PARENT), torch.zeros_like(frontier_ids)]
    first_id = 1 + k
    for step in range(1, depth):
        logprobs = expand(step, frontier_tokens, parent_slots)
        if logprobs.dim() != 3 or logprobs.shape[:2] != (batch, k) or logprobs.shape[2] < k:
            raise ValueError(f"expand returned {tuple(logprobs.shape)}, expected [B={batch}, K={k}, V >= K]")
        child_logprobs, child_tokens = logprobs.to(score_dtype).topk(k, dim=-1)  # [B, K, K]
        if token_ids is not None:
            child_tokens = token_ids[child_tokens]
        child_scores = (frontier_scores[:, :, None] + child_logprobs).flatten(1)  # [B, K*K]
        child_tokens = child_tokens.flatten(1)
        tokens.append(child_tokens)
        scores.append(child_scores)
        parents.append(frontier_ids[:, :, None].expand(-1, -1, k).flatten(1))
        best = _stable_top_indices(child_scores, k)  # [B, K] the next frontier
        frontier_ids, parent_slots = first_id + best, best // k  # child i * K + j has parent slot i
        frontier_tokens, frontier_scores = child_tokens.gather(1, best), child_scores.gather(1, best)
        first_id += k * k
    return torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1)


def build_dynamic_tree(
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    expand: ExpandFn,
    *,
    top_k: int,
    depth: int,
    num_nodes: int,
    return_scores: bool = False,
    check: bool = True,
    token_ids: torch.Tensor | None = None,
) -> TokenTree | tuple[TokenTree, torch.Tensor]:
    """Grow an EAGLE-2 dynamic tree for B requests at once; any draft head drives it via ``expand``.

    1. The root's top_k children (by ``root_logprobs``) are the first frontier; a node's score
       is its cumulative log-prob (sum along its path).
    2. For step = 1 .. depth - 1: ``expand`` gives the draft's next-token log-probs at every
       frontier node; each gets its top_k children (score = parent score + child log-prob);
       the next frontier is the top_k of these K*K children by score.
    3. Rerank every drafted node (all K*K children of every step, not only the frontier) by
       (score desc, drafting order) and keep the best ``num_nodes``. Log-probs are <= 0, so a
       child never outscores its parent, and on a tie the parent comes first in drafting order:
       the kept set is closed under ancestors. Kept nodes are emitted in drafting order, which
       is parents before children (by depth, then drafting order), the root first.

    What ``expand(step, frontier_tokens, parent_slots)`` receives:
        step             the depth of the frontier nodes, 1 .. depth - 1
        frontier_tokens  [B, K] long, the frontier nodes' tokens
        parent_slots     [B, K] long, for each frontier node the slot (0 .. K - 1) its parent had
                         in the previous call's frontier; -1 at step 1, where the parent is the root
    So a head keeps its per-node state (features, K/V) by frontier slot, level by level, and
    never needs the builder's own node numbering.
    It must return log-probabilities [B, K, V] (e.g. log_softmax), never raw logits.

    Shape:
        root_tokens [B] long, root_logprobs [B, V] -> TokenTree of num_nodes + 1 nodes per request;
        with return_scores, also scores [T] (cumulative draft log-prob per node, 0 at the root)
    ``token_ids`` [V] (distinct ids): the log-probs are over a reduced read-out whose column c is
    token ``token_ids[c]``, so a draft reading out over a few thousand tokens never widens its
    rows to the whole vocabulary; None: column c is token c.
    Ties between tokens of one distribution follow torch.topk. Siblings are distinct tokens of
    one top-k, so every request keeps num_nodes + 1 nodes. Host syncs: one, the check that the
    kept nodes are closed under ancestors; ``check=False`` skips it, for callers whose ``expand``
    returns log-probs by construction (a log_softmax).
    """
    if root_tokens.dim() != 1 or root_logprobs.dim() != 2 or root_logprobs.shape[0] != root_tokens.shape[0]:
        raise ValueError(
            f"need root_tokens [B] and root_logprobs [B, V], got {tuple(root_tokens.shape)} "
            f"and {tuple(root_logprobs.shape)}"
        )
    check_dynamic_budget(top_k, depth, num_nodes, vocab=root_logprobs.shape[1])
    if token_ids is not None and (
        token_ids.dim() != 1 or len(token_ids) != root_logprobs.shape[1] or token_ids.is_floating_point()
    ):
        raise ValueError(
            f"token_ids must be 1-D integer ids, one per log-prob column ({root_logprobs.shape[1]}), got "
            f"{token_ids.dtype} {tuple(token_ids.shape)}"
        )
    pool_tokens, pool_scores, pool_parents = _grow_pool(
        root_tokens, root_logprobs, expand, top_k, depth, token_ids
    )
    batch, pool_size = pool_tokens.shape
    kept = _stable_top_indices(pool_scores, num_nodes + 1).sort(dim=1).values  # [B, n+1] drafting order
    new_index = torch.full_like(pool_parents, NO_PARENT)  # [B, P] pool id -> index in the tree
    new_index.scatter_(1, kept, torch.arange(num_nodes + 1, device=kept.device).expand(batch, -1))
    parent_ids = pool_parents.gather(1, kept)
    parents = torch.where(parent_ids >= 0, new_index.gather(1, parent_ids.clamp(min=0)), NO_PARENT)
    if check and not bool((kept[:, 0] == 0).all() & (parents[:, 1:] >= 0).all()):  # host sync
        raise ValueError("kept nodes are not closed under ancestors: expand must return log-probs (<= 0)")
    tree = _pack_trees(pool_tokens.gather(1, kept), parents, depth, distinct=True, max_children=top_k)
    if return_scores:
        return tree, pool_scores.gather(1, kept).flatten()
    return tree
