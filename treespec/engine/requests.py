"""A request's state in the engine, what a step emits for it, and the engine's running counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from treespec.sampling import SamplingParams

if TYPE_CHECKING:
    from treespec.engine.step_state import StepTimes


@dataclass
class Request:
    """One generation request and its progress."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    sampling: SamplingParams
    slot: int = -1  # cache row while running
    num_prefilled: int = 0  # prompt tokens whose K/V is cached
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length", "stop", "abort" or "error"
    error: str | None = None  # with finish reason "error": what failed
    generator: torch.Generator | None = None  # its own, when its sampling has a seed
    stop: Callable[[list[int]], bool] | None = None  # prompt + output -> finished?
    speculate: bool = True  # False: the proposer never sees it; it decodes one token a step

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """Tokens a request produced in one step."""

    request_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    error: str | None = None  # with finish reason "error": what failed (the proposer, and why)


@dataclass
class EngineStats:
    """Counts and timings accumulated over the engine's life."""

    steps: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens whose K/V came from a pinned prefix, not a forward
    new_tokens: int = 0
    propose_s: float = 0.0  # time the proposer took
    forward_s: float = 0.0  # scoring: target forwards (includes the host syncs they end with)
    verify_s: float = 0.0  # verification (or plain sampling without a proposer)
    commit_s: float = 0.0  # KV cache compaction of the accepted paths
    advance_s: float = 0.0  # the requests moved on: outputs cut, features handed over, retirements
    step_s: float = 0.0  # time inside step(), all stages and bookkeeping
    drafted_nodes: int = 0  # tree nodes proposed beyond the roots, over all decoding steps and requests
    # Per request id: tokens committed at each decoding step (accepted drafted tokens + the bonus).
    accepted_lengths: dict[int, list[int]] = field(default_factory=dict)

    def add_step(self, times: StepTimes) -> None:
        self.steps += 1
        self.propose_s += times.propose_s
        self.forward_s += times.forward_s
        self.verify_s += times.verify_s
        self.commit_s += times.commit_s
        self.advance_s += times.advance_s
        self.step_s += times.step_s

    @property
    def tau(self) -> float:
        """Mean tokens committed per decoding step, the bonus included (EAGLE's and vLLM's tau)."""
        lengths = [n for per_request in self.accepted_lengths.values() for n in per_request]
        return sum(lengths) / len(lengths) if lengths else 0.0
