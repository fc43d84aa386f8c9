"""Static tree shapes (:class:`TreeShape`, sorted path tuples), the presets, and the shape that
maximises the expected accepted length for measured acceptance rates."""

from __future__ import annotations

import heapq
import itertools
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from treespec.tree.masks import NO_PARENT, pack_ancestor_mask

# --------------------------------------------------------------------------------------------
# Static tree shapes
# --------------------------------------------------------------------------------------------

Path = tuple[int, ...]


@dataclass(frozen=True)
class TreeShape:
    """A static tree shape: a validated, sorted set of root-to-node paths, compiled once.

    Node 0 is the root ``()``; node i >= 1 has path ``paths[i - 1]``. Paths are sorted by
    ``(len(path), path)``, so parents come before children and siblings are in rank order.
    Build with :meth:`from_paths` (or ``TreeShape(paths)``, the same thing).

    Fields (N = num_nodes, the root included; W = ceil(N / 32)):
        paths            N - 1 paths, sorted, the root excluded
        num_nodes        N
        parents          [N] parent node of each node, -1 at the root
        depth            [N] len(path); 0 at the root
        ranks            [N] top-k rank of each node's last step (path[-1]); -1 at the root
        tree_mask        [N, W] int32 ancestor-and-self bitmask (see pack_ancestor_mask)
        leaf_paths       paths of the nodes without children, in node order
        leaf_nodes       their node indices (one root-to-leaf branch each)
        max_depth        deepest node's depth (0 for the root alone)
        max_rank         largest rank used (-1 for the root alone)
        nodes_per_depth  [max_depth + 1] node count at each depth (1 at depth 0)
    """

    paths: tuple[Path, ...]
    num_nodes: int = field(init=False, repr=False, compare=False)
    parents: tuple[int, ...] = field(init=False, repr=False, compare=False)
    depth: tuple[int, ...] = field(init=False, repr=False, compare=False)
    ranks: tuple[int, ...] = field(init=False, repr=False, compare=False)
    tree_mask: torch.Tensor = field(init=False, repr=False, compare=False)
    leaf_paths: tuple[Path, ...] = field(init=False, repr=False, compare=False)
    leaf_nodes: tuple[int, ...] = field(init=False, repr=False, compare=False)
    max_depth: int = field(init=False, repr=False, compare=False)
    max_rank: int = field(init=False, repr=False, compare=False)
    nodes_per_depth: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        paths = _normalise_paths(self.paths)
        node_of = {(): 0} | {path: i + 1 for i, path in enumerate(paths)}
        parents = (NO_PARENT,) + tuple(node_of[path[:-1]] for path in paths)
        depth = (0,) + tuple(len(path) for path in paths)
        has_child = {path[:-1] for path in paths}
        leaf_nodes = tuple(node for path, node in node_of.items() if path not in has_child)
        derived = dict(
            paths=paths,
            num_nodes=len(paths) + 1,
            parents=parents,
            depth=depth,
            ranks=(-1,) + tuple(path[-1] for path in paths),
            tree_mask=pack_ancestor_mask(list(parents)),
            leaf_paths=tuple(paths[node - 1] if node else () for node in leaf_nodes),
            leaf_nodes=leaf_nodes,
            max_depth=max(depth),
            max_rank=max((path[-1] for path in paths), default=-1),
            nodes_per_depth=tuple(depth.count(d) for d in range(max(depth) + 1)),
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: derived once, here

    def cut(self, max_depth: int) -> TreeShape:
        """This shape without the nodes deeper than ``max_depth`` (a request close to its
        max_new_tokens needs no deeper guesses)."""
        if max_depth >= self.max_depth:
            return self
        return TreeShape.from_paths(p for p in self.paths if len(p) <= max_depth)

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]]) -> TreeShape:
        """Validate and sort root-to-node paths; ``()`` (the root, always node 0) is ignored."""
        return cls(tuple(paths))


def _normalise_paths(paths: Iterable[Sequence[int]]) -> tuple[Path, ...]:
    """Check paths (tuples of ints >= 0, no duplicates, every parent present); sort them."""
    seen: set[Path] = set()
    for raw in paths:
        if not isinstance(raw, (tuple, list)) or not all(
            isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in raw
        ):
            raise ValueError(f"path {raw!r} is not a tuple of ints")
        path = tuple(int(r) for r in raw)
        if any(r < 0 for r in path):
            raise ValueError(f"path {path} has a negative rank")
        if path in seen:
            raise ValueError(f"path {path} is given twice")
        if path:  # the root () is implicit
            seen.add(path)
    ordered = tuple(sorted(seen, key=lambda p: (len(p), p)))
    for path in ordered:
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"path {path} lacks its parent {path[:-1]}")
    return ordered


def chain(k: int) -> TreeShape:
    """k nodes after the root in one line, each the top-1 of its parent: (0,), (0, 0), ..."""
    if k < 0:
        raise ValueError(f"chain length must be >= 0, got {k}")
    return TreeShape.from_paths((0,) * d for d in range(1, k + 1))


def full_tree(branching: int, depth: int) -> TreeShape:
    """The full ``branching``-ary tree of the given depth: every path over ranks < branching."""
    if branching < 1 or depth < 0:
        raise ValueError(f"need branching >= 1 and depth >= 0, got {branching} and {depth}")
    ranks = range(branching)
    return TreeShape.from_paths(p for d in range(1, depth + 1) for p in itertools.product(ranks, repeat=d))


PRESETS: dict[str, TreeShape] = {
    "chain-2": chain(2),
    "chain-4": chain(4),
    "chain-8": chain(8),
    "binary-2": full_tree(2, 2),  # 6 nodes after the root
    "binary-3": full_tree(2, 3),  # 14
    "ternary-2": full_tree(3, 2),  # 12
    "quaternary-2": full_tree(4, 2),  # 20
}


# --------------------------------------------------------------------------------------------
# Choosing a static shape from measured acceptance rates
# --------------------------------------------------------------------------------------------


def _check_acceptance(acceptance: Sequence[Sequence[float]] | torch.Tensor) -> list[list[float]]:
    """acceptance[d][r] -> list of lists of floats, each in [0, 1] (rows may differ in length)."""
    if isinstance(acceptance, torch.Tensor) and acceptance.dim() != 2:
        raise ValueError(f"acceptance must be [depth, ranks], got shape {tuple(acceptance.shape)}")
    rows = acceptance.tolist() if isinstance(acceptance, torch.Tensor) else [list(row) for row in acceptance]
    if not rows or not all(rows):
        raise ValueError("acceptance needs at least one depth, each with at least one rank")
    for d, row in enumerate(rows):
        for r, rate in enumerate(row):
            if not 0.0 <= rate <= 1.0:  # also rejects NaN
                raise ValueError(f"acceptance[{d}][{r}] = {rate} is not a probability in [0, 1]")
    return rows


def _path_probability(path: Path, rates: list[list[float]]) -> float:
    prob = 1.0
    for d, r in enumerate(path):
        if d >= len(rates) or r >= len(rates[d]):
            raise ValueError(f"path {path}: no acceptance rate for rank {r} at depth {d + 1}")
        prob *= rates[d][r]
    return prob


def expected_accepted_length(shape: TreeShape, acceptance: Sequence[Sequence[float]] | torch.Tensor) -> float:
    """Expected number of drafted tokens a step accepts with this shape (the bonus token excluded).

    A node is accepted when all of its path is, with probability prod_i acceptance[i][path[i]];
    siblings are accepted in mutually exclusive events, so the expectation is the sum of the
    path probabilities. Tokens per step = 1 + this.
    """
    rates = _check_acceptance(acceptance)
    return sum(_path_probability(path, rates) for path in shape.paths)


def best_paths(rates: Sequence[Sequence[float]]) -> Iterator[tuple[float, Path]]:
    """Every path the table allows, by decreasing probability: (probability, path).

    ``rates[d][r]`` is the probability that the rank-r candidate at depth d + 1 is accepted given
    its parent was. A heap over the frontier (children of the paths given so far); ties go to the
    shorter path, then the lower ranks. The order :func:`best_tree` takes its nodes in, and the
    one the adaptive budget sums expected tokens over.
    """
    frontier = [(-rate, 1, (r,)) for r, rate in enumerate(rates[0])]  # (-prob, depth, path)
    heapq.heapify(frontier)
    while frontier:
        neg_prob, depth, path = heapq.heappop(frontier)
        yield -neg_prob, path
        if depth < len(rates):
            for r, rate in enumerate(rates[depth]):
                heapq.heappush(frontier, (neg_prob * rate, depth + 1, path + (r,)))


def best_tree(acceptance: Sequence[Sequence[float]] | torch.Tensor, num_nodes: int) -> TreeShape:
    """The shape of ``num_nodes`` nodes (root excluded) maximising expected_accepted_length.

    ``acceptance[d][r]`` is the probability that the rank-r candidate at depth d + 1 is accepted
    given its parent was (rows may have different lengths: only ranks in the table are used).

    Construction (Medusa's): start from the root and repeatedly add the frontier node (a child
    of a node already in the tree) with the largest path probability. Why this one: it is
    simple, and it is optimal for this objective. Rates are in [0, 1], so a path's probability
    never exceeds its prefix's; the N most probable paths are therefore closed under prefixes
    (ties broken towards shorter, then lower-ranked paths, which is the order used here), so
    they form a tree, and since the objective is a plain sum over nodes no other tree of N
    nodes scores more. The greedy loop adds exactly those paths, in order. Sequoia's dynamic
    program is the alternative: it also models children sampled without replacement (the k-th
    sibling's rate conditioned on the earlier ones being rejected) and hardware cost. We do not
    need it: whatever the verifier, measuring the rank-r rate as "accepted given the parent
    was" keeps the objective a sum of monotone path probabilities, which greedy already solves.

    Ties in path probability (e.g. zero rates once the useful nodes are used up) go to the
    shorter path, then the lower ranks. Raises ValueError when the table allows fewer nodes.
    """
    rates = _check_acceptance(acceptance)
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    chosen = [path for _, path in itertools.islice(best_paths(rates), num_nodes)]
    if len(chosen) < num_nodes:
        raise ValueError(f"the acceptance table allows only {len(chosen)} nodes, {num_nodes} asked")
    return TreeShape.from_paths(chosen)
