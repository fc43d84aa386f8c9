"""The decoding loop: admit requests, build one flattened step, score it, commit, emit.

Each step carries, for every running request, either its next prefill chunk (a chain of prompt
tokens) or its root (the last sampled token, whose K/V is not cached yet), all in one target
forward. Requests join (:meth:`Engine.add_request`) while others decode and leave when they hit
an EOS token or ``max_new_tokens``; their cache slot is then reused.

Names: a *request id* is the engine's handle for a request; a *slot* is a cache row. They differ.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from treespec.sampling import SamplingParams, next_tokens
from treespec.target import Target

DEFAULT_MAX_LEN = 2048


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
    finish_reason: str | None = None  # "eos" or "length"

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


@dataclass
class EngineStats:
    """Counts and timings accumulated over the engine's life."""

    steps: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    forward_s: float = 0.0  # time inside target forwards (includes the host syncs they end with)
    step_s: float = 0.0  # time inside step(): forward + sampling + bookkeeping


class Engine:
    """Continuous-batching decoder over one target and one preallocated KV cache."""

    def __init__(
        self,
        target: Target,
        *,
        max_batch_size: int = 8,
        max_len: int | None = None,
        prefill_chunk_size: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if prefill_chunk_size is not None and (
            not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1
        ):
            raise ValueError(f"prefill_chunk_size must be an int >= 1 or None, got {prefill_chunk_size!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if max_len is None:
            max_len = min(DEFAULT_MAX_LEN, target.max_context or DEFAULT_MAX_LEN)
        self.target = target
        self.cache = target.new_cache(max_batch_size, max_len)
        self.prefill_chunk_size = prefill_chunk_size
        self.generator = generator
        self.stats = EngineStats()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}
        self._next_id = 0

    def add_request(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
    ) -> int:
        """Queue a request; it starts at the next step with a free slot. Returns its request id."""
        prompt = self._check_prompt(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        # The last sampled token is never fed back, so the cache holds prompt + max_new - 1 tokens.
        if len(prompt) + max_new_tokens - 1 > self.cache.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the cache length "
                f"{self.cache.max_len} (model context {self.target.max_context})"
            )
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        request = Request(self._next_id, prompt, max_new_tokens, frozenset(eos), sampling or SamplingParams())
        self._next_id += 1
        self._requests[request.request_id] = request
        self._waiting.append(request)
        return request.request_id

    def _check_prompt(self, prompt: Sequence[int]) -> list[int]:
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        prompt = list(prompt)
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError(f"prompt tokens must be ints, got {sorted({type(t).__name__ for t in prompt})}")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.target.vocab_size})")
        return prompt

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def output(self, request_id: int) -> list[int]:
        """All tokens generated so far for a request."""
        return list(self._requests[request_id].output)

    def pop(self, request_id: int) -> Request:
        """Forget a finished request and return it."""
        request = self._requests[request_id]
        if not request.finished:
            raise ValueError(f"request {request_id} has not finished")
        return self._requests.pop(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one forward over all running requests; return what each one produced."""
        start = time.perf_counter()
        self._admit()
        if not self._running:
            return []
        tokens, cu_q, logit_requests = self._build_step()
        forward_start = time.perf_counter()
        out = self.target.forward(
            torch.tensor(tokens),
            self.cache,
            torch.tensor(cu_q),
            torch.tensor([r.slot for r in self._running]),
            logit_rows=torch.tensor([cu_q[i + 1] - 1 for i in logit_requests], dtype=torch.long),
            return_hidden=False,
        )
        self.stats.forward_s += time.perf_counter() - forward_start
        # A chain step accepts every token it carried.
        self.cache.commit(
            [r.slot for r in self._running], [range(cu_q[i + 1] - cu_q[i]) for i in range(len(cu_q) - 1)]
        )
        for i, request in enumerate(self._running):
            if request.prefilling:
                request.num_prefilled += cu_q[i + 1] - cu_q[i]
        outputs = self._emit([self._running[i] for i in logit_requests], out.logits)
        self._retire()
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - start
        return outputs

    def _admit(self) -> None:
        while self._waiting and self.cache.num_free:
            request = self._waiting.popleft()
            request.slot = self.cache.allocate()
            self._running.append(request)
            self.stats.prompt_tokens += len(request.prompt)

    def _build_step(self) -> tuple[list[int], list[int], list[int]]:
        """Flatten the running requests' new tokens. Returns tokens, cu_q, and which requests need logits."""
        tokens: list[int] = []
        cu_q = [0]
        logit_requests = []
        for i, request in enumerate(self._running):
            if request.prefilling:
                chunk = self.prefill_chunk_size or len(request.prompt)
                new = request.prompt[request.num_prefilled : request.num_prefilled + chunk]
                if request.num_prefilled + len(new) == len(request.prompt):
                    logit_requests.append(i)  # the prompt's last row predicts the first new token
            else:
                new = [request.output[-1]]  # the root: last sampled token, not yet cached
                logit_requests.append(i)
            tokens += new
            cu_q.append(len(tokens))
        return tokens, cu_q, logit_requests

    def _emit(self, requests: list[Request], logits: torch.Tensor) -> list[RequestOutput]:
        """Sample one token for each request that has logits; apply EOS and length limits."""
        if all(r.sampling.greedy for r in requests):
            chosen = logits.argmax(-1).tolist()  # host sync: one per step
        else:
            chosen = [
                int(next_tokens(logits[i : i + 1], r.sampling, self.generator))
                for i, r in enumerate(requests)
            ]
        outputs = []
        for request, token in zip(requests, chosen, strict=True):
            request.output.append(token)
            self.stats.new_tokens += 1
            if token in request.eos_token_ids:
                request.finish_reason = "eos"
            elif len(request.output) >= request.max_new_tokens:
                request.finish_reason = "length"
            outputs.append(
                RequestOutput(request.request_id, [token], request.finished, request.finish_reason)
            )
        return outputs

    def _retire(self) -> None:
        for request in self._running:
            if request.finished:
                self.cache.free(request.slot)
                request.slot = -1
        self._running = [r for r in self._running if not r.finished]
