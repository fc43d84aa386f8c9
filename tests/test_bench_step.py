"""`treespec bench step` (treespec.bench.step) on a tiny random Llama with random heads: the report's structure and
positive times for every forward size and every proposer's budget."""

from __future__ import annotations

import json

import pytest
from conftest import build
from test_eagle import random_head
from test_heads import random_heads

SMALL = dict(context=16, batches=(1, 2), sizes=(1, 4), budgets=(1, 3), repeats=1, warmup=1)


@pytest.fixture(scope="module")
def bench_step():
    from treespec.bench import step

    return step


def test_quick_run_reports_every_size_and_budget(bench_step, tmp_path):
    model = build("llama")
    heads = {"eagle": random_head(model), "medusa": random_heads(model), "draft": build("llama", seed=3)}
    config = bench_step.StepBenchConfig(device="cpu", dtype="fp32", **SMALL)
    prompts = [[5, 6, 7, 8] * 3, list(range(20, 40))]
    report = bench_step.run(model, heads, prompts, config, log=lambda _: None)
    out = tmp_path / "step.json"
    bench_step.write(report, out, log=lambda _: None)
    saved = json.loads(out.read_text())
    assert saved["batching"].startswith("per request")
    assert saved["target"] == {"attention_backend": "reference", "linear_backends": ["fp32-kmajor"],
                               "backends": ["fp32-kmajor+reference"]}  # fmt: skip
    assert not saved["skipped"]
    forward = saved["forward"]
    assert [(r["batch"], r["new_per_request"]) for r in forward] == [(b, n) for b in (1, 2) for n in (1, 4)]
    for row in forward:
        assert row["new_tokens"] == row["batch"] * row["new_per_request"]
        assert row["treespec_ms"] > 0 and row["hf_ms"] > 0
        if row["new_per_request"] == 1:
            assert row["treespec_vs_1"] == row["hf_vs_1"] == 1.0
    propose = saved["propose"]
    want = [(k, b, n) for b in (1, 2) for k in ("ngram", "draft", "medusa", "eagle") for n in (1, 3)]
    assert [(r["proposer"], r["batch"], r["budget"]) for r in propose] == want
    for row in propose:
        assert row["ms"] > 0 and row["vs_target_step"] > 0
        assert 0 <= row["drafted_nodes"] <= row["budget"]
        if row["proposer"] != "ngram":  # heads always fill a fixed budget; n-grams need matches
            assert row["drafted_nodes"] == row["budget"]
    if bench_step.plot(saved, tmp_path / "again.png"):  # matplotlib is in the test extra
        assert out.with_suffix(".png").stat().st_size > 0


def test_missing_heads_are_skipped_and_bad_configs_refused(bench_step):
    model = build("llama")
    config = bench_step.StepBenchConfig(device="cpu", dtype="fp32", **{**SMALL, "batches": (1,)})
    report = bench_step.run(model, {}, [[1, 2, 3]], config, log=lambda _: None)
    assert set(report["skipped"]) == {"draft", "medusa", "eagle"}
    assert {r["proposer"] for r in report["propose"]} == {"ngram"}
    with pytest.raises(ValueError, match="include 1"):
        bench_step.StepBenchConfig(sizes=(2, 4))
    with pytest.raises(ValueError, match="unknown proposer"):
        bench_step.StepBenchConfig(proposers=("lookahead",))


def test_heads_given_by_folder_replace_the_shipped_ones(bench_step, tmp_path):
    """``--heads eagle=PATH`` drafts with that folder's head (the report names it); a malformed
    value is refused by name."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from treespec.models import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path("smollm2-135m-instruct"))
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True))  # fmt: skip
    tiny.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    random_head(tiny).save(tmp_path / "eagle")
    out = tmp_path / "step.json"
    argv = ["--model", str(tmp_path / "tiny"), "--dtype", "fp32", "--context", "16", "--batches", "1",
            "--sizes", "1,2", "--budgets", "1,3", "--repeats", "1", "--warmup", "0", "--proposers", "eagle",
            "--out", str(out)]  # fmt: skip
    bench_step.main([*argv, "--heads", f"eagle={tmp_path / 'eagle'}"])
    report = json.loads(out.read_text())
    assert report["heads"] == {"eagle": str(tmp_path / "eagle")} and not report["skipped"]
    assert [(r["proposer"], r["budget"]) for r in report["propose"]] == [("eagle", 1), ("eagle", 3)]
    with pytest.raises(ValueError, match="KIND=PATH with KIND eagle, medusa or draft, got 'lookahead=x'"):
        bench_step.main([*argv, "--heads", "lookahead=x"])
