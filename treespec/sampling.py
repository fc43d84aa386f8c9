"""Logits -> probabilities (temperature, top-k, top-p, min-p) and seeded sampling.

Semantics and order follow Hugging Face's logits warpers as ``generate(do_sample=True)`` applies
them: temperature, then top-k, then top-p (nucleus, keeping at least one token), then min-p.
The processors that come before them (penalties, bans) are ``treespec.processors``. Temperature 0
means greedy: the argmax of the raw logits, whatever top-k and top-p say.
Randomness is an input: pass a ``torch.Generator`` so that seeded runs reproduce exactly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
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
    # Processors (treespec.processors), under HF's names and semantics unless noted; each node of
    # a tree sees its own path. Defaults are off.
    repetition_penalty: float = 1.0  # HF: over prompt and output
    frequency_penalty: float = 0.0  # vLLM / OpenAI: minus this times the count in the output
    presence_penalty: float = 0.0  # vLLM / OpenAI: minus this once for a token in the output
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0  # EOS is suppressed until this many new tokens
    min_p: float | None = None  # a warper, after top-p: drop p < min_p * max p (sampling only)
    logit_bias: tuple[tuple[int, float], ...] = ()  # token -> added logit; a dict is accepted
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()  # suppressed at the first new token only
    seed: int | None = None  # this request's own random stream (vLLM's per-request seed)

    def __post_init__(self) -> None:
        self._check_processors()
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

    @property
    def has_processors(self) -> bool:
        """Whether any processor that treespec.processors applies is on."""
        return bool(
            self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
            or self.no_repeat_ngram_size or self.min_new_tokens or self.logit_bias or self.bad_words_ids
            or self.suppress_tokens or self.begin_suppress_tokens
        )  # fmt: skip

    def token_ids(self) -> set[int]:
        """Every token id the processors name (for a check against the vocabulary)."""
        words = {t for word in self.bad_words_ids for t in word}
        return (
            words
            | {t for t, _ in self.logit_bias}
            | set(self.suppress_tokens)
            | set(self.begin_suppress_tokens)
        )

    def _check_processors(self) -> None:
        _check_number(
            "repetition_penalty", self.repetition_penalty, lambda v: v > 0, "a number > 0 (1.0: off)"
        )
        _check_number("frequency_penalty", self.frequency_penalty, lambda v: True, "a finite number (0: off)")
        _check_number("presence_penalty", self.presence_penalty, lambda v: True, "a finite number (0: off)")
        for name in ("no_repeat_ngram_size", "min_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (0: off), got {value!r}")
        if self.min_p is not None:
            _check_number("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1] or None")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and _is_token(p[0]) for p in pairs
        ):
            raise ValueError(f"logit_bias must map token ids (ints >= 0) to numbers, got {bias!r}")
        for _, value in pairs:
            _check_number("a logit_bias value", value, lambda v: True, "a finite number")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in pairs))
        self._check_token_lists()

    def _check_token_lists(self) -> None:
        words = self.bad_words_ids
        if not isinstance(words, (list, tuple)) or not all(
            isinstance(w, (list, tuple)) and w and all(_is_token(t) for t in w) for w in words
        ):
            raise ValueError(
                f"bad_words_ids must be a list of non-empty lists of token ids (ints >= 0), got {words!r}"
            )
        object.__setattr__(self, "bad_words_ids", tuple(tuple(w) for w in words))
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(_is_token(t) for t in value):
                raise ValueError(f"{name} must be a list of token ids (ints >= 0), got {value!r}")
            object.__setattr__(self, name, tuple(value))


def _check_number(name: str, value, ok: Callable[[float], bool], expected: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


FIXED_SHAPES = os.environ.get("TREESPEC_FIXED_SHAPES") == "1"  # tests set it to see a GPU's path


def reads_are_free(device: torch.device) -> bool:
    """True where reading a value back to the host stalls nothing (a CPU: the data is there):
    loops may then stop as soon as they are done and searches may widen as needed. On a GPU, and
    wherever ``FIXED_SHAPES`` is set, code takes fixed shapes and masks and reads nothing back."""
    return device.type == "cpu" and not FIXED_SHAPES


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, ``[N, V] -> [N]``, as ``torch.argmax``. On a
    CPU it takes each block of 128 values' maximum first, then the first block holding the row's,
    then the place within it: the same indices, several times faster than PyTorch's CPU argmax
    (0.14 ms instead of 1.3 ms for 32 rows of 49,152 fp32 logits on 2 cores)."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 256 or rows == 0:
        return logits.argmax(-1)
    block = 128
    if vocab % block:
        logits = torch.nn.functional.pad(logits, (0, block - vocab % block), value=float("-inf"))
    blocks = logits.view(rows, logits.shape[1] // block, block)
    first = blocks.amax(-1).argmax(-1)  # [N] the first block holding the maximum
    inner = blocks[torch.arange(rows, device=logits.device), first].argmax(-1)
    return first * block + inner


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, top-k and top-p, in float32.

    Shape:
        logits [N, V] -> probs [N, V]
    """
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        scores = _top_p_filter(scores, params.top_p)
    if params.min_p:  # HF's MinPLogitsWarper: the top token always stays
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return scores.softmax(-1)


def _top_p_filter(scores: torch.Tensor, top_p: float, *, adaptive: bool | None = None) -> torch.Tensor:
    """Drop the low tail whose total mass is <= 1 - top_p (HF's rule), keeping the top token.

    ``adaptive`` (default: where :func:`reads_are_free`) looks at the top tokens first,
    widening per row as needed (below): several times cheaper than a sort on a CPU, where its
    data-dependent loop costs nothing, but each widening reads the device. Elsewhere (a GPU) the
    whole row is sorted, as HF does: a fixed sequence of kernels that reads nothing back.

    HF sorts the whole vocabulary; the kept nucleus is usually a few hundred tokens, so this looks
    only at the top k of each row (k = 256, then 8x more for the rows whose nucleus is wider, up
    to the whole vocabulary). A token outside the top k has at most the mass outside the top k
    below it in ascending order, so once that mass is <= 1 - top_p every such token is dropped.
    """
    if adaptive is None:
        adaptive = reads_are_free(scores.device)
    if not adaptive:
        ascending, order = scores.sort(-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False  # always keep the most likely token
        return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
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
        return argmax(logits)
    return sample(logits_to_probs(logits, params), generator)
