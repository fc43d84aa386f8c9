"""The flattened ragged batch of B requests' token trees (:class:`TokenTree`) and what the host
knows of it without reading the device (:class:`TreeHost`)."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from treespec.tree.masks import pack_ancestor_mask


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
    def equal_sized(
        cls, flat: tuple[torch.Tensor, ...], num_requests: int, max_depth: int, max_children: int
    ) -> TokenTree:
        """B trees of the same size laid back to back, as a native drafter writes them: ``flat``
        (tokens, parents, depth [B * n] long, tree_mask [B * n, W] int32); the host knows their
        sizes, a depth bound and a bound on any node's children, and reads nothing."""
        tokens, parents, depth, mask = flat
        size = len(tokens) // num_requests
        cu_nodes = torch.arange(num_requests + 1, device=tokens.device) * size
        host = TreeHost((size,) * num_requests, max_depth, max_children=max_children)
        return cls(tokens, parents, depth, cu_nodes, mask, None, host)

    @classmethod
    def roots(cls, tokens: Sequence[int]) -> TokenTree:
        """The tree of a step that drafts nothing: one root per request (its last committed
        token), the tree every proposer returns when its budget is zero. Laid out directly: a
        step of plain decoding builds one (what ``from_lists`` would give, without its per-tree
        masks and checks)."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("roots needs at least one request's token")
        n = len(tokens)
        host = TreeHost((1,) * n, 0, tuple(tokens), (-1,) * n, 0)
        return cls(torch.tensor(tokens, dtype=torch.long), torch.full((n,), -1, dtype=torch.long),
                   torch.zeros(n, dtype=torch.long), torch.arange(n + 1), torch.ones((n, 1), dtype=torch.int32),
                   None, host)  # fmt: skip

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
