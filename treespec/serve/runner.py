"""The engine stepping in a thread of its own, for a server whose HTTP side runs on asyncio.

Requests come in through :meth:`EngineRunner.submit` (from the event loop), which returns a
:class:`TokenStream`; the engine thread adds them between steps, steps while anything is
unfinished, and pushes each step's new tokens into their streams. A stream whose client went
away is aborted between steps (:meth:`treespec.Engine.abort`): its cache slot and whatever the
proposer keeps for it are free before the next step runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from treespec.engine.loop import Engine
from treespec.proposers.routed import RoutedProposer
from treespec.sampling import SamplingParams


@dataclass(frozen=True)
class Delta:
    """New tokens of one request from one step; ``finish_reason`` set on its last delta (the
    engine's: "eos", "length", "stop", "abort"), ``error`` when the engine failed."""

    tokens: list[int]
    finish_reason: str | None = None
    error: str | None = None


class TokenStream:
    """One request's tokens as the engine thread produces them, read on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.request_id: int | None = None  # the engine's, once the engine thread has added it
        self.prompt_tokens = 0

    def push(self, delta: Delta) -> None:
        """From the engine thread. Once the event loop has closed (the server stopping) there is
        no one left to tell."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:
            pass

    async def next(self) -> Delta:
        return await self._queue.get()


@dataclass
class Metrics:
    """What ``GET /metrics`` reports, updated by the engine thread (plain counters: a reader may
    see one step's updates half applied, never a torn number)."""

    requests_total: int = 0
    requests_aborted: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    # per method ("none" for requests that do not speculate): decoding steps and tokens committed
    decode_steps: dict[str, int] = field(default_factory=dict)
    committed_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class _Submission:
    stream: TokenStream
    prompt: list[int]
    max_new_tokens: int
    eos: list[int]
    sampling: SamplingParams
    stop: Callable[[list[int]], bool] | None
    speculate: bool
    proposer: str | None


class EngineRunner:
    """Owns the engine and the thread that steps it. ``method`` names the proposer in the
    metrics; ``router`` (the engine's proposer, or the one inside its budget) gives each request
    the member it names, where the server offers several."""

    def __init__(self, engine: Engine, method: str, router: RoutedProposer | None = None) -> None:
        self.engine = engine
        self.method = method
        self.router = router
        self.metrics = Metrics()
        self._wake = threading.Condition()
        self._incoming: list[_Submission] = []
        self._aborts: list[TokenStream] = []
        self._streams: dict[int, TokenStream] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="treespec-engine", daemon=True)

    def start(self) -> None:
        """Step the engine in a thread of its own (tests; :func:`treespec.serve.server.serve` runs
        :meth:`run` on the main thread instead)."""
        self._thread.start()

    def run(self) -> None:
        """Step the engine on the calling thread until :meth:`close`. PyTorch's parallel operators
        cost several times more on a thread other than the main one (its OpenMP regions: 20 us
        on the main thread, 75-90 us on another, for an add of 256 x 576 on 2 cores), which
        doubled a server's decoding step (13.6 ms against 27.2 for SmolLM2-135M), so the
        server gives the main thread to the engine and the HTTP side the other."""
        self._loop()

    def close(self) -> None:
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def running(self) -> int:
        return self.engine.num_running

    @property
    def waiting(self) -> int:
        return self.engine.num_waiting + len(self._incoming)

    def submit(
        self,
        prompt: list[int],
        *,
        max_new_tokens: int,
        eos: list[int],
        sampling: SamplingParams,
        stop: Callable[[list[int]], bool] | None = None,
        speculate: bool = True,
        proposer: str | None = None,
    ) -> TokenStream:
        """Queue a request (checked by the caller: the engine thread takes it as it is); its
        tokens arrive on the returned stream. ``proposer``: the router's member that drafts for
        it (None: the default). Call from the event loop."""
        stream = TokenStream(asyncio.get_running_loop())
        stream.prompt_tokens = len(prompt)
        with self._wake:
            if self._closing:
                raise RuntimeError("the server is shutting down")
            self._incoming.append(
                _Submission(stream, prompt, max_new_tokens, eos, sampling, stop, speculate, proposer)
            )
            self._wake.notify()
        return stream

    def abort(self, stream: TokenStream) -> None:
        """End a request whose client went away (at the next pause between steps)."""
        with self._wake:
            self._aborts.append(stream)
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._incoming or self._aborts or self._closing or self.engine.has_unfinished()):
                    self._wake.wait()
                if self._closing:
                    return
                incoming, self._incoming = self._incoming, []
                aborts, self._aborts = self._aborts, []
            for item in incoming:
                self._add(item)
            for stream in aborts:
                self._abort(stream)
            if self.engine.has_unfinished():
                self._step()

    def _add(self, item: _Submission) -> None:
        try:
            request_id = self.engine.add_request(
                item.prompt, max_new_tokens=item.max_new_tokens, eos_token_id=item.eos, sampling=item.sampling,
                stop=item.stop, speculate=item.speculate,
            )  # fmt: skip
        except (ValueError, TypeError) as exc:  # checked before it came here; said, never swallowed
            item.stream.push(Delta([], "error", error=str(exc)))
            return
        if self.router is not None and item.speculate:  # before its first step: its member sees the prefill
            self.router.route(request_id, item.proposer)
        item.stream.request_id = request_id
        self._streams[request_id] = item.stream
        self.metrics.requests_total += 1
        self.metrics.prompt_tokens += len(item.prompt)

    def _abort(self, stream: TokenStream) -> None:
        request_id = stream.request_id
        if request_id is None or request_id not in self._streams:
            return  # never added (dropped with the incoming list) or already finished
        self.engine.abort(request_id)
        self._forget(request_id)
        self.metrics.requests_aborted += 1

    def _forget(self, request_id: int) -> None:
        """Drop a request that ended from the engine, its statistics and the streams."""
        self.engine.pop(request_id)
        self.engine.stats.accepted_lengths.pop(request_id, None)
        self._streams.pop(request_id, None)

    def _step(self) -> None:
        start = time.perf_counter()
        lengths = {rid: len(self.engine.stats.accepted_lengths.get(rid, ())) for rid in self._streams}
        # each request's method, read before the step (a request that finishes leaves the router)
        methods = {rid: self.router.member_of(rid) for rid in self._streams} if self.router else {}
        try:
            outputs = self.engine.step()
        except Exception:  # a bug or a broken model: every open request is told, the server stays up
            message = traceback.format_exc(limit=3)
            for request_id, stream in list(self._streams.items()):
                stream.push(Delta([], "error", error=message))
                self.engine.abort(request_id)
                self._forget(request_id)
            return
        metrics = self.metrics
        metrics.steps += 1
        metrics.step_seconds += time.perf_counter() - start
        speculating = {r.request_id for r in self.engine.last_step.plan.decoding if r.speculate}
        for out in outputs:
            metrics.generated_tokens += len(out.new_tokens)
            accepted = self.engine.stats.accepted_lengths.get(out.request_id, ())
            if len(accepted) > lengths.get(out.request_id, 0):  # a decoding step (not the first token)
                method = (
                    "none" if out.request_id not in speculating else methods.get(out.request_id, self.method)
                )
                metrics.decode_steps[method] = metrics.decode_steps.get(method, 0) + 1
                metrics.committed_tokens[method] = metrics.committed_tokens.get(method, 0) + accepted[-1]
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.push(Delta(out.new_tokens, out.finish_reason if out.finished else None, error=out.error))
            if out.finished:
                self._forget(out.request_id)
