"""Logits processing against HF's own warpers (the oracle), and seeded sampling."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from treespec.sampling import SamplingParams, logits_to_probs, next_tokens, sample


def hf_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.5, 10, 0.6), (1.0, 1, None), (2.0, 0, 0.05)],
)
def test_probs_equal_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, SamplingParams(temperature, top_k, top_p))
    torch.testing.assert_close(ours, hf_probs(logits, temperature, top_k, top_p), atol=1e-6, rtol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(6))


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_top_p_on_a_large_vocabulary_keeps_hfs_nucleus(top_p):
    # Peaked rows are decided within the first 256 candidates, flatter ones need 2,048 or the
    # whole vocabulary: every path must keep exactly the tokens HF's full sort keeps.
    generator = torch.Generator().manual_seed(1)
    scales = torch.tensor([12.0, 6.0, 3.0, 1.5, 0.5, 0.05])[:, None]
    logits = torch.randn(6, 20000, generator=generator) * scales
    ours = logits_to_probs(logits, SamplingParams(1.0, None, top_p))
    want = hf_probs(logits, 1.0, None, top_p)
    assert torch.equal(ours > 0, want > 0)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)
    kept = (ours > 0).sum(-1)
    assert kept.min() < 256 < 2048 < kept.max()  # the case covers each round


def test_greedy_is_argmax_whatever_the_filters():
    logits = torch.randn(3, 20)
    params = SamplingParams(0.0, top_k=3, top_p=0.5)
    assert torch.equal(next_tokens(logits, params), logits.argmax(-1))
    assert torch.equal(logits_to_probs(logits, params).argmax(-1), logits.argmax(-1))


def test_seeded_sampling_reproduces():
    probs = torch.softmax(torch.randn(4, 30), -1)
    a = sample(probs, torch.Generator().manual_seed(5))
    b = sample(probs, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


def test_sample_frequencies_follow_probs():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, gen) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[3] == 0
    torch.testing.assert_close(freq, probs[0], atol=0.03, rtol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.01), "top_p"),
    ],
)
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_pre_drawn_uniforms_invert_the_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.5, 0.5, 0.0, 0.0]])
    u = torch.tensor([0.0, 0.6])
    assert sample(probs, uniforms=u).tolist() == [1, 1]  # mass 0 tokens are never chosen
    assert sample(probs, uniforms=torch.tensor([0.2499, 0.4999])).tolist() == [1, 0]
    assert sample(probs, uniforms=torch.tensor([0.2501, 0.9999])).tolist() == [3, 1]
    unnormalised = probs * 7.0
    assert torch.equal(sample(unnormalised, uniforms=u), sample(probs, uniforms=u))


def test_uniform_grid_reproduces_the_distribution():
    probs = torch.softmax(torch.randn(1, 12, generator=torch.Generator().manual_seed(3)), -1)
    grid = (torch.arange(100_000) + 0.5) / 100_000  # a deterministic "sample" of [0, 1)
    draws = sample(probs.expand(len(grid), -1), uniforms=grid)
    freq = torch.bincount(draws, minlength=12).float() / len(grid)
    torch.testing.assert_close(freq, probs[0], atol=2e-5, rtol=0)


def test_argmax_gives_torchs_first_maximum_at_any_shape():
    from treespec.sampling import argmax

    generator = torch.Generator().manual_seed(0)
    for rows, vocab in [(0, 49152), (1, 300), (5, 49152), (3, 1000)]:
        logits = torch.randn(rows, vocab, generator=generator)
        if rows:
            logits[-1, 7] = logits[-1, vocab - 2] = 99.0  # a tie across blocks: the first wins
        assert torch.equal(argmax(logits), logits.argmax(-1))
