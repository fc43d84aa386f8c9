"""Smoke runs of the measurement scripts on the real default model, at their smallest sizes:
they run, print their result and write what they say they write."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name: str):
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, argv: list[str], monkeypatch) -> None:
    module = _script(name)
    monkeypatch.setattr(sys, "argv", [name, *argv])
    module.main()


def run_suite(name: str, argv: list[str]) -> None:
    """``treespec bench NAME ARGV``, in this process."""
    from treespec import cli

    assert cli.main(["bench", name, *argv]) == 0


def tiny_model_data_and_prompts(tmp_path: Path) -> str:
    """A tiny model in tmp_path/model, its head data (48 answer tokens) in tmp_path/data, and two
    bench prompts in two categories; returns the prompts file."""
    from test_bench import tiny_model_folder, write_prompts

    from treespec.heads.training.data import write_dataset

    model = tiny_model_folder(tmp_path)
    write_dataset(model, [list(range(5, 12)), [20, 21, 22], list(range(30, 45)), [7, 8]], tmp_path / "data",
                  feature_layers=(0, 1, 1), max_new_tokens=12, batch_size=4, progress=False)  # fmt: skip
    return write_prompts(tmp_path / "p.jsonl", [{"category": "a", "prompt": "w1 w2 w3"},
                                                {"category": "b", "prompt": "w9 w40 w77"}])  # fmt: skip


@pytest.mark.slow
def test_profile_step_groups_the_time_of_each_forward(tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.json"
    run_suite("profile", ["--sizes", "1,2", "--linear-backends", "auto", "--repeats", "1", "--warmup", "0",
                          "--context", "16", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert [r["new_tokens"] for r in rows] == [1, 2]
    for row in rows:
        groups = row["groups_ms"]
        assert groups["linear"] > 0 and row["wall_ms"] > 0 and row["top_ops"]
    assert "tokens:" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_batch_decode_reports_prefill_and_decode_rates(monkeypatch, capsys):
    run_suite("batch", ["--batch", "2", "--new", "3"])
    printed = capsys.readouterr().out
    assert "prefill" in printed and "decode step" in printed and "tokens/s" in printed


def test_learning_curve_trains_nested_points_measures_them_and_skips_what_the_data_lacks(
    tmp_path, monkeypatch
):
    pytest.importorskip("matplotlib")
    prompts = tiny_model_data_and_prompts(tmp_path)
    argv = ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "curve"),
            "--points", "10,30,100000", "--epochs", "1", "--prompts", prompts, "--per-category", "1",
            "--new-tokens", "4", "--settings", "4:0", "31:1"]  # fmt: skip
    run_script("learning_curve", argv, monkeypatch)
    points = json.loads((tmp_path / "curve" / "curve.json").read_text())["points"]
    assert [p.get("skipped", "") == "" for p in points] == [True, True, False]
    assert "the data held 48 answer tokens" in points[2]["skipped"]
    small, large = points[:2]
    assert 10 <= small["answer_tokens"] < large["answer_tokens"] and small["positions"] < large["positions"]
    for p in (small, large):
        assert (
            p["tau"] >= 1 and set(p["tau_per_category"]) == {"a", "b"} and p["identical_to_reference"] == 1.0
        )
        assert p["prompts"] == 2 and all(0 <= a <= 1 for a in p["acceptance_by_depth"])
        assert set(p["tau_at"]) == {"4 nodes T=0", "31 nodes T=1"} and all(
            t >= 1 for t in p["tau_at"].values()
        )
    assert "tau, 4 nodes T=0 | tau, 31 nodes T=1" in (tmp_path / "curve" / "curve.md").read_text()
    assert "| 10" not in (tmp_path / "curve" / "curve.md").read_text()  # the data's own sizes, not the asked
    assert (tmp_path / "curve" / "curve.png").stat().st_size > 1000
    # a second run keeps the finished points (their heads are not retrained)
    stamp = (tmp_path / "curve" / "eagle-10" / "head" / "model.safetensors").stat().st_mtime_ns
    run_script("learning_curve", argv, monkeypatch)
    assert (tmp_path / "curve" / "eagle-10" / "head" / "model.safetensors").stat().st_mtime_ns == stamp
    beside = ["--out", str(tmp_path / "beside"), "--beside", str(tmp_path / "curve"), "--points", "10"]
    run_script("learning_curve", argv + beside, monkeypatch)
    assert (tmp_path / "beside" / "curve.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        run_script("learning_curve", argv + ["--settings", "40:0"], monkeypatch)


def test_learning_curve_of_a_draft_model_at_a_chosen_number_of_layers(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    prompts = tiny_model_data_and_prompts(tmp_path)

    def argv(layers: int, out: str) -> list[str]:
        return ["--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"), "--out", str(tmp_path / out),
                "--kind", "draft", "--draft-layers", str(layers), "--points", "10", "--epochs", "1",
                "--prompts", prompts, "--per-category", "1", "--new-tokens", "4"]  # fmt: skip

    run_script("learning_curve", argv(1, "curve"), monkeypatch)
    assert (
        json.loads((tmp_path / "curve" / "draft-10" / "head" / "config.json").read_text())["num_layers"] == 1
    )
    (point,) = json.loads((tmp_path / "curve" / "curve.json").read_text())["points"]
    assert point["tau"] >= 1 and point["identical_to_reference"] == 1.0
    # the tiny target has 2 layers: a draft as deep as its target is refused by name
    with pytest.raises(ValueError, match="num_layers < the target's 2 layers"):
        run_script("learning_curve", argv(2, "deep"), monkeypatch)


def test_eagle_kinds_trains_both_kinds_point_by_point_and_draws_them_together(tmp_path):
    import subprocess

    pytest.importorskip("matplotlib")
    prompts = tiny_model_data_and_prompts(tmp_path)
    env = os.environ | {
        "PYTHON": sys.executable, "MODEL": str(tmp_path / "model"), "POINTS": "10,30", "EPOCHS": "1",
        "TTT_STEPS": "2", "SETTINGS": "4:0", "PER_CATEGORY": "1", "NEW_TOKENS": "4", "BENCH_PROMPTS": prompts,
    }  # fmt: skip
    out = tmp_path / "kinds"
    run = subprocess.run([str(SCRIPTS / "eagle_kinds.sh"), str(tmp_path / "data"), str(out)], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for kind, ttt in (("eagle", "1"), ("eagle3", "2")):
        curve = json.loads((out / kind / "curve.json").read_text())
        assert curve["args"]["ttt_steps"] == ttt and curve["args"]["precision"] == "bf16"
        assert [
            p["answer_tokens"] >= 10 and set(p["tau_at"]) == {"4 nodes T=0"} for p in curve["points"]
        ] == [True] * 2
    assert (
        json.loads((out / "eagle3" / "eagle3-10" / "report.json").read_text())["config"]["kind"] == "eagle3"
    )
    assert (out / "eagle3" / "curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_quick_recipe_runs_every_stage_and_reports_its_tau(tmp_path):
    """The quick recipe end to end at its smallest: prompts, answers, features, an EAGLE head, its
    tau; a second run resumes every stage and trains no further."""
    import subprocess

    env = os.environ | {
        "TREESPEC": str(Path(sys.executable).parent / "treespec"), "PYTHON": sys.executable, "PROMPTS": "10",
        "ANSWER_TOKENS": "64", "BATCH": "4", "MAX_NEW": "16", "EPOCHS": "1",
        "BENCH_ARGS": "--num-prompts 1 --max-new-tokens 8 --warmup 0",
    }  # fmt: skip
    out = tmp_path / "quick"
    run = subprocess.run(
        [str(SCRIPTS / "quick_recipe.sh"), str(out)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["answer_tokens"] >= 64 and recipe["tau"] >= 1.0 and recipe["identical_to_reference"] == 1.0
    assert set(recipe["wall_s"]) == {
        "prompts",
        "answers",
        "features",
        "train",
        "bench",
        "data_and_training",
        "all",
    }
    assert (out / "eagle" / "head").is_dir() and "quick recipe: " in run.stdout
    steps = json.loads((out / "eagle" / "report.json").read_text())["steps"]
    run = subprocess.run(
        [str(SCRIPTS / "quick_recipe.sh"), str(out)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((out / "eagle" / "report.json").read_text())["steps"] == steps
    # the second run's stage times add to the first's (bench reruns whole: its last run counts)
    ledger = [line.split("\t") for line in (out / "stage_seconds.tsv").read_text().splitlines()]
    again = json.loads((out / "recipe.json").read_text())
    assert again["runs"] == 2 and recipe["runs"] == 1
    for name in ("prompts", "answers", "features", "train", "bench"):
        times = [float(t) for n, t in ledger if n == name]
        assert len(times) == 2
        assert again["wall_s"][name] == (times[-1] if name == "bench" else sum(times))


@pytest.mark.slow
def test_ship_heads_trains_benches_and_ships_the_three_kinds_and_resumes(tmp_path):
    """scripts/ship_heads.sh at its smallest, on a tiny model: the curve's largest EAGLE point,
    Medusa and the draft, both benches, ship.json and the copies; a second run trains nothing."""
    import subprocess

    pytest.importorskip("matplotlib")
    prompts = tiny_model_data_and_prompts(tmp_path)
    env = os.environ | {
        "TREESPEC": str(Path(sys.executable).parent / "treespec"), "PYTHON": sys.executable,
        "MODEL": str(tmp_path / "model"), "TOKENS": "30", "CURVE": str(tmp_path / "curve"), "CURVE_POINTS": "10",
        "EAGLE_EPOCHS": "1", "DRAFT_LAYERS": "1", "PER_CATEGORY": "1", "BENCH_PROMPTS": prompts,
        "BENCH_ARGS": "--max-new-tokens 4 --warmup 0", "SHIP": str(tmp_path / "shipped"), "SERVE_CHECK": "skip",
    }  # fmt: skip
    command = [str(SCRIPTS / "ship_heads.sh"), str(tmp_path / "data"), str(tmp_path / "out")]
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "ship.json").read_text())
    for kind in ("eagle", "medusa", "draft"):
        assert summary[f"{kind} T=0"]["tau"] >= 1 and summary[f"{kind} T=0"]["identical_to_reference"] == 1.0
        assert summary[kind]["answer_tokens"] >= 30 and summary[kind]["steps"] >= 1
        shipped = tmp_path / "shipped" / f"model-{kind}"
        assert (shipped / "config.json").is_file() and (shipped / "model.safetensors").is_file()
    assert "hf-assisted T=0" in summary and summary["eagle T=1"]["tau"] >= 1
    assert summary["eagle T=0"]["acceptance_by_depth"] and summary["medusa"]["trainable_params"] > 0
    table = (tmp_path / "out" / "ship.md").read_text()
    assert "| eagle | 1 | **" in table and "| draft | " in table  # one row per method, one per kind
    assert (tmp_path / "curve" / "eagle-10" / "report.json").is_file()  # the curve's smaller point too
    served = json.loads((tmp_path / "out" / "serve_check.json").read_text())["heads"]
    assert set(served) == {"eagle", "medusa"} and "not run in vLLM" in run.stderr
    stamps = {
        k: (tmp_path / "out" / k / "head" / "model.safetensors").stat().st_mtime_ns
        for k in ("medusa", "draft")
    }
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    for kind, stamp in stamps.items():
        assert (tmp_path / "out" / kind / "head" / "model.safetensors").stat().st_mtime_ns == stamp
    # a data folder smaller than TOKENS ends with a clear error, not a half-shipped set
    run = subprocess.run(command, env=env | {"TOKENS": "100000"}, capture_output=True, text=True)
    assert run.returncode == 1 and "fewer than 100000 answer tokens" in run.stderr


def test_serve_check_compares_tokens_per_step_only_where_both_engines_wrote_the_same_text():
    """same_output_ratio keeps the prompts whose vLLM run alone matched treespec's text, drops
    treespec's last step of each, and is None when no prompt matched."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_check", SCRIPTS / "serve_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ours = {"sequences": [[1, 2, 3], [4, 5], [6]], "committed_per_step": [[2, 3, 1], [4, 1], [9, 9]]}
    alone = [
        {"sequence": [1, 2, 3], "drafts": 4, "accepted": 6},  # alike: 1 + 6/4 = 2.5
        {"sequence": [4, 7], "drafts": 50, "accepted": 0},  # differs: left out
        {"sequence": [6], "drafts": 1, "accepted": 3},
    ]  # alike: 1 + 9/5 = 2.8 over both
    ours_steps = (2 + 3 + 9) / 3  # the last step of each alike prompt left out
    ratio, alike = module.same_output_ratio(ours, {"per_prompt": alone})
    assert ratio == pytest.approx(2.8 / ours_steps) and alike == 2
    alone[0]["sequence"] = alone[2]["sequence"] = [0]
    assert module.same_output_ratio(ours, {"per_prompt": alone}) == (None, 0)
    assert module.same_output_ratio(ours, {}) == (None, 0)  # a report without per-prompt runs


def test_serve_check_exports_each_kind_and_reads_it_back(tmp_path, monkeypatch, capsys):
    """scripts/serve_check.py without vLLM (--no-vllm, as CI has none): each kind is written in
    the published layout vLLM reads, loaded back from there, and decodes the target's own greedy
    output with a chain; a head of the wrong kind is refused, naming what it is."""
    from test_bench import tiny_model_folder
    from test_eagle import random_head

    import treespec
    from treespec.heads.layouts import published_layout

    model = tiny_model_folder(tmp_path)
    random_head(model, eagle3=True, draft_vocab=48).save(tmp_path / "eagle3")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3"}\n{"prompt": "w9 w40 w77 w3"}\n')
    out = tmp_path / "serve.json"
    heads = [f"{kind}={tmp_path / kind}" for kind in ("eagle", "eagle3", "medusa")]
    argv = ["--model", str(tmp_path / "model"), "--heads", *heads, "--prompts", str(prompts), "--n", "2",
            "--new", "12", "--chain", "2", "--out", str(tmp_path / "exported"), "--json", str(out), "--no-vllm"]  # fmt: skip
    run_script("serve_check", argv, monkeypatch)
    report = json.loads(out.read_text())
    plain = None
    for kind in ("eagle", "eagle3", "medusa"):
        entry = report["heads"][kind]
        assert published_layout(Path(entry["exported"])) == kind
        assert 1.0 <= entry["treespec"]["tokens_per_step"] <= 3.0
        if plain is None:
            from treespec.models import load
            from treespec.prompts import encode_prompts

            target, tokenizer = load(tmp_path / "model", dtype=torch.bfloat16)
            ids = encode_prompts(tokenizer, ["w1 w2 w3", "w9 w40 w77 w3"])
            plain = treespec.generate(target, ids, max_new_tokens=12).sequences
        assert entry["treespec"]["sequences"] == plain
    assert "eagle3  treespec" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="that is an EAGLE-1 head, not a medusa head"):
        run_script(
            "serve_check", [*argv[:2], "--heads", f"medusa={tmp_path / 'eagle'}", *argv[6:]], monkeypatch
        )
    from treespec.heads import MedusaConfig, MedusaHeads

    shape = json.loads((tmp_path / "medusa" / "config.json").read_text())
    MedusaHeads(MedusaConfig(shape["hidden_size"], shape["vocab_size"], num_heads=2, conditioned=True)).save(
        tmp_path / "conditioned"
    )
    with pytest.raises(SystemExit, match="conditioned Medusa heads have no published layout vLLM can load"):
        run_script(
            "serve_check",
            [*argv[:2], "--heads", f"medusa={tmp_path / 'conditioned'}", *argv[6:]],
            monkeypatch,
        )
    # shipped heads (no --heads): a conditioned Medusa head is skipped and named, the others checked
    monkeypatch.setattr(
        treespec.heads,
        "shipped_for",
        lambda _: {"eagle": str(tmp_path / "eagle"), "medusa": str(tmp_path / "conditioned")},
    )
    run_script("serve_check", [*argv[:2], *argv[6:]], monkeypatch)
    report = json.loads(out.read_text())
    assert set(report["heads"]) == {"eagle"}
    assert report["skipped"]["medusa"]["reason"].startswith(
        "conditioned Medusa heads have no published layout"
    )
    assert "medusa  skipped: conditioned" in capsys.readouterr().out


def test_serve_check_without_vllm_says_what_to_install(tmp_path, monkeypatch):
    with pytest.raises(
        SystemExit, match="no vLLM interpreter at .*run ../shared/peers/setup.sh, or pass --no-vllm"
    ):
        run_script("serve_check", ["--heads", "eagle=nowhere", "--vllm-python", str(tmp_path / "no-python")],
                   monkeypatch)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not Path.home().joinpath(".cache/treespec-peers/vllm/bin/python").is_file(),
                    reason="vLLM's CPU build is not installed (../shared/peers/setup.sh)")  # fmt: skip
def test_serve_check_against_vllm(tmp_path, monkeypatch):
    """Where vLLM's CPU build is installed: the shipped EAGLE head, exported, drafts in vLLM with
    the tokens per step treespec gets from it (within 5 %) on the prompts the two engines decode to
    the same text. Over all prompts the ratio is not the export's: where bf16 rounding sends the
    texts apart the head is asked other questions, and four prompts moved it 0.93-1.07x between
    runs of the same head. Eight prompts of 64 tokens, so some decode alike."""
    out = tmp_path / "serve.json"
    run_script("serve_check", ["--heads", "eagle=smollm2-135m-instruct-eagle", "--n", "8", "--new", "64",
                               "--out", str(tmp_path / "exported"), "--json", str(out)], monkeypatch)  # fmt: skip
    entry = json.loads(out.read_text())["heads"]["eagle"]
    assert entry["same_output_ratio"] is not None, f"no prompt decoded alike in both engines: {entry}"
    assert abs(entry["same_output_ratio"] - 1) <= 0.05, entry["same_output_ratio"]


def test_bench_head_cost_times_each_head_kind_at_both_budgets(tmp_path, monkeypatch):
    """scripts/bench_head_cost.py on a tiny bf16 model: a row per head variant and budget, with the
    propose and forward times of full-size trees (random heads) and the path each drafted on."""
    from test_bench import tiny_model_folder

    tiny_model_folder(tmp_path)
    out = tmp_path / "cost.json"
    run_suite("head-cost", ["--model", str(tmp_path / "model"), "--new", "6", "--repeats", "1",
                            "--dtype", "bf16", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert {(r["head"], r["total_tokens"]) for r in report["rows"]} == {
        (head, nodes)
        for head in ("eagle1-full-vocab", "eagle1-vocab8192", "eagle3-vocab8192", "eagle3-vocab8192-modules")
        for nodes in (31, 8)
    }
    assert all(r["propose_ms"] > 0 and r["forward_ms"] > 0 for r in report["rows"])
    assert report["single_token_forward_ms"] > 0
    from treespec.kernels import cpu_kernels

    native = "native tree" if cpu_kernels.available() else "modules"
    assert {r["head"]: r["path"] for r in report["rows"]} == {
        "eagle1-full-vocab": native, "eagle1-vocab8192": native, "eagle3-vocab8192": native,
        "eagle3-vocab8192-modules": "modules",
    }  # fmt: skip

    if cpu_kernels.available():  # each phase of a pass, per road and row count, beside its floor
        phases = report["phases"]
        assert {(p["road"], p["rows"]) for p in phases} == {
            (r, n) for r in cpu_kernels.roads() for n in (1, 4, 8)
        }
        assert {p["phase"] for p in phases} == {"fc", "qkv", "o", "gate+up", "down", "read-out"}
        assert all(p["ms"] > 0 and 0 < p["floor_ms"] for p in phases)


def test_serve_load_picks_prompts_across_the_file_and_tabulates_vllms_results(tmp_path):
    """scripts/serve_load.py's own parts (the servers and vLLM's client need the peers): the
    prompts spread over the file, the commands of each server, and the table from vLLM's result
    JSON (the p50 and p99 the client is asked for)."""
    load = _script("serve_load")
    source = tmp_path / "spec.jsonl"
    source.write_text("".join(json.dumps({"turns": [f"q{i}", "second"]}) + "\n" for i in range(10)))
    out = tmp_path / "prompts.jsonl"
    assert load.write_prompts(source, out, 4) == 4
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["q0", "q2", "q5", "q7"]
    with pytest.raises(ValueError, match="--num-prompts must be in 1..10, got 11"):
        load.write_prompts(source, out, 11)
    command, env = load.server_command("treespec-ngram,eagle", 8100, tmp_path, 8)
    assert command[-6:] == ["--port", "8100", "--proposer", "ngram,eagle", "--max-batch", "8"] and env == {}
    assert load.server_command("vllm", 8100, tmp_path, 4)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "-np" in load.server_command("llama", 8100, tmp_path, 4)[0]
    with pytest.raises(ValueError, match="servers are treespec-PROPOSER, vllm or llama"):
        load.server_command("sglang", 8100, tmp_path, 4)
    result = {"completed": 32, "output_throughput": 151.25, "request_throughput": 1.5, "p50_ttft_ms": 80.0,
              "p99_ttft_ms": 300.0, "p50_itl_ms": 40.0, "median_itl_ms": 41.0, "p99_itl_ms": 90.5,
              "p50_tpot_ms": 20.0, "p99_tpot_ms": 30.0}  # fmt: skip
    rows = load.summarize({"vllm-c8": result})
    assert rows == [{"run": "vllm-c8", "completed": 32, "output_tok_s": 151.25, "req_s": 1.5, "ttft_p50_ms": 80.0,
                     "ttft_p99_ms": 300.0, "tpot_p50_ms": 20.0, "tpot_p99_ms": 30.0, "itl_p50_ms": 40.0,
                     "itl_p99_ms": 90.5}]  # fmt: skip
    assert "| vllm-c8 | 32 | 151.2 | 1.50 | 80.0 / 300.0 | 20.0 / 30.0 | 40.0 / 90.5 |" in load.table(rows)
