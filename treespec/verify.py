"""The tree rejection sampler: which drafted nodes the target keeps, plus one token of its own.

Terminology (the words reappear in identifiers):
    root       node 0 of a request's tree: its last committed token. Always kept: its K/V was
               written in this step and its logits predict the first new token.
    accepted   a drafted node the target keeps. The walk starts at the root and at each node
               moves to the child the target accepts, or stops.
    bonus      the one token the target adds after the last accepted node, so that every step
               commits at least one token.
    recovered  a bonus drawn from the residual distribution left after rejections (as opposed
               to a fresh draw from the target at a node whose children were not tried).
    target_probs / draft_probs   the target's distribution p (after temperature, top-k, top-p)
               and the draft's distribution q at a node, over the next token.

Modes (what each guarantees is argued in docs/verification.md):
    greedy         temperature 0: accept the child equal to the target's argmax at its parent;
                   the bonus is that argmax. Output equals greedy decoding of the target.
    deterministic  top-k children, tried in order: accept x with probability p(x); on
                   rejection p(x) <- 0 and renormalise; the bonus is drawn from what remains.
                   Lossless: the committed tokens are distributed exactly as under p.
    sampled        children drawn one after another from q without replacement: accept x with
                   probability min(1, p(x) / q(x)); on rejection p <- norm(max(p - q, 0)) and
                   q <- q without x (renormalised) before the next sibling. Lossless.
                   ``deterministic`` is this rule with a one-hot q.
    typical        Medusa's typical acceptance (lossy, opt-in): x passes if
                   p(x) > min(eps, delta * exp(-H(p))); the deepest path of passing nodes wins
                   (first in node order on ties); the bonus is drawn from p at its end.

Randomness is an input: ``uniforms [T, 2]`` (column 0: the acceptance test of node t as a child;
column 1: the bonus draw if the walk ends at node t), or a ``torch.Generator`` to draw them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from treespec.sampling import SamplingParams, argmax, logits_to_probs, reads_are_free, sample_from_uniforms
from treespec.tree import TokenTree

Mode = Literal["greedy", "deterministic", "sampled", "typical"]
MODES = ("greedy", "deterministic", "sampled", "typical")
NO_NODE = -1  # padding in children tables and paths
MEDUSA_TYPICAL = (0.09, 0.3)  # (eps, delta) of typical acceptance, Medusa's defaults
_TINY = 1e-30  # keeps a renormalisation finite when a residual is (numerically) empty


@dataclass(frozen=True)
class VerifyOutput:
    """What the target keeps of each request's tree, on the device.

    Shapes (B requests, D = the trees' depth bound, ``TokenTree.max_depth``):
        paths         [B, D+1] long per request, the root (0) then each accepted node in path
                                order, as indices within the request's own tree; NO_NODE after
        num_accepted  [B] long     accepted drafted tokens (the root not counted)
        bonus_tokens  [B] long     the target's own token after the last accepted node

    The padded form needs no host sync to build; ``accepted_nodes`` / ``cu_accepted`` are the
    ragged view, and ``readback_table`` what the engine reads back, once per step.
    """

    paths: torch.Tensor
    num_accepted: torch.Tensor
    bonus_tokens: torch.Tensor

    @property
    def accepted_nodes(self) -> torch.Tensor:
        """[A] per request, the root then its accepted nodes, back to back (a host sync on a GPU)."""
        return self.paths[self.paths >= 0]

    @property
    def cu_accepted(self) -> torch.Tensor:
        """[B+1] request b owns accepted_nodes[cu_accepted[b]:cu_accepted[b+1]]."""
        cu = self.num_accepted.new_zeros(len(self.num_accepted) + 1)
        cu[1:] = (self.num_accepted + 1).cumsum(0)
        return cu

    def readback_table(self, tree: TokenTree) -> torch.Tensor:
        """[B, 2 (D+1)] long, on the device: the paths, then the committed tokens (the accepted
        drafted tokens, then the bonus; -1 after). :func:`parse_readback` reads it on the host."""
        starts = tree.cu_nodes[:-1, None]
        nodes = self.paths[:, 1:]
        drafted = torch.where(
            nodes >= 0, tree.tokens[(nodes + starts).clamp(0, max(tree.num_nodes - 1, 0))], -1
        )
        committed = torch.cat([drafted, drafted.new_full((len(drafted), 1), -1)], 1)
        committed.scatter_(1, self.num_accepted[:, None], self.bonus_tokens[:, None])
        return torch.cat([self.paths, committed], 1)

    def committed_tokens(self, tree: TokenTree) -> list[list[int]]:
        """Per request: the accepted drafted tokens, then the bonus (host sync)."""
        return [tokens for _, tokens in parse_readback(self.readback_table(tree).tolist())]

    def accepted_lists(self) -> list[list[int]]:
        """Per request, the kept node indices (root first), as the KV cache's commit wants them."""
        return [[n for n in row if n >= 0] for row in self.paths.tolist()]


def parse_readback(rows: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Host lists of :meth:`VerifyOutput.readback_table`: per request (kept nodes, committed tokens)."""
    out = []
    for row in rows:
        width = len(row) // 2
        nodes = [n for n in row[:width] if n >= 0]
        out.append((nodes, row[width : width + len(nodes)]))
    return out


def verify(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    *,
    mode: Mode | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    typical_eps: float = MEDUSA_TYPICAL[0],
    typical_delta: float = MEDUSA_TYPICAL[1],
    check: bool = True,
) -> VerifyOutput:
    """Walk every request's tree from its root and decide what the target keeps.

    ``mode`` defaults to ``greedy`` at temperature 0, else ``deterministic``. Ask for
    ``sampled`` explicitly, and only for trees whose children really were drawn from
    ``draft_probs`` without replacement: on top-k children that rule is not lossless.

    Shape:
        target_logits [T, V]: row t is the target's next-token logits at node t
        uniforms      [T, 2] in [0, 1), or None to draw them from ``generator``
    """
    mode = mode or ("greedy" if params.greedy else "deterministic")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if check:
        check_inputs(tree, target_logits, mode, uniforms)
    if mode == "greedy":
        return _verify_greedy(tree, target_logits)
    if params.greedy:
        raise ValueError(f"mode {mode!r} samples and needs temperature > 0")
    if uniforms is None:
        uniforms = torch.rand(tree.num_nodes, 2, generator=generator, device=target_logits.device)
    if mode == "typical":
        return _verify_typical(tree, target_logits, params, uniforms, typical_eps, typical_delta)
    return _verify_stochastic(tree, target_logits, params, uniforms, sampled_children=mode == "sampled")


def check_inputs(
    tree: TokenTree, target_logits: torch.Tensor, mode: str, uniforms: torch.Tensor | None
) -> None:
    """Raise ValueError naming the first thing that is wrong (shapes, structure, NaN/inf and where)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    num_nodes = tree.num_nodes
    if target_logits.dim() != 2 or target_logits.shape[0] != num_nodes:
        raise ValueError(f"target_logits must be [T={num_nodes}, V], got {tuple(target_logits.shape)}")
    for name in ("parents", "depth", "tree_mask"):
        if getattr(tree, name).shape[0] != num_nodes:
            raise ValueError(f"tree.{name} has {getattr(tree, name).shape[0]} rows for {num_nodes} tokens")
    if (
        int(tree.cu_nodes[0]) != 0
        or int(tree.cu_nodes[-1]) != num_nodes
        or bool((tree.cu_nodes.diff() < 1).any())
    ):
        raise ValueError(
            f"tree.cu_nodes must rise from 0 to {num_nodes} by >= 1, got {tree.cu_nodes.tolist()}"
        )
    _check_parents(tree)
    vocab = target_logits.shape[1]
    if bool(((tree.tokens < 0) | (tree.tokens >= vocab)).any()):
        raise ValueError(f"tree tokens must lie in [0, {vocab})")
    _check_finite(target_logits, tree, "target_logits")
    if mode == "sampled":
        if tree.draft_probs is None or tree.draft_probs.shape != target_logits.shape:
            shape = None if tree.draft_probs is None else tuple(tree.draft_probs.shape)
            raise ValueError(
                f"sampled mode needs tree.draft_probs of shape {tuple(target_logits.shape)}, got {shape}"
            )
        # Two row reductions instead of elementwise masks: a sum is non-finite iff a row holds
        # NaN or inf, and a row's min is negative iff it holds a negative entry.
        bad = ~torch.isfinite(tree.draft_probs.sum(-1)) | (tree.draft_probs.amin(-1) < 0)
        if bool(bad.any()):
            raise ValueError(f"draft_probs row {int(bad.nonzero()[0])} has a negative or non-finite entry")
    if uniforms is not None and uniforms.shape != (num_nodes, 2):
        raise ValueError(f"uniforms must be [T={num_nodes}, 2], got {tuple(uniforms.shape)}")


def _check_parents(tree: TokenTree) -> None:
    local = torch.arange(tree.num_nodes, device=tree.tokens.device) - tree.cu_nodes[_node_requests(tree)]
    is_root = local == 0
    bad = torch.where(is_root, tree.parents != NO_NODE, (tree.parents < 0) | (tree.parents >= local))
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        raise ValueError(
            f"node {int(local[t])} (row {t}) has parent {int(tree.parents[t])}: roots need -1, other nodes a "
            "parent in range that comes before them"
        )


def _check_finite(logits: torch.Tensor, tree: TokenTree, name: str) -> None:
    # -inf marks a banned token (logits processors use it); NaN, +inf or a row of only -inf is an
    # error. One reduction finds all three: a row's max is NaN, +inf or -inf exactly then.
    bad = ~torch.isfinite(logits.amax(-1))
    if bool(bad.any()):
        t = int(bad.nonzero()[0])
        b = (
            int(torch.searchsorted(tree.cu_nodes, torch.tensor(t, device=tree.cu_nodes.device), right=True))
            - 1
        )
        raise ValueError(
            f"{name} row {t} (request {b}, node {t - int(tree.cu_nodes[b])}) holds NaN or +inf, or only -inf"
        )


def _node_requests(tree: TokenTree) -> torch.Tensor:
    """[T] request index of each node."""
    return torch.repeat_interleave(
        torch.arange(tree.num_requests, device=tree.tokens.device),
        tree.cu_nodes.diff(),
        output_size=tree.num_nodes,
    )


def _global_parents(tree: TokenTree, root_fill: int = NO_NODE) -> torch.Tensor:
    """[T] each node's parent as a row of the flattened batch; ``root_fill`` at the roots."""
    return torch.where(tree.parents >= 0, tree.parents + tree.cu_nodes[_node_requests(tree)], root_fill)


def children_table(tree: TokenTree) -> torch.Tensor:
    """[T, C] global indices of each node's children in node order, NO_NODE-padded.

    C is the tree's ``max_children`` bound when its builder gave one (nothing is read from the
    device), else the widest node's count (one host sync)."""
    num_nodes = tree.num_nodes
    global_parent = _global_parents(tree)
    key = torch.where(global_parent >= 0, global_parent, num_nodes)  # roots sort last, to a spare row
    # Rank among siblings: position minus the first position of the same parent (sorted stably,
    # so siblings keep node order).
    order = torch.argsort(key, stable=True)
    parent_of = key[order]
    rank = torch.arange(num_nodes, device=key.device) - torch.searchsorted(parent_of, parent_of)
    width = tree.max_children()
    if width is None:
        width = int(torch.where(parent_of < num_nodes, rank, -1).max()) + 1 if num_nodes else 0
    width = max(width, 1)
    table = torch.full((num_nodes + 1, width + 1), NO_NODE, dtype=torch.long, device=key.device)
    table[parent_of, rank.clamp(max=width)] = order  # roots land in the spare row
    return table[:num_nodes, :width]


def _verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> VerifyOutput:
    """Accept each node whose token is the target's argmax at its parent, if its parent was
    accepted; the deepest accepted node ends the path, and its argmax is the bonus.

    Siblings carry distinct tokens, so at most one child of a node matches and the accepted
    nodes are one path from the root: each sits in the path's column of its depth. On the
    device, one pass per level of the tree's depth bound: nothing is read back (the engine reads
    the result once per step)."""
    best = argmax(target_logits)  # [T]
    parent = _global_parents(tree).clamp(min=0)  # a root points at itself
    match = (tree.parents < 0) | (tree.tokens == best[parent])
    kept = match
    for _ in range(tree.max_depth()):
        kept = match & kept[parent]
    request = _node_requests(tree)
    width = tree.max_depth() + 1
    local = torch.arange(tree.num_nodes, device=kept.device) - tree.cu_nodes[request]
    paths = torch.full((tree.num_requests, width + 1), NO_NODE, dtype=torch.long, device=kept.device)
    paths[request, torch.where(kept, tree.depth, width)] = local  # the rest lands in a spare column
    paths = paths[:, :width]
    num_accepted = (paths >= 0).sum(1) - 1
    last = tree.cu_nodes[:-1] + paths.gather(1, num_accepted[:, None])[:, 0]
    return VerifyOutput(paths, num_accepted, best[last])


def _deepest_kept(tree: TokenTree, kept: torch.Tensor, request: torch.Tensor) -> torch.Tensor:
    """[B] global index of each request's deepest kept node (first in node order on ties)."""
    index = torch.arange(tree.num_nodes, device=kept.device)
    score = torch.where(kept, tree.depth * tree.num_nodes + (tree.num_nodes - 1 - index), -1)  # unique, >= 0
    best = torch.full((tree.num_requests,), -1, dtype=torch.long, device=kept.device).scatter_reduce(
        0, request, score, "amax"
    )
    return tree.num_nodes - 1 - best % tree.num_nodes  # the score's node, decoded (roots are kept: best >= 0)


def _finish(tree: TokenTree, last: torch.Tensor, bonus: torch.Tensor) -> VerifyOutput:
    """Paths from each root to ``last [B]`` (global indices) -> the padded output, on the device."""
    batch, width = tree.num_requests, tree.max_depth() + 1
    num_accepted = tree.depth[last]
    rows = torch.arange(batch, device=last.device)
    path = torch.full((batch, width + 1), NO_NODE, dtype=torch.long, device=last.device)  # last: a spare
    node = last.clone()
    global_parent = _global_parents(tree)
    for _ in range(width):  # walk up from the last node, writing depths from the bottom
        live = node >= 0
        at = node.clamp(min=0)
        path[rows, torch.where(live, tree.depth[at], width)] = torch.where(live, node, NO_NODE)
        node = torch.where(live, global_parent[at], NO_NODE)
    path = path[:, :width]
    local = torch.where(path >= 0, path - tree.cu_nodes[:-1, None], NO_NODE)
    return VerifyOutput(local, num_accepted, bonus)


def _verify_stochastic(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    uniforms: torch.Tensor,
    *,
    sampled_children: bool,
) -> VerifyOutput:
    """Recursive rejection sampling down the tree (see the module doc).

    One pass per level of the tree's depth bound, every request in each (a request whose walk
    has ended only masks its rows); within a level, siblings in rank order. Fixed shapes and
    masks instead of compaction, so nothing is read from the device. Where reads are free (a
    CPU: :func:`treespec.sampling.reads_are_free`) the loops stop once no request walks or tries
    a child: the same results, without the passes that would change nothing."""
    children = children_table(tree)  # [T, C]
    current = tree.cu_nodes[:-1].clone()  # [B] global index of each request's current node
    bonus = torch.zeros_like(current)
    walking = torch.ones_like(current, dtype=torch.bool)
    stop_early = reads_are_free(current.device)
    for _ in range(tree.max_depth() + 1):  # a walk ends at a leaf by then
        if stop_early and not bool(walking.any()):
            break
        node = current
        target_probs = logits_to_probs(target_logits[node], params)  # [B, V]
        draft_probs = tree.draft_probs[node].float() if sampled_children else None
        next_node = torch.full_like(node, NO_NODE)
        for rank in range(children.shape[1]):
            child = children[node, rank]
            trying = walking & (child >= 0) & (next_node < 0)
            if stop_early and not bool(trying.any()):
                break
            at = child.clamp(min=0)
            token = tree.tokens[at]
            p_x = target_probs.gather(1, token[:, None])[:, 0]
            if sampled_children:
                q_x = draft_probs.gather(1, token[:, None])[:, 0]
                accept_prob = (p_x / q_x.clamp(min=_TINY)).clamp(max=1.0)
            else:
                accept_prob = p_x
            accepted = trying & (uniforms[at, 0] < accept_prob)
            next_node = torch.where(accepted, child, next_node)
            rejected = (trying & ~accepted)[:, None]
            p_rows, q_rows = _residual(target_probs, draft_probs, token)
            target_probs = torch.where(rejected, p_rows, target_probs)
            if draft_probs is not None:
                draft_probs = torch.where(rejected, q_rows, draft_probs)
        stopping = walking & (next_node < 0)
        recovered = sample_from_uniforms(target_probs, uniforms[node, 1])
        bonus = torch.where(stopping, recovered, bonus)
        current = torch.where(walking & ~stopping, next_node, current)
        walking = walking & ~stopping
    return _finish(tree, current, bonus)


def _residual(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After rejecting ``token`` in every row: p <- norm(max(p - q, 0)), q <- norm(q without x).

    With no draft_probs (deterministic children) q is one-hot at ``token``, so p just loses x.

    Shape:
        target_probs, draft_probs [N, V]; token [N]
    """
    rows = torch.arange(len(token), device=token.device)
    if draft_probs is None:
        residual = target_probs.clone()
        residual[rows, token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp(min=0.0)
        draft_probs = draft_probs.clone()
        draft_probs[rows, token] = 0.0
        draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True).clamp(min=_TINY)
    # p == q empties the residual, but then x was accepted with probability 1: keep p.
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > _TINY, residual / mass.clamp(min=_TINY), target_probs), draft_probs


def _verify_typical(
    tree: TokenTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    uniforms: torch.Tensor,
    eps: float,
    delta: float,
) -> VerifyOutput:
    """Medusa's typical acceptance: lossy, but never rejects a token the target finds typical."""
    if not (0 < eps <= 1 and delta >= 0):
        raise ValueError(
            f"typical acceptance needs 0 < eps <= 1 and delta >= 0, got eps={eps}, delta={delta}"
        )
    target_probs = logits_to_probs(target_logits, params)  # [T, V]
    entropy = -torch.special.xlogy(target_probs, target_probs).sum(-1)  # [T]; 0 log 0 = 0
    threshold = torch.minimum(torch.full_like(entropy, eps), delta * torch.exp(-entropy))
    request = _node_requests(tree)
    global_parent = _global_parents(tree, root_fill=0)
    passes = (tree.parents < 0) | (target_probs[global_parent, tree.tokens] > threshold[global_parent])
    kept = tree.parents < 0
    for _ in range(tree.max_depth()):
        kept = kept | (passes & kept[global_parent])
    last = _deepest_kept(tree, kept, request)
    bonus = sample_from_uniforms(target_probs[last], uniforms[last, 1])
    return _finish(tree, last, bonus)
