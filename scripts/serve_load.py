"""The serving load test (docs/serving.md): treespec's server with and without speculation, vLLM's
OpenAI server (CPU build) and llama-server, each started in turn on the same port and driven by
the same client, vLLM's serving benchmark (``../shared/peers/serve_bench.py``), on the same
held-out prompts at each concurrency.

    python scripts/serve_load.py OUT [--servers treespec-none,treespec-auto,vllm,llama]
                                     [--concurrency 1,8] [--num-prompts 32] [--output-len 128]

Needs ``../shared/peers/setup.sh`` (vLLM's venv, llama.cpp's ``llama-server``, the bf16 GGUF) and
pandas in vLLM's venv (its benchmark reads a prompt file with it: ``$PEERS_DIR/vllm/bin/python -m
pip install pandas``).
Prompts: the first turn of every k-th row of Spec-Bench without MT-bench
(``../shared/data/prompts/spec_bench/``, prompts no head trains on), written to OUT at run time,
never into the repository. Chat endpoint, temperature 0, each server applying the model's chat
template; a request ends at the model's end of sequence or ``--output-len`` tokens. Every request
on a connection of its own (``Connection: close``): llama-server closes a kept-alive connection
after a few requests, which the client saw as failed requests (9 of 32). Per run
OUT gets vLLM's result JSON (``SERVER-cN.json``) and the server's log, each run on a freshly
started server (llama-server and vLLM keep earlier prompts' K/V and would reuse them); ``summary.json`` and the
printed table give output tokens/s, requests/s, time to first token, time per output token after
the first (TPOT: a speculative server's chunks carry several tokens, so its inter-token latency,
ITL, is per chunk) and ITL (p50, p99). Run it alone: the client shares the cores with the server it times.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "treespec-peers"))
MODEL = "smollm2-135m-instruct"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
METRICS = ("ttft", "itl", "tpot", "e2el")


def write_prompts(source: Path, out: Path, count: int) -> int:
    """Every k-th row's first turn of ``source`` (Spec-Bench JSONL) as ``{"prompt": ...}`` lines
    in ``out``, k spreading ``count`` rows over the whole file (its categories in turn)."""
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    if count < 1 or count > len(rows):
        raise ValueError(f"--num-prompts must be in 1..{len(rows)}, got {count}")
    step = len(rows) / count
    picked = [rows[int(i * step)]["turns"][0] for i in range(count)]
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in picked))
    return len(picked)


def server_command(
    name: str, port: int, model_dir: Path, max_batch: int, treespec_args: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment that start server ``name`` on ``port``
    (``treespec_args``: more flags for treespec's)."""
    if name.startswith("treespec-"):
        proposer = name.removeprefix("treespec-")
        treespec = [sys.executable, "-m", "treespec.cli"]
        return [*treespec, "serve", MODEL, "--port", str(port), "--proposer", proposer,
                "--max-batch", str(max_batch), *treespec_args], {}  # fmt: skip
    if name == "vllm":
        return [str(PEERS_DIR / "vllm/bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(model_dir), "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", MODEL, "--max-num-seqs", str(max_batch)], VLLM_ENV  # fmt: skip
    if name == "llama":
        return [str(PEERS_DIR / "llama.cpp/build/bin/llama-server"), "-m", str(PEERS_DIR / "smollm2-bf16.gguf"),
                "--host", "127.0.0.1", "--port", str(port), "-np", str(max_batch), "-c", str(4096 * max_batch),
                "-t", "2", "--alias", MODEL], {}  # fmt: skip
    raise ValueError(f"servers are treespec-PROPOSER, vllm or llama, got {name!r}")


def wait_ready(port: int, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def summarize(results: dict[str, dict]) -> list[dict]:
    """One row per run (``SERVER-cN`` -> vLLM's result JSON): the numbers the table prints."""
    rows = []
    for run, result in results.items():
        row = {"run": run, "completed": result.get("completed"), "output_tok_s": result.get("output_throughput"),
               "req_s": result.get("request_throughput")}  # fmt: skip
        for metric in ("ttft", "tpot", "itl"):
            for p in ("p50", "p99"):  # the percentiles the client is asked for (--metric-percentiles)
                row[f"{metric}_{p}_ms"] = result.get(f"{p}_{metric}_ms")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| run | done | output tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms |\n"
        "|---|---|---|---|---|---|---|\n"
    )

    def f(x) -> str:
        return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"

    return head + "".join(
        f"| {r['run']} | {r['completed']} | {f(r['output_tok_s'])} | {f(r['req_s'])} | "
        f"{f(r['ttft_p50_ms'])} / {f(r['ttft_p99_ms'])} | {f(r['tpot_p50_ms'])} / {f(r['tpot_p99_ms'])} | "
        f"{f(r['itl_p50_ms'])} / {f(r['itl_p99_ms'])} |\n"
        for r in rows
    )


def _run(name: str, level: int, run: str, args: argparse.Namespace, model_dir: Path, prompts: Path) -> bool:
    """Start server ``name``, time it at concurrency ``level`` with vLLM's client, stop it; whether
    the client finished (its result JSON is then in ``args.out``)."""
    command, extra = server_command(name, args.port, model_dir, level, tuple(args.treespec_args.split()))
    log = open(args.out / f"{run}.server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **extra},
                              cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        wait_ready(args.port, server, args.ready_timeout)
        client = [str(PEERS_DIR / "vllm/bin/python"), str(SHARED / "peers/serve_bench.py"),
                  "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{args.port}",
                  "--endpoint", "/v1/chat/completions", "--model", MODEL, "--tokenizer", str(model_dir),
                  "--dataset-name", "custom", "--dataset-path", str(prompts), "--skip-chat-template",
                  "--disable-shuffle", "--num-prompts", str(args.num_prompts), "--max-concurrency",
                  str(level), "--custom-output-len", str(args.output_len), "--temperature", "0",
                  "--num-warmups", "1", "--header", "Connection=close", "--percentile-metrics", ",".join(METRICS),
                  "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(args.out),
                  "--result-filename", f"{run}.json", "--disable-tqdm"]  # fmt: skip
        done = subprocess.run(client, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True)
        (args.out / f"{run}.client.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            print(f"{run}: the client failed ({done.returncode}): {done.stderr[-400:]}", flush=True)
        return done.returncode == 0
    except RuntimeError as exc:  # a server that did not start: said, and the next one runs
        print(f"{run}: {exc} (its log: {args.out / f'{run}.server.log'})", flush=True)
        return False
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        log.close()
        time.sleep(3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--servers", default="treespec-none,treespec-auto,vllm,llama")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--treespec-args", default="", help="more flags for treespec serve, one string")
    parser.add_argument(
        "--prompts", type=Path, default=SHARED / "data/prompts/spec_bench/question_no_mtbench.jsonl"
    )
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = Path(os.environ.get("TREESPEC_MODEL_DIR", Path.home() / ".cache/treespec/models" / MODEL))
    vllm = PEERS_DIR / "vllm/bin/python"
    if subprocess.run([str(vllm), "-c", "import pandas"], capture_output=True).returncode != 0:
        raise SystemExit(f"vLLM's serving benchmark reads the prompts with pandas, which {vllm} lacks: "
                         f"{vllm} -m pip install pandas (or run ../shared/peers/setup.sh first)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = args.out / "prompts.jsonl"
    write_prompts(args.prompts, prompts, args.num_prompts)
    results: dict[str, dict] = {}
    for name in args.servers.split(","):
        for level in levels:  # a fresh server per run: no prompt cached by an earlier one
            run = f"{name}-c{level}"
            if _run(name, level, run, args, model_dir, prompts):
                results[run] = json.loads((args.out / f"{run}.json").read_text())
                print(table(summarize({run: results[run]})).splitlines()[-1], flush=True)
    rows = summarize(results)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
