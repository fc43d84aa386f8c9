"""The fp32-kmajor linear backend: same values as the layer's own product, used only where asked."""

from __future__ import annotations

import pytest
import torch
from conftest import build, hf_greedy
from torch import nn

import treespec
from treespec import linear
from treespec.proposers.draft import DraftModelProposer
from treespec.target import Target


def make_layer(dtype: torch.dtype, bias: bool = True) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(48, 40, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_the_native_product_inside_active_only(dtype):
    layer = make_layer(dtype)
    x = torch.randn(2, 5, 48).to(dtype)
    native = layer(x)
    linear.install(layer)
    assert torch.equal(layer(x), native)  # outside active(): the layer's own forward
    with torch.inference_mode(), linear.active():
        fast = layer(x)
        single = layer(x[:1, :1])
    assert fast.dtype == dtype and fast.shape == native.shape
    # fp32 accumulation either way: the results differ by summation order, within one rounding
    wide = x.float() @ layer.weight.float().t() + layer.bias.float()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(fast.float(), wide, atol=tol, rtol=tol)
    torch.testing.assert_close(fast, native, atol=2 * tol, rtol=2 * tol)
    assert torch.equal(single, nn.Linear.forward(layer, x[:1, :1]))  # one row: the native kernel


def test_copy_follows_in_place_and_replaced_weights():
    layer = make_layer(torch.float32, bias=False)
    linear.install(layer)
    x = torch.randn(4, 48)
    with torch.inference_mode(), linear.active():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    with torch.inference_mode(), linear.active():
        torch.testing.assert_close(layer(x), 2 * before)
    layer.bias = nn.Parameter(torch.zeros(40))
    with torch.no_grad():
        layer.bias.add_(1)
    with torch.inference_mode(), linear.active():
        torch.testing.assert_close(layer(x), 2 * before + 1)
    layer.bias = None
    layer.weight = nn.Parameter(torch.zeros(40, 48))
    with torch.inference_mode(), linear.active():
        assert torch.count_nonzero(layer(x)) == 0


def test_grad_mode_uses_the_native_forward():
    layer = make_layer(torch.float32)
    assert linear.install(nn.Sequential(layer, nn.ReLU(), layer)) == 1  # one layer, however often it appears
    linear.install(layer)  # idempotent
    x = torch.randn(3, 48)
    with linear.active():
        layer(x).sum().backward()  # gradients flow: training never takes the copy
    assert layer.weight.grad is not None
    assert layer.forward.weight_t is None  # no copy was ever made


def test_resolve_linear_backend():
    assert linear.resolve_linear_backend("auto", "cpu") == "fp32-kmajor"
    assert linear.resolve_linear_backend("auto", "cuda") == "native"
    assert linear.resolve_linear_backend("native", "cpu") == "native"
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
