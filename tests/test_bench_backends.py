"""``treespec bench --attention-backend / --linear-backend``: the backends reach treespec's target
and proposers (not the HF baselines), the JSON says which ran, and bad values are refused."""

from __future__ import annotations

import json

import pytest
import torch
from test_bench import tiny_model_folder, write_prompts

from treespec.bench import e2e as benchmark
from treespec.cli import main
from treespec.kernels import cpu_kernels


def test_attention_backend_reaches_the_target_and_the_heads(tmp_path, monkeypatch):
    tiny_model_folder(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"category": "copy", "turns": ["w1 w2 w3 w1 w2 w3"]}])
    seen = []  # (who, attention backend asked for) of every EAGLE proposer the bench builds
    original = benchmark.EagleProposer

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attention_backend"))
        return original(*args, **kwargs)

    monkeypatch.setattr(benchmark, "EagleProposer", spy)
    out = tmp_path / "out.json"
    argv = ["bench", "--model", str(tmp_path / "model"), "--prompts", prompts, "--max-new-tokens", "4",
            "--dtype", "fp32", "--warmup", "0", "--budget", "fixed", "--proposer", "ngram,eagle",
            "--baselines", "hf", "--heads", f"eagle={tmp_path / 'eagle'}", "--json", str(out), "--no-plot",
            "--attention-backend", "reference", "--linear-backend", "native"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["config"]["attention_backend"] == "reference"
    assert report["config"]["linear_backend"] == "native"
    assert report["target"]["attention_backend"] == "reference"  # what the Target resolved and ran
    assert report["target"]["linear_backend"] == "native"
    assert report["target"]["batch_invariant"] is False  # forced backends: not the automatic CPU mode
    assert seen and set(seen) == {"reference"}
    assert all(m["identical_to_reference"] == 1.0 for m in report["methods"])


def test_bad_backends_are_refused(tmp_path, capsys):
    base = ["bench", "--model", str(tmp_path / "nothing"), "--no-plot"]
    assert main([*base, "--attention-backend", "flash"]) == 2
    err = capsys.readouterr().err
    assert "--attention-backend: invalid choice: 'flash'" in err and "'reference'" in err
    assert main([*base, "--linear-backend", "fast"]) == 2
    assert "--linear-backend: invalid choice: 'fast'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        benchmark.BenchConfig(attention_backend="flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="triton can run here")
def test_a_backend_that_cannot_run_here_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at each call: the interpreter off, no GPU
    assert main(["bench", "--model", str(tmp_path / "nothing"), "--attention-backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("treespec: error: --attention-backend triton: backend='triton' cannot run here")


@pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())
@pytest.mark.parametrize("fused_env", ["1", "0"])
def test_the_report_names_the_decoder_path_it_ran(tmp_path, monkeypatch, capsys, fused_env):
    """A bf16 Llama runs the fused decoder on the road chosen (the best, or the one TREESPEC_CPU_ISA
    caps it to); TREESPEC_FUSED=0 forces the modules, and the report says so with the reason."""
    monkeypatch.setenv("TREESPEC_FUSED", fused_env)
    tiny_model_folder(tmp_path)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"category": "copy", "turns": ["w1 w2 w3 w1 w2 w3"]}])
    out = tmp_path / "out.json"
    argv = ["bench", "--model", str(tmp_path / "model"), "--prompts", prompts, "--max-new-tokens", "4",
            "--dtype", "bf16", "--warmup", "0", "--proposer", "ngram", "--baselines", "hf",
            "--json", str(out), "--no-plot"]  # fmt: skip
    assert main(argv) == 0
    target = json.loads(out.read_text())["target"]
    printed = capsys.readouterr().out
    if fused_env == "1":
        assert target["path"] == "fused" and target["cpu_isa"] == cpu_kernels.isa()
        assert f"decoder fused ({cpu_kernels.isa()})" in printed
    else:
        assert target["path"] == "modules" and target["path_reason"] == "turned off by TREESPEC_FUSED=0"
        assert "decoder modules (turned off by TREESPEC_FUSED=0)" in printed


@pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())
def test_cpu_kernels_bench_prints_each_phase_beside_its_floor(tmp_path, capsys):
    """``treespec bench cpu-kernels`` on a tiny Llama: every phase of the fused step is timed, the
    linear phases and the attention get the floor of their bytes or FLOPs, and the JSON holds
    both; a floor is the larger of the two bounds."""
    from treespec.bench.cpu_kernels import phase_floors

    tiny_model_folder(tmp_path)
    out = tmp_path / "ck.json"
    main(["bench", "cpu-kernels", "--model", str(tmp_path / "model"), "--rows", "1", "--sizes", "1,3",
          "--context", "20", "--repeats", "2", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "each phase's floor" in printed and "gate/up" in printed
    step = json.loads(out.read_text())["fused_step"]
    assert [s["new_tokens"] for s in step] == [1, 3]
    assert {"qkv", "attention", "o_proj", "gate/up", "down", "lm_head"} == set(step[0]["floors_ms"])
    assert all(v > 0 for s in step for v in s["floors_ms"].values())
    config = type("Config", (), dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=1000,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16))  # fmt: skip
    read = phase_floors(config, 1, 10, bandwidth=1e9, peak=1e12)  # bound by the bytes
    assert read["qkv"] == pytest.approx(1e3 * 2 * (2 * 64 * 8 * 16) / 1e9)
    assert read["attention"] == pytest.approx(1e3 * (2 * 2 * 2 * 11 * 16 * 2) / 1e9)
    compute = phase_floors(config, 10_000, 10, bandwidth=1e9, peak=1e12)  # bound by the FLOPs
    assert compute["down"] == pytest.approx(1e3 * 2 * 10_000 * (2 * 128 * 64) / 1e12)
