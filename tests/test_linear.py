"""The fp32-kmajor linear backend and module views: same values as the layer's own product, and the
user's model left as it was found."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import build, hf_greedy
from torch import nn

import treespec
from treespec.kernels import cpu_kernels
from treespec.proposers.draft import DraftModelProposer
from treespec.target import Target, linear


def make_layer(dtype: torch.dtype, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(48, 40, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_the_native_product(dtype):
    layer = make_layer(dtype)
    x = torch.randn(2, 5, 48).to(dtype)
    native = layer(x)
    fast_layer = linear.KMajorLinear(layer)
    with torch.inference_mode():
        fast = fast_layer(x)
        single = fast_layer(x[:1, :1])
    assert fast.dtype == dtype and fast.shape == native.shape
    # fp32 accumulation either way: the results differ by summation order, within one rounding
    wide = x.float() @ layer.weight.float().t() + layer.bias.float()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(fast.float(), wide, atol=tol, rtol=tol)
    torch.testing.assert_close(fast, native, atol=2 * tol, rtol=2 * tol)
    assert torch.equal(single, layer(x[:1, :1]))  # one row: the native kernel


def test_copy_follows_in_place_and_replaced_weights():
    layer = make_layer(torch.float32, bias=False)
    fast = linear.KMajorLinear(layer)
    x = torch.randn(4, 48)
    with torch.inference_mode():
        before = fast(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), 2 * before)
    layer.bias = nn.Parameter(torch.zeros(40))
    with torch.no_grad():
        layer.bias.add_(1)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), 2 * before + 1)
    layer.bias = None
    layer.weight = nn.Parameter(torch.zeros(40, 48))
    with torch.inference_mode():
        assert torch.count_nonzero(fast(x)) == 0


def test_grad_mode_uses_the_native_forward():
    layer = make_layer(torch.float32)
    view = linear.module_view(nn.ModuleList([layer, nn.ReLU(), layer]), "fp32-kmajor")
    assert view[0] is view[2] and isinstance(view[0], linear.KMajorLinear)  # one layer, one view
    view[0](torch.randn(3, 48)).sum().backward()  # gradients flow: training never takes the copy
    assert layer.weight.grad is not None
    assert view[0]._weight_t is None  # no copy was ever made


def test_a_view_leaves_the_module_as_it_was():
    layer = make_layer(torch.float32)
    model = nn.Sequential(layer, nn.ReLU()).train()
    view = linear.module_view(model, "fp32-kmajor").eval()
    view.register_forward_hook(lambda *args: None)
    assert model.training and layer.training and not view.training
    assert type(model[0]) is nn.Linear and "forward" not in vars(model[0])
    assert not model._forward_hooks and len(view._forward_hooks) == 1
    assert view[0].weight is layer.weight  # shared, not copied
    x = torch.randn(3, 48)
    with torch.inference_mode():
        torch.testing.assert_close(view(x), model(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="resolved backend"):
        linear.module_view(model, "auto")


def test_a_dropped_target_leaves_the_model_as_it_was_found():
    """The Target runs a view: after it is dropped the user's modules, config and
    model.generate output are what they were."""
    model = build("llama").to(torch.bfloat16)
    prompt = torch.tensor([[5, 9, 2, 7, 7, 3]])
    before = model.generate(prompt, max_new_tokens=12, do_sample=False)
    modules = [(name, type(m), dict(vars(m).get("_forward_hooks", {}))) for name, m in model.named_modules()]
    attention = model.config._attn_implementation
    target = Target(model, linear_backend="fp32-kmajor")
    treespec.generate(target, [[5, 9, 2, 7, 7, 3]] * 2, max_new_tokens=8,
                      proposer=DraftModelProposer(build("llama"), target_model=model))  # fmt: skip
    assert target.runner.config._attn_implementation == "treespec"
    del target
    gc.collect()
    assert [
        (name, type(m), dict(vars(m).get("_forward_hooks", {}))) for name, m in model.named_modules()
    ] == modules
    assert all("forward" not in vars(m) for m in model.modules())
    assert model.config._attn_implementation == attention
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False), before)


def test_resolve_linear_backend():
    assert linear.resolve_linear_backend("auto", "cpu") == "fp32-kmajor"
    assert linear.resolve_linear_backend("auto", "cuda") == "native"
    assert linear.resolve_linear_backend("native", "cpu") == "native"
    if cpu_kernels.available():  # bf16 weights on a CPU with AVX2: treespec's kernel
        assert linear.resolve_linear_backend("auto", "cpu", torch.bfloat16) == "bf16-kernel"
    assert linear.resolve_linear_backend("auto", "cuda", torch.bfloat16) == "native"
    with pytest.raises(ValueError, match="for CPUs"):
        linear.resolve_linear_backend("bf16-kernel", "cuda")
    with pytest.raises(ValueError, match="one of"):
        linear.resolve_linear_backend("fast", "cpu")
    with pytest.raises(ValueError, match="for CPUs"):
        linear.resolve_linear_backend("fp32-kmajor", "cuda")


@pytest.mark.parametrize("backend", ["native", "fp32-kmajor"])
def test_speculative_output_is_exact_with_either_backend(backend):
    """fp32 greedy with the target as its own draft: every step scores 5 rows through the chosen
    backend and (up to near-ties) accepts them all."""
    model = build("llama")
    prompt = [5, 9, 2, 7, 7, 3]
    expected = hf_greedy(model, prompt, 24)
    target = Target(model, linear_backend=backend)
    proposer = DraftModelProposer(build("llama"), target_model=model)
    out = treespec.generate(target, [prompt], max_new_tokens=24, proposer=proposer)
    assert out.sequences[0] == expected
    assert out.stats.steps <= 8  # prefill + about 24 / 5 tree steps
    assert target.linear_backend == backend
