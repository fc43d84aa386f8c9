"""tree_attention_ref, the fast PyTorch twin, against tree_attention_naive, the plain reference,
run in float64; and the plain reference against its own oracle: causal attention along each
node's root-to-node branch."""

from __future__ import annotations

import pytest
import torch

from treespec.kernels.tree_attention import (
    build_plan,
    tree_attention_naive,
    tree_attention_ref,
    unpack_tree_mask,
)

# The plain reference runs in float64 on the very values the twin reads (inputs rounded to the
# dtype first), so the differences are the twin's own. fp32: another summation order (SDPA's
# fused softmax), ~1e-6. fp16/bf16: on a CPU the twin computes in fp32 and rounds its output
# once, half an ulp = 2^-11 (fp16) or 2^-8 (bf16) relative, on outputs of magnitude <= ~4 (convex
# combinations of standard normal values).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


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


def in_float64(batch: dict) -> dict:
    return {
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in batch.items()
    }


def check_against_naive(batch, window=None, softcap=None, atol=None, attention=tree_attention_ref):
    """``attention`` equals the plain reference run in float64 on the same (rounded) inputs."""
    options = dict(sm_scale=batch["q"].shape[-1] ** -0.5, window=window, softcap=softcap)
    out = attention(**batch, **options)
    expect = tree_attention_naive(**in_float64(batch), **options)
    atol = TOLERANCE[batch["q"].dtype] if atol is None else atol
    torch.testing.assert_close(out.double(), expect, atol=atol, rtol=atol)


def random_case(seed: int, dtype: torch.dtype) -> dict:
    """Fresh random inputs: ragged trees (a root alone, chains, wide trees), GQA groups 1-4, head
    dims 16/32/80, an empty prefix in every case, non-contiguous slots in any order."""
    gen = torch.Generator().manual_seed(seed)
    batch_size = int(torch.randint(1, 4, (1,), generator=gen))
    sizes = [int(torch.randint(1, 24, (1,), generator=gen)) for _ in range(batch_size)]
    trees = [random_parents(n, gen) for n in sizes]
    prefixes = [int(torch.randint(0, 40, (1,), generator=gen)) for _ in range(batch_size)]
    prefixes[0] = 0  # an empty prefix in every case
    slots = torch.randperm(6, generator=gen)[:batch_size].tolist()
    hkv = int(torch.randint(1, 3, (1,), generator=gen))
    group = [1, 2, 4][int(torch.randint(0, 3, (1,), generator=gen))]
    dim = [16, 32, 80][int(torch.randint(0, 3, (1,), generator=gen))]  # 80: not a power of two
    batch = make_batch(trees, prefixes, slots, hq=hkv * group, hkv=hkv, dim=dim, dtype=dtype, seed=seed)
    return batch


def branch(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 3.0), (9, 2.0)])
def test_naive_equals_causal_attention_along_each_branch(window, softcap):
    """The plain reference's oracle: a tree node attends exactly like the last token of a causal
    chain made of its root-to-node branch, placed after the same committed prefix."""
    gen = torch.Generator().manual_seed(6)
    trees = [random_parents(12, gen), [-1], random_parents(40, gen)]  # 40 nodes: two mask words
    batch = in_float64(make_batch(trees, prefixes=[5, 0, 17], slots=[4, 0, 2]))
    options = dict(sm_scale=0.25, window=window, softcap=softcap)
    tree_out = tree_attention_naive(**batch, **options)
    for b, parents in enumerate(trees):
        first, slot, prefix = int(batch["cu_q"][b]), int(batch["slots"][b]), int(batch["prefix_lens"][b])
        for leaf in set(range(len(parents))) - set(parents):
            path = branch(parents, leaf)
            k_row, v_row = batch["k_cache"][slot].clone(), batch["v_cache"][slot].clone()  # [Hkv, L, D]
            k_row[:, prefix : prefix + len(path)] = batch["k_cache"][slot, :, [prefix + j for j in path]]
            v_row[:, prefix : prefix + len(path)] = batch["v_cache"][slot, :, [prefix + j for j in path]]
            chain_out = tree_attention_naive(
                batch["q"][[first + j for j in path]], k_row[None], v_row[None],
                torch.tensor([0, len(path)]), torch.tensor([0]), torch.tensor([prefix]),
                q_positions=torch.arange(len(path)) + prefix, **options,
            )  # fmt: skip
            torch.testing.assert_close(chain_out, tree_out[[first + j for j in path]], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(5))
def test_ref_equals_naive_on_random_inputs(seed, dtype):
    batch = random_case(seed, dtype)
    options = [{}, {"window": 5}, {"softcap": 3.0}, {"window": 3, "softcap": 2.0}, {}]
    check_against_naive(batch, **options[seed % len(options)])


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
    check_against_naive(batch)


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
    check_against_naive(batch, window=window)


def test_softcap():
    gen = torch.Generator().manual_seed(3)
    trees = [random_parents(10, gen)]
    batch = make_batch(trees, prefixes=[7], slots=[1])
    batch["q"] = batch["q"] * 8  # large logits, so the cap matters
    check_against_naive(batch, softcap=5.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dtypes(dtype):
    gen = torch.Generator().manual_seed(4)
    trees = [random_parents(8, gen), random_parents(3, gen)]
    batch = make_batch(trees, prefixes=[11, 2], slots=[0, 1], dtype=dtype)
    out = tree_attention_ref(**batch, sm_scale=0.25)
    assert out.dtype == dtype
    check_against_naive(batch)  # the reference reads the same rounded inputs


def test_plan_padded_rows_never_nan():
    plan = build_plan(
        torch.tensor([0, 1, 5], dtype=torch.int32),
        torch.tensor([3, 1]),
        torch.tensor([0, 2], dtype=torch.int32),
    )
    assert plan.visible.shape == (2, 4, 6)
    assert plan.visible.any(-1).all()


@pytest.mark.parametrize("attention", [tree_attention_ref, tree_attention_naive])
def test_bad_inputs(attention):
    batch = make_batch([[-1, 0]], prefixes=[2], slots=[0])
    with pytest.raises(ValueError, match="cu_q"):
        attention(**{**batch, "cu_q": torch.tensor([0, 3], dtype=torch.int32)}, sm_scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention(**{**batch, "q": torch.randn(2, 3, 16)}, sm_scale=1.0)
    with pytest.raises(ValueError, match="q_positions"):
        attention(**{**batch, "q_positions": None}, sm_scale=1.0, window=4)
    with pytest.raises(ValueError, match="cache length"):
        attention(**{**batch, "prefix_lens": torch.tensor([95], dtype=torch.int32)}, sm_scale=1.0)
    with pytest.raises(ValueError, match="tree_mask"):
        attention(**{**batch, "tree_mask": torch.zeros(1, 1, dtype=torch.int32)}, sm_scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_paths_equal_naive(dtype):
    """Equal tree sizes (q padding is a reshape), consecutive slots (a slice), and a lone decode
    token that sees every key (no mask) take the fast paths; the plain reference must not notice."""
    gen = torch.Generator().manual_seed(5)
    trees = [random_parents(6, gen), random_parents(6, gen)]
    batch = make_batch(trees, prefixes=[4, 13], slots=[2, 3], dtype=dtype)
    plan = build_plan(batch["cu_q"], batch["slots"], batch["prefix_lens"], batch["tree_mask"])
    assert plan.uniform and plan.slot_index == slice(2, 4) and not plan.all_visible
    check_against_naive(batch)
    single = make_batch([[-1]], prefixes=[30], slots=[1], dtype=dtype)
    plan = build_plan(single["cu_q"], single["slots"], single["prefix_lens"], single["tree_mask"])
    assert plan.uniform and plan.all_visible
    check_against_naive(single)
