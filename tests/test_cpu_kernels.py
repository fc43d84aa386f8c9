"""treespec's CPU kernels (kernels/cpu_kernels.c): values against float64 references, the same bits
for a row whatever rows come with it, the fallbacks where a kernel cannot serve, and the
batch-invariant mode end to end (a bf16 speculative run gives the autoregressive run's tokens)."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
from conftest import build
from torch import nn

import treespec
from treespec.kernels import cpu_kernels
from treespec.kernels.tree_attention import tree_attention, tree_attention_naive, tree_attention_ref
from treespec.proposers import DraftModelProposer, NgramProposer
from treespec.target import Target, linear

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())


@pytest.fixture(params=list(cpu_kernels.ISAS))
def road(request):
    """Each instruction road, forced for the test and switched back; skipped where this machine
    lacks it (the CPU's instructions, or for AMX the OS's grant of its tiles)."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    if request.param not in cpu_kernels.roads():
        pytest.skip(f"this machine has no {request.param} road (roads: {', '.join(cpu_kernels.roads())})")
    previous = cpu_kernels.set_isa(request.param)
    yield request.param
    cpu_kernels.set_isa(previous)


@needs_kernels
@pytest.mark.parametrize("shape", [(40, 48), (7, 13), (5, 8), (130, 200)])  # K and N tails, odd sizes
def test_linear_matches_float64_and_is_batch_invariant(shape, road):
    """On every road, 70 rows (AMX: four full chunks of 16 and a partial one; AVX2: a block of 64
    and a partial one) against weights with row and column tails: close to float64, and each
    row's bits the same in any batch, whatever tiles its row count takes (AVX2: 1-6 rows as one
    tile or two, more by sixes with the remainders)."""
    torch.manual_seed(0)
    n, k = shape
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(70, k)
    full = cpu_kernels.linear_bf16(x, weight)
    torch.testing.assert_close(full, cpu_kernels.linear_reference(x, weight), atol=1e-4, rtol=1e-5)
    rounded = cpu_kernels.linear_bf16(x.bfloat16(), weight, bias)  # bf16 in and out: one rounding at the end
    assert rounded.dtype == torch.bfloat16
    want = cpu_kernels.linear_reference(x.bfloat16(), weight, bias)
    torch.testing.assert_close(rounded.double(), want.double(), atol=2e-2, rtol=2**-7)
    for length in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 17, 36, 64, 67):
        rows = slice(3, 3 + length)
        assert torch.equal(cpu_kernels.linear_bf16(x[rows], weight), full[rows])  # the same bits, any batch
        assert torch.equal(cpu_kernels.linear_bf16(x[rows].bfloat16(), weight, bias), rounded[rows])
    batched = cpu_kernels.linear_bf16(x.reshape(1, 70, k), weight)  # leading dimensions kept
    assert batched.shape == (1, 70, n) and torch.equal(batched[0], full)


@needs_kernels
def test_panels_hold_the_weight_and_are_made_again_when_it_changes():
    """The AVX2 road's panel layout holds every weight once (zeros past N), in the order
    linear_avx2.c reads it; road_weight makes it once per weight, again after an in-place update
    or for a new tensor, and drops it with the weight; an fp32 x reads panels on every road."""
    weight = torch.randn(37, 5).bfloat16()  # a partial last panel
    packed = cpu_kernels.pack_panels(weight)
    assert packed.shape == (3, 5, 8, 2) and packed.is_contiguous()
    unpacked = packed.permute(0, 3, 2, 1).reshape(48, 5)  # [p, half, j, k] -> row 16p + 8 half + j
    assert torch.equal(unpacked[:37], weight) and not unpacked[37:].any()
    assert cpu_kernels.reads_panels(x_bf16=False)
    first = cpu_kernels.road_weight(weight, x_bf16=False)
    assert cpu_kernels.road_weight(weight, x_bf16=False) is first  # made once
    x = torch.randn(3, 5)
    before = cpu_kernels.linear_bf16(x, weight)
    weight.mul_(2)
    assert cpu_kernels.road_weight(weight, x_bf16=False) is not first
    assert torch.equal(cpu_kernels.linear_bf16(x, weight), before * 2)  # exact: a power of two
    key = id(weight)
    del weight
    assert key not in cpu_kernels._PANELS


@needs_kernels
def test_linear_refuses_what_it_cannot_take():
    weight = torch.randn(8, 16).bfloat16()
    with pytest.raises(ValueError, match="weight must be a 2-D bf16"):
        cpu_kernels.linear_bf16(torch.randn(2, 16), weight.float())
    with pytest.raises(ValueError, match=r"x must be a bf16 or fp32 CPU tensor \[..., 16\]"):
        cpu_kernels.linear_bf16(torch.randn(2, 15), weight)
    with pytest.raises(ValueError, match="bias must be bf16"):
        cpu_kernels.linear_bf16(torch.randn(2, 16), weight, torch.zeros(8))


def test_an_unavailable_kernel_is_never_chosen(monkeypatch):
    """Without the kernel (another CPU, no compiler), "auto" keeps the fp32-kmajor layers, the
    bf16 backends and the batch-invariant mode say why they cannot run, and nothing crashes."""
    monkeypatch.setattr(cpu_kernels, "_load", lambda: (None, "no C compiler (cc or gcc) on PATH"))
    assert linear.resolve_linear_backend("auto", "cpu", torch.bfloat16) == "fp32-kmajor"
    with pytest.raises(ValueError, match="no C compiler"):
        linear.resolve_linear_backend("bf16-kernel", "cpu", torch.bfloat16)
    model = build("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="no C compiler"):
        Target(model, batch_invariant=True)
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels.linear_bf16(torch.randn(2, 64), torch.randn(8, 64).bfloat16())
    out = treespec.generate(Target(model), [[5, 6, 7]], max_new_tokens=4)  # still runs, on PyTorch's kernels
    assert len(out.sequences[0]) == 4


@needs_kernels
def test_kernel_layer_falls_back_to_the_layer_itself():
    """One row or several: the kernel, the same bits; fp32 weights and gradients take
    nn.functional.linear."""
    torch.manual_seed(0)
    layer = nn.Linear(24, 16).bfloat16()
    view = linear.Bf16KernelLinear(layer)
    x = torch.randn(3, 24).bfloat16()
    with torch.inference_mode():
        assert torch.equal(view(x), cpu_kernels.linear_bf16(x, layer.weight, layer.bias))
        assert torch.equal(view(x[:1]), view(x)[:1])
    view(x).float().sum().backward()  # gradients flow through the native layer
    assert layer.weight.grad is not None
    wide = nn.Linear(24, 16)
    with torch.inference_mode():
        assert torch.equal(linear.Bf16KernelLinear(wide)(x.float()), wide(x.float()))


def tree_case(dtype=torch.bfloat16):
    """Two requests on a 4-slot cache: a 4-node tree (parents -1, 0, 0, 1) and a 3-token chain."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 3, 40, 24).to(dtype)  # odd head_dim: the kernel's tails
    q = torch.randn(7, 6, 24).to(dtype)
    cu_q, slots, prefix = torch.tensor([0, 4, 7]), torch.tensor([2, 0]), torch.tensor([10, 20])
    tree_mask = torch.tensor([[1], [3], [5], [11], [1], [3], [7]], dtype=torch.int32)
    return q, k_cache, v_cache, cu_q, slots, prefix, tree_mask


@needs_kernels
def test_attention_matches_the_specification_and_is_batch_invariant():
    q, k_cache, v_cache, cu_q, slots, prefix, tree_mask = tree_case()
    out = tree_attention(q, k_cache, v_cache, cu_q, slots, prefix, tree_mask, sm_scale=0.2, backend="cpu")
    want = tree_attention_naive(q.double(), k_cache.double(), v_cache.double(), cu_q, slots, prefix, tree_mask,
                                sm_scale=0.2)  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2**-7)
    causal = tree_attention(q, k_cache, v_cache, cu_q, slots, prefix, None, sm_scale=0.2, backend="cpu")
    torch.testing.assert_close(
        causal.double(), tree_attention_naive(q.double(), k_cache.double(), v_cache.double(), cu_q, slots, prefix,
                                              None, sm_scale=0.2), atol=2e-2, rtol=2**-7)  # fmt: skip
    # The tree's request without the chain beside it: the same bits.
    alone = tree_attention(q[:4], k_cache, v_cache, cu_q[:2], slots[:1], prefix[:1], tree_mask[:4], sm_scale=0.2,
                           backend="cpu")  # fmt: skip
    assert torch.equal(alone, out[:4])
    # Node 3 (path 0 -> 1 -> 3) as an autoregressive step would score it: nodes 0 and 1 committed,
    # node 3's K/V at the next position, one row: the same bits as among the tree's rows.
    k_ar, v_ar = k_cache.clone(), v_cache.clone()
    k_ar[2, :, 12], v_ar[2, :, 12] = k_cache[2, :, 13], v_cache[2, :, 13]
    single = tree_attention(q[3:4], k_ar, v_ar, torch.tensor([0, 1]), slots[:1], prefix[:1] + 2, None, sm_scale=0.2,
                            backend="cpu")  # fmt: skip
    assert torch.equal(single, out[3:4])
    # the same through the PyTorch reference: summation orders differ, so bits may (this is the bug
    # the kernel fixes); only closeness holds there
    torch.testing.assert_close(
        tree_attention_ref(q[3:4], k_ar, v_ar, torch.tensor([0, 1]), slots[:1], prefix[:1] + 2, None, sm_scale=0.2),
        single, atol=2e-2, rtol=2**-7)  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (4, 24), (7, 80), (9, 8)])
def test_query_heads_that_share_key_loads_get_the_bits_of_each_head_alone(group, head_dim):
    """The kernel scores a request's (row, query head) columns of a KV group together, up to 16 per
    key load: each head's output is the same sequence of operations as that head attending alone
    (one query head, one KV head), and close to the float64 specification."""
    torch.manual_seed(group)
    kv_heads, rows = 2, 5
    k_cache, v_cache = torch.randn(2, 3, kv_heads, 30, head_dim).bfloat16()
    q = torch.randn(rows, group * kv_heads, head_dim).bfloat16()
    cu_q, slots, prefix = torch.tensor([0, rows]), torch.tensor([1]), torch.tensor([17])
    tree_mask = torch.tensor([[1], [3], [5], [11], [19]], dtype=torch.int32)
    out = tree_attention(q, k_cache, v_cache, cu_q, slots, prefix, tree_mask, sm_scale=0.3, backend="cpu")
    want = tree_attention_naive(q.double(), k_cache.double(), v_cache.double(), cu_q, slots, prefix, tree_mask,
                                sm_scale=0.3)  # fmt: skip
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2**-7)
    for head in range(group * kv_heads):
        kv = head // group
        alone = tree_attention(q[:, head : head + 1], k_cache[:, kv : kv + 1].contiguous(),
                               v_cache[:, kv : kv + 1].contiguous(), cu_q, slots, prefix, tree_mask, sm_scale=0.3,
                               backend="cpu")  # fmt: skip
        assert torch.equal(alone[:, 0], out[:, head]), head


@needs_kernels
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_of_many_rows_keeps_each_rows_bits_on_every_road(head_dim, road):
    """A 10-node tree (30 query columns: the AMX road's tile products take 16 at a time) whose
    keys end exactly at the cache's last position (a partial block of keys read from a padded
    copy), beside a 3-token chain of another request: close to the float64 specification, and
    every node has the bits of its autoregressive step (its ancestors committed, one row)."""
    torch.manual_seed(head_dim)
    length, prefix, parents = 45, 35, [-1, 0, 0, 1, 1, 2, 3, 6, 6, 4]
    k_cache, v_cache = torch.randn(2, 3, 2, length, head_dim).bfloat16()
    q = torch.randn(13, 6, head_dim).bfloat16()
    from treespec.tree import TokenTree

    tree = TokenTree.from_lists([list(range(10)), [0, 1, 2]], [parents, [-1, 0, 1]])
    cu_q, slots, prefixes = torch.tensor([0, 10, 13]), torch.tensor([1, 0]), torch.tensor([prefix, 5])
    out = tree_attention(
        q, k_cache, v_cache, cu_q, slots, prefixes, tree.tree_mask, sm_scale=0.125, backend="cpu"
    )
    want = tree_attention_naive(q.double(), k_cache.double(), v_cache.double(), cu_q, slots, prefixes,
                                tree.tree_mask, sm_scale=0.125)  # fmt: skip
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2**-7)
    for node in range(10):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]  # the root first
        k_ar, v_ar = k_cache.clone(), v_cache.clone()
        for depth, n in enumerate(path):  # ancestors committed in order, the node last
            k_ar[1, :, prefix + depth], v_ar[1, :, prefix + depth] = (
                k_cache[1, :, prefix + n],
                v_cache[1, :, prefix + n],
            )
        single = tree_attention(q[node : node + 1], k_ar, v_ar, torch.tensor([0, 1]), slots[:1],
                                torch.tensor([prefix + len(path) - 1]), None, sm_scale=0.125, backend="cpu")  # fmt: skip
        assert torch.equal(single, out[node : node + 1]), node
    chain = tree_attention(q[10:], k_cache, v_cache, torch.tensor([0, 3]), slots[1:], prefixes[1:], None,
                           sm_scale=0.125, backend="cpu")  # fmt: skip
    assert torch.equal(chain, out[10:])


@needs_kernels
def test_attention_refuses_inputs_outside_the_contract():
    """The kernel reads raw pointers: bad shapes or slots are refused before it runs."""
    q, k_cache, v_cache, cu_q, slots, prefix, tree_mask = tree_case()
    with pytest.raises(ValueError, match="cu_q"):
        tree_attention(q, k_cache, v_cache, cu_q[:2], slots, prefix, tree_mask, sm_scale=0.2, backend="cpu")
    with pytest.raises(ValueError, match="exceed the cache length"):
        tree_attention(q, k_cache, v_cache, cu_q, slots, prefix + 40, tree_mask, sm_scale=0.2, backend="cpu")
    with pytest.raises(ValueError, match="slots must lie in"):
        tree_attention(q, k_cache, v_cache, cu_q, torch.tensor([2, 7]), prefix, tree_mask, sm_scale=0.2,
                       backend="cpu")  # fmt: skip


@needs_kernels
def test_attention_hands_what_it_cannot_serve_to_the_reference():
    """A window, a soft-cap or fp32 inputs: the PyTorch reference computes them, no crash."""
    q, k_cache, v_cache, cu_q, slots, prefix, tree_mask = tree_case(torch.float32)
    positions = torch.tensor([10, 11, 11, 12, 20, 21, 22], dtype=torch.int32)
    for kwargs in (dict(), dict(window=4, q_positions=positions), dict(softcap=5.0)):
        got = tree_attention(q, k_cache, v_cache, cu_q, slots, prefix, tree_mask, sm_scale=0.2, backend="cpu",
                             **kwargs)  # fmt: skip
        want = tree_attention_ref(q, k_cache, v_cache, cu_q, slots, prefix, tree_mask, sm_scale=0.2, **kwargs)
        assert torch.equal(got, want)
    q, k_cache, v_cache, *rest = tree_case()
    windowed = tree_attention(q, k_cache, v_cache, *rest, sm_scale=0.2, backend="cpu", window=4,
                              q_positions=positions)  # fmt: skip
    assert torch.equal(windowed, tree_attention_ref(q, k_cache, v_cache, *rest, sm_scale=0.2, window=4,
                                                    q_positions=positions))  # fmt: skip


def test_batch_invariant_mode_is_on_where_it_can_be_and_refused_with_a_reason():
    bf16 = build("llama").to(torch.bfloat16)
    assert Target(bf16).batch_invariant is cpu_kernels.available()  # the default: wherever it can be
    assert not Target(build("llama")).batch_invariant  # fp32: not needed to match HF, not served
    assert not Target(bf16, linear_backend="native").batch_invariant  # a backend chosen by hand
    assert not Target(bf16, batch_invariant=False).batch_invariant
    with pytest.raises(ValueError, match="needs a bf16 model on a CPU"):
        Target(build("llama"), batch_invariant=True)  # fp32
    if cpu_kernels.available():
        with pytest.raises(ValueError, match="takes attention 'cpu'"):
            Target(bf16, batch_invariant=True, attention_backend="reference")
        with pytest.raises(ValueError, match="sliding window"):
            Target(build("gemma3").to(torch.bfloat16), batch_invariant=True)
        assert not Target(build("gemma3").to(torch.bfloat16)).batch_invariant


@needs_kernels
def test_bf16_speculation_gives_the_autoregressive_tokens_when_batch_invariant():
    """The target drafts for itself (every step scores a 6-node tree and accepts most of it), and
    n-grams, in bf16, three prompts in one batch: with batch invariance the tokens are the
    autoregressive run's, token for token. (Without batch invariance the trees' logits differ in
    their last bits, the next test shows; whether that flips a token of this run is a matter of
    near-ties, so it is not asserted: on an AVX2 CPU it did, on an AVX-512 one it does not.)"""
    model = build("llama", seed=4, hidden_size=256, intermediate_size=1024).to(torch.bfloat16)
    prompts = [[5, 9, 2, 7, 7, 3], [11, 12, 13, 11, 12, 13, 11], [40, 41, 42, 43] * 3]

    def runs(target):
        plain = treespec.generate(target, prompts, max_new_tokens=40)
        draft = DraftModelProposer(copy.deepcopy(model), target_model=model, dynamic=(2, 4, 6))
        drafted = treespec.generate(target, prompts, max_new_tokens=40, proposer=draft)
        ngram = treespec.generate(
            target, prompts, max_new_tokens=40, proposer=NgramProposer(max_depth=4, max_nodes=8)
        )
        assert (
            drafted.stats.steps < plain.stats.steps and ngram.stats.steps < plain.stats.steps
        )  # trees accepted
        return plain.sequences, drafted.sequences, ngram.sequences

    target = Target(model, batch_invariant=True)
    assert (target.attention_backend, target.linear_backend) == ("cpu", "bf16-kernel")
    plain, drafted, ngram = runs(target)
    assert drafted == plain and ngram == plain


def tree_and_paths_logits(target: Target) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Logits of a 5-node tree scored in one forward (root 7; 7 -> 3, 7 -> 9; 3 -> 4; 4 -> 8) after
    a prompt, and of each node scored as an autoregressive step would (its path committed, one
    row)."""
    prompt = torch.tensor([5, 9, 2, 7, 7, 3, 11, 30])
    tokens, parents = [7, 3, 9, 4, 8], [-1, 0, 0, 1, 3]
    from treespec.tree import TokenTree

    tree = TokenTree.from_lists([tokens], [parents])
    cache = target.new_cache(1, 64)
    slot = torch.tensor([cache.allocate()])
    target.forward(prompt, cache, torch.tensor([0, len(prompt)]), slot, return_hidden=False)
    cache.commit([int(slot)], [list(range(len(prompt)))])
    scored = target.forward(tree.tokens, cache, torch.tensor([0, 5]), slot, tree_mask=tree.tree_mask,
                            depth=tree.depth, return_hidden=False).logits  # fmt: skip
    alone = {}
    for node in range(5):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        ar_cache = target.new_cache(1, 64)
        ar_slot = torch.tensor([ar_cache.allocate()])
        for token in torch.cat([prompt, torch.tensor([tokens[n] for n in path])]).tolist():
            logits = target.forward(torch.tensor([token]), ar_cache, torch.tensor([0, 1]), ar_slot,
                                    return_hidden=False).logits  # fmt: skip
            ar_cache.commit([int(ar_slot)], [[0]])
        alone[node] = logits[0]
    return scored, alone


@needs_kernels
def test_batch_invariant_tree_logits_equal_the_autoregressive_steps_bit_for_bit():
    """Every node's logits from one tree forward equal those of the autoregressive steps over its
    path, bit for bit, in bf16. The same model with its MLP's intermediate units rotated by one
    computes the same function summed in another order: its logits are close. Whether that
    reordering also changes bits after the model's bf16 roundings depends on the road and the
    CPU, so the control that bit equality can fail is built by construction instead
    (:func:`test_bit_equality_sees_the_order_of_a_sum`). The down projections' weights spread
    over many binades, so those sums round (fp32 sums of bf16 products of one binade are often
    exact, in any order)."""
    model = build("llama", seed=4, hidden_size=512, intermediate_size=2048).to(torch.bfloat16)
    with torch.no_grad():  # weights over 2^-6..2^6 times their size: fp32 sums of bf16 products round
        for layer in model.model.layers:
            weight = layer.mlp.down_proj.weight
            spread = torch.randint(-6, 7, weight.shape, generator=torch.Generator().manual_seed(1))
            weight.copy_(weight * torch.exp2(spread.float()).to(weight.dtype) / 8)
    scored, alone = tree_and_paths_logits(Target(model, batch_invariant=True))
    for node, logits in alone.items():
        assert torch.equal(scored[node], logits), node
    reordered = copy.deepcopy(model)
    with torch.no_grad():
        for layer in reordered.model.layers:
            mlp = layer.mlp
            for proj in (mlp.gate_proj, mlp.up_proj):
                proj.weight.copy_(proj.weight.roll(1, 0))
            mlp.down_proj.weight.copy_(mlp.down_proj.weight.roll(1, 1))
    _, reordered_alone = tree_and_paths_logits(Target(reordered, batch_invariant=True))
    for node, logits in alone.items():
        torch.testing.assert_close(reordered_alone[node], logits, rtol=0.05, atol=0.05)


@needs_kernels
def test_bit_equality_sees_the_order_of_a_sum(road):
    """The negative control of every bit-for-bit test here, different by construction: one dot
    product whose terms sit in one accumulator lane (k = 0, 32, 64, 96: on AMX one element of
    four successive tile products) as 256, -256, 2^-20, 2^-20. In increasing k the big terms cancel first and the small ones survive
    (2^-19); with k reversed the small ones are absorbed by -256 (below half its ulp) and the
    result is 0. A kernel that summed a row in any other order would fail one of the two."""
    terms = torch.zeros(128)
    terms[[0, 32, 64, 96]] = torch.tensor([256.0, -256.0, 2.0**-20, 2.0**-20])
    weight = (terms != 0).to(torch.bfloat16)[None]
    for dtype in (torch.bfloat16, torch.float32):
        x = terms.to(dtype)[None]
        assert cpu_kernels.linear_bf16(x, weight).item() == 2.0**-19
        assert cpu_kernels.linear_bf16(x.flip(-1), weight.flip(-1)).item() == 0.0


@needs_kernels
def test_each_road_measures_its_arithmetic_peak_and_an_absent_road_is_refused(road):
    """The micro-benchmark's peak (treespec bench cpu-kernels) runs on every road this machine
    has: a positive rate in flops/s; a road that is not here is refused by name."""
    assert cpu_kernels.peak_flops(road, iterations=64_000) > 1e9
    absent = [r for r in cpu_kernels.ISAS if r not in cpu_kernels.roads()] + ["sse2"]
    for name in absent:
        with pytest.raises(ValueError, match=f"no '{name}' road on this machine"):
            cpu_kernels.peak_flops(name)


@needs_kernels
def test_the_roads_and_the_phases_are_the_librarys_own():
    """The roads' names, codes and CPU flags and the fused stack's phase names come from the C
    library (cpu_common.h, decoder.c): the roads slowest first, each needing its predecessor's
    flags, the road this process took among them, and one phase name per counter the profiling
    build fills."""
    assert list(cpu_kernels.ISAS) == ["avx2", "avx512bf16", "amx"]
    flags = list(cpu_kernels.ISA_FLAGS.values())
    assert {"avx2", "fma"} == flags[0] and all(a < b for a, b in zip(flags, flags[1:], strict=False))
    assert len(set(cpu_kernels.ISAS.values())) == 3 and cpu_kernels.isa() in cpu_kernels.ISAS
    assert (
        cpu_kernels.roads()[0] == "avx2"
    )  # the kernels loaded: this CPU has AVX2 and FMA, read as the table says
    names = cpu_kernels.phase_names(cpu_kernels._load()[0])
    assert names[:4] == ["norm", "qkv", "rotary+cache", "attention"] and names[-1] == "final norm"
    assert len(names) <= 16  # the counters treespec_phase_seconds holds


@needs_kernels
def test_a_kernel_that_cannot_allocate_its_buffers_raises_instead_of_aborting(road):
    """Sizes whose work buffers exceed any address space (2^56 bytes): the C entry points return
    before computing anything, and Python raises MemoryError naming what was asked (the process
    lives on, and the kernels still work after)."""
    x, weight = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    y = torch.empty(4, 4, dtype=torch.bfloat16)
    lib = cpu_kernels._load()[0]
    rows = 2**52  # y's fp32 scratch (and the AVX2 road's widened x): 2^56 bytes
    code = lib.treespec_linear_bf16(x.data_ptr(), 1, weight.data_ptr(), None, y.data_ptr(), 1, rows, 4, 8)
    assert code == cpu_kernels.NO_MEMORY
    q = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    cache = torch.zeros(8, dtype=torch.bfloat16).as_strided(
        (1, 1, 2**52, 8), (0, 0, 0, 1)
    )  # claims 2^52 positions
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(MemoryError, match="tree attention over a cache of 4503599627370496 positions"):
        cpu_kernels.tree_attention_bf16(q, cache, cache, one, one, one, one + 1, None, 0.5)
    # the fused decoder over 2^52 rows: its buffers fail before any layer runs or any row is read
    p = x.data_ptr()
    outs = (ctypes.c_void_p * 1)()
    code = lib.treespec_decoder_bf16(p, None, None, None, 1, rows, 8, 8, 1, 1, 8, 1e-5, 0.5, p, p, p, p, 1, 8,
                                     p, p, p, p, None, 0, outs)  # fmt: skip
    assert code == cpu_kernels.NO_MEMORY
    assert torch.equal(cpu_kernels.linear_bf16(x, weight), torch.zeros(4, 4, dtype=torch.bfloat16))


@needs_kernels
def test_sibling_projections_run_as_one_call_with_the_same_bits():
    """q/k/v and gate/up of each layer form groups in a kernel view; a group's outputs are the bits
    of separate calls, a member called on another tensor computes alone, and a member whose
    weight the kernel cannot read sends the group back to separate products."""
    model = build("llama", hidden_size=256, intermediate_size=1024).to(torch.bfloat16)
    view = linear.module_view(model, "bf16-kernel")
    attention, mlp = view.model.layers[0].self_attn, view.model.layers[0].mlp
    assert attention.q_proj.group is attention.k_proj.group is attention.v_proj.group is not None
    assert mlp.gate_proj.group is mlp.up_proj.group is not None and mlp.down_proj.group is None
    torch.manual_seed(0)
    x = torch.randn(5, 256).bfloat16()
    with torch.inference_mode():
        for rows in (x[:1], x):
            fused = [attention.q_proj(rows), attention.k_proj(rows), attention.v_proj(rows)]
            separate = [cpu_kernels.linear_bf16(rows, m.weight, m.bias) for m in (model.model.layers[0].self_attn.q_proj,
                        model.model.layers[0].self_attn.k_proj, model.model.layers[0].self_attn.v_proj)]  # fmt: skip
            assert all(torch.equal(a, b) for a, b in zip(fused, separate, strict=True))
        group = attention.q_proj.group
        assert not group._pending and group._input is None  # everything handed out, nothing held
        attention.q_proj(x)
        other = x.clone()
        assert torch.equal(attention.k_proj(other), separate[1])  # another tensor: computed alone
        assert torch.equal(attention.v_proj(x), separate[2])  # still waiting for x: handed out
    model.model.layers[0].mlp.up_proj.float()  # one member in fp32: the group computes separately
    with torch.inference_mode():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x.float())
    assert up.dtype == torch.float32 and torch.equal(gate, cpu_kernels.linear_bf16(x, mlp.gate_proj.weight))
