"""The engine on the Triton attention backend equals the engine on the reference backend.

Greedy fp32 decoding, token for token, with and without a proposer, on every tiny model family
and (slow) on the default real model. Without a GPU the kernel runs through Triton's interpreter
(conftest sets TRITON_INTERPRET=1); with one, models and heads move to it. A proposer only
drafts: the tokens are the target's whichever proposer runs, so the reference backend without
a proposer is the oracle for every run.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build
from test_eagle import random_head

import treespec
from treespec import Target
from treespec.kernels import tree_attention as ta
from treespec.proposers import DraftModelProposer, EagleProposer, NgramProposer

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or ta.interpreting()), reason="needs CUDA or TRITON_INTERPRET=1"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Repetitive prompts so that the n-gram proposer finds something to copy, of different lengths,
# one longer than 16 tokens (prefill blocks of 64 rows). Few and short: the interpreter is slow.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(30, 50)) + list(range(30, 36))]
NEW = 8


@pytest.fixture(autouse=True)
def one_gpu_config(monkeypatch):
    """On a GPU, one fixed kernel configuration per shape instead of autotuning each."""
    monkeypatch.setenv("TREESPEC_TRITON_AUTOTUNE", "0")


def make_proposer(kind: str | None, model, backend: str):
    """A fresh proposer of ``kind``; the EAGLE head attends on ``backend`` too."""
    if kind == "ngram":
        return NgramProposer(max_depth=4)
    if kind == "eagle":
        head = random_head(model).to(model.device)
        return EagleProposer(head, model, top_k=3, depth=3, total_tokens=8, attention_backend=backend)
    return None


def run(model, backend: str, prompts, new: int, proposer=None) -> list[list[int]]:
    target = Target(model, attention_backend=backend)
    return treespec.generate(target, prompts, max_new_tokens=new, proposer=proposer).sequences


def test_triton_backend_equals_reference_on_every_family(family):
    model = build(family).to(DEVICE)
    expected = run(model, "reference", PROMPTS, NEW)
    for kind in (None, "ngram", "eagle"):
        assert run(model, "triton", PROMPTS, NEW, make_proposer(kind, model, "triton")) == expected, kind


def test_triton_backend_with_a_draft_model():
    model, draft = build("qwen2").to(DEVICE), build("qwen2", seed=3).to(DEVICE)
    proposer = DraftModelProposer(draft, dynamic=(2, 3, 6), attention_backend="triton")
    assert run(model, "triton", PROMPTS, NEW, proposer) == run(model, "reference", PROMPTS, NEW)


@pytest.mark.slow
def test_triton_backend_equals_reference_on_the_default_model():
    """SmolLM2-135M: 9 query heads over 3 KV heads (a GQA group of 3), head dim 64, 30 layers.
    The interpreter takes ~3 s a step here, so: a prompt the model keeps counting, whose drafts
    the n-gram proposer gets accepted (12 tokens in 4 steps of 5-node trees), and 6 plain steps."""
    from treespec.models import load

    model, tokenizer = load("smollm2-135m-instruct", dtype=torch.float32)
    model = model.to(DEVICE)
    model.generation_config.eos_token_id = None
    prompts = [tokenizer("1, 2, 3, 1, 2, 3, 1, 2")["input_ids"]]
    expected = run(model, "reference", prompts, 12)
    assert run(model, "triton", prompts, 12, NgramProposer(max_depth=4)) == expected
    assert run(model, "triton", prompts, 6) == [expected[0][:6]]
