"""One step's flattened rows (:class:`StepBatch`) and what the host learns from its one read
(:class:`StepReadback`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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
        tree_sizes = trees.sizes() if trees is not None else []  # the host's, from the proposer
        tree_cu = trees.cu_list() if trees is not None else [0]
        prompt_tokens, prompt_depth, pieces = [], [], []  # pieces: (kind, start, stop) in running order
        prefill_rows, tree_rows, final, accepted, cu = [], [], set(), {}, [0]
        b = 0
        for request in running:
            start = cu[-1]
            if request.request_id in chunks:
                chunk = chunks[request.request_id]
                pieces.append(("prompt", len(prompt_tokens), len(prompt_tokens) + len(chunk)))
                prompt_tokens += chunk
                prompt_depth += range(len(chunk))
                accepted[request.request_id] = range(len(chunk))
                if request.num_prefilled + len(chunk) == len(request.prompt):
                    final.add(request.request_id)
                    prefill_rows.append(start + len(chunk) - 1)
                cu.append(start + len(chunk))
            else:
                pieces.append(("tree", tree_cu[b], tree_cu[b + 1]))
                tree_rows += range(start, start + tree_sizes[b])
                cu.append(start + tree_sizes[b])
                b += 1
        logit_rows = prefill_rows + tree_rows
        # The step's host data reaches the device in one copy: prompt tokens, their depths, logit rows.
        host = torch.tensor(prompt_tokens + prompt_depth + logit_rows, dtype=torch.long).to(device)
        prompt_t, prompt_d, rows_t = host.split([len(prompt_tokens), len(prompt_depth), len(logit_rows)])
        if not prompt_tokens:  # decoding only: the trees are the step
            tokens, depth = trees.tokens, trees.depth
            mask = trees.tree_mask if max(tree_sizes, default=1) > 1 else None
        else:
            sources = {"prompt": (prompt_t, prompt_d), "tree": (trees.tokens, trees.depth) if trees else None}
            tokens = torch.cat([sources[kind][0][i:j] for kind, i, j in pieces])
            depth = torch.cat([sources[kind][1][i:j] for kind, i, j in pieces])
            mask = None
            if trees is not None and max(tree_sizes, default=1) > 1:
                masks = [
                    chain_mask(j - i, device) if kind == "prompt" else trees.tree_mask[i:j]
                    for kind, i, j in pieces
                ]
                width = max(m.shape[1] for m in masks)
                mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
        return cls(
            tokens,
            depth,
            mask,
            rows_t,
            len(prefill_rows),
            cu,
            {r: len(c) for r, c in chunks.items()},
            accepted,
            final,
        )


@dataclass(frozen=True)
class StepReadback:
    """What the host learns from the step's one read (:func:`read_back`), per request:
    the prompts' first tokens; each decoding request's kept node indices (root first) and
    committed tokens; its tree's tokens and parents; and whether the proposal check failed."""

    first_tokens: list[int]
    accepted: list[list[int]]
    committed: list[list[int]]
    tree_lists: list[tuple[list[int], list[int]]]
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
    first_tokens = flat[:at]
    accepted, committed, tree_lists = [], [], []
    if table is not None:
        rows, width = table.shape
        chunk = flat[at : at + rows * width]
        at += rows * width
        for nodes, tokens in parse_readback([chunk[i * width : (i + 1) * width] for i in range(rows)]):
            accepted.append(nodes)
            committed.append(tokens)
        cu = trees.cu_list()
        if need_structure:
            n = trees.num_nodes
            tokens, parents = flat[at : at + n], flat[at + n : at + 2 * n]
        else:
            tokens, parents = trees.host.tokens, trees.host.parents
        tree_lists = [(list(tokens[i:j]), list(parents[i:j])) for i, j in itertools.pairwise(cu)]
    return StepReadback(first_tokens, accepted, committed, tree_lists, bool(flat[-1]))
