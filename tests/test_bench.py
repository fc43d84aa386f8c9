"""``treespec bench`` (treespec.bench.e2e): end to end on a tiny model with its own tokenizer and
heads, the identity check, bad input; and the autoregressive engine benchmark of
treespec bench ar (treespec.bench.ar) on one small case."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import pytest
import torch
from conftest import build
from test_eagle import random_head
from transformers.utils import logging as hf_logging

from treespec.bench.ar import ARBenchConfig, run_ar_bench
from treespec.bench.e2e import BenchConfig, Components, category_batches, format_report, summarise
from treespec.cli import main
from treespec.heads.draft import make_draft, save_draft
from treespec.heads.medusa import MedusaConfig, MedusaHeads
from treespec.prompts import read_prompt_records

KEYS = {"name", "tokens_per_s", "speedup_vs_hf", "speedup_vs_none", "mean_accepted_tokens", "identical_to_reference",
        "stage_ms"}  # fmt: skip


def tiny_model_folder(path):
    """A tiny Llama with a word-level tokenizer (w0 .. w126, [UNK]) and three random heads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = build("llama")
    model.generation_config.eos_token_id = None
    model.save_pretrained(path / "model")
    vocab = {f"w{i}": i for i in range(127)} | {"[UNK]": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(
        path / "model"
    )
    random_head(model).save(path / "eagle")
    torch.manual_seed(0)
    MedusaHeads(MedusaConfig(64, 128, num_heads=2, own_lm_head=False)).save(path / "medusa")
    save_draft(make_draft(model, 1), path / "draft", dtype=torch.float32)
    return model


def write_prompts(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_cli_runs_every_method_and_baseline_end_to_end(tmp_path, capfd):
    tiny_model_folder(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"category": "copy", "turns": ["w1 w2 w3 w1 w2 w3 w1 w2"]},
        {"category": "copy", "question": "w5 w6 w5 w6 w5"},
        {"category": "free", "prompt": "w9 w40 w77"},
    ])  # fmt: skip
    argv = ["bench", "--model", str(tmp_path / "model"), "--prompts", prompts, "--max-new-tokens", "6",
            "--dtype", "fp32", "--json", str(tmp_path / "out.json"), "--warmup", "0",
            "--heads", f"eagle={tmp_path / 'eagle'}", "--heads", f"medusa={tmp_path / 'medusa'}",
            "--heads", f"draft={tmp_path / 'draft'}"]  # fmt: skip
    pytest.importorskip("matplotlib")
    notices = []  # what transformers logs while treespec's baselines call into HF
    handler = logging.Handler(logging.WARNING)
    handler.emit = notices.append
    hf_logging.warning_once.cache_clear()  # a notice logged once before this test would hide
    logging.getLogger("transformers").addHandler(handler)
    try:
        assert main([*argv, "--plot", str(tmp_path / "elsewhere.png")]) == 0
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert [n.getMessage() for n in notices] == []
    printed = capfd.readouterr()
    assert "legend: tok/s new tokens per second" in printed.out
    assert "summary: fastest " in printed.out and "best speculative method " in printed.out
    assert "speedup vs none per category: copy, free" in printed.out
    assert "treespec's methods kept the target's output on all 3 prompts" in printed.out
    assert "the baselines kept the target's output on all 3 prompts" in printed.out
    assert printed.out.startswith("treespec bench: importing torch")
    assert "loading heads: draft" in printed.out and "calibrating the tree budget" in printed.err
    assert not (tmp_path / "out.png").exists()  # --plot PATH writes there
    report = json.loads((tmp_path / "out.json").read_text())
    names = [m["name"] for m in report["methods"]]
    assert names == ["hf", "hf-pld", "hf-assisted", "none", "ngram", "draft", "medusa", "eagle", "hybrid"]
    drafting = {m["name"]: m["drafting"] for m in report["methods"] if "drafting" in m}
    assert drafting["none"] == drafting["ngram"] == {}  # no model drafts for them
    assert set(drafting["hybrid"]) == set(drafting["eagle"]) == {"eagle head"}
    assert drafting["eagle"]["eagle head"].startswith("modules (the fused decoder is for bf16 heads")  # fp32
    assert set(drafting["draft"]) == {"draft model"} and set(drafting["medusa"]) == {"medusa heads"}
    assert "drafting through: draft: draft model modules (" in printed.out
    assert set(report["config"]) >= {"model", "proposers", "baselines", "max_new_tokens", "dtype", "temperature",
                                     "batch_size", "seed", "warmup", "json", "plot", "device", "budget",
                                     "linear_backend"}  # fmt: skip
    for method in report["methods"]:
        if method["kind"] == "treespec":
            assert KEYS <= set(method) and set(method["stage_ms"]) == {
                "propose",
                "score",
                "verify",
                "commit",
                "other",
            }
            assert sum(method["accepted_length_histogram"].values()) == method["decode_steps"]
        assert method["identical_to_reference"] == 1.0, method["name"]  # fp32: every method, HF's too
    assert set(report["methods"][0]["per_category"]) == {"copy", "free"}
    hf, pld, assisted = report["methods"][:3]  # HF's tau: tokens per target forward after the prefill
    assert hf["mean_accepted_tokens"] == 1.0 and pld["mean_accepted_tokens"] >= 1.0
    assert assisted["mean_accepted_tokens"] >= 1.0
    for method in report["methods"]:  # tau per category, weighted by steps = overall
        taus = [v["tau"] for v in method["per_category"].values()]
        assert min(taus) - 1e-9 <= method["mean_accepted_tokens"] <= max(taus) + 1e-9
    assert "tau (tokens per step) per category: copy, free" in format_report(report)
    assert (tmp_path / "elsewhere.png").stat().st_size > 1000
    assert main([*argv[:-6], "--proposer", "eagle", "--batch-size", "2", "--budget", "fixed",
                 "--baselines", "hf,hf-pld", "--heads", f"eagle={tmp_path / 'eagle'}"]) == 0  # fmt: skip
    assert (tmp_path / "out.png").stat().st_size > 1000  # by default, the plot lies beside the JSON
    (tmp_path / "out.png").unlink()
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["skipped_baselines"] == {"hf-pld": "HF supports it at batch size 1 only"}
    assert report["batch_sizes_run"] == {"1": 1, "2": 1}  # two "copy" prompts together, "free" alone
    assert set(report["methods"][0]["per_category"]) == {"copy", "free"}
    fixed_31 = report["methods"][-1]
    assert fixed_31["name"] == "eagle" and fixed_31["mean_drafted_nodes"] > 4  # random heads: trees of ~31
    assert main([*argv[:-6], "--proposer", "eagle", "--budget", "4", "--baselines", "hf", "--no-plot",
                 "--heads", f"eagle={tmp_path / 'eagle'}"]) == 0  # fmt: skip
    assert not (tmp_path / "out.png").exists()
    eagle = json.loads((tmp_path / "out.json").read_text())["methods"][-1]
    assert 0 < eagle["mean_drafted_nodes"] <= 4 and eagle["identical_to_reference"] == 1.0
    # a repetition penalty for every method and baseline: HF's and treespec's outputs still agree
    assert main([*argv[:-6], "--proposer", "ngram,eagle", "--repetition-penalty", "1.5", "--no-plot",
                 "--baselines", "hf,hf-pld", "--heads", f"eagle={tmp_path / 'eagle'}"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["config"]["repetition_penalty"] == 1.5
    assert all(m["identity"] == {"exact": 3, "near_tie": 0, "diverged": 0} for m in report["methods"])


def test_batches_stay_within_a_category():
    assert category_batches(["a", "b", "a", "a", "b", "c"], 2) == [[0, 2], [3], [1, 4], [5]]
    assert category_batches(["a", "a", "a"], 1) == [[0], [1], [2]]


def test_identity_check_flags_an_injected_divergence(tmp_path):
    model = tiny_model_folder(tmp_path)
    config = BenchConfig(model=str(tmp_path / "model"), proposers=("ngram",), baselines=("hf",), dtype="fp32",
                         max_new_tokens=4)  # fmt: skip
    components = Components.__new__(Components)
    components.hf_model = model
    pairs = [("a", "x"), ("b", "y")]
    encoded = [[1, 2, 3], [4, 5]]
    with torch.no_grad():
        logits = model(torch.tensor([encoded[1] + [7]])).logits[0, -1]
    reference = [[10, 11, 12, 13], [7, 8, 9, 10]]
    broken = [[10, 11, 12, 13], [7, 99, 9, 10]]  # prompt 1 parts at position 1
    run = lambda tokens: [{"prompts": [i], "tokens": [t], "seconds": 1.0} for i, t in enumerate(tokens)]  # noqa: E731
    results = {"hf": run(reference), "none": run(reference), "ngram": run(broken)}
    for r in results["none"] + results["ngram"]:
        r.update(
            steps=4,
            accepted_lengths=[1, 1, 1, 1],
            drafted_nodes=0,
            stages_s=dict.fromkeys(["propose", "score", "verify", "commit"], 0.1),
        )
    report = summarise(config, components, pairs, encoded, results, ["hf", "none", "ngram"])
    ngram = report["methods"][2]
    assert ngram["identical_to_reference"] == 0.5
    (mismatch,) = ngram["mismatches"]
    assert mismatch["prompt"] == 1 and mismatch["position"] == 1 and mismatch["got"] == 99
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    assert gap > 1e-3 and mismatch["top2_logit_gap"] == pytest.approx(gap, abs=1e-5)
    # fp32's near-tie bound is 1e-4: this gap is a real divergence, named in the summary
    assert ngram["identity"] == {"exact": 1, "near_tie": 0, "diverged": 1} and not mismatch["near_tie"]
    assert report["methods"][0]["identity"] == {"exact": 2, "near_tie": 0, "diverged": 0}
    text = format_report(report)
    assert "prompt 1: first differs" not in text  # the details only with verbose
    assert "REAL DIVERGENCE (gap > 0.0001) in ngram (1)" in text.splitlines()[-1]
    assert "treespec's methods on 1 of 2 method-prompt runs" in text.splitlines()[-1]
    assert "prompt 1: first differs at token 1 (99 vs 8)" in format_report(report, verbose=True)
    # a bound above the gap: the same divergence is a near-tie
    wide = summarise(
        replace(config, tie_gap=2 * gap), components, pairs, encoded, results, ["hf", "none", "ngram"]
    )
    assert wide["methods"][2]["identity"] == {"exact": 1, "near_tie": 1, "diverged": 0}
    last = format_report(wide).splitlines()[-1]
    assert "1 first differing at a near-tie" in last and "REAL DIVERGENCE" not in last
    assert "near-tie" in format_report(wide, verbose=True)
    # with a repetition penalty the gap is the processed logits', which decided the token
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    penalised = summarise(replace(config, repetition_penalty=2.0), components, pairs, encoded, results,
                          ["hf", "none", "ngram"])  # fmt: skip
    top = (
        RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[4, 5, 7]]), logits[None].clone())[0]
        .topk(2)
        .values
    )
    assert penalised["methods"][2]["mismatches"][0]["top2_logit_gap"] == pytest.approx(
        float(top[0] - top[1]), abs=1e-5
    )
    assert BenchConfig(dtype="bf16").near_tie_gap == 0.5 and BenchConfig(tie_gap=0.2).near_tie_gap == 0.2


def test_bad_input(tmp_path, capsys):
    with pytest.raises(ValueError, match="looked for turns\\[0\\], question, prompt"):
        read_prompt_records(write_prompts(tmp_path / "p.jsonl", [{"text": "hello"}]))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_prompt_records(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="does not exist"):
        read_prompt_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown method"):
        BenchConfig(proposers=("speculate",))
    with pytest.raises(ValueError, match="unknown baseline"):
        BenchConfig(baselines=("vllm",))
    for bad in ("64", "8:0", "8:9", "8:", "x", "8:two"):
        with pytest.raises(ValueError, match="a node count N from 1 to 31 or N:D"):
            BenchConfig(budget=bad)
    assert BenchConfig(budget="8:3").budget == "8:3"
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        BenchConfig(linear_backend="fast")
    with pytest.raises(ValueError, match="draft_vocab must be >= 0, got -1"):
        BenchConfig(draft_vocab=-1)
    with pytest.raises(ValueError, match="tie_gap must be >= 0, got -0.5"):
        BenchConfig(tie_gap=-0.5)
    assert main(["bench", "--proposer", "magic"]) == 2
    assert "unknown method" in capsys.readouterr().err
    tiny_model_folder(tmp_path)
    prompts = write_prompts(tmp_path / "ok.jsonl", [{"prompt": "w1 w2"}])
    # a baseline that needs a component this model does not have: named
    assert main(["bench", "--model", str(tmp_path / "model"), "--prompts", prompts, "--proposer", "none",
                 "--baselines", "hf-assisted", "--dtype", "fp32", "--json", str(tmp_path / "o.json")]) == 2  # fmt: skip
    assert "hf-assisted needs a head of kind 'draft'" in capsys.readouterr().err
    assert main(["bench", "--model", str(tmp_path / "model"), "--prompts", prompts, "--proposer", "eagle",
                 "--baselines", "hf", "--dtype", "fp32", "--json", str(tmp_path / "o.json")]) == 2  # fmt: skip
    assert "method 'eagle' needs a head of kind 'eagle'" in capsys.readouterr().err


def test_ar_bench_runs_and_matches_hf_in_fp32(tmp_path):
    tiny_model_folder(tmp_path)
    config = ARBenchConfig(model=str(tmp_path / "model"), dtypes=("fp32",), batch_sizes=(2,), max_new_tokens=4,
                           repeats=1, warmup=0)  # fmt: skip
    report = run_ar_bench(config, out_path=tmp_path / "ar.json", log=lambda line: None)
    (case,) = report["cases"]
    assert set(case["tokens_per_s"]) == {"hf_generate", "hf_loop", "treespec"}
    assert case["tokens_match_hf_generate"] and case["new_tokens"] == 8
    assert json.loads((tmp_path / "ar.json").read_text())["config"]["batch_sizes"] == [2]
    with pytest.raises(ValueError, match="dtypes must be among"):
        ARBenchConfig(dtypes=("int8",))


def test_bench_help_shows_every_default(capsys):
    assert main(["bench", "--help"]) == 0
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n(?=  -)", options)]  # one per option, unwrapped
    takes_value = [e for e in entries if re.match(r"-[-\w]+ [A-Z{]", e)]  # flags (--verbose) have none
    assert len(takes_value) >= 20
    for entry in takes_value:
        assert "(default: " in entry, entry
    assert any("(default: bench_results/bench.json)" in e for e in entries)
    assert any(e.startswith("--proposer") and e.endswith("(default: all)") for e in entries)


def test_every_method_is_set_against_plain_decoding_beside_hf():
    """`vs none` is each method's speed over treespec's own plain decoding in the same run, in the
    JSON (overall and per category), the table and the summary, which names the best and the
    slowest speculative method: a method below plain decoding reads below 1.00x there even when it
    is far above HF."""
    from treespec.bench.e2e import SPEEDUP_BASES, _speedups, summary_line

    def entry(name, kind, rates):
        return {"name": name, "kind": kind, "tokens_per_s": sum(rates.values()) / 2,
                "per_category": {c: {"tokens_per_s": r} for c, r in rates.items()}}  # fmt: skip

    methods = [entry("hf", "baseline", {"a": 10.0, "b": 20.0}), entry("none", "treespec", {"a": 40.0, "b": 80.0}),
               entry("eagle", "treespec", {"a": 60.0, "b": 60.0}), entry("draft", "treespec", {"a": 36.0, "b": 72.0})]  # fmt: skip
    for base in SPEEDUP_BASES:
        _speedups(methods, base)
    hf, none, eagle, draft = methods
    assert none["speedup_vs_none"] == 1.0 and hf["speedup_vs_none"] == 15.0 / 60.0
    assert eagle["speedup_vs_none"] == 1.0 and eagle["per_category"]["a"]["speedup_vs_none"] == 1.5
    assert draft["speedup_vs_hf"] == 54.0 / 15.0 and draft["speedup_vs_none"] == 0.9
    report = {"methods": methods, "categories": ["a", "b"], "config": {"temperature": 1.0, "dtype": "bf16"}}
    table = format_report(report)
    assert table.splitlines()[0].split()[:5] == ["method", "tok/s", "vs", "hf", "vs"]
    draft_row = next(line for line in table.splitlines() if line.startswith("draft"))
    assert draft_row.split()[1:4] == ["54.0", "3.60x", "0.90x"]
    assert "speedup vs none per category: a, b" in table
    assert summary_line(report).endswith(
        "best speculative method eagle at 1.00x plain decoding, slowest draft at 0.90x; output identity not checked"
        " (sampling)"
    )
    without_none = [m for m in methods if m["name"] != "none"]
    for m in without_none:
        for key in ("speedup_vs_none", "speedup_vs_hf"):
            m.pop(key)
            for values in m["per_category"].values():
                values.pop(key)
    _speedups(without_none, "none")  # no plain decoding in the run: no ratio to it, no crash
    assert all("speedup_vs_none" not in m for m in without_none)


def test_drafting_is_reported_in_plain_steps():
    """`draft`: each method's drafting ms per step over plain decoding's scoring ms per step, in
    the JSON and the table; nothing where the run had no plain decoding."""
    from treespec.bench.e2e import _drafting_share, _method_row

    def entry(name, propose, score):
        return {"name": name, "kind": "treespec", "tokens_per_s": 50.0, "per_category": {},
                "stage_ms": {"propose": propose, "score": score, "verify": 0.5, "commit": 0.1, "other": 0.2}}  # fmt: skip

    methods = [entry("none", 0.0, 12.0), entry("eagle", 3.0, 30.0), entry("draft", 18.0, 30.0)]
    _drafting_share(methods)
    assert [m.get("drafting_vs_plain_step") for m in methods] == [None, 0.25, 1.5]
    assert _method_row(methods[1]).split()[9] == "0.25"  # after the identity columns
    alone = [entry("eagle", 3.0, 30.0)]
    _drafting_share(alone)
    assert "drafting_vs_plain_step" not in alone[0] and _method_row(alone[0]).split()[9] == "-"
