"""Logits -> probabilities (temperature, top-k, top-p) and seeded sampling.

Semantics and order follow Hugging Face's logits warpers as ``generate(do_sample=True)`` applies
them: temperature, then top-k, then top-p (nucleus, keeping at least one token). Temperature 0
means greedy: the argmax of the raw logits, whatever top-k and top-p say.
Randomness is an input: pass a ``torch.Generator`` so that seeded runs reproduce exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None or 0 = no top-k filter
    top_p: float | None = None  # None or 1.0 = no nucleus filter
    # (eps, delta) turns on Medusa's typical acceptance above temperature 0: a drafted token x
    # passes if p(x) > min(eps, delta * exp(-H(p))). LOSSY: the output no longer follows the
    # target's distribution exactly (docs/verification.md). Medusa's values: (0.09, 0.3).
    typical_acceptance: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an int >= 0 or None, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        typical = self.typical_acceptance
        if typical is not None and not (
            isinstance(typical, tuple)
            and len(typical) == 2
            and all(isinstance(x, (int, float)) for x in typical)
            and 0 < typical[0] <= 1
            and typical[1] >= 0
        ):
            raise ValueError(
                f"typical_acceptance must be None or (eps, delta) with 0 < eps <= 1 and delta >= 0, got {typical!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k and top-p, in float32.

    Shape:
        logits [N, V] -> probs [N, V]
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    return scores.softmax(-1)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop the low tail whose total mass is <= 1 - top_p (HF's rule), keeping the top token.

    HF sorts the whole vocabulary; the kept nucleus is usually a few hundred tokens, so this looks
    only at the top k of each row (k = 256, then 8x more for the rows whose nucleus is wider, up
    to the whole vocabulary). A token outside the top k has at most the mass outside the top k
    below it in ascending order, so once that mass is <= 1 - top_p every such token is dropped.
    """
    probs = scores.softmax(-1)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    rows = torch.arange(scores.shape[0], device=scores.device)  # rows not decided yet
    k = min(256, scores.shape[-1])
    while len(rows):
        top, index = probs[rows].topk(k, dim=-1)  # [R, k] descending
        rest = (probs[rows].sum(-1, keepdim=True) - top.sum(-1, keepdim=True)).clamp(min=0)
        tail_mass = rest + top.flip(-1).cumsum(-1).flip(-1)  # ascending cumsum at each top token
        decided = (rest <= 1 - top_p).squeeze(-1) | (k == scores.shape[-1])
        kept = tail_mass > 1 - top_p
        kept[:, 0] = True  # always keep the most likely token
        keep[rows[decided, None], index[decided]] = kept[decided]
        rows, k = rows[~decided], min(k * 8, scores.shape[-1])
    return scores.masked_fill(~keep, float("-inf"))


def sample(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row from ``probs [N, V]`` -> ``[N]`` long.

    With ``uniforms [N]`` in [0, 1) the draw is the inverse CDF at that point: a deterministic
    function of its inputs. Rows need not be normalised. Otherwise ``torch.multinomial`` draws
    from ``generator`` (the same stream HF's ``generate`` uses, so seeded runs can match it).
    """
    if uniforms is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return sample_from_uniforms(probs, uniforms)


def sample_from_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first token whose cumulative mass exceeds ``u * total``.

    A token of zero mass is never chosen: its cumulative mass equals its predecessor's.

    Shape:
        probs [N, V], uniforms [N] -> tokens [N] long
    """
    cdf = probs.float().cumsum(-1)  # [N, V]
    point = uniforms.float().clamp(0.0, 1.0)[:, None] * cdf[:, -1:]  # [N, 1]
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pick the next token for each row of ``logits [N, V]`` -> ``[N]`` long."""
    if params.greedy:
        return logits.argmax(-1)
    return sample(logits_to_probs(logits, params), generator)
