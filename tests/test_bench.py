"""The benchmark entry points: input handling fast, a tiny real run slow."""

from __future__ import annotations

import json

import pytest

from treespec.bench import BenchConfig, run
from treespec.bench_spec import SpecBenchConfig, _summarise, read_prompts, run_spec
from treespec.cli import main


def write_prompts(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_read_prompts_takes_the_first_per_category(tmp_path):
    rows = [{"category": c, "turns": [f"{c} {i}"]} for c in ("qa", "rag") for i in range(3)]
    assert read_prompts(write_prompts(tmp_path / "p.jsonl", rows), 2) == [
        ("qa", "qa 0"), ("qa", "qa 1"), ("rag", "rag 0"), ("rag", "rag 1"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'category' and 'turns'"):
        read_prompts(write_prompts(tmp_path / "bad.jsonl", [{"text": "x"}]), 1)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(str(tmp_path / "missing.jsonl"), 1)


def test_summary_is_total_tokens_over_total_time():
    def row(category, seconds):
        methods = {
            m: {"seconds": seconds, "same_tokens_as_hf_generate": True}
            for m in ("hf_generate", "hf_prompt_lookup")
        }
        methods["ngram_chain"] = {"seconds": seconds / 2, "tau": 2.0, "same_tokens_as_hf_generate": True}
        return {"category": category, "methods": methods}

    summary = _summarise([row("qa", 1.0), row("qa", 3.0), row("rag", 2.0)], new=10)
    assert summary["qa"]["hf_generate"]["tokens_per_s"] == pytest.approx(20 / 4)
    assert summary["qa"]["ngram_chain"]["vs_hf_generate"] == pytest.approx(2.0)
    assert summary["all"]["ngram_chain"]["tau"] == 2.0


def test_bad_configs_and_cli_errors(capsys):
    with pytest.raises(ValueError, match="dtypes"):
        BenchConfig(dtypes=("int8",))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpecBenchConfig(prompts="x", max_new_tokens=0)
    assert main(["bench", "--proposer", "ngram"]) == 2
    assert "--prompts" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_real_runs(tmp_path):
    report = run(BenchConfig(dtypes=("fp32",), batch_sizes=(1,), max_new_tokens=4, repeats=1, warmup=0),
                 out_path=tmp_path / "ar.json", log=lambda _: None)  # fmt: skip
    case = report["cases"][0]
    assert case["tokens_match_hf_generate"] and set(case["tokens_per_s"]) == {
        "hf_generate",
        "hf_loop",
        "treespec",
    }
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"category": "copy", "turns": ["Repeat: one two three, one two three."]}]
    )
    spec = run_spec(SpecBenchConfig(prompts=prompts, dtype="fp32", per_category=1, max_new_tokens=6),
                    out_path=tmp_path / "ngram.json", log=lambda _: None)  # fmt: skip
    methods = spec["summary"]["all"]
    assert set(methods) == {"hf_generate", "hf_prompt_lookup", "treespec_ar", "ngram_chain", "ngram_trie"}
    assert methods["ngram_trie"]["same_tokens_as_hf_generate"] == 1.0
    assert json.loads((tmp_path / "ngram.json").read_text())["rss"]["after_mib"] > 0
