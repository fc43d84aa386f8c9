"""The Triton kernel against the plain reference (tree_attention_naive, in float64) and its twin.

Without a GPU the kernel runs through Triton's interpreter (conftest sets TRITON_INTERPRET=1),
so shapes stay small. Every output is poisoned with NaN first: an element the kernel forgets to
write fails the comparison.
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


def run_triton(batch, num_splits=None, **kw):
    out = torch.full_like(batch["q"], float("nan"))
    group = batch["q"].shape[1] // batch["k_cache"].shape[1]
    schedule = ta.schedule_blocks(batch["cu_q"], batch["prefix_lens"], group, num_splits=num_splits)
    return ta.tree_attention_triton(**batch, out=out, schedule=schedule, **kw)


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
    forced = ta.tree_attention(**batch, sm_scale=0.5, backend="triton")
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
    target = Target(model, attention_backend="triton")
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
