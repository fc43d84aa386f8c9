"""scripts/gpu_check.sh, tested before a GPU ever sees it: its dry run (--cpu-smoke, the same
script end to end through Triton's interpreter) passes and every stage writes its JSON lines; a
stage that fails or runs out of time records its error and the next stage still runs; a failed
preflight stops the script; the limits fit 9 minutes; scripts/gpu_prepare.sh's transfer plan
fits the device tool's 64 MiB a call."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STAGES = ["preflight", "kernels", "setup", "tests", "identity", "bench1", "bandwidth", "batch8"]

needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")  # fmt: skip


def run_check(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out"
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "T_"))}
    environ.update(OUT=str(out), TREESPEC_GPU_STASH=str(tmp_path / "stash"), **env)
    environ.pop("TRITON_INTERPRET", None)  # the script sets it itself
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    lines = [json.loads(t) for t in (out / "results.jsonl").read_text().splitlines()]
    return proc, lines


def status(lines: list[dict]) -> dict[str, dict]:
    return {r["stage"]: r for r in lines if r["case"] == "stage_status"}


def cases(lines: list[dict], stage: str) -> list[dict]:
    return [r for r in lines if r["stage"] == stage and r["case"] != "stage_status"]


@pytest.mark.slow
@needs_bash
def test_the_dry_run_passes_end_to_end_and_every_stage_writes_its_lines(tmp_path):
    proc, lines = run_check(tmp_path, GPU_CHECK_DRY_RUN="1")  # the same as --cpu-smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = status(lines)
    assert list(done) == STAGES  # in order, each with its status line
    assert all(done[s]["status"] == "ok" for s in STAGES if s != "setup"), done
    assert done["setup"]["status"] in ("ok", "skipped")  # skipped: no model and no GGUF pieces

    preflight = {r["case"]: r for r in cases(lines, "preflight")}
    kernel = preflight["kernel"]
    assert (kernel["heads"], kernel["kv_heads"], kernel["dim"]) == (9, 3, 64)  # the default model's layout
    assert preflight["kernel"]["ok"] and preflight["summary"]["triton_equals_reference"]
    assert preflight["environment"]["interpreter"] is True
    kernels = cases(lines, "kernels")
    assert len(kernels) >= 6 and all(r["ok"] for r in kernels)
    assert {(r["heads"], r["kv_heads"]) for r in kernels} >= {(9, 3), (4, 1)}
    assert {(r["launch"], r["num_splits"]) for r in kernels if (r["heads"], r["kv_heads"]) == (9, 3)} == {
        ("tree", 1), ("tree", 3), ("causal", 1), ("causal", 3)}  # fmt: skip
    tests = cases(lines, "tests")
    assert tests[-1]["case"] == "session" and tests[-1]["failed"] == 0
    outcomes = {r["outcome"] for r in tests[:-1]}
    assert len(tests) > 1 and outcomes <= {"skipped", "passed"}  # skipped without a GPU
    identity = cases(lines, "identity")
    assert identity and all(r["triton_equals_reference"] for r in identity)
    for stage, methods in (("bench1", {"hf", "none", "ngram"}), ("batch8", {"hf", "none", "ngram"})):
        totals = {r["method"]: r for r in cases(lines, stage) if r["case"] == "speed_total"}
        assert set(totals) >= methods and all(r["tokens_per_s"] > 0 for r in totals.values())
    bandwidth = [r for r in cases(lines, "bandwidth") if r["case"] == "bandwidth"]
    assert [r["kind"] for r in bandwidth] == ["tree", "prefill"] and all(r["ok"] for r in bandwidth)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert all(re.search(rf"^{s}\s+(ok|skipped)", summary, re.M) for s in STAGES), summary
    assert (tmp_path / "out" / "gpu_check.log").stat().st_size > 0


@pytest.mark.slow
@needs_bash
def test_a_failing_stage_records_its_error_and_the_next_stages_still_run(tmp_path):
    proc, lines = run_check(tmp_path, "--cpu-smoke", "kernels", "identity", "bandwidth",
                            GPU_CHECK_FAIL="kernels", T_IDENTITY="1")  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:]
    done = status(lines)
    assert list(done) == ["kernels", "identity", "bandwidth"]
    assert done["kernels"]["status"] == "failed" and done["kernels"]["rc"] == 1
    assert "failure injected into stage kernels" in done["kernels"]["stderr_tail"]
    assert done["identity"]["status"] == "timeout" and done["identity"]["rc"] == 124
    assert done["bandwidth"]["status"] == "ok"
    assert [r["kind"] for r in cases(lines, "bandwidth") if r["case"] == "bandwidth"] == ["tree", "prefill"]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert re.search(r"^kernels\s+failed", summary, re.M) and re.search(r"^identity\s+timeout", summary, re.M)


@needs_bash
def test_a_failed_preflight_stops_the_script(tmp_path):
    proc, lines = run_check(tmp_path, "--cpu-smoke", "preflight", "kernels", GPU_CHECK_FAIL="preflight")
    assert proc.returncode == 3, proc.stdout[-3000:]
    done = status(lines)
    assert list(done) == ["preflight", "gpu_check"]
    assert done["preflight"]["status"] == "failed" and done["gpu_check"]["status"] == "stopped"
    assert not cases(lines, "kernels")


def test_the_stage_limits_fit_nine_minutes():
    text = SCRIPT.read_text()
    block = re.search(r"declare -A LIMIT=\((.*?)\)\n", text, re.S).group(1)
    limits = {
        name: int(seconds)
        for name, seconds in re.findall(r"\[(\w+)\]=\$\{T_\w+:-\$\(\((\d+) \* SCALE", block)
    }
    assert set(limits) == set(STAGES)
    assert sum(limits.values()) <= 540
    assert "BUDGET_S=${GPU_CHECK_BUDGET_S:-$((540 * SCALE))}" in text


def test_the_script_is_executable_in_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    mode = subprocess.run(["git", "ls-files", "-s", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True,
                          text=True).stdout.split()  # fmt: skip
    assert mode and mode[0] == "100755"
    assert os.access(SCRIPT, os.X_OK)


@needs_bash
def test_the_transfer_plan_fits_64_mib_a_call(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to size")
    gguf = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf
    proc = subprocess.run(["bash", "scripts/gpu_prepare.sh", "--plan"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GGUF_BYTES": str(gguf)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sizes = re.search(r"in (\d+) pieces of (\d+) KiB; largest call (\d+) KiB of 65536", proc.stdout)
    pieces, piece_kib, largest = map(int, sizes.groups())
    assert largest <= 65536 and pieces * (piece_kib + 1) * 1024 >= gguf  # KiB rounded down
    calls = re.findall(
        r"^(\d+)\. run  command: (.*?)  carry: (\[.*?\])  timeout_s: (\d+)$", proc.stdout, re.M
    )
    assert len(calls) == pieces
    assert [json.loads(carry)[1] for _, _, carry, _ in calls] == [
        f".gpu_carry/part{i}" for i in range(pieces)
    ]
    assert all(int(t) <= 600 for *_, t in calls)
    ran = " ".join(command for _, command, _, _ in calls).split()
    assert all(s in ran for s in STAGES)  # every stage runs in some call
