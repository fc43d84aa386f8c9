"""Exactness on the real default model (slow: it is pulled into $TREESPEC_HOME once)."""

from __future__ import annotations

import pytest
import torch

import treespec
from treespec.models import load
from treespec.prompts import DEFAULT_PROMPTS, encode_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load("smollm2-135m-instruct", dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare full 64-token continuations
    return model, tokenizer


def test_smollm2_greedy_equals_hf_generate(smollm2):
    model, tokenizer = smollm2
    prompts = encode_prompts(tokenizer, DEFAULT_PROMPTS[:4])
    assert len({len(p) for p in prompts}) > 1  # different lengths in one batch
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, pad_token_id=0)
            expected.append(out[0, len(p) :].tolist())
    for chunk in (None, 16):
        got = treespec.generate(model, prompts, max_new_tokens=64, prefill_chunk_size=chunk)
        assert got.sequences == expected, f"chunk {chunk}"
    text = tokenizer.decode(expected[2])
    assert len(text.strip()) > 20  # a real model writes real text
