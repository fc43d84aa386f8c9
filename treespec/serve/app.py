"""The OpenAI-compatible HTTP side of ``treespec serve``: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed or not), ``/health`` and ``/metrics`` (docs/serving.md).

Requests are checked here, before the engine sees them: a bad field is a 400 in OpenAI's error
shape naming the field, what was expected and what was given.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from treespec.api import _stop_criteria
from treespec.sampling import SamplingParams
from treespec.serve.runner import EngineRunner, TokenStream

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons, as OpenAI names them


class BadRequest(Exception):
    """A request the server refuses: HTTP 400 with ``message`` and the field it is about."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    # treespec's own: false keeps this request away from the server's proposer (plain decoding);
    # proposer: which of the server's proposers drafts for it (None: the server's default)
    speculation: bool = True
    proposer: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class ServerConfig:
    """What the app serves: the model's name, its stop tokens, the longest context a request
    may fill (prompt + new tokens), the API key (None: open) and the proposers a request may
    name (the first the default; empty: the server does not speculate)."""

    model_name: str
    eos: tuple[int, ...]
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    proposers: tuple[str, ...] = ()


def sampling_params(body: _Sampling, vocab_size: int) -> SamplingParams:
    """The request's :class:`SamplingParams` (OpenAI's defaults: temperature 1, top-p 1)."""
    if body.n != 1:
        raise BadRequest(f"n must be 1 (one completion per request), got {body.n}", "n")
    if body.logprobs not in (None, False, 0):
        raise BadRequest("logprobs are not returned by this server; leave the field out", "logprobs")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if not -2.0 <= value <= 2.0:
            raise BadRequest(f"{name} must be between -2 and 2, got {value}", name)
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise BadRequest(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias"
            )
        if not -100.0 <= value <= 100.0:
            raise BadRequest(f"logit_bias values must be between -100 and 100, got {value}", "logit_bias")
        bias.append((int(key), float(value)))
    return SamplingParams(
        temperature=temperature, top_p=None if top_p == 1.0 else top_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, logit_bias=tuple(bias), seed=body.seed,
    )  # fmt: skip


def stop_strings(body: _Sampling) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or not all(s for s in stop):
        raise BadRequest(f"stop must be up to 4 non-empty strings, got {body.stop!r}", "stop")
    return stop


class TextCut:
    """The text of a growing token list, released as it becomes final: a character is held back
    while the tokens so far end inside a multi-byte character, and while the text could still turn
    into a stop string (OpenAI leaves the stop string out of the text)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = 0  # characters released

    def add(self, tokens: list[int], final: bool) -> str:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, final = text[:cut], True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an unfinished multi-byte character
                end = len(text.rstrip("\ufffd"))
            for stop in self.stops:  # the longest tail that begins a stop string waits
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if stop.startswith(text[end - k : end]):
                        end -= k
                        break
        piece = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


def build_app(runner: EngineRunner, tokenizer, config: ServerConfig) -> FastAPI:
    """The FastAPI app over a started :class:`EngineRunner`."""
    app = FastAPI(title="treespec", docs_url=None, redoc_url=None)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(400, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        given = first.get("input")
        return _error(400, f"{where or 'body'}: {first.get('msg')} (got {given!r})"[:500], where)

    @app.middleware("http")
    async def authorise(request: Request, call_next):
        if config.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return _error(
                    401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key"
                )
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "treespec", "max_model_len": config.max_model_len}]}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(runner), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.echo or (body.best_of or 1) != 1 or body.suffix:
            raise BadRequest("echo, best_of > 1 and suffix are not supported; leave them out", "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise BadRequest(f"one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        return await _serve(body, request, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        for m in messages:  # content parts: the text ones, joined
            if isinstance(m.get("content"), list):
                parts = m["content"]
                if any(p.get("type") != "text" for p in parts):
                    raise BadRequest("only text content parts are supported", "messages")
                m["content"] = "".join(p.get("text", "") for p in parts)
        try:
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))  # fmt: skip
        except Exception as exc:  # the template's own refusal (roles out of order, ...)
            raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from exc
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(body, request, ids, limit, chat=True)

    async def _serve(
        body: _Sampling, request: Request, ids: list[int], max_tokens: int | None, *, chat: bool
    ):
        if body.model is not None and body.model != config.model_name:
            raise BadRequest(f"model {body.model!r} is not served here; this server serves {config.model_name!r}",
                             "model")  # fmt: skip
        if not ids:
            raise BadRequest("the prompt is empty", "prompt")
        if any(not isinstance(t, int) or not 0 <= t < config.vocab_size for t in ids):
            raise BadRequest(f"prompt token ids must be in [0, {config.vocab_size})", "prompt")
        room = config.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be an int >= 1, got {max_tokens!r}", "max_tokens")
        if max_tokens > room:
            raise BadRequest(f"this model's maximum context length is {config.max_model_len} tokens; the prompt "
                             f"has {len(ids)} and max_tokens asks for {max_tokens} more", "max_tokens")  # fmt: skip
        if body.proposer is not None and body.proposer not in config.proposers:
            served = ", ".join(config.proposers) if config.proposers else "none: it does not speculate"
            raise BadRequest(f"proposer {body.proposer!r} is not served here; this server drafts with {served}",
                             "proposer")  # fmt: skip
        params = sampling_params(body, config.vocab_size)
        stops = stop_strings(body)
        stop = _stop_rule(stops, tokenizer)
        stream = runner.submit(ids, max_new_tokens=max_tokens, eos=list(config.eos), sampling=params, stop=stop,
                               speculate=body.speculation, proposer=body.proposer)  # fmt: skip
        reply = Reply(chat, config.model_name, len(ids))
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(runner, stream, TextCut(tokenizer, stops), reply, usage),
                                     media_type="text/event-stream")  # fmt: skip
        return await _whole(runner, stream, TextCut(tokenizer, stops), reply, request)

    return app


def _stop_rule(stops: list[str], tokenizer) -> Callable[[list[int]], bool] | None:
    """The engine's stop rule for OpenAI's stop strings: HF's StopStringCriteria on the tokens."""
    return _stop_criteria(stops, tokenizer) if stops else None


class Reply:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}  # fmt: skip

    def whole(self, text: str, finish: str, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(completion_tokens)}  # fmt: skip

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}  # fmt: skip

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage(completion_tokens)}  # fmt: skip


async def _whole(runner: EngineRunner, stream: TokenStream, cut: TextCut, reply: Reply, request: Request):
    """Wait for the whole completion; a client that goes away meanwhile aborts it (between the
    engine's steps). The disconnect is read from the ASGI channel as a streaming response reads
    it: Starlette's ``is_disconnected`` polls with a cancelled scope and never saw uvicorn's."""
    text, count = "", 0
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while True:
            step = asyncio.ensure_future(stream.next())
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                runner.abort(stream)
                return JSONResponse({}, status_code=499)
            delta = step.result()
            if delta.error is not None:
                return _error(500, f"the engine failed: {delta.error}", None, "server_error")
            count += len(delta.tokens)
            text += cut.add(delta.tokens, final=delta.finish_reason is not None)
            if delta.finish_reason is not None:
                return JSONResponse(reply.whole(text, FINISH.get(delta.finish_reason, "stop"), count))
    finally:
        gone.cancel()


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (the request's body is read: the next ASGI message is
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(runner: EngineRunner, stream: TokenStream, cut: TextCut, reply: Reply, usage: bool
                  ) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events: a chunk per step's new text, the finish reason, usage if asked, [DONE].
    A chat stream's role chunk goes out with the first step's tokens (as vLLM's does), so a
    client's time to first token counts the prefill. Cancelled (the client went away), it
    aborts the request."""
    done, count, opened = False, 0, not reply.chat
    try:
        while True:
            delta = await stream.next()
            if not opened:
                yield _event(reply.chunk(None, None, first=True))
                opened = True
            if delta.error is not None:
                yield _event(
                    {"error": {"message": f"the engine failed: {delta.error}", "type": "server_error"}}
                )
                done = True
                break
            count += len(delta.tokens)
            piece = cut.add(delta.tokens, final=delta.finish_reason is not None)
            if delta.finish_reason is not None:
                if piece:
                    yield _event(reply.chunk(piece, None))
                yield _event(reply.chunk(None, FINISH.get(delta.finish_reason, "stop")))
                done = True
                break
            if piece:
                yield _event(reply.chunk(piece, None))
        if usage:
            yield _event(reply.usage_chunk(count))
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            runner.abort(stream)


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _error(status: int, message: str, param: str | None, code: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)  # fmt: skip


def prometheus(runner: EngineRunner) -> str:
    """The runner's counters in Prometheus' text format."""
    m = runner.metrics
    lines = [
        "# HELP treespec_requests_running Requests decoding now.", "# TYPE treespec_requests_running gauge",
        f"treespec_requests_running {runner.running}",
        "# HELP treespec_requests_waiting Requests waiting for a slot.", "# TYPE treespec_requests_waiting gauge",
        f"treespec_requests_waiting {runner.waiting}",
        "# HELP treespec_requests_total Requests taken.", "# TYPE treespec_requests_total counter",
        f"treespec_requests_total {m.requests_total}",
        "# HELP treespec_requests_aborted_total Requests whose client went away.",
        "# TYPE treespec_requests_aborted_total counter", f"treespec_requests_aborted_total {m.requests_aborted}",
        "# HELP treespec_prompt_tokens_total Prompt tokens taken.", "# TYPE treespec_prompt_tokens_total counter",
        f"treespec_prompt_tokens_total {m.prompt_tokens}",
        "# HELP treespec_generated_tokens_total Tokens generated.",
        "# TYPE treespec_generated_tokens_total counter", f"treespec_generated_tokens_total {m.generated_tokens}",
        "# HELP treespec_steps_total Engine steps.", "# TYPE treespec_steps_total counter",
        f"treespec_steps_total {m.steps}",
        "# HELP treespec_step_seconds_total Seconds inside engine steps.",
        "# TYPE treespec_step_seconds_total counter", f"treespec_step_seconds_total {m.step_seconds:.6f}",
        "# HELP treespec_decode_steps_total Decoding steps, per request, by method (none: no speculation).",
        "# TYPE treespec_decode_steps_total counter",
        *(f'treespec_decode_steps_total{{method="{k}"}} {v}' for k, v in sorted(m.decode_steps.items())),
        "# HELP treespec_committed_tokens_total Tokens committed by decoding steps, by method; over "
        "treespec_decode_steps_total: tokens per step.",
        "# TYPE treespec_committed_tokens_total counter",
        *(f'treespec_committed_tokens_total{{method="{k}"}} {v}' for k, v in sorted(m.committed_tokens.items())),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
