"""Token trees: static tree shapes (path tuples) and the flattened ragged batch of trees.

Terminology:
    root     node 0 of every request's tree: its last committed token, whose K/V is not cached
             yet. The root is the empty path ``()``.
    path     a root-to-node tuple of ranks: ``path[i]`` is the top-k rank taken at depth i + 1
             (the encoding Medusa and vLLM use). ``(0, 1)`` is the 2nd-best child of the best
             child of the root.
    shape    a :class:`TreeShape`: a validated, sorted set of paths, with everything derived
             from it once (parents, depths, ancestor bitmask, leaf paths).
    tree     a :class:`TokenTree`: B requests' trees flattened into one ragged batch, the form
             the target scores and the verifier reads.

Pure structures: nothing here touches a model or device state beyond the tensors it builds.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

BITS_PER_WORD = 32
NO_PARENT = -1  # the root's parent


def pack_bits(visible: torch.Tensor) -> torch.Tensor:
    """Pack a boolean visibility tensor into the attention contract's int32 words: the form of
    the vectorised builders (``words_from_bits`` packs the host-side builders' Python bitsets).

    Bit j of word w in row t is ``visible[..., t, 32*w + j]`` (two's complement for bit 31).

    Shape:
        visible [..., M, N] bool -> [..., M, max(1, ceil(N / 32))] int32
    """
    *lead, rows, cols = visible.shape
    num_words = max(1, -(-cols // BITS_PER_WORD))
    padded = torch.nn.functional.pad(visible, (0, num_words * BITS_PER_WORD - cols))
    bits = padded.view(*lead, rows, num_words, BITS_PER_WORD).long()
    shifts = torch.arange(BITS_PER_WORD, device=visible.device)
    words = (bits << shifts).sum(-1)  # distinct powers of two: the sum is the bitwise or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def ancestor_bits(parents: Sequence[int], *, forest: bool = False) -> list[int]:
    """Ancestor-and-self sets of one tree (or, with ``forest``, of several trees whose roots have
    parent -1) as Python-int bitsets: bit j of row t is set when node j is node t or an ancestor.
    Parents come before children.

    Shape:
        parents [N] -> N ints of N bits
    """
    rows: list[int] = []
    for node, parent in enumerate(parents):
        is_root = parent == NO_PARENT and (forest or node == 0)
        if not (is_root or 0 <= parent < node):
            raise ValueError(
                f"parent of node {node} is {parent}: node 0 must be the root ({NO_PARENT}) and every "
                "other parent must come before its child"
            )
        rows.append((1 << node) | (0 if is_root else rows[parent]))
    return rows


def words_from_bits(rows: Sequence[int], num_words: int | None = None) -> torch.Tensor:
    """Python-int bitsets -> the contract's int32 words (two's complement for bit 31).

    Shape:
        N ints -> [N, num_words] int32 (default: enough words for N bits)
    """
    num_words = num_words or max(1, -(-len(rows) // BITS_PER_WORD))
    words = [(bits >> (BITS_PER_WORD * w)) & 0xFFFFFFFF for bits in rows for w in range(num_words)]
    out = torch.tensor(words, dtype=torch.int64).view(len(rows), num_words)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def pack_ancestor_mask(
    parents: Sequence[int], *, forest: bool = False, num_words: int | None = None
) -> torch.Tensor:
    """Ancestor-and-self bitmask of one tree (or forest) given parent indices: the packing of
    the attention contract (kernels/tree_attention.py).

    Shape:
        parents [N] -> mask [N, num_words or ceil(N / 32)] int32
    """
    return words_from_bits(ancestor_bits(parents, forest=forest), num_words)


def chain_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[length, ceil(length / 32)] int32 ancestor bitmask of a chain: row i sees 0..i.

    Closed form (a prefill chunk may be thousands of tokens): word w of row i has its low
    ``clamp(i - 32 w + 1, 0, 32)`` bits set."""
    words = max(1, -(-length // BITS_PER_WORD))
    row = torch.arange(length, device=device)[:, None]
    first_bit = torch.arange(words, device=device)[None, :] * BITS_PER_WORD
    count = (row - first_bit + 1).clamp(0, BITS_PER_WORD)  # bits set in each word
    value = (torch.ones_like(count) << count) - 1  # int64; 2^32 - 1 for a full word
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


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


@dataclass(frozen=True)
class TreeHost:
    """What the host knows of a :class:`TokenTree` without reading the device.

    A proposer knows its trees' sizes (it chose them) and a bound on their depth, so the engine
    lays out the step and bounds verification's walk from these, and reads the device once per
    step (docs/architecture.md, "One read per step"). Trees built on the host (``from_lists``)
    also carry their tokens and parents.

    Fields (B requests, T nodes):
        sizes      [B] nodes per request
        max_depth  no node is deeper (an upper bound: exact for trees built on the host)
        tokens     [T] or None; parents [T] or None (within each request, -1 at the root)
        max_children  no node has more children (a bound; None: unknown, read when needed)
    """

    sizes: tuple[int, ...]
    max_depth: int
    tokens: tuple[int, ...] | None = None
    parents: tuple[int, ...] | None = None
    max_children: int | None = None


@dataclass(frozen=True)
class TokenTree:
    """B requests' token trees, flattened back to back (vLLM's layout, no padding).

    Node 0 of each request is its root. Parents index within the same request's tree and come
    before their children. Siblings carry distinct tokens.

    Shapes (T = total nodes, B = requests, V = vocabulary):
        tokens      [T] long    token of each node
        parents     [T] long    parent index within its own request's tree, -1 at the root
        depth       [T] long    0 at the root
        cu_nodes    [B+1] long  request b owns nodes cu_nodes[b]:cu_nodes[b+1]
        tree_mask   [T, W] int32  ancestor-and-self bitmask within each request (attention contract)
        draft_probs [T, V] float or None: row t is the draft distribution that node t's children
                    were drawn from (sampled-children verification); rows of leaves are unused
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    cu_nodes: torch.Tensor
    tree_mask: torch.Tensor
    draft_probs: torch.Tensor | None = None
    host: TreeHost | None = field(default=None, compare=False)  # what the host knows; None: read it

    @property
    def num_requests(self) -> int:
        return len(self.cu_nodes) - 1

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def sizes(self) -> list[int]:
        """Nodes per request: from ``host`` when the builder gave it, else a host sync."""
        if self.host is not None:
            return list(self.host.sizes)
        return (self.cu_nodes[1:] - self.cu_nodes[:-1]).tolist()

    def cu_list(self) -> list[int]:
        """``cu_nodes`` as a host list, from :meth:`sizes`."""
        return list(itertools.accumulate(self.sizes(), initial=0))

    def node_rows(self, members: Sequence[int]) -> list[int]:
        """The flat indices of requests ``members``' nodes, in that order (host ints)."""
        cu = self.cu_list()
        return [i for m in members for i in range(cu[m], cu[m + 1])]

    def max_depth(self) -> int:
        """No node is deeper: ``host``'s bound when the builder gave it, else a host sync."""
        if self.host is not None:
            return self.host.max_depth
        return int(self.depth.max()) if self.num_nodes else 0

    def max_children(self) -> int | None:
        """No node has more children: ``host``'s bound when the builder gave it, else None."""
        return None if self.host is None else self.host.max_children

    def to(self, device: torch.device | str) -> TokenTree:
        """The same tree with every tensor on ``device``."""
        probs = None if self.draft_probs is None else self.draft_probs.to(device)
        return TokenTree(
            self.tokens.to(device), self.parents.to(device), self.depth.to(device),
            self.cu_nodes.to(device), self.tree_mask.to(device), probs, self.host,
        )  # fmt: skip

    def select(self, members: Sequence[int]) -> TokenTree:
        """The trees of requests ``members`` (in that order), as one TokenTree. Laid out from the
        host's sizes: nothing is read from the device when the tree carries ``host``."""
        members = list(members)
        if members == list(range(self.num_requests)):
            return self
        index = self.node_rows(members)
        rows = torch.tensor(index, dtype=torch.long).to(self.tokens.device)
        picked = [self.sizes()[m] for m in members]
        host = None
        if self.host is not None:
            own = self.host
            host = TreeHost(
                tuple(picked), own.max_depth,
                None if own.tokens is None else tuple(own.tokens[i] for i in index),
                None if own.parents is None else tuple(own.parents[i] for i in index),
                own.max_children,
            )  # fmt: skip
        cu_nodes = torch.tensor(list(itertools.accumulate(picked, initial=0)), device=self.tokens.device)
        probs = None if self.draft_probs is None else self.draft_probs[rows]
        return TokenTree(
            self.tokens[rows],
            self.parents[rows],
            self.depth[rows],
            cu_nodes,
            self.tree_mask[rows],
            probs,
            host,
        )

    @staticmethod
    def concat(trees: Sequence[TokenTree]) -> TokenTree:
        """Several TokenTrees' requests back to back, in order (masks padded to the widest)."""
        width = max(t.tree_mask.shape[1] for t in trees)
        mask = torch.cat(
            [torch.nn.functional.pad(t.tree_mask, (0, width - t.tree_mask.shape[1])) for t in trees]
        )
        sizes = [n for t in trees for n in t.sizes()]
        device = trees[0].tokens.device
        cu_nodes = torch.tensor(list(itertools.accumulate(sizes, initial=0)), device=device)
        probs = None
        if all(t.draft_probs is not None for t in trees):
            probs = torch.cat([t.draft_probs for t in trees])
        hosts = [t.host for t in trees]
        host = None
        if all(h is not None for h in hosts):
            known = all(h.tokens is not None and h.parents is not None for h in hosts)
            host = TreeHost(
                tuple(sizes), max(h.max_depth for h in hosts),
                tuple(x for h in hosts for x in h.tokens) if known else None,
                tuple(x for h in hosts for x in h.parents) if known else None,
                None if any(h.max_children is None for h in hosts) else max(h.max_children for h in hosts),
            )  # fmt: skip
        return TokenTree(
            torch.cat([t.tokens for t in trees]), torch.cat([t.parents for t in trees]),
            torch.cat([t.depth for t in trees]), cu_nodes, mask, probs, host,
        )  # fmt: skip

    @classmethod
    def roots(cls, tokens: Sequence[int]) -> TokenTree:
        """The tree of a step that drafts nothing: one root per request (its last committed
        token), the tree every proposer returns when its budget is zero."""
        return cls.from_lists([[token] for token in tokens])

    @classmethod
    def from_lists(
        cls,
        tokens: list[list[int]],
        parents: list[list[int]] | None = None,
        draft_probs: torch.Tensor | None = None,
    ) -> TokenTree:
        """Build from per-request token lists and parent lists (None = each request is a chain).

        Validates the structure: a root first, parents before children, distinct sibling tokens.
        """
        if parents is None:
            parents = [list(range(-1, len(t) - 1)) for t in tokens]
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} token lists but {len(parents)} parent lists")
        for b, (toks, par) in enumerate(zip(tokens, parents, strict=True)):
            if not toks or len(toks) != len(par):
                raise ValueError(
                    f"request {b}: {len(toks)} tokens and {len(par)} parents (need the same, >= 1)"
                )
            _check_distinct_siblings(toks, par, b)
        flat_tokens = [t for toks in tokens for t in toks]
        if draft_probs is not None and draft_probs.shape[0] != len(flat_tokens):
            raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows for {len(flat_tokens)} nodes")
        return cls._from_host(torch.tensor(flat_tokens, dtype=torch.long), parents, draft_probs, flat_tokens)

    make_dummy = from_lists  # the name tests use, after vLLM's metadata classes

    @classmethod
    def from_parents(
        cls, tokens: torch.Tensor, parents: Sequence[Sequence[int]], draft_probs: torch.Tensor | None = None
    ) -> TokenTree:
        """A tree whose structure the host knows and whose tokens live on the device (a drafter's
        picks on a static shape): nothing is read from the device. The caller guarantees
        distinct siblings (top-k picks, or draws without replacement).

        Shape:
            tokens [T] long on any device; parents: per request, its N_b parents (sum = T)
        """
        if sum(len(p) for p in parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens for trees of {[len(p) for p in parents]} nodes")
        return cls._from_host(tokens.long(), parents, draft_probs, None)

    @classmethod
    def _from_host(
        cls,
        tokens: torch.Tensor,
        parents: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None,
        host_tokens: list[int] | None,
    ) -> TokenTree:
        """The structure laid out on the host from the parents (masks, depths, offsets), copied to
        the tokens' device in one copy; ``host_tokens``: the tokens' host copy, if there is one."""
        masks = [pack_ancestor_mask(list(p)) for p in parents]
        width = max(m.shape[1] for m in masks)
        mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
        depth: list[int] = []
        for par in parents:
            d: list[int] = []
            for q in par:
                d.append(0 if q < 0 else d[q] + 1)
            depth += d
        sizes = tuple(len(p) for p in parents)
        flat_parents = [q for p in parents for q in p]
        layout = torch.tensor([*itertools.accumulate(sizes, initial=0), *flat_parents, *depth]).to(
            tokens.device
        )
        cu_nodes, flat, depth_t = layout.split([len(sizes) + 1, len(tokens), len(tokens)])
        host = TreeHost(
            sizes, max(depth, default=0), None if host_tokens is None else tuple(host_tokens),
            tuple(flat_parents), most_children(parents),
        )  # fmt: skip
        return cls(tokens, flat, depth_t, cu_nodes, mask.to(tokens.device), draft_probs, host)

    def validate(self) -> None:
        """Raise ValueError unless every invariant of the class docstring holds.

        Rebuilds the tree with :meth:`from_lists` (root first, parents before children, distinct
        siblings) and compares depth and the bitmask. Host syncs throughout: for tests and
        debugging, not the decode loop.
        """
        num_nodes = self.num_nodes
        cu = self.cu_nodes.tolist()
        if cu[0] != 0 or cu[-1] != num_nodes or any(end <= start for start, end in itertools.pairwise(cu)):
            raise ValueError(f"cu_nodes {cu} must start at 0, rise strictly and end at {num_nodes} nodes")
        for name in ("parents", "depth"):
            if getattr(self, name).shape != (num_nodes,):
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({num_nodes},)"
                )
        if self.tree_mask.dim() != 2 or self.tree_mask.shape[0] != num_nodes:
            raise ValueError(f"tree_mask has shape {tuple(self.tree_mask.shape)} for {num_nodes} nodes")
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        spans = list(itertools.pairwise(cu))
        rebuilt = TokenTree.from_lists([tokens[a:b] for a, b in spans], [parents[a:b] for a, b in spans])
        if not torch.equal(self.depth.cpu(), rebuilt.depth):
            raise ValueError("depth does not match the parents")
        width = max(self.tree_mask.shape[1], rebuilt.tree_mask.shape[1])
        pad = torch.nn.functional.pad
        mine = pad(self.tree_mask.cpu(), (0, width - self.tree_mask.shape[1]))
        if not torch.equal(mine, pad(rebuilt.tree_mask, (0, width - rebuilt.tree_mask.shape[1]))):
            raise ValueError("tree_mask is not the ancestor-and-self bitmask of the parents")
        if self.draft_probs is not None and self.draft_probs.shape[0] != num_nodes:
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for {num_nodes} nodes")
        if self.host is not None:
            self._validate_host(cu, tokens, parents, rebuilt)

    def _validate_host(
        self, cu: list[int], tokens: list[int], parents: list[int], rebuilt: TokenTree
    ) -> None:
        """The host's mirror must agree with the tensors: the engine lays out steps from it."""
        own, real = self.host, rebuilt.host
        problems = [
            f"sizes {list(own.sizes)} for cu_nodes {cu}" if list(own.sizes) != list(real.sizes) else "",
            f"max_depth {own.max_depth} < {real.max_depth}" if own.max_depth < real.max_depth else "",
            f"max_children {own.max_children} < {real.max_children}"
            if own.max_children is not None and own.max_children < real.max_children
            else "",
            "tokens differ from the tensor's"
            if own.tokens is not None and list(own.tokens) != tokens
            else "",
            "parents differ from the tensor's"
            if own.parents is not None and list(own.parents) != parents
            else "",
        ]
        if any(problems):
            raise ValueError(
                f"the tree's host mirror disagrees with it: {'; '.join(p for p in problems if p)}"
            )


def most_children(parents: Iterable[Sequence[int]]) -> int:
    """The most children any node has, over trees given by their parent lists (0: roots alone)."""
    counts = [collections.Counter(p for p in par if p >= 0) for par in parents]
    return max((max(c.values(), default=0) for c in counts), default=0)


def host_structure(trees: Sequence[TokenTree]) -> list[tuple[list[int], list[int], list[int]]]:
    """(cu_nodes, tokens, parents) of each tree as host lists: from ``host`` where a tree carries
    them, the rest read back together, in one host sync."""
    missing = [t for t in trees if t.host is None or t.host.tokens is None or t.host.parents is None]
    read = iter(torch.cat([torch.cat([t.tokens, t.parents]) for t in missing]).tolist() if missing else [])
    out = []
    for tree in trees:
        if tree.host is not None and tree.host.tokens is not None and tree.host.parents is not None:
            out.append((tree.cu_list(), list(tree.host.tokens), list(tree.host.parents)))
            continue
        n = tree.num_nodes
        tokens, parents = [next(read) for _ in range(n)], [next(read) for _ in range(n)]
        out.append((tree.cu_list(), tokens, parents))
    return out


def _check_distinct_siblings(tokens: list[int], parents: list[int], request: int) -> None:
    seen: set[tuple[int, int]] = set()
    for token, parent in zip(tokens[1:], parents[1:], strict=True):
        if (parent, token) in seen:
            raise ValueError(f"request {request}: node {parent} has two children with token {token}")
        seen.add((parent, token))


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


# --------------------------------------------------------------------------------------------
# Builders: per-request tokens on a tree, flattened into a TokenTree
# --------------------------------------------------------------------------------------------


def _ancestors(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-and-self relation and depth of B trees by following parent pointers.

    Shape:
        parents [B, M] (-1 at node 0, parents before children) -> anc [B, M, M] bool, depth [B, M]
    """
    num_trees, num_nodes = parents.shape
    anc = torch.eye(num_nodes, dtype=torch.bool, device=parents.device).expand(num_trees, -1, -1).clone()
    depth = torch.zeros_like(parents)
    node = torch.arange(num_nodes, device=parents.device).expand(num_trees, -1)
    for _ in range(max_depth):  # one level up per pass
        node = torch.where(node >= 0, parents.gather(1, node.clamp(min=0)), NO_PARENT)
        up = node >= 0
        anc |= torch.nn.functional.one_hot(node.clamp(min=0), num_nodes).bool() & up[..., None]
        depth += up
    return anc, depth


def extend_ancestors(visible: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Add K nodes to B forests' ancestor-and-self relations, on the device: a new node sees
    itself and what its parent sees (parent -1: a root of the forest, it sees only itself).

    Shape:
        visible [B, N, N] bool, parents [B, K] long (indices < N, or -1) -> [B, N + K, N + K]
    """
    n, k = visible.shape[1], parents.shape[1]
    grown = torch.nn.functional.pad(visible, (0, k, 0, k))
    own = torch.eye(n + k, dtype=torch.bool, device=visible.device)[n:]  # [K, N+K]
    if n == 0:  # the first level: every parent is a root
        grown[:, n:] = own
        return grown
    inherited = grown[:, :n].gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, n + k))  # [B, K, N+K]
    grown[:, n:] = (inherited & (parents >= 0)[..., None]) | own
    return grown


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
    anc, depth = _ancestors(parents, max_depth)  # [B, M, M], [B, M]
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
