"""The Triton kernel against the plain reference (tree_attention_naive, in float64) and its twin.

Without a GPU the kernel runs through Triton's interpreter (conftest sets TRITON_INTERPRET=1),
so shapes stay small; with one, every input moves to DEVICE and the ``cuda`` tests add GPU-sized
shapes. Every output is poisoned with NaN first: an element the kernel forgets to write fails
the comparison.
"""

from __future__ import annotations

import pytest
import torch
from test_tree_attention import check_against_naive, in_float64, make_batch, random_case, random_parents

from treespec.kernels import tree_attention as ta

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or ta.interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)

# Against the float64 plain reference on the same rounded inputs. fp32: IEEE dots (no TF32) in
# another summation order, ~1e-6. fp16/bf16: the output is rounded once (half an ulp: 2^-11 or
# 2^-8 relative, outputs of magnitude <= ~4); on a GPU the softmax weights are also rounded to
# the dtype before the P.V dot, which adds about as much again.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def one_gpu_config(monkeypatch):
    """On a GPU, one fixed kernel configuration per shape: autotuning each of this file's shapes
    would take minutes (one test below runs the autotuner)."""
    monkeypatch.setenv("TREESPEC_TRITON_AUTOTUNE", "0")


def on_device(batch: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def host_schedule(batch: dict, num_splits=None) -> ta.TritonSchedule:
    """The schedule from host lists, as an engine step builds it."""
    cu = batch["cu_q"].tolist()
    num_new = [end - start for start, end in zip(cu, cu[1:], strict=False)]
    group = batch["q"].shape[1] // batch["k_cache"].shape[1]
    longest = max(batch["prefix_lens"].tolist(), default=0)
    return ta.schedule_blocks(num_new, longest, group, device=DEVICE, num_splits=num_splits)


def run_triton(batch, num_splits=None, **kw):
    """The kernel on DEVICE with a host-built schedule; the output comes back to the CPU."""
    batch = on_device(batch)
    out = torch.full_like(batch["q"], float("nan"))
    schedule = host_schedule(batch, num_splits)
    return ta.tree_attention_triton(**batch, out=out, schedule=schedule, **kw).cpu()


def kernel(num_splits=None):
    """The kernel with the contract's signature (NaN-poisoned output, a fixed split-KV factor)."""

    def attention(sm_scale, window=None, softcap=None, **inputs):
        return run_triton(inputs, num_splits=num_splits, sm_scale=sm_scale, window=window, softcap=softcap)

    return attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_equals_naive_and_twin_on_random_shapes(seed, dtype):
    batch = random_case(seed, dtype)
    options = [{}, {"window": 5}, {"softcap": 3.0}, {"num_splits": 3}]
    kw = dict(options[seed % len(options)], sm_scale=batch["q"].shape[-1] ** -0.5)
    out = run_triton(batch, num_splits=kw.pop("num_splits", None), **kw)
    assert not torch.isnan(out).any()
    expect = ta.tree_attention_naive(**in_float64(batch), **kw)
    torch.testing.assert_close(out.double(), expect, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    twin = ta.tree_attention_ref(**batch, **kw)  # and the twin: both within the tolerance
    torch.testing.assert_close(out.float(), twin.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("num_splits", [None, 4])
def test_kernel_on_trees_of_two_mask_words(num_splits):
    gen = torch.Generator().manual_seed(7)
    trees = [random_parents(37, gen), [-1], random_parents(5, gen)]  # 37 nodes: two mask words
    batch = make_batch(trees, prefixes=[21, 3, 0], slots=[5, 1, 3])
    check_against_naive(batch, window=9, atol=TOLERANCE[torch.float32], attention=kernel(num_splits))
    check_against_naive(batch, softcap=4.0, atol=TOLERANCE[torch.float32], attention=kernel(num_splits))


def test_causal_prefill_chunk_mixed_with_a_tree_in_one_launch():
    gen = torch.Generator().manual_seed(3)
    chain = list(range(-1, 19))  # a prefill chunk of 20 tokens is a chain
    trees = [chain, random_parents(12, gen)]
    batch = make_batch(trees, prefixes=[0, 30], slots=[2, 0])
    check_against_naive(batch, atol=TOLERANCE[torch.float32], attention=kernel())
    chunk = {**make_batch([chain], prefixes=[9], slots=[1]), "tree_mask": None}  # causal flag
    check_against_naive(chunk, atol=TOLERANCE[torch.float32], attention=kernel())


def test_single_node_and_big_tree():
    gen = torch.Generator().manual_seed(4)
    trees = [[-1], random_parents(70, gen)]  # 70 nodes: three mask words, several query blocks
    batch = make_batch(trees, prefixes=[50, 6], slots=[0, 4], length=128)
    check_against_naive(batch, atol=TOLERANCE[torch.float32], attention=kernel())


def test_dispatch():
    batch = make_batch([[-1, 0]], prefixes=[3], slots=[0])
    auto = ta.tree_attention(**batch, sm_scale=0.5)  # CPU tensors: the reference
    torch.testing.assert_close(auto, ta.tree_attention_ref(**batch, sm_scale=0.5), atol=0, rtol=0)
    forced = ta.tree_attention(**on_device(batch), sm_scale=0.5, backend="triton").cpu()
    torch.testing.assert_close(forced, auto, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="backend must be one of"):
        ta.tree_attention(**batch, sm_scale=0.5, backend="flash")


def test_forced_triton_without_gpu_or_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="cannot run here"):
        ta.resolve_backend("triton", torch.device("cpu"))
    assert ta.resolve_backend("auto", torch.device("cpu")) == "reference"


def test_target_runs_the_kernel_end_to_end():
    """A tiny model decoded greedily through the Triton path equals HF generate."""
    from conftest import build, hf_greedy

    import treespec
    from treespec.target import Target

    model = build("gemma3")  # sliding window 8 < prompt: the window path runs too
    prompt = list(range(3, 15))
    expected = hf_greedy(model, prompt, 6)
    target = Target(model.to(DEVICE), attention_backend="triton")
    assert treespec.generate(target, [prompt, prompt[:5]], max_new_tokens=6).sequences[0] == expected


def test_tree_of_260_nodes():
    gen = torch.Generator().manual_seed(5)
    trees = [random_parents(260, gen)]  # 9 mask words
    batch = make_batch(trees, prefixes=[20], slots=[1], hq=2, hkv=1, length=300)
    check_against_naive(batch, atol=TOLERANCE[torch.float32], attention=kernel())


def test_benchmark_script_smoke(tmp_path):
    """scripts/bench_kernels.py runs end to end on tiny shapes (its GPU numbers need a GPU)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "bench_kernels.py"
    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)], check=True, env=env, capture_output=True
    )
    report = json.loads(out.read_text())
    assert [c["kind"] for c in report["cases"]] == ["tree", "prefill"]
    assert all(c["max_abs_error"] < 1e-4 for c in report["cases"])


# --------------------------------------------------------------------------------------------
# The head layouts of real models: GQA groups that are not powers of two
# --------------------------------------------------------------------------------------------

# (Hq, Hkv, D): SmolLM2 9/3, Qwen2.5-0.5B 14/2, Qwen2.5-1.5B 12/2, Llama 3 32/8, Gemma 3 4/1,
# plain multi-head 8/8. Each layout once and each head dim twice rather than the cross product:
# the interpreter runs every program in Python (the GPU-only test below takes the product).
LAYOUT_CASES = [(9, 3, 64), (14, 2, 128), (12, 2, 256), (32, 8, 256), (4, 1, 64), (8, 8, 128)]


def mixed_batch(
    hq, hkv, dim, dtype=torch.float32, seed=0, prefixes=(13, 0, 6, 9), length=48, tree=9, chunk=20
):
    """One launch's worth: a tree, a prefill chunk (a chain under the bitmask), one decode token
    and a short chain, with an empty prefix among them and slots out of order."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_parents(tree, gen), list(range(-1, chunk - 1)), [-1], [-1, 0, 1]]
    return make_batch(
        trees,
        list(prefixes),
        slots=[4, 1, 5, 2],
        hq=hq,
        hkv=hkv,
        dim=dim,
        length=length,
        dtype=dtype,
        seed=seed,
    )


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("hq,hkv,dim", LAYOUT_CASES)
def test_real_layouts_trees_chains_and_chunks_in_one_launch(hq, hkv, dim, num_splits):
    batch = mixed_batch(hq, hkv, dim, seed=hq + dim)
    check_against_naive(batch, atol=TOLERANCE[torch.float32], attention=kernel(num_splits))


@pytest.mark.parametrize("hq,hkv,dim", LAYOUT_CASES)
def test_real_layouts_causal_chunks(hq, hkv, dim):
    """Prefill chunks under the causal flag (tree_mask None), with a window as Gemma's sliding layers."""
    chunks = [list(range(-1, 18)), list(range(-1, 4))]
    batch = {
        **make_batch(chunks, [7, 0], slots=[3, 0], hq=hq, hkv=hkv, dim=dim, length=32),
        "tree_mask": None,
    }
    window = 9 if hkv == 1 else None
    check_against_naive(batch, window=window, atol=TOLERANCE[torch.float32], attention=kernel(num_splits=2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_real_layout_in_half_precision(dtype):
    batch = mixed_batch(9, 3, 64, dtype=dtype, seed=1)
    check_against_naive(batch, atol=TOLERANCE[dtype], attention=kernel(num_splits=2))


@pytest.mark.parametrize("group", range(1, ta.TRITON_MAX_GROUP + 1))
def test_every_group_size(group):
    gen = torch.Generator().manual_seed(group)
    hkv = 2 if group <= 8 else 1
    batch = make_batch(
        [random_parents(6, gen), [-1, 0, 1]], [5, 2], slots=[1, 0], hq=hkv * group, hkv=hkv, dim=32
    )
    check_against_naive(batch, atol=TOLERANCE[torch.float32], attention=kernel(num_splits=1 + group % 2))


@pytest.mark.parametrize("group", range(1, ta.TRITON_MAX_GROUP + 1))
def test_schedule_from_host_lists(group):
    """Blocks of a power of two tokens, >= 16 rows each (tl.dot's minimum), every token mapped
    to its block; nothing is read from a device (the inputs are Python ints)."""
    num_new = [1, 17, 5, 0, 3]
    schedule = ta.schedule_blocks(num_new, 700, group, device="cpu")
    block_m = schedule.block_m
    assert block_m & (block_m - 1) == 0 and block_m * ta.group_pad(group) >= 16
    assert ta.group_pad(group) >= group and ta.group_pad(group) & (ta.group_pad(group) - 1) == 0
    request, start = schedule.block_request.tolist(), schedule.block_start.tolist()
    expected = [(b, i) for b, n in enumerate(num_new) for i in range(n)]
    got = [(request[blk], start[blk] + i) for blk, i in zip(schedule.token_block.tolist(), schedule.token_index.tolist(), strict=True)]  # fmt: skip
    assert got == expected and all(0 <= i < block_m for i in schedule.token_index.tolist())
    assert schedule.num_splits > 1 and schedule.split_len * schedule.num_splits >= 700


def test_layouts_the_kernel_cannot_serve_are_refused_before_launch():
    assert ta.triton_layout_refusal(9, 3, 64, torch.bfloat16) is None
    assert ta.triton_layout_refusal(14, 2, 80, torch.float32) is None  # not a power of two: padded
    for layout, reason in [
        ((32, 1, 64, torch.float32), "at most 16 query heads per KV head"),
        ((8, 2, 512, torch.float16), "head dims 16 to 256"),
        ((8, 2, 8, torch.float16), "head dims 16 to 256"),
        ((8, 2, 64, torch.float64), "serves torch.float32"),
        ((9, 2, 64, torch.float32), "multiple of the KV heads"),
    ]:
        message = ta.triton_layout_refusal(*layout)
        assert reason in message and 'attention_backend="reference"' in message
        assert f"{layout[0]} query heads over {layout[1]} KV heads, head dim {layout[2]}" in message
    batch = on_device(make_batch([[-1, 0]], [3], slots=[0], hq=2, hkv=1, dim=8))
    with pytest.raises(ValueError, match='head dim 8.*attention_backend="reference"'):
        ta.tree_attention_triton(**batch, sm_scale=1.0)
    with pytest.raises(ValueError, match="at most 16 query heads"):
        ta.tree_attention_triton(**on_device(make_batch([[-1]], [1], slots=[0], hq=32, hkv=1)), sm_scale=1.0)


def test_target_refuses_a_layout_the_kernel_cannot_serve():
    from conftest import build

    from treespec.target import Target

    model = build("llama", hidden_size=32).to(DEVICE)  # 4 heads of dim 8: below tl.dot's 16
    with pytest.raises(ValueError, match='head dim 8.*attention_backend="reference"'):
        Target(model, attention_backend="triton")
    Target(model, attention_backend="reference")  # the named backend serves it


def test_without_a_schedule_the_inputs_are_checked():
    """The standalone call checks the contract (host reads); a caller with a schedule did so already."""
    batch = on_device(make_batch([[-1, 0, 1]], [3], slots=[0]))
    with pytest.raises(ValueError, match="cu_q"):
        ta.tree_attention_triton(**{**batch, "cu_q": batch["cu_q"] + 1}, sm_scale=1.0)
    with pytest.raises(ValueError, match="one dtype"):
        ta.tree_attention_triton(
            **{**batch, "k_cache": batch["k_cache"].half()}, sm_scale=1.0, schedule=host_schedule(batch)
        )


def gpu_sized_batch(hq, hkv, dim, dtype):
    """Decode-like sizes: long prefixes (the schedule itself turns split-KV on), a 40-node tree,
    a 64-token prefill chunk, a lone decode token, a 1023-token prefix filling the cache."""
    gen = torch.Generator().manual_seed(hq * dim)
    trees = [random_parents(40, gen), list(range(-1, 63)), [-1], random_parents(24, gen)]
    batch = make_batch(
        trees, [900, 0, 1023, 300], [3, 0, 5, 1], hq=hq, hkv=hkv, dim=dim, length=1024, dtype=dtype
    )
    assert host_schedule(batch).num_splits > 1
    return batch


def check_on_gpu(batch):
    """The kernel against the float64 plain reference, both on the GPU (the reference's Python
    loop over rows is fast there)."""
    options = dict(sm_scale=batch["q"].shape[-1] ** -0.5)
    out = run_triton(batch, **options)
    expect = ta.tree_attention_naive(**on_device(in_float64(batch)), **options).cpu()
    tolerance = TOLERANCE[batch["q"].dtype]
    torch.testing.assert_close(out.double(), expect, atol=tolerance, rtol=tolerance)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (14, 2), (12, 2), (32, 8), (4, 1), (8, 8)])
def test_real_layouts_at_gpu_sizes_in_bf16(hq, hkv, dim):
    """The full cross product of layouts and head dims (bf16; fp32 below at each layout once)."""
    check_on_gpu(gpu_sized_batch(hq, hkv, dim, torch.bfloat16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,dim", LAYOUT_CASES)
def test_real_layouts_at_gpu_sizes_in_fp32(hq, hkv, dim):
    check_on_gpu(gpu_sized_batch(hq, hkv, dim, torch.float32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_autotuned_kernel_at_the_default_models_layout(monkeypatch):
    """The autotuner's configurations (the other tests take one fixed one) at SmolLM2's 9/3/64."""
    monkeypatch.setenv("TREESPEC_TRITON_AUTOTUNE", "1")
    check_on_gpu(gpu_sized_batch(9, 3, 64, torch.bfloat16))
