"""treespec serve: the real ``openai`` client against a live server on 127.0.0.1 (a tiny model with
SmolLM2's tokenizer, bf16 through the batch-invariant kernels): both endpoints, streamed or not,
equal to ``treespec.generate`` at temperature 0 with and without speculation, 16 clients at once,
a client that goes away, seeded sampling, metrics, and every bad input."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
try:  # the HTTP client the openai package brings (httpx2 in its newer releases, httpx before)
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treespec.models import model_path

    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, tie_word_embeddings=True))  # fmt: skip
    with torch.no_grad():  # confident and repetitive enough that n-gram drafts get accepted
        model.lm_head.weight.mul_(6)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class LiveServer:
    """A server in a thread of this process, on a free port."""

    def __init__(self, folder, **options) -> None:
        import uvicorn

        from treespec.serve import ServeConfig
        from treespec.serve.server import build

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.config = ServeConfig(str(folder), port=port, max_batch=4, prefill_chunk=16, **options)
        self.app, self.runner = build(self.config)
        self.runner.start()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=options.get("api_key") or "none",
                                    max_retries=0)  # fmt: skip

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.runner.close()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line and line[0] != "#"
        }


@pytest.fixture(scope="module", params=["none", "ngram"])
def server(request, tiny_folder):
    # n-gram with its own fixed trees: the adaptive budget's choice hangs on the machine's timings
    live = LiveServer(tiny_folder, proposer=request.param, budget="fixed")
    yield live
    live.close()


@pytest.fixture(scope="module")
def reference(tiny_folder):
    """treespec.generate on the same model (bf16), greedy: the tokens and the text."""
    from treespec import generate
    from treespec.models import load

    model, tokenizer = load(str(tiny_folder), dtype=torch.bfloat16)

    def run(ids: list[int], max_new: int, **kwargs) -> tuple[list[int], str]:
        out = generate(model, [ids], max_new_tokens=max_new, tokenizer=tokenizer, **kwargs).sequences[0]
        return out, tokenizer.decode(out, skip_special_tokens=True)

    return run, tokenizer


PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "1 2 3 4 5 6", "Hello"]


def _chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))  # fmt: skip


def test_both_endpoints_equal_generate_at_temperature_zero(server, reference):
    run, tokenizer = reference
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        tokens, want = run(ids, 24)
        got = server.client.completions.create(
            model=server.config.model, prompt=text, max_tokens=24, temperature=0
        )
        assert got.choices[0].text == want
        assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(tokens)
        assert got.choices[0].finish_reason == ("length" if len(tokens) == 24 else "stop")
        by_ids = server.client.completions.create(
            model=server.config.model, prompt=ids, max_tokens=24, temperature=0
        )
        assert by_ids.choices[0].text == want
        chat_ids = _chat_ids(tokenizer, text)
        _, want = run(chat_ids, 20)
        got = server.client.chat.completions.create(
            model=server.config.model, messages=[{"role": "user", "content": text}], max_completion_tokens=20,
            temperature=0, extra_body={"speculation": False},
        )  # fmt: skip
        assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
        assert got.usage.prompt_tokens == len(chat_ids)


def test_streams_carry_the_same_text_then_the_finish_and_usage(server, reference):
    run, tokenizer = reference
    text = PROMPTS[1]
    _, want = run(tokenizer(text)["input_ids"], 30)
    chunks = list(server.client.completions.create(model=server.config.model, prompt=text, max_tokens=30,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    _, want = run(_chat_ids(tokenizer, text), 30)
    chunks = list(server.client.chat.completions.create(model=server.config.model,
                                                        messages=[{"role": "user", "content": text}],
                                                        max_tokens=30, temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert all(c.usage is None for c in chunks)  # not asked for


def test_stop_strings_end_the_text_before_them(server, reference):
    run, tokenizer = reference
    text = PROMPTS[0]
    _, full = run(tokenizer(text)["input_ids"], 30)
    stop = full[5:8]  # a piece of what it will write
    got = server.client.completions.create(model=server.config.model, prompt=text, max_tokens=30, temperature=0,
                                           stop=[stop])  # fmt: skip
    assert got.choices[0].text == full[: full.find(stop)] and got.choices[0].finish_reason == "stop"
    streamed = server.client.completions.create(model=server.config.model, prompt=text, max_tokens=30,
                                                temperature=0, stop=stop, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == full[: full.find(stop)]


def test_sixteen_clients_at_once_each_get_their_own_completion(server, reference):
    run, tokenizer = reference
    texts = [f"{PROMPTS[i % 4]} {i}" for i in range(16)]
    wants = [run(tokenizer(t)["input_ids"], 16 + i % 5)[1] for i, t in enumerate(texts)]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def one(i: int):
        if i % 2:
            stream = await client.completions.create(model=server.config.model, prompt=texts[i],
                                                     max_tokens=16 + i % 5, temperature=0, stream=True)  # fmt: skip
            return "".join([c.choices[0].text async for c in stream])
        got = await client.completions.create(model=server.config.model, prompt=texts[i], max_tokens=16 + i % 5,
                                              temperature=0)  # fmt: skip
        return got.choices[0].text

    async def everyone():
        return await asyncio.gather(*(one(i) for i in range(16)))

    assert asyncio.run(everyone()) == wants
    metrics = server.metrics()
    assert metrics["treespec_requests_running"] == 0 and metrics["treespec_requests_waiting"] == 0
    if server.config.proposer == "ngram":  # drafts were accepted: the speculative path ran, exactly
        steps = metrics['treespec_decode_steps_total{method="ngram"}']
        assert metrics['treespec_committed_tokens_total{method="ngram"}'] > 1.1 * steps


def test_seeded_sampling_repeats_itself(server):
    def sample(seed: int) -> str:
        return server.client.completions.create(model=server.config.model, prompt=PROMPTS[3], max_tokens=20,
                                                temperature=1.0, top_p=0.9, seed=seed).choices[0].text  # fmt: skip

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_a_client_that_goes_away_frees_its_slot(server):
    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", json={
        "model": server.config.model, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "stream": True,
    }) as response:  # fmt: skip
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "text_completion"
    deadline = time.time() + 20
    while True:
        metrics = server.metrics()
        if metrics["treespec_requests_aborted_total"] == before["treespec_requests_aborted_total"] + 1:
            break
        assert time.time() < deadline, metrics
        time.sleep(0.05)
    assert metrics["treespec_requests_running"] == 0
    assert metrics["treespec_generated_tokens_total"] - before["treespec_generated_tokens_total"] < 400
    engine = server.runner.engine
    assert engine.cache.num_free == engine.max_running


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list().data
    assert [m.id for m in models] == [server.config.model]
    server.client.completions.create(
        model=server.config.model, prompt=PROMPTS[2], max_tokens=8, temperature=0
    )
    metrics = server.metrics()
    assert metrics["treespec_steps_total"] > 0 and metrics["treespec_generated_tokens_total"] > 0
    method = server.config.proposer
    assert metrics[f'treespec_decode_steps_total{{method="{method}"}}'] > 0
    assert (
        metrics[f'treespec_committed_tokens_total{{method="{method}"}}']
        >= metrics[f'treespec_decode_steps_total{{method="{method}"}}']
    )


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "x", "model": "gpt-4"}, "model"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias"),
        ({"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "proposer": "medusa"}, "proposer"),
        ({"prompt": "x", "proposer": 5}, "proposer"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400s_that_name_the_field(server, body, field):
    response = httpx.post(server.url + "/v1/completions", json={"model": server.config.model, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert error["message"]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_tokens"),
    ],
)
def test_bad_chat_requests_are_400s(server, body, field):
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": server.config.model, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_an_api_key_is_required_where_one_is_set(tiny_folder):
    live = LiveServer(tiny_folder, proposer="none", api_key="sesame")
    try:
        got = live.client.completions.create(
            model=live.config.model, prompt="hi", max_tokens=3, temperature=0
        )
        assert got.usage.completion_tokens >= 1
        wrong = openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert httpx.get(live.url + "/health").status_code == 200  # open: load balancers probe it
    finally:
        live.close()


def test_serve_refuses_bad_options():
    from treespec.serve import ServeConfig

    with pytest.raises(ValueError, match="proposer must be one of"):
        ServeConfig("m", proposer="magic")
    for listed in ("eagle,eagle", "eagle,auto", "ngram,none", "eagle,magic"):
        with pytest.raises(ValueError, match="a list of proposers names distinct ones of ngram, eagle"):
            ServeConfig("m", proposer=listed)
    assert ServeConfig("m", proposer="eagle, ngram").proposers == ("eagle", "ngram")
    with pytest.raises(ValueError, match="max_batch must be"):
        ServeConfig("m", max_batch=0)
    with pytest.raises(ValueError, match="port must be"):
        ServeConfig("m", port=70000)
    with pytest.raises(ValueError, match="budget must be"):
        ServeConfig("m", budget="huge")


def test_a_request_picks_one_of_the_servers_proposers(tiny_folder, reference, monkeypatch):
    """--proposer ngram,eagle: n-gram lookup drafts by default, "proposer": "eagle" picks the EAGLE
    head (a random one for the tiny model), "speculation": false neither; every completion equals
    generate, each method's steps are counted apart, and a proposer the server lacks is a 400."""
    from test_eagle import random_head

    from treespec.bench.e2e import Components
    from treespec.proposers import EagleProposer

    original = Components.proposer

    def proposer(self, method):
        if method != "eagle":
            return original(self, method)
        head = random_head(self.model, std=0.05).to(torch.bfloat16)
        return EagleProposer(head, self.model, top_k=2, depth=3, total_tokens=5, max_batch_size=4)

    monkeypatch.setattr(Components, "proposer", proposer)
    live = LiveServer(tiny_folder, proposer="ngram,eagle", budget="fixed")
    run, tokenizer = reference
    try:
        for text in PROMPTS[:3]:
            ids = tokenizer(text)["input_ids"]
            _, want = run(ids, 20)
            for extra in ({}, {"proposer": "eagle"}, {"proposer": "ngram"}, {"speculation": False}):
                got = live.client.completions.create(model=live.config.model, prompt=text, max_tokens=20,
                                                     temperature=0, extra_body=extra)  # fmt: skip
                assert got.choices[0].text == want, (text, extra)
        metrics = live.metrics()
        for method in ("ngram", "eagle", "none"):
            assert metrics[f'treespec_decode_steps_total{{method="{method}"}}'] > 0, method
        response = httpx.post(live.url + "/v1/completions", json={"prompt": "x", "proposer": "medusa"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "proposer"
        assert "this server drafts with ngram, eagle" in response.json()["error"]["message"]
        assert live.runner.router is not None and live.runner.router._route == {}
    finally:
        live.close()


def test_the_command_serves_and_stops_on_sigterm(tiny_folder):
    """`treespec serve` as a user starts it (the engine on the main thread, the HTTP side on
    another): a process that answers, and exits cleanly on SIGTERM."""
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "treespec.cli", "serve", str(tiny_folder), "--port", str(port),
               "--proposer", "ngram", "--budget", "fixed", "--max-batch", "2"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        got = client.completions.create(model=str(tiny_folder), prompt="1 2 3", max_tokens=5, temperature=0)
        assert got.usage.completion_tokens >= 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "treespec: serving" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


def test_a_failing_step_is_told_to_its_requests_and_a_waiting_client_that_leaves_is_aborted(tiny_folder):
    """An engine step that raises ends every open request with the error (a 500 for a whole
    completion, an error event in a stream) and the server goes on serving; a client that stops
    waiting for a whole completion is aborted within about half a second, its slot freed."""
    live = LiveServer(tiny_folder, proposer="none")
    engine = live.runner.engine
    step = engine.step
    try:
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("a broken kernel"))
        with pytest.raises(openai.InternalServerError, match="(?s)the engine failed.*a broken kernel"):
            live.client.completions.create(model=live.config.model, prompt="hi", max_tokens=4, temperature=0)
        with httpx.stream("POST", live.url + "/v1/completions", json={
            "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True,
        }) as response:  # fmt: skip
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert "a broken kernel" in events[-1]["error"]["message"]

        def slow_step():  # 20 ms a step: a whole completion of 400 tokens takes seconds
            time.sleep(0.02)
            return step()

        engine.step = slow_step
        before = live.metrics()["treespec_requests_aborted_total"]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 400, "temperature": 0},
                       timeout=0.3)  # fmt: skip
        deadline = time.time() + 10
        while live.metrics()["treespec_requests_aborted_total"] == before:
            assert time.time() < deadline, "the request was not aborted"
            time.sleep(0.05)
        assert (
            live.metrics()["treespec_requests_running"] == 0 and engine.cache.num_free == engine.max_running
        )
        engine.step = step
        got = live.client.completions.create(
            model=live.config.model, prompt="hi", max_tokens=4, temperature=0
        )
        assert got.usage.completion_tokens >= 1
    finally:
        engine.step = step
        live.close()


def test_a_proposer_that_raises_fails_its_request_with_the_error_and_the_server_goes_on(tiny_folder):
    """Drafting that raises for one request ends that request with a 500 naming the proposer's
    error (the engine's finish reason "error"), not the whole server; the next request runs."""
    live = LiveServer(tiny_folder, proposer="ngram")
    proposer = live.runner.engine.proposer
    propose = proposer.propose
    try:
        proposer.propose = lambda requests: (_ for _ in ()).throw(KeyError("a lost index"))
        with pytest.raises(openai.InternalServerError, match="(?s)the engine failed.*KeyError.*a lost index"):
            live.client.completions.create(
                model=live.config.model, prompt="1 2 1 2", max_tokens=6, temperature=0
            )
        proposer.propose = propose
        got = live.client.completions.create(
            model=live.config.model, prompt="1 2 1 2", max_tokens=6, temperature=0
        )
        assert got.usage.completion_tokens >= 1
    finally:
        proposer.propose = propose
        live.close()
