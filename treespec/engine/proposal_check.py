"""A proposer's trees checked against the requests they answer, with errors that name the
request and the node (the engine runs the cheap check every step, the full one in debug)."""

from __future__ import annotations

import torch

from treespec.proposers.base import ProposalRequest
from treespec.tree import TokenTree


def check_proposal(
    tree: TokenTree, asks: list[ProposalRequest], vocab_size: int, max_nodes: int, *, full: bool = False
) -> torch.Tensor | None:
    """A proposer's tree must match the requests: clear errors naming the request and node.

    Cheap by default: shapes and the host's sizes, then one tensor test of every request's root
    and tokens, returned unread (a 0-d bool on the device, True when something is wrong): the
    engine reads it with the step's one read and then locates the problem on the host
    (:func:`locate_problem`). ``full`` reads it at once and also runs ``TokenTree.validate``
    (structure, depths, bitmask: host-side, for tests and debugging); it returns None.
    """
    if not isinstance(tree, TokenTree):
        raise TypeError(f"proposer returned {type(tree).__name__}, expected a TokenTree")
    if tree.num_requests != len(asks):
        raise ValueError(f"proposer returned {tree.num_requests} trees for {len(asks)} requests")
    num_nodes = tree.num_nodes
    for name in ("parents", "depth", "tree_mask"):
        if getattr(tree, name).shape[0] != num_nodes:
            raise ValueError(
                f"proposer's tree.{name} has {getattr(tree, name).shape[0]} rows for {num_nodes} nodes"
            )
    host_sizes = tree.sizes()  # the builder's, on the host (a host sync only for a tree without them)
    if (
        len(host_sizes) != len(asks)
        or sum(host_sizes) != num_nodes
        or min(host_sizes, default=1) < 1
        or max(host_sizes, default=1) > max_nodes
    ):
        locate_problem(tree, asks, vocab_size, max_nodes)
        raise ValueError(f"proposer returned trees of {host_sizes} nodes for {len(asks)} requests")
    device = tree.tokens.device
    roots = torch.tensor([ask.tokens[-1] for ask in asks]).to(device)
    starts = torch.tensor(tree.cu_list()[:-1]).to(device)
    bad_token = ((tree.tokens < 0) | (tree.tokens >= vocab_size)).any()
    suspect = (tree.tokens[starts] != roots).any() | bad_token | (tree.cu_nodes[:-1] != starts).any()
    if not full:
        return suspect
    if bool(suspect):
        locate_problem(tree, asks, vocab_size, max_nodes)
    try:
        tree.validate()
    except ValueError as err:
        raise ValueError(f"proposer returned a malformed tree: {err}") from None
    return None


def locate_problem(tree: TokenTree, asks: list[ProposalRequest], vocab_size: int, max_nodes: int) -> None:
    """Name the first request whose tree is wrong, and how (host-side, reading the device)."""
    sizes = (tree.cu_nodes[1:] - tree.cu_nodes[:-1]).tolist()
    if tree.host is not None and list(tree.host.sizes) != sizes:
        raise ValueError(
            f"proposer returned a tree whose host sizes {list(tree.host.sizes)} disagree with cu_nodes {tree.cu_nodes.tolist()}"
        )
    starts = tree.cu_nodes[:-1].tolist()
    if min(sizes) < 1 or starts[0] != 0 or starts[-1] + sizes[-1] != tree.num_nodes:
        raise ValueError(
            f"proposer returned cu_nodes {tree.cu_nodes.tolist()} for {tree.num_nodes} nodes: every tree "
            "needs at least its root, back to back from 0"
        )
    tokens = tree.tokens.tolist()
    for b, ask in enumerate(asks):
        if tokens[starts[b]] != ask.tokens[-1]:
            raise ValueError(
                f"proposer's tree for request {ask.request_id}: node 0 is token {tokens[starts[b]]}, "
                f"but the root must be the last committed token {ask.tokens[-1]}"
            )
        if sizes[b] > max_nodes:
            raise ValueError(
                f"proposer's tree for request {ask.request_id} has {sizes[b]} nodes > its max_tree_nodes={max_nodes}"
            )
        bad = [i for i in range(sizes[b]) if not 0 <= tokens[starts[b] + i] < vocab_size]
        if bad:
            raise ValueError(
                f"proposer's tree for request {ask.request_id}: node {bad[0]} has a token outside the vocabulary"
            )
