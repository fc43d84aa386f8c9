"""Smoke runs of the measurement scripts on the real default model, at their smallest sizes:
they run, print their result and write what they say they write."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run_script(name: str, argv: list[str], monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [name, *argv])
    module.main()


@pytest.mark.slow
def test_profile_step_groups_the_time_of_each_forward(tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.json"
    run_script("profile_step", ["--sizes", "1,2", "--linear-backends", "auto", "--repeats", "1", "--warmup", "0",
                                "--context", "16", "--out", str(out)], monkeypatch)  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert [r["new_tokens"] for r in rows] == [1, 2]
    for row in rows:
        groups = row["groups_ms"]
        assert groups["linear"] > 0 and row["wall_ms"] > 0 and row["top_ops"]
    assert "tokens:" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_batch_decode_reports_prefill_and_decode_rates(monkeypatch, capsys):
    run_script("bench_batch_decode", ["--batch", "2", "--new", "3"], monkeypatch)
    printed = capsys.readouterr().out
    assert "prefill" in printed and "decode step" in printed and "tokens/s" in printed
