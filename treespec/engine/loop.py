"""The decoding loop: admit requests, build one flattened step, score it, commit, emit.

Each step carries, for every running request, either its next prefill chunk (a chain of prompt
tokens) or its root (the last sampled token, whose K/V is not cached yet), all in one target
forward. Requests join (:meth:`Engine.add_request`) while others decode and leave when they hit
an EOS token or ``max_new_tokens``; their cache slot is then reused.

Names: a *request id* is the engine's handle for a request; a *slot* is a cache row. They differ.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from treespec.engine.handover import HiddenHandover, committed_features
from treespec.engine.picking import TokenPicker
from treespec.engine.proposal_check import check_proposal, locate_problem
from treespec.engine.requests import EngineStats, Request, RequestOutput
from treespec.engine.step_batch import StepBatch, StepReadback, read_back
from treespec.engine.step_state import Step, StepPlan, StepTimer
from treespec.proposers.base import ProposalRequest, Proposer, RequestResult, StepResult
from treespec.sampling import SamplingParams
from treespec.target import Target
from treespec.target.cache import default_max_len
from treespec.tree import TokenTree

TOKENIZE_HINT = (
    "tokenize first, with the chat template for a chat model: "
    "treespec.prompts.encode_prompts(tokenizer, [text, ...]), or plain: tokenizer([text, ...])['input_ids']"
)


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
        proposer: Proposer | None = None,
        debug: bool | None = None,
        sampler: str = "hf",
        max_prefill_tokens: int | None = None,
    ) -> None:
        """``max_batch_size`` requests run at once (fewer if the proposer holds fewer: its
        ``max_batch_size``); the rest wait. ``generator`` must live on the target's device.
        ``sampler`` is how a token is sampled outside tree verification (a prompt's first token,
        every token of plain decoding): ``"hf"`` calls ``torch.multinomial`` row by row, the
        draws HF's ``generate`` makes for one prompt with the same seed; ``"inverse-cdf"`` draws
        one uniform per row and samples the same distribution for the whole batch at once, at a
        fraction of the cost (``multinomial`` draws an exponential per vocabulary entry). Tree
        verification has its own rule either way.
        ``debug`` (default: the environment variable ``TREESPEC_DEBUG=1``) runs the full,
        host-side check of every proposed tree and of verification's inputs each step; without
        it a step runs one cheap tensor check of what a proposer returned.
        ``max_prefill_tokens`` bounds the prompt tokens a step runs across requests (each still at
        most ``prefill_chunk_size``): prompts are prefilled in the running order within it (admission
        order, requests that speculate before those that do not), and a prompt left out waits for a
        later step, so a step that also decodes stays short (vLLM's
        ``max_num_batched_tokens``, a server's inter-token latency). None: every prefilling
        request runs its chunk every step."""
        _check_engine_args(target, max_batch_size, prefill_chunk_size, max_prefill_tokens, generator, proposer,
                           sampler)  # fmt: skip
        if max_len is None:
            max_len = default_max_len(target.max_context)
        self.target = target
        self.proposer = proposer
        self.wants_hidden = proposer is not None and proposer.needs_hidden
        # Features a head reads: the final hidden state, or the concatenated inputs of the layers
        # it names (EAGLE-3's low, middle and high layers).
        self.feature_layers = proposer.hidden_layers if self.wants_hidden else ()
        self._handover = HiddenHandover(proposer) if self.wants_hidden else None
        # A tree of N nodes is written past the committed prefix before verification: room for it.
        self.max_tree_nodes = proposer.max_tree_nodes if proposer is not None else 1
        capacity = proposer.max_batch_size if proposer is not None else None
        self.max_running = min(max_batch_size, capacity or max_batch_size)
        if proposer is not None and proposer.max_context is not None and max_len > proposer.max_context:
            raise ValueError(
                f"requests may need {max_len} context tokens, but {type(proposer).__name__} holds "
                f"{proposer.max_context} per request: build the proposer (its head or draft model) with max_len={max_len}"
            )  # fmt: skip
        self.max_len = max_len
        self.cache = target.new_cache(self.max_running, max_len + self.max_tree_nodes)
        self.prefill_chunk_size = prefill_chunk_size
        self.max_prefill_tokens = max_prefill_tokens
        self.generator = generator
        self.sampler = sampler
        self.debug = os.environ.get("TREESPEC_DEBUG") == "1" if debug is None else debug
        self.picker = TokenPicker(proposer, generator, sampler, self.debug)
        self.stats = EngineStats()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        self._pinned: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # tokens, keys, values
        self.last_step: Step | None = None

    def pin_prefix(self, tokens: Sequence[int]) -> None:
        """Compute the K/V of ``tokens`` once (a shared system prompt, a chat template's
        opening) and keep it: from then on a request whose prompt starts with some of these tokens
        copies their K/V into its slot instead of prefilling them (at least its last prompt token
        is still scored, for the logits of its first new token). Outputs do not change: a token's
        K/V depends only on the tokens before it (exactly so with the batch-invariant kernels).
        Needs a free slot now, and a proposer that reads no target hidden states: a head must see
        every prompt position's hidden state, which a copied prefix does not compute."""
        tokens = self._check_prompt(tokens)
        if self.wants_hidden:
            raise ValueError(
                "pin_prefix needs a proposer that reads no target hidden states: "
                f"{type(self.proposer).__name__} learns from every prompt position's hidden state"
            )
        if len(tokens) > self.max_len:
            raise ValueError(
                f"a pinned prefix of {len(tokens)} tokens exceeds the cache length {self.max_len}"
            )
        if not self.cache.num_free:
            raise ValueError(
                "pin_prefix needs a free cache slot: pin before adding requests, or wait for one to end"
            )
        slot = self.cache.allocate()
        try:
            self.target.forward(
                torch.tensor(tokens), self.cache, torch.tensor([0, len(tokens)]), torch.tensor([slot]),
                logit_rows=torch.tensor([len(tokens) - 1]), return_hidden=False,
            )  # fmt: skip
            n = len(tokens)
            self._pinned.append(
                (tokens, self.cache.keys[:, slot, :, :n].clone(), self.cache.values[:, slot, :, :n].clone())
            )
        finally:
            self.cache.free(slot)

    def _reuse_pinned(self, request: Request) -> None:
        """Copy the longest pinned prefix the prompt starts with (all but its last token at most)."""
        best, best_len = None, 0
        for pinned in self._pinned:
            n = 0
            limit = min(len(pinned[0]), len(request.prompt) - 1)
            while n < limit and pinned[0][n] == request.prompt[n]:
                n += 1
            if n > best_len:
                best, best_len = pinned, n
        if best is None:
            return
        self.cache.keys[:, request.slot, :, :best_len] = best[1][:, :, :best_len]
        self.cache.values[:, request.slot, :, :best_len] = best[2][:, :, :best_len]
        self.cache.lengths[request.slot] = best_len
        request.num_prefilled = best_len
        self.stats.reused_prompt_tokens += best_len

    def add_request(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        stop: Callable[[list[int]], bool] | None = None,
        speculate: bool = True,
    ) -> int:
        """Queue a request; it starts at the next step with a free slot. Returns its request id.
        ``stop`` (e.g. stop strings) sees prompt + output after each new token and ends the
        request, that token kept, when it returns True (finish reason "stop"). ``speculate=False``
        keeps the request away from the proposer (no tree, no drafting cost, nothing for the
        proposer to learn from it): it decodes one token a step beside requests that speculate,
        and its output is the same either way."""
        prompt = self._check_prompt(prompt)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        # The last sampled token is never fed back, so the cache holds prompt + max_new - 1 tokens.
        if len(prompt) + max_new_tokens - 1 > self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds the cache length "
                f"{self.max_len} (model context {self.target.max_context})"
            )
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a treespec.SamplingParams, got {type(sampling).__name__}")
        outside = sorted(t for t in sampling.token_ids() if t >= self.target.vocab_size)
        if outside:
            raise ValueError(
                f"the sampling parameters name token id {outside[0]}, outside the vocabulary [0, {self.target.vocab_size})"
            )
        if not isinstance(speculate, bool):
            raise TypeError(f"speculate must be a bool, got {type(speculate).__name__}")
        request = Request(self._next_id, prompt, max_new_tokens, frozenset(eos), sampling, stop=stop,
                          speculate=speculate and self.proposer is not None)  # fmt: skip
        if sampling.seed is not None:  # its own stream: what it draws does not depend on its batch
            request.generator = torch.Generator(device=self.target.device).manual_seed(sampling.seed)
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
            got = sorted({type(t).__name__ for t in prompt})
            hint = f": {TOKENIZE_HINT}" if "str" in got else ""
            raise TypeError(f"prompt tokens must be ints, got {got}{hint}")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.target.vocab_size})")
        return prompt

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def abort(self, request_id: int) -> None:
        """End a request now, between steps (a client that went away): it leaves the queue, or
        its cache slot and whatever the proposer keeps for it are freed at once. Its finish
        reason is "abort"; its output so far stays readable until ``pop``. A finished request
        is left as it is."""
        if request_id not in self._requests:
            raise ValueError(f"no request {request_id} in this engine")
        request = self._requests[request_id]
        if request.finished:
            return
        request.finish_reason = "abort"
        if request in self._waiting:
            self._waiting.remove(request)
            return
        if self._handover is not None:
            self._handover.carry.pop(request_id, None)
        self._retire()

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
        """One round: propose trees, score everything in one forward, verify, read back, commit,
        advance. The device is read once, after verification (:func:`treespec.engine.step_batch.read_back`).
        The finished step is kept as ``last_step``."""
        timer = StepTimer(self.target.device)
        self._admit()
        if not self._running:
            return []
        plan = self._plan(timer)
        if not plan.running:  # every request of the step failed in drafting: nothing ran
            self.last_step = Step(plan, (), None)
            self._retire()
            return self._failed_outputs(plan)
        logits, features = self._score(plan)
        timer.mark()
        results = self._results(plan, self._verify(plan, logits), features)
        timer.mark()
        self._commit(plan, results)
        timer.mark()
        step = Step(plan, results, features)
        outputs = self._advance(step)
        timer.mark()
        self.last_step = replace(step, times=timer.times())
        self.stats.add_step(self.last_step.times)
        return outputs

    def _plan(self, timer: StepTimer) -> StepPlan:
        """Propose the decoding requests' trees (the step's first stage), then lay out its rows."""
        decoding = tuple(r for r in self._running if not r.prefilling)
        trees, suspect = self._propose(decoding)
        timer.mark()
        failed = tuple(r for r in decoding if r.finished)  # its drafting raised: it leaves now
        decoding = tuple(r for r in decoding if not r.finished)
        chunks = self._chunks()
        running = tuple(
            r for r in self._running if not r.finished and (not r.prefilling or r.request_id in chunks)
        )
        if not running:  # every request of the step failed in drafting: nothing to score
            return StepPlan((), (), (), None, None, None, failed)
        batch = StepBatch.build(list(running), chunks, trees, self.target.device)
        finishing = tuple(r for r in running if r.prefilling and batch.finishes_prefill(r))
        return StepPlan(running, finishing, decoding, trees, suspect, batch, failed)

    def _score(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward over the step's rows: (its logits, the features the proposer
        reads, or None)."""
        batch = plan.batch
        # A token outside the vocabulary is reported after the read; the forward must not index with it.
        tokens = batch.tokens if plan.suspect is None else batch.tokens.clamp(0, self.target.vocab_size - 1)
        out = self.target.forward(
            tokens, self.cache, batch.cu, [r.slot for r in plan.running], tree_mask=batch.tree_mask,
            depth=batch.depth, logit_rows=batch.logit_rows, hidden_layers=self.feature_layers,
            return_hidden=self.wants_hidden,
        )  # fmt: skip
        features = (
            torch.cat([out.layer_hidden[layer] for layer in self.feature_layers], dim=-1)
            if self.feature_layers
            else out.hidden
        )
        return out.logits, features

    def _verify(self, plan: StepPlan, logits: torch.Tensor) -> StepReadback:
        """The processors, the prompts' first tokens and the trees' verification, read back in
        the step's one read; a proposal that failed its check raises here, before anything is
        committed."""
        finishing, decoding = list(plan.finishing), list(plan.decoding)
        logits = self.picker.process(logits, finishing, decoding, plan.trees)
        first = self.picker.first_tokens(finishing, logits[: plan.batch.num_prefill_logits])
        table = self.picker.verify_table(decoding, plan.trees, logits[plan.batch.num_prefill_logits :])
        back = read_back(first, table, plan.trees, plan.suspect)
        if back.suspect:  # the forward ran on clamped tokens; nothing is committed
            locate_problem(plan.trees, self._asks(decoding), self.target.vocab_size, self.max_tree_nodes)
            raise ValueError("proposer returned a tree that does not match its requests")
        return back

    def _results(
        self, plan: StepPlan, back: StepReadback, features: torch.Tensor | None
    ) -> tuple[RequestResult, ...]:
        """One record per request that produced tokens, built from the step's read: first the
        requests whose prompt finished (the prompt's last token acts as a root-alone tree whose
        row produced the first token), then the decoding requests' trees; each with the target's
        features at its committed rows when the proposer reads them. Nothing is cut yet."""
        finishing, decoding = list(plan.finishing), list(plan.decoding)
        prefill_hidden: list = [None] * len(finishing)
        decode_hidden: list = [None] * len(decoding)
        if self._handover is not None:
            accepted = [outcome.accepted for outcome in back.trees]
            prefill_hidden, decode_hidden = committed_features(
                features, plan.batch, list(plan.running), finishing, decoding, accepted
            )
        first = (
            RequestResult(r.request_id, (r.prompt[-1],), (-1,), (0,), (token,), hidden)
            for r, token, hidden in zip(finishing, back.first_tokens, prefill_hidden, strict=True)
        )
        trees = (
            RequestResult(r.request_id, o.tree_tokens, o.tree_parents, o.accepted, o.committed, hidden)
            for r, o, hidden in zip(decoding, back.trees, decode_hidden, strict=True)
        )
        return (*first, *trees)

    def _commit(self, plan: StepPlan, results: tuple[RequestResult, ...]) -> None:
        """Keep in the cache every prefill chunk whole and each tree's accepted path."""
        trees = results[len(plan.finishing) :]
        keep = plan.batch.prefill_accepted | {r.request_id: list(r.accepted) for r in trees}
        self.cache.commit([r.slot for r in plan.running], [keep[r.request_id] for r in plan.running])

    def _advance(self, step: Step) -> list[RequestOutput]:
        """Move every request on by what the step committed, tell the proposer what each kept,
        retire the finished requests; the step's outputs."""
        plan = step.plan
        if self._handover is not None:
            self._handover.prefill(step.features, plan.batch, list(plan.running))
        for request in plan.running:
            if request.prefilling:
                request.num_prefilled += plan.batch.chunk_len[request.request_id]
        outputs = self._failed_outputs(plan)
        observed = []
        for i, (request, result) in enumerate(zip(plan.finishing + plan.decoding, step.results, strict=True)):
            kept = self._append(request, list(result.committed))
            if i >= len(plan.finishing):  # a tree's step
                self.stats.accepted_lengths.setdefault(request.request_id, []).append(len(result.committed))
            outputs.append(RequestOutput(request.request_id, kept, request.finished, request.finish_reason))
            if request.speculate:
                observed.append(replace(result, committed=tuple(kept), hidden=_cut(result.hidden, kept)))
        if self.proposer is not None and observed:
            self.proposer.observe(StepResult(observed))
        self._retire()
        return outputs

    @staticmethod
    def _failed_outputs(plan: StepPlan) -> list[RequestOutput]:
        return [RequestOutput(r.request_id, [], True, r.finish_reason, r.error) for r in plan.failed]

    def _admit(self) -> None:
        while self._waiting and self.cache.num_free and len(self._running) < self.max_running:
            request = self._waiting.popleft()
            request.slot = self.cache.allocate()
            # requests that speculate run first: their trees come first, as the proposer returns them
            at = len(self._running)
            if request.speculate:
                at = next((i for i, r in enumerate(self._running) if not r.speculate), at)
            self._running.insert(at, request)
            self.stats.prompt_tokens += len(request.prompt)
            if self._pinned:
                self._reuse_pinned(request)

    def _propose(self, decoding: Sequence[Request]) -> tuple[TokenTree | None, torch.Tensor | None]:
        """One tree per decoding request, on the model's device, and the proposal check's flag
        on the device (True: something is wrong; the step raises once it has read it back);
        (None, None) without decoding requests. Without a proposer every tree is its root alone."""
        if not decoding:
            return None, None
        plain = [r for r in decoding if not r.speculate]  # the running order puts them last
        if len(plain) == len(decoding):
            return TokenTree.roots([r.output[-1] for r in decoding]).to(self.target.device), None
        asks = self._asks(decoding[: len(decoding) - len(plain)])
        try:
            tree = self.proposer.propose(asks)
        except Exception:  # whatever it was, it is named to the requests it fails on
            tree = self._propose_apart(asks)
            if tree is None:  # every speculating request failed: the rest decode their roots
                if not plain:
                    return None, None
                return TokenTree.roots([r.output[-1] for r in plain]).to(self.target.device), None
            asks = [a for a in asks if not self._requests[a.request_id].finished]
        suspect = check_proposal(tree, asks, self.target.vocab_size, self.max_tree_nodes, full=self.debug)
        self.stats.drafted_nodes += tree.num_nodes - len(asks)
        tree = tree.to(self.target.device)
        if plain:
            roots = TokenTree.roots([r.output[-1] for r in plain]).to(self.target.device)
            if tree.draft_probs is not None:  # rows of leaves, never read: kept so the trees concatenate
                roots = replace(
                    roots, draft_probs=tree.draft_probs.new_zeros(len(plain), tree.draft_probs.shape[1])
                )
            tree = TokenTree.concat([tree, roots])
        return tree, suspect

    def _propose_apart(self, asks: list[ProposalRequest]) -> TokenTree | None:
        """The proposer raised on the step's requests together: ask it for each request alone,
        so that only the requests it fails on fail (finish reason "error", the exception named)
        and the others go on. Their trees in order, or None when every one failed."""
        trees = []
        for ask in asks:
            try:
                trees.append(self.proposer.propose([ask]))
            except Exception as error:
                request = self._requests[ask.request_id]
                request.finish_reason = "error"
                request.error = (
                    f"{type(self.proposer).__name__}.propose raised {type(error).__name__}: {error}"
                )
        return TokenTree.concat(trees) if trees else None

    def _asks(self, decoding: Sequence[Request]) -> list[ProposalRequest]:
        return [
            ProposalRequest(
                r.request_id, r.prompt + r.output, len(r.prompt), r.sampling, r.max_new_tokens - len(r.output)
            )
            for r in decoding
        ]

    def _chunks(self) -> dict[int, list[int]]:
        """This step's prompt chunk of each prefilling request that runs: at most
        ``prefill_chunk_size`` tokens each, in the running order until ``max_prefill_tokens`` are
        taken (the requests past it wait; the first always runs: prompts move on).
        :class:`StepBatch` flattens them with the decoding trees into one ragged batch."""
        chunks: dict[int, list[int]] = {}
        left = self.max_prefill_tokens
        for request in self._running:
            if not request.prefilling or (left is not None and left < 1):
                continue
            size = self.prefill_chunk_size or len(request.prompt)
            if left is not None:
                size = min(size, left)
            chunk = request.prompt[request.num_prefilled : request.num_prefilled + size]
            chunks[request.request_id] = chunk
            if left is not None:
                left -= len(chunk)
        return chunks

    def _append(self, request: Request, tokens: list[int]) -> list[int]:
        """Append the step's committed tokens to the request's output, cut at EOS,
        max_new_tokens or its stop rule (that token kept); returns what was kept."""
        kept = []
        for token in tokens:
            kept.append(token)
            if token in request.eos_token_ids:
                request.finish_reason = "eos"
            elif len(request.output) + len(kept) >= request.max_new_tokens:
                request.finish_reason = "length"
            elif request.stop is not None and request.stop(request.prompt + request.output + kept):
                request.finish_reason = "stop"
            if request.finished:
                break
        request.output.extend(kept)
        self.stats.new_tokens += len(kept)
        return kept

    def _retire(self) -> None:
        for request in self._running:
            if request.finished:
                self.cache.free(request.slot)
                request.slot = -1
                if request.speculate:
                    self.proposer.release(request.request_id)
        self._running = [r for r in self._running if not r.finished]


def _check_engine_args(
    target: Target,
    max_batch_size: int,
    prefill_chunk_size: int | None,
    max_prefill_tokens: int | None,
    generator: torch.Generator | None,
    proposer: Proposer | None,
    sampler: str,
) -> None:
    """Refuse, by name, what an Engine cannot run with."""
    if prefill_chunk_size is not None and (not isinstance(prefill_chunk_size, int) or prefill_chunk_size < 1):
        raise ValueError(f"prefill_chunk_size must be an int >= 1 or None, got {prefill_chunk_size!r}")
    if max_prefill_tokens is not None and (
        not isinstance(max_prefill_tokens, int)
        or isinstance(max_prefill_tokens, bool)
        or max_prefill_tokens < 1
    ):
        raise ValueError(f"max_prefill_tokens must be an int >= 1 or None, got {max_prefill_tokens!r}")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    if proposer is not None and not isinstance(proposer, Proposer):
        raise TypeError(f"proposer must be a treespec.proposers.Proposer, got {type(proposer).__name__}")
    if proposer is not None and proposer.vocab_size not in (None, target.vocab_size):
        raise ValueError(
            f"the draft's vocabulary ({proposer.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}); a draft model must share the target's tokenizer"
        )
    if sampler not in ("hf", "inverse-cdf"):
        raise ValueError(f"sampler must be 'hf' or 'inverse-cdf', got {sampler!r}")
    if generator is not None and generator.device.type != target.device.type:
        raise ValueError(
            f"the generator is on {generator.device} but the model on {target.device}: every step "
            f"draws its randomness on the model's device (torch.Generator(device={str(target.device)!r}))"
        )


def _cut(hidden: torch.Tensor | None, kept: list[int]) -> torch.Tensor | None:
    """hidden[j] is the feature at the node that predicted kept[j]: the rows of what was kept."""
    return None if hidden is None else hidden[: len(kept)]
