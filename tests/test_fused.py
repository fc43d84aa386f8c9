"""The fused decoder (one C call per step for a Llama-style stack) and the CPU kernels' instruction
roads: the fused stack agrees with the model's own modules, stays batch-invariant on every road
this CPU has, and every model, setting or CPU it cannot serve falls back with its reason."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from conftest import build
from test_cpu_kernels import tree_and_paths_logits
from torch import nn

import treespec
from treespec.kernels import cpu_kernels
from treespec.kernels.tree_attention import cpu_rows
from treespec.proposers import NgramProposer
from treespec.target import Target, fused, runner
from treespec.target.cache import KVCache

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())
ROADS = cpu_kernels.roads()


@pytest.fixture(params=ROADS)
def road(request):
    """Each instruction road this CPU has, switched for the test and switched back."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    previous = cpu_kernels.set_isa(request.param)
    yield request.param
    cpu_kernels.set_isa(previous)


def two_requests_then_a_tree(target: Target, hidden_layers: tuple[int, ...]):
    """Prefill two requests (7 and 5 tokens) in one forward, then score a 4-node tree for the
    first and one token for the second: the outputs and the caches after each."""
    torch.manual_seed(3)
    cache = target.new_cache(2, 64)
    prompt = torch.randint(0, 128, (12,))
    first = target.forward(prompt, cache, [0, 7, 12], [0, 1], hidden_layers=hidden_layers)
    cache.commit([0, 1], [list(range(7)), list(range(5))])
    from treespec.tree import TokenTree

    tree = TokenTree.from_lists([[4, 9, 2, 7], [1]], [[-1, 0, 0, 1], [-1]])
    second = target.forward(tree.tokens, cache, [0, 4, 5], [0, 1], tree_mask=tree.tree_mask, depth=tree.depth,
                            hidden_layers=hidden_layers)  # fmt: skip
    return first, second, cache


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_stack_agrees_with_the_models_modules(family, road):
    model = build(family, seed=2).to(torch.bfloat16)
    fused_target, modules_target = Target(model), Target(model, fused=False)
    assert (fused_target.path, modules_target.path) == ("fused", "modules")
    layers = (0, 1, 2)  # the embeddings, after layer 1, the final normed rows
    got, want = (
        two_requests_then_a_tree(fused_target, layers),
        two_requests_then_a_tree(modules_target, layers),
    )
    for out, ref in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(out.logits, ref.logits, atol=2e-2, rtol=2e-2)
        assert out.logits.dtype == torch.float32 and out.logits.shape == ref.logits.shape
        torch.testing.assert_close(out.hidden.float(), ref.hidden.float(), atol=2e-2, rtol=2e-2)
        assert set(out.layer_hidden) == set(layers)
        for layer in layers:
            torch.testing.assert_close(out.layer_hidden[layer], ref.layer_hidden[layer], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[2].keys, want[2].keys, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[2].values, want[2].values, atol=2e-2, rtol=2e-2)
    assert got[2].keys.abs().sum() > 0  # the stack wrote its K/V


@needs_kernels
def test_fused_tree_logits_equal_the_autoregressive_steps_bit_for_bit(road):
    """On each road, every node of a tree scored in one fused forward has the bits of the
    one-token steps over its path (test_cpu_kernels holds the control that this can fail)."""
    model = build("llama", seed=4, hidden_size=256, intermediate_size=512).to(torch.bfloat16)
    target = Target(model)
    assert target.path == "fused"
    scored, alone = tree_and_paths_logits(target)
    for node, logits in alone.items():
        assert torch.equal(scored[node], logits), node


@needs_kernels
def test_speculation_on_the_fused_stack_gives_plain_decodings_tokens(road):
    model = build("llama", seed=5, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    target = Target(model)
    prompts = [[11, 12, 13, 11, 12, 13, 11], [40, 41, 42, 43] * 3, [7, 3]]
    plain = treespec.generate(target, prompts, max_new_tokens=30)
    ngram = treespec.generate(
        target, prompts, max_new_tokens=30, proposer=NgramProposer(max_depth=4, max_nodes=8)
    )
    assert ngram.sequences == plain.sequences and ngram.stats.steps < plain.stats.steps


@needs_kernels
@pytest.mark.parametrize("shape", [(40, 48), (7, 13), (130, 200), (64, 576)])  # K tails past 8 and 32
def test_linear_on_each_road_matches_float64_and_is_batch_invariant(shape, road):
    torch.manual_seed(0)
    n, k = shape
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(37, k).bfloat16()
    full = cpu_kernels.linear_bf16(x, weight, bias)
    want = x.double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(full.double(), want, atol=2e-2, rtol=2**-7)
    for rows in (slice(0, 1), slice(3, 4), slice(0, 3), slice(5, 22), slice(0, 36)):
        assert torch.equal(cpu_kernels.linear_bf16(x[rows], weight, bias), full[rows])


def test_the_road_can_be_capped_and_a_missing_one_is_refused(monkeypatch):
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    code = "from treespec.kernels import cpu_kernels as c; print(c.isa())"
    run = subprocess.run([sys.executable, "-c", code], env={**_env(), "TREESPEC_CPU_ISA": "avx2"},
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert run.stdout.strip() == "avx2"
    run = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert run.stdout.strip() == cpu_kernels.best_isa()
    monkeypatch.setenv("TREESPEC_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="TREESPEC_CPU_ISA must be one of avx2, avx512bf16, amx, got 'sse2'"):
        cpu_kernels._chosen_isa()
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx2", "fma"})
    assert cpu_kernels.best_isa() == "avx2"
    with pytest.raises(ValueError, match="the avx512bf16 road needs avx512_bf16, avx512bw, avx512f"):
        cpu_kernels.set_isa("avx512bf16")
    with pytest.raises(ValueError, match="the amx road needs amx_bf16, amx_tile, avx512_bf16"):
        cpu_kernels.set_isa("amx")
    with pytest.raises(ValueError, match="roads are avx2, avx512bf16, amx, got 'sse2'"):
        cpu_kernels.set_isa("sse2")


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if key != "TREESPEC_CPU_ISA"}


@needs_kernels
def test_what_the_fused_stack_cannot_serve_runs_through_the_modules_with_its_reason(monkeypatch):
    fp32 = build("llama")
    assert Target(fp32).path == "modules"  # fp32 is not a fallback: the modules are its path
    with pytest.raises(ValueError, match="fused=True runs treespec's batch-invariant CPU kernels"):
        Target(fp32, fused=True)
    other = build("qwen3").to(torch.bfloat16)  # batch-invariant, not a fused family
    with pytest.warns(
        RuntimeWarning, match="through its modules, not the fused decoder: the fused decoder serves"
    ):
        target = Target(other)
    assert target.path == "modules" and "Qwen3ForCausalLM" in target.path_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process, not per Target
        Target(other)
    with pytest.raises(ValueError, match="fused=True: the fused decoder serves"):
        Target(other, fused=True)
    llama = build("llama").to(torch.bfloat16)
    monkeypatch.setenv("TREESPEC_FUSED", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        off = Target(llama)
    assert off.path == "modules" and off.path_reason == "turned off by TREESPEC_FUSED=0"
    monkeypatch.setenv("TREESPEC_FUSED", "maybe")
    with pytest.raises(ValueError, match="TREESPEC_FUSED must be 0 or 1, got 'maybe'"):
        Target(llama)
    monkeypatch.delenv("TREESPEC_FUSED")
    odd = build("llama", hidden_act="gelu").to(torch.bfloat16)
    assert "activation is 'gelu'" in fused.fused_refusal(odd)
    biased = build("llama", mlp_bias=True).to(torch.bfloat16)
    assert "MLP biases" in fused.fused_refusal(biased)
    windowed = Target(build("gemma3").to(torch.bfloat16))  # a sliding window: no batch invariance either
    assert windowed.path == "modules" and windowed.path_reason.startswith("batch-invariant kernels are off")
    monkeypatch.setattr(cpu_kernels, "_load", lambda: (None, "no C compiler (cc or gcc) on PATH"))
    assert (
        fused.fused_refusal(llama)
        == "the fused decoder needs treespec's CPU kernels: no C compiler (cc or gcc) on PATH"
    )


@needs_kernels
def test_a_replaced_parameter_is_read_at_the_next_forward():
    model = build("llama", seed=1).to(torch.bfloat16)
    target = Target(model)
    before = two_requests_then_a_tree(target, ())[0].logits
    layer = model.model.layers[1].mlp
    layer.down_proj.weight = nn.Parameter(layer.down_proj.weight.detach() * 3, requires_grad=False)
    after = two_requests_then_a_tree(target, ())[0].logits
    reference = two_requests_then_a_tree(Target(model, fused=False), ())[0].logits
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, reference, atol=2e-2, rtol=2e-2)


def test_host_rows_are_what_the_step_metadata_gives():
    """The fused path's rows and positions, laid out from host lists, equal cpu_rows over the
    step's metadata (chains and a tree with depths), with the same refusals."""
    cache = KVCache(1, 3, 1, 32, 4, dtype=torch.float32)
    cache.lengths = [5, 0, 9]
    depth = torch.tensor([0, 1, 1, 2, 0, 0, 1])
    for num_new, slots, d in (([1, 2], [2, 0], None), ([4, 3], [0, 2], depth), ([0, 3], [1, 2], depth[:3])):
        rows, positions = runner.host_rows(cache, num_new, slots, d)
        step = runner.StepMetadata.build(cache, num_new, slots, None, d, backend="reference")
        want = cpu_rows(step.cu_q, step.slots, step.prefix_lens, step.num_rows)
        assert all(torch.equal(a, b) for a, b in zip(rows, want, strict=True))
        assert torch.equal(positions, step.q_positions.long())
    with pytest.raises(ValueError, match="one count >= 0 of new tokens per slot"):
        runner.host_rows(cache, [1, 2], [0])
    with pytest.raises(ValueError):
        runner.host_rows(cache, [30], [2])  # past the cache


@needs_kernels
def test_a_weight_updated_in_place_is_read_at_the_next_forward(road):
    """On every road, the AVX2 road's panel copies included: an in-place update of a weight (and
    of a bias, which the table holds widened to fp32) changes the next step as the modules see it."""
    model = build("qwen2", seed=1).to(torch.bfloat16)
    target = Target(model)
    before = two_requests_then_a_tree(target, ())[0].logits
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(3)
        attn.q_proj.bias.add_(1)
    after = two_requests_then_a_tree(target, ())[0].logits
    reference = two_requests_then_a_tree(Target(model, fused=False), ())[0].logits
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(cpu_kernels.best_isa() is None, reason="the kernels need an x86-64 CPU with AVX2 and FMA")
def test_a_kernel_build_that_fails_says_why_and_raises_nothing(monkeypatch, tmp_path):
    """No compiler, an unwritable cache, a compiler error and a compiler that hangs each leave the
    kernels unavailable with the reason (the Target then runs PyTorch's kernels)."""
    monkeypatch.setenv("TREESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    library, reason = cpu_kernels.load_library()
    assert library is None and "building cpu_kernels.c in" in reason and "no-such-compiler" in reason
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\necho 'error: out of memory' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    assert cpu_kernels.load_library() == (None, "building cpu_kernels.c failed: error: out of memory")
    hanging = tmp_path / "hanging-cc"
    hanging.write_text("#!/bin/sh\nsleep 30\n")
    hanging.chmod(0o755)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.setattr(cpu_kernels, "BUILD_TIMEOUT_S", 0.5)
    library, reason = cpu_kernels.load_library()
    assert library is None and reason.startswith("building cpu_kernels.c took over 0.5 s")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TREESPEC_HOME", str(blocker))  # the cache directory cannot be made
    monkeypatch.delenv("CC")
    library, reason = cpu_kernels.load_library()
    assert library is None and f"in {blocker / 'kernels'} failed" in reason
