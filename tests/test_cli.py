"""Every `treespec` subcommand, the benchmark suites included, refuses a bad flag value by name
with exit code 2, before it loads anything."""

from __future__ import annotations

import pytest

from treespec import cli

BAD = {
    ("models", "list"): (["--bogus"], "--bogus"),
    ("models", "pull"): (["no-such-model"], "no-such-model"),
    ("models", "path"): (["no-such-model"], "no-such-model"),
    ("bench",): (["--max-new-tokens", "many"], "--max-new-tokens"),
    ("train-heads", "data"): (["--dtype", "fp8"], "--dtype"),
    ("train-heads", "prompts"): (["--corpus", "c", "--count", "many"], "--count"),
    ("train-heads", "answers"): (["--corpus", "c", "--answer-tokens", "many"], "--answer-tokens"),
    ("train-heads", "features"): (
        ["--corpus", "c", "--out", "o", "--batch-tokens", "many"],
        "--batch-tokens",
    ),
    ("train-heads", "train"): (
        ["--kind", "eagle", "--data", "d", "--out", "o", "--precision", "fp8"],
        "--precision",
    ),
    ("train-heads", "eval"): (
        ["--kind", "eagle", "--head", "h", "--data", "d", "--batch-tokens", "many"],
        "--batch-tokens",
    ),
    ("train-heads", "readout"): (["--head", "h", "--data", "d", "--rows", "many", "--out", "o"], "--rows"),
    ("serve",): (["--port", "many"], "--port"),
}
SUITE_FLAGS = {
    "step": "--context",
    "batch": "--batch",
    "verify": "--nodes",
    "ar": "--max-new-tokens",
    "head-cost": "--new",
    "cpu-kernels": "--repeats",
    "compile": "--repeats",
    "draft-acceptance": "--prompts",
    "profile": "--repeats",
    "heads-tau": "--new",
}
BAD |= {("bench", suite): ([flag, "many"], flag) for suite, flag in SUITE_FLAGS.items()}


def test_every_subcommand_and_suite_is_covered():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse keeps them there
    subcommands = {("bench",), ("serve",)} | {("bench", s) for s in cli.BENCH_SUITES}
    for name, sub in commands.items():
        if name in ("bench", "serve"):
            continue
        stages = sub._subparsers._group_actions[0].choices
        subcommands |= {(name, stage) for stage in stages}
    assert subcommands == set(BAD)


@pytest.mark.parametrize("command", sorted(BAD), ids=" ".join)
def test_a_bad_flag_value_is_refused_by_name(command, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_HOME", str(tmp_path))  # nothing pulled: no model could load
    argv, named = BAD[command]
    assert cli.main([*command, *argv]) == 2
    assert named in capsys.readouterr().err


def test_serve_hands_its_options_to_the_server(monkeypatch, capsys):
    """treespec serve's flags reach ServeConfig as given; a bad list of proposers is one line."""
    pytest.importorskip("fastapi")
    from treespec.serve import server

    seen = []
    monkeypatch.setattr(server, "serve", seen.append)
    argv = ["serve", "m", "--port", "9000", "--proposer", "ngram,eagle", "--budget", "8", "--max-batch", "3",
            "--api-key", "k", "--max-model-len", "256", "--prefill-chunk", "64", "--served-model-name", "x",
            "--max-prefill-tokens", "96", "--dtype", "fp32"]  # fmt: skip
    assert cli.main(argv) == 0
    config = seen[0]
    got = (config.model, config.port, config.proposers, config.budget, config.max_batch, config.api_key,
           config.max_model_len, config.prefill_chunk, config.served_model_name, config.max_prefill_tokens,
           config.dtype)  # fmt: skip
    assert got == ("m", 9000, ("ngram", "eagle"), "8", 3, "k", 256, 64, "x", 96, "fp32")
    assert cli.main(["serve", "m", "--max-prefill-tokens", "0"]) == 0 and seen[1].max_prefill_tokens is None
    assert cli.main(["serve", "--proposer", "eagle,eagle"]) != 0
    assert "a list of proposers names distinct ones" in capsys.readouterr().err
