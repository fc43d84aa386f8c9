"""Ancestor bitmasks: a tree's attention contract packed into 32-bit words, per node."""

from __future__ import annotations

from collections.abc import Sequence

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


def ancestors_and_depth(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
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
