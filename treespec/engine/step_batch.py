"""One step's flattened rows (:class:`StepBatch`) and what the host learns from its one read
(:class:`StepReadback`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from treespec.engine.requests import Request
from treespec.tree import TokenTree, chain_mask
from treespec.verify import parse_readback


@dataclass
class StepBatch:
    """One step's flattened rows, on the model's device. Requests appear in running order;
    logits rows are ordered prefill-final rows first, then all tree nodes (so the verifier's
    logits are one slice). Laid out on the host from the prompts and the trees' host sizes:
    building it reads nothing from the device.

    Shapes (T rows, B requests):
        tokens [T], depth [T], tree_mask [T, W] int32 or None (all chains: causal), logit_rows [R]
    """

    tokens: torch.Tensor
    depth: torch.Tensor
    tree_mask: torch.Tensor | None
    logit_rows: torch.Tensor
    num_prefill_logits: int
    cu: list[int]  # [B+1] request b owns rows cu[b]:cu[b+1] (host)
    chunk_len: dict[int, int]  # prefill tokens carried per request id
    prefill_accepted: dict[int, range]  # per request id, what the cache keeps of its chunk: all of it
    final_chunk: set[int]  # request ids whose chunk ends their prompt

    def finishes_prefill(self, request: Request) -> bool:
        return request.request_id in self.final_chunk

    @classmethod
    def build(
        cls,
        running: list[Request],
        chunks: dict[int, list[int]],
        trees: TokenTree | None,
        device: torch.device,
    ) -> StepBatch:
        layout = _Layout.of(running, chunks, trees)
        # The step's host data reaches the device in one copy: prompt tokens, their depths, logit rows.
        logit_rows = layout.prefill_rows + layout.tree_rows
        host = torch.tensor(layout.prompt_tokens + layout.prompt_depth + logit_rows, dtype=torch.long).to(
            device
        )
        prompt_t, prompt_d, rows_t = host.split(
            [len(layout.prompt_tokens), len(layout.prompt_depth), len(logit_rows)]
        )
        tree_sizes = trees.sizes() if trees is not None else []
        has_branches = trees is not None and max(tree_sizes, default=1) > 1
        if not layout.prompt_tokens:  # decoding only: the trees are the step
            tokens, depth = trees.tokens, trees.depth
            mask = trees.tree_mask if has_branches else None
        else:
            sources = {"prompt": (prompt_t, prompt_d), "tree": (trees.tokens, trees.depth) if trees else None}
            tokens = torch.cat([sources[kind][0][i:j] for kind, i, j in layout.pieces])
            depth = torch.cat([sources[kind][1][i:j] for kind, i, j in layout.pieces])
            mask = _mixed_mask(layout.pieces, trees, device) if has_branches else None
        return cls(tokens, depth, mask, rows_t, len(layout.prefill_rows), layout.cu,
                   {r: len(c) for r, c in chunks.items()}, layout.accepted, layout.final)  # fmt: skip


@dataclass
class _Layout:
    """Where each request's rows lie in the step, worked out on the host: its piece (prompt chunk
    or tree, with its span in the prompt tokens or the trees' nodes), the rows that need logits,
    and what prefill keeps."""

    prompt_tokens: list[int] = field(default_factory=list)
    prompt_depth: list[int] = field(default_factory=list)
    pieces: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, start, stop), running order
    prefill_rows: list[int] = field(default_factory=list)
    tree_rows: list[int] = field(default_factory=list)
    final: set[int] = field(default_factory=set)
    accepted: dict[int, range] = field(default_factory=dict)
    cu: list[int] = field(default_factory=lambda: [0])

    @classmethod
    def of(cls, running: list[Request], chunks: dict[int, list[int]], trees: TokenTree | None) -> _Layout:
        tree_sizes = trees.sizes() if trees is not None else []  # the host's, from the proposer
        tree_cu = trees.cu_list() if trees is not None else [0]
        layout, b = cls(), 0
        for request in running:
            start = layout.cu[-1]
            if request.request_id in chunks:
                chunk = chunks[request.request_id]
                layout.pieces.append(
                    ("prompt", len(layout.prompt_tokens), len(layout.prompt_tokens) + len(chunk))
                )
                layout.prompt_tokens += chunk
                layout.prompt_depth += range(len(chunk))
                layout.accepted[request.request_id] = range(len(chunk))
                if request.num_prefilled + len(chunk) == len(request.prompt):
                    layout.final.add(request.request_id)
                    layout.prefill_rows.append(start + len(chunk) - 1)
                layout.cu.append(start + len(chunk))
            else:
                layout.pieces.append(("tree", tree_cu[b], tree_cu[b + 1]))
                layout.tree_rows += range(start, start + tree_sizes[b])
                layout.cu.append(start + tree_sizes[b])
                b += 1
        return layout


def _mixed_mask(pieces: list[tuple[str, int, int]], trees: TokenTree, device: torch.device) -> torch.Tensor:
    """The ancestor bitmask of a step holding prompt chunks (causal chains) beside trees."""
    masks = [chain_mask(j - i, device) if kind == "prompt" else trees.tree_mask[i:j] for kind, i, j in pieces]
    width = max(m.shape[1] for m in masks)
    return torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])


@dataclass(frozen=True)
class TreeOutcome:
    """What verification made of one decoding request's tree, as the host reads it: the tree's
    tokens and parents (node 0 the root), the kept node indices (the root first, then the
    accepted path in order) and the committed tokens (the accepted drafts, then the bonus),
    before any cut at EOS, a stop rule or the request's length."""

    tree_tokens: tuple[int, ...]
    tree_parents: tuple[int, ...]
    accepted: tuple[int, ...]
    committed: tuple[int, ...]


@dataclass(frozen=True)
class StepReadback:
    """What the host learns from the step's one read (:func:`read_back`): the first token of
    each request whose prompt finished, one :class:`TreeOutcome` per decoding request, and
    whether the proposal check failed."""

    first_tokens: tuple[int, ...]
    trees: tuple[TreeOutcome, ...]
    suspect: bool


def read_back(
    first: torch.Tensor,
    table: torch.Tensor | None,
    trees: TokenTree | None,
    suspect: torch.Tensor | None,
) -> StepReadback:
    """The step's one device-to-host read: the prompts' first tokens, each decoding request's
    kept nodes and committed tokens (the verification table), the tree structure the host
    does not know yet (trees drafted on the device), and the proposal check's flag, packed
    into one tensor. Everything the host does after verification comes from it."""
    need_structure = trees is not None and (trees.host is None or trees.host.tokens is None)
    parts = [first.long().flatten()]
    if table is not None:
        parts.append(table.flatten())
    if need_structure:
        parts += [trees.tokens, trees.parents]
    parts.append((suspect if suspect is not None else torch.zeros((), dtype=torch.bool)).long().view(1))
    flat = torch.cat([p.to(first.device) for p in parts]).tolist()  # host sync: the one per step
    at = len(first)
    first_tokens = tuple(flat[:at])
    outcomes: list[TreeOutcome] = []
    if table is not None:
        rows, width = table.shape
        chunk = flat[at : at + rows * width]
        at += rows * width
        if need_structure:
            n = trees.num_nodes
            tokens, parents = flat[at : at + n], flat[at + n : at + 2 * n]
        else:
            tokens, parents = trees.host.tokens, trees.host.parents
        kept = parse_readback([chunk[i * width : (i + 1) * width] for i in range(rows)])
        for (i, j), (nodes, committed) in zip(itertools.pairwise(trees.cu_list()), kept, strict=True):
            outcomes.append(
                TreeOutcome(tuple(tokens[i:j]), tuple(parents[i:j]), tuple(nodes), tuple(committed))
            )
    return StepReadback(first_tokens, tuple(outcomes), bool(flat[-1]))
