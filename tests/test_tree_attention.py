"""tree_attention_ref against its oracle: causal attention along each node's root-to-node branch."""

from __future__ import annotations

import pytest
import torch

from treespec.kernels.tree_attention import build_plan, tree_attention_ref, unpack_tree_mask


def pack_ancestors(parents: list[int]) -> torch.Tensor:
    """[N, W] int32 ancestor-and-self bitmask of a tree given by parent indices (-1 = root)."""
    n = len(parents)
    words = torch.zeros(n, (n + 31) // 32, dtype=torch.int64)
    for node in range(n):
        a = node
        while a >= 0:
            words[node, a // 32] |= 1 << (a % 32)
            a = parents[a]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def branch(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def oracle(q, k_cache, v_cache, slot, prefix, rows, parents, depth, sm_scale, window=None, softcap=None):
    """Plain attention of each node over prefix + its branch, one query at a time, in float64."""
    out = []
    groups = q.shape[1] // k_cache.shape[1]
    for node in range(len(parents)):
        keys = list(range(prefix)) + [prefix + j for j in branch(parents, node)]
        positions = list(range(prefix)) + [prefix + depth[j] for j in branch(parents, node)]
        pos = prefix + depth[node]
        if window is not None:
            keys = [k for k, p in zip(keys, positions, strict=False) if pos - p < window]
        k = k_cache[slot, :, keys].double().repeat_interleave(groups, 0)  # [Hq, n, D]
        v = v_cache[slot, :, keys].double().repeat_interleave(groups, 0)
        s = torch.einsum("hd,hnd->hn", q[rows[node]].double(), k) * sm_scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out.append(torch.einsum("hn,hnd->hd", s.softmax(-1), v))
    return torch.stack(out)


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def depths(parents: list[int]) -> list[int]:
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def make_batch(
    trees, prefixes, slots, num_slots=6, hq=4, hkv=2, dim=16, length=96, dtype=torch.float32, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    total = sum(len(t) for t in trees)
    q = torch.randn(total, hq, dim, generator=gen).to(dtype)
    k_cache = torch.randn(num_slots, hkv, length, dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, hkv, length, dim, generator=gen).to(dtype)
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t))
    width = max((len(t) + 31) // 32 for t in trees)
    masks = [torch.nn.functional.pad(pack_ancestors(t), (0, width - (len(t) + 31) // 32)) for t in trees]
    positions = torch.cat([torch.tensor(depths(t)) + p for t, p in zip(trees, prefixes, strict=False)]).int()
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu_q=torch.tensor(cu, dtype=torch.int32),
        slots=torch.tensor(slots, dtype=torch.int32),
        prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        tree_mask=torch.cat(masks),
        q_positions=positions,
    )


def check_against_oracle(batch, trees, window=None, softcap=None, atol=1e-5, attention=tree_attention_ref):
    sm_scale = batch["q"].shape[-1] ** -0.5
    out = attention(**batch, sm_scale=sm_scale, window=window, softcap=softcap)
    for b, parents in enumerate(trees):
        start = int(batch["cu_q"][b])
        rows = list(range(start, start + len(parents)))
        expect = oracle(
            batch["q"],
            batch["k_cache"],
            batch["v_cache"],
            int(batch["slots"][b]),
            int(batch["prefix_lens"][b]),
            rows,
            parents,
            depths(parents),
            sm_scale,
            window,
            softcap,
        )
        torch.testing.assert_close(out[rows].double(), expect, atol=atol, rtol=atol)


def test_mask_bits_literal():
    #      0
    #     / \
    #    1   2
    #    |
    #    3
    mask = pack_ancestors([-1, 0, 0, 1])
    assert mask.tolist() == [[0b0001], [0b0011], [0b0101], [0b1011]]
    assert unpack_tree_mask(mask)[:, :4].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]


def test_bit_31_and_second_word():
    parents = list(range(-1, 39))  # a chain of 40 nodes crosses the word boundary
    mask = pack_ancestors(parents)
    assert mask.shape == (40, 2) and mask[31, 0] == -1  # all 32 bits set: the sign bit too
    assert unpack_tree_mask(mask)[:, :40].equal(torch.ones(40, 40).tril().bool())


def test_trees_in_a_batch_with_non_contiguous_slots():
    gen = torch.Generator().manual_seed(1)
    trees = [random_parents(9, gen), [-1], random_parents(40, gen)]  # a root alone; a tree over 32 nodes
    batch = make_batch(trees, prefixes=[5, 0, 17], slots=[4, 0, 2])
    check_against_oracle(batch, trees)


def test_causal_none_equals_chain_mask():
    trees = [list(range(-1, 6)), list(range(-1, 2))]  # chains
    batch = make_batch(trees, prefixes=[3, 9], slots=[1, 3])
    with_mask = tree_attention_ref(**batch, sm_scale=0.25)
    batch["tree_mask"] = None
    torch.testing.assert_close(tree_attention_ref(**batch, sm_scale=0.25), with_mask, atol=0, rtol=0)


@pytest.mark.parametrize("window", [1, 4, 12])
def test_sliding_window(window):
    gen = torch.Generator().manual_seed(2)
    trees = [random_parents(12, gen), random_parents(6, gen)]
    batch = make_batch(trees, prefixes=[20, 3], slots=[2, 5])
    check_against_oracle(batch, trees, window=window)


def test_softcap():
    gen = torch.Generator().manual_seed(3)
    trees = [random_parents(10, gen)]
    batch = make_batch(trees, prefixes=[7], slots=[1])
    batch["q"] = batch["q"] * 8  # large logits, so the cap matters
    check_against_oracle(batch, trees, softcap=5.0)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_half_precision_dtypes(dtype, atol):
    gen = torch.Generator().manual_seed(4)
    trees = [random_parents(8, gen), random_parents(3, gen)]
    batch = make_batch(trees, prefixes=[11, 2], slots=[0, 1], dtype=dtype)
    out = tree_attention_ref(**batch, sm_scale=0.25)
    assert out.dtype == dtype
    check_against_oracle(batch, trees, atol=atol)  # oracle reads the same rounded inputs


def test_plan_padded_rows_never_nan():
    plan = build_plan(
        torch.tensor([0, 1, 5], dtype=torch.int32),
        torch.tensor([3, 1]),
        torch.tensor([0, 2], dtype=torch.int32),
    )
    assert plan.visible.shape == (2, 4, 6)
    assert plan.visible.any(-1).all()


def test_bad_inputs():
    batch = make_batch([[-1, 0]], prefixes=[2], slots=[0])
    with pytest.raises(ValueError, match="cu_q"):
        tree_attention_ref(**{**batch, "cu_q": torch.tensor([0, 3], dtype=torch.int32)}, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tree_attention_ref(**{**batch, "q": torch.randn(2, 3, 16)}, sm_scale=1.0)
    with pytest.raises(ValueError, match="q_positions"):
        tree_attention_ref(**{**batch, "q_positions": None}, sm_scale=1.0, window=4)
    with pytest.raises(ValueError, match="cache length"):
        tree_attention_ref(**{**batch, "prefix_lens": torch.tensor([95], dtype=torch.int32)}, sm_scale=1.0)
    with pytest.raises(ValueError, match="tree_mask"):
        tree_attention_ref(**{**batch, "tree_mask": torch.zeros(1, 1, dtype=torch.int32)}, sm_scale=1.0)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_fast_paths_equal_oracle(dtype, atol):
    """Equal tree sizes (q padding is a reshape), consecutive slots (a slice), and a lone decode
    token that sees every key (no mask) take the fast paths; the oracle must not notice."""
    gen = torch.Generator().manual_seed(5)
    trees = [random_parents(6, gen), random_parents(6, gen)]
    batch = make_batch(trees, prefixes=[4, 13], slots=[2, 3], dtype=dtype)
    plan = build_plan(batch["cu_q"], batch["slots"], batch["prefix_lens"], batch["tree_mask"])
    assert plan.uniform and plan.slot_index == slice(2, 4) and not plan.all_visible
    check_against_oracle(batch, trees, atol=atol)
    single = make_batch([[-1]], prefixes=[30], slots=[1], dtype=dtype)
    plan = build_plan(single["cu_q"], single["slots"], single["prefix_lens"], single["tree_mask"])
    assert plan.uniform and plan.all_visible
    check_against_oracle(single, [[-1]], atol=atol)
