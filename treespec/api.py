"""``treespec.generate``: the one-call Python API."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treespec.auto import auto_proposer
from treespec.engine import TOKENIZE_HINT, Engine, EngineStats
from treespec.proposers.base import Proposer
from treespec.sampling import SamplingParams
from treespec.target import Target

DEFAULT_MAX_BATCH = 64  # requests decoding at once when generate() is given more prompts


@dataclass(frozen=True)
class GenerationStats:
    """Counts and timings of one ``generate`` call."""

    num_requests: int
    prompt_tokens: int
    new_tokens: int
    steps: int  # target forwards
    total_s: float  # wall time of the whole call
    propose_s: float  # of which: proposing
    forward_s: float  #   scoring (target forwards)
    verify_s: float  #   verifying (or sampling, without a proposer)
    commit_s: float  #   KV cache compaction
    accepted_lengths: list[list[int]]  # per request (input order): tokens committed per decoding step
    drafted_nodes: int = 0  # tree nodes proposed beyond the roots, all requests together

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per decoding step, bonus included (1.0 without speculation)."""
        lengths = [n for per_request in self.accepted_lengths for n in per_request]
        return sum(lengths) / len(lengths) if lengths else 0.0

    @classmethod
    def from_engine(cls, ids: list[int], stats: EngineStats, total_s: float) -> GenerationStats:
        return cls(
            len(ids), stats.prompt_tokens, stats.new_tokens, stats.steps, total_s, stats.propose_s,
            stats.forward_s, stats.verify_s, stats.commit_s, [stats.accepted_lengths.get(i, []) for i in ids],
            stats.drafted_nodes,
        )  # fmt: skip


@dataclass(frozen=True)
class GenerationOutput:
    """``sequences[i]`` holds the new tokens of request i (in input order), EOS included."""

    sequences: list[list[int]]
    stats: GenerationStats


def as_prompts(input_ids, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """Normalise a list of token lists or a padded 2-D tensor (+ attention_mask) to token lists.

    Padding is dropped here, so it never enters compute. Each mask row must be one run of ones
    (left or right padding).
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids tensor must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            return input_ids.tolist()
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        return [
            _unpad(row, mask_row, i)
            for i, (row, mask_row) in enumerate(
                zip(input_ids.tolist(), attention_mask.tolist(), strict=False)
            )
        ]
    if attention_mask is not None:
        raise ValueError("attention_mask is only meaningful with a 2-D input_ids tensor")
    if isinstance(input_ids, (str, bytes)) or (
        isinstance(input_ids, Sequence) and any(isinstance(p, (str, bytes)) for p in input_ids)
    ):
        raise TypeError(f"prompts must be token ids, got text: {TOKENIZE_HINT}")
    if isinstance(input_ids, Sequence) and input_ids and all(isinstance(t, int) for t in input_ids):
        return [list(input_ids)]  # one prompt given as a flat list
    if not isinstance(input_ids, Sequence) or not all(
        isinstance(p, (Sequence, torch.Tensor)) for p in input_ids
    ):
        raise TypeError(
            f"input_ids must be a list of token lists or a 2-D tensor, got {type(input_ids).__name__}"
        )
    if not input_ids:
        raise ValueError("input_ids holds no prompts")
    return [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in input_ids]


def _unpad(row: list[int], mask_row: list[int], index: int) -> list[int]:
    kept = [i for i, m in enumerate(mask_row) if m]
    if kept and kept[-1] - kept[0] + 1 != len(kept):
        raise ValueError(
            f"attention_mask row {index} has a hole: expected one run of ones (left or right padding)"
        )
    return [row[i] for i in kept]


def _default_eos(model: PreTrainedModel) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def generate(
    target: Target | PreTrainedModel,
    input_ids,
    *,
    proposer: Proposer | str | None = None,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    prefill_chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    streamer=None,
    attention_mask: torch.Tensor | None = None,
    max_batch_size: int | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer=None,
    sampler: str = "hf",
    **processors,
) -> GenerationOutput:
    """Generate from the target for a batch of prompts of different lengths.

    Processors take HF's names (``repetition_penalty``, ``no_repeat_ngram_size``,
    ``bad_words_ids``, ``min_new_tokens``, ``suppress_tokens``, ``begin_suppress_tokens``,
    ``min_p``) or vLLM's (``frequency_penalty``, ``presence_penalty``, ``logit_bias``, ``seed``):
    every field of :class:`SamplingParams` past top-p. Each tree node sees its own path
    (``treespec.processors``). ``sampling`` instead gives the whole :class:`SamplingParams`, one
    for all prompts or one per prompt (each with its own ``seed`` if it wants draws that do not
    depend on the rest of the batch); it cannot be combined with the loose arguments.
    ``stop_strings`` (with ``tokenizer``) stop a request once its text ends with one of them, as
    HF's ``StopStringCriteria`` decides: the token that completes it is kept.

    ``input_ids`` is a list of token lists, or a padded 2-D tensor with ``attention_mask``.
    ``eos_token_id=None`` takes the model's ``generation_config.eos_token_id`` (as HF does); pass
    ``[]`` to never stop early. ``temperature=0`` is greedy. ``streamer`` follows HF's protocol
    (``put`` then ``end``) and needs a single prompt. ``proposer`` drafts token trees
    (``treespec.proposers``); None decodes autoregressively; ``"auto"`` uses the heads shipped for
    this model (``treespec.auto``). The output is the target's either way.
    ``max_batch_size`` requests decode at once (default: all prompts, at most
    ``DEFAULT_MAX_BATCH``, and never more than the proposer holds); the others wait for a slot.
    ``sampler="inverse-cdf"`` samples the tokens that no tree verifies (plain decoding, each
    prompt's first token) from one uniform per row, the whole batch at once: the same
    distribution, the decode step at batch 64 about a fifth cheaper, but not the draws of HF's
    ``generate`` that the default ``"hf"`` reproduces (``Engine``).
    """
    target = target if isinstance(target, Target) else Target(target)
    prompts = as_prompts(input_ids, attention_mask)
    if streamer is not None and len(prompts) != 1:
        raise ValueError(f"a streamer needs exactly one prompt, got {len(prompts)}")
    per_prompt = _sampling_per_prompt(sampling, len(prompts), temperature, top_k, top_p, processors)
    stop = _stop_criteria(stop_strings, tokenizer)
    eos = _default_eos(target.model) if eos_token_id is None else eos_token_id
    longest = _longest_context(target, prompts, max_new_tokens)
    if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
        raise ValueError(f"max_batch_size must be an int >= 1 or None, got {max_batch_size!r}")
    batch_size = min(len(prompts), max_batch_size or DEFAULT_MAX_BATCH)
    if isinstance(proposer, str):
        if proposer != "auto":
            raise ValueError(f'proposer must be a Proposer, None or "auto", got {proposer!r}')
        proposer = auto_proposer(target.model, batch_size=batch_size, target=target, max_len=longest)
    start = time.perf_counter()
    engine = Engine(target, max_batch_size=batch_size, max_len=longest, prefill_chunk_size=prefill_chunk_size,
                    generator=generator, proposer=proposer, sampler=sampler)  # fmt: skip
    ids = [
        engine.add_request(p, max_new_tokens=max_new_tokens, eos_token_id=eos, sampling=params, stop=stop)
        for p, params in zip(prompts, per_prompt, strict=True)
    ]
    _run(engine, streamer, prompts[0])
    done = [engine.pop(i) for i in ids]
    failed = [(n, r.error) for n, r in enumerate(done) if r.finish_reason == "error"]
    if failed:  # its output stopped short: returning it would be silently wrong
        n, error = failed[0]
        raise RuntimeError(f"prompt {n} failed ({len(failed)} of {len(ids)} prompts): {error}")
    sequences = [r.output for r in done]
    return GenerationOutput(
        sequences, GenerationStats.from_engine(ids, engine.stats, time.perf_counter() - start)
    )


def _longest_context(target: Target, prompts: list[list[int]], max_new_tokens: int) -> int:
    """The longest prompt plus ``max_new_tokens``, checked against the model's context."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if target.max_context is not None and longest > target.max_context:
        raise ValueError(
            f"prompt + max_new_tokens = {longest} tokens exceeds the model's context of {target.max_context}"
        )
    return longest


def _run(engine: Engine, streamer, first_prompt: list[int]) -> None:
    """Step the engine until every request has finished, streaming (HF's ``put`` then ``end``)
    the single prompt's tokens when a streamer is given."""
    if streamer is not None:
        streamer.put(torch.tensor([first_prompt]))
    while engine.has_unfinished():
        for produced in engine.step():
            if streamer is not None:
                streamer.put(torch.tensor(produced.new_tokens))
    if streamer is not None:
        streamer.end()


PROCESSOR_FIELDS = (
    "repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size", "min_new_tokens",
    "min_p", "logit_bias", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "seed",
)  # fmt: skip


def _sampling_per_prompt(
    sampling, count: int, temperature, top_k, top_p, processors: dict
) -> list[SamplingParams]:
    """One SamplingParams per prompt, from ``sampling`` or from the loose arguments."""
    unknown = sorted(set(processors) - set(PROCESSOR_FIELDS))
    if unknown:
        raise TypeError(
            f"generate() got unexpected keyword argument(s) {unknown}; sampling arguments are temperature, "
            f"top_k, top_p and {', '.join(PROCESSOR_FIELDS)}"
        )
    if sampling is None:
        return [SamplingParams(temperature, top_k, top_p, **processors)] * count
    loose = [name for name, value, off in (("temperature", temperature, 0.0), ("top_k", top_k, None),
                                          ("top_p", top_p, None)) if value != off] + sorted(processors)  # fmt: skip
    if loose:
        raise ValueError(
            f"give either sampling= or the loose sampling arguments, not both: got sampling and {loose}"
        )
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    sampling = list(sampling)
    if len(sampling) != count or not all(isinstance(p, SamplingParams) for p in sampling):
        raise ValueError(
            f"sampling must be one SamplingParams or a list of one per prompt ({count}), got "
            f"{len(sampling)} item(s) of {sorted({type(p).__name__ for p in sampling})}"
        )
    return sampling


def _stop_criteria(stop_strings, tokenizer):
    """A callable (tokens so far -> stop?) from HF's ``StopStringCriteria``, or None."""
    if stop_strings is None:
        return None
    if tokenizer is None:
        raise ValueError(
            "stop_strings needs the tokenizer: generate(..., stop_strings=[...], tokenizer=tokenizer)"
        )
    strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
    if not strings or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop_strings must be a non-empty string or list of them, got {stop_strings!r}")
    from transformers import StopStringCriteria

    criteria = StopStringCriteria(tokenizer, strings)
    tail = criteria.maximum_token_len

    def stop(tokens: list[int]) -> bool:
        return bool(criteria(torch.tensor([tokens[-tail:]]), None)[0])

    return stop
