"""Exactness on the real default model (slow: it is pulled into $TREESPEC_HOME once)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

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
    expected = [hf_greedy(model, p, 64) for p in prompts]
    for chunk in (None, 16):
        got = treespec.generate(model, prompts, max_new_tokens=64, prefill_chunk_size=chunk)
        assert got.sequences == expected, f"chunk {chunk}"
    text = tokenizer.decode(expected[2])
    assert len(text.strip()) > 20  # a real model writes real text


def test_smollm2_speculative_greedy_equals_hf_generate(smollm2):
    """Every proposer form on the real model, fp32 greedy: HF's tokens exactly."""
    from treespec.proposers import DraftModelProposer, NgramProposer
    from treespec.tree import chain

    model, tokenizer = smollm2
    texts = [
        "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
        "List the numbers from one to twenty, separated by commas.",
    ]
    prompts = encode_prompts(tokenizer, texts)
    expected = [hf_greedy(model, p, 48) for p in prompts]
    for proposer in (NgramProposer(), NgramProposer(tree=False), NgramProposer(token_cost=0.3)):
        out = treespec.generate(model, prompts, max_new_tokens=48, proposer=proposer, prefill_chunk_size=32)
        assert out.sequences == expected
        assert out.stats.tau > 1.0
    # The target as its own draft (a chain of 3): every step commits 4 tokens.
    out = treespec.generate(
        model, prompts[:1], max_new_tokens=49, proposer=DraftModelProposer(model, shape=chain(3))
    )
    assert out.sequences[0][:48] == expected[0] and out.stats.tau == 4.0


def test_smollm2_random_medusa_heads_keep_the_output_exact(smollm2):
    """Random heads on the real model: poor guesses, HF's tokens all the same."""
    from treespec.heads import MedusaConfig, MedusaHeads
    from treespec.proposers import MedusaProposer
    from treespec.tree import full_tree

    model, tokenizer = smollm2
    prompts = encode_prompts(tokenizer, DEFAULT_PROMPTS[:2])
    expected = [hf_greedy(model, p, 24) for p in prompts]
    torch.manual_seed(0)
    heads = MedusaHeads(
        MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3, own_lm_head=False)
    )
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.02)
    out = treespec.generate(
        model,
        prompts,
        max_new_tokens=24,
        proposer=MedusaProposer(heads, model, tree=full_tree(2, 3)),
        prefill_chunk_size=16,
    )
    assert out.sequences == expected


@pytest.mark.parametrize("eagle3", [False, True])
def test_smollm2_random_eagle_head_keeps_the_output_exact(smollm2, eagle3):
    """A random EAGLE-1 / EAGLE-3 head (reduced draft vocabulary) on the real model, batch 2,
    chunked prefill: HF's tokens exactly."""
    from treespec.heads import EagleConfig, EagleHead
    from treespec.proposers import EagleProposer

    model, tokenizer = smollm2
    prompts = encode_prompts(tokenizer, DEFAULT_PROMPTS[:2])
    expected = [hf_greedy(model, p, 24) for p in prompts]
    torch.manual_seed(0)
    config = EagleConfig.from_target(model.config, eagle3=eagle3, draft_vocab_size=4096 if eagle3 else None)
    assert config.feature_layers == ((2, 15, 27) if eagle3 else ())
    head = EagleHead(config)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if eagle3:
        head.d2t.copy_(torch.arange(4096) * 3)  # draft id i -> target id 4i
    proposer = EagleProposer(head, model, top_k=4, depth=4, total_tokens=15)
    out = treespec.generate(model, prompts, max_new_tokens=24, proposer=proposer, prefill_chunk_size=16)
    assert out.sequences == expected


def test_shipped_heads_load_and_fit_the_real_model(smollm2):
    """The heads shipped for SmolLM2 load by name, match its sizes, and keep its output exact."""
    from treespec import heads
    from treespec.heads.training.train import TrainConfig, proposer_for

    model, tokenizer = smollm2
    shipped = heads.shipped_for("smollm2-135m-instruct")
    assert set(shipped) == {"eagle", "medusa", "draft"}
    prompts = encode_prompts(tokenizer, DEFAULT_PROMPTS[:1])
    expected = [hf_greedy(model, p, 16) for p in prompts]
    for kind, name in shipped.items():
        module = heads.load(name, target_model=model)
        if kind == "draft":
            assert module.get_output_embeddings() is model.get_output_embeddings()
            assert module.config.num_hidden_layers < model.config.num_hidden_layers
        else:
            assert module.config.hidden_size == 576 and module.config.vocab_size == 49152
        out = treespec.generate(
            model, prompts, max_new_tokens=16, proposer=proposer_for(TrainConfig(kind=kind), module, model)
        )
        assert out.sequences == expected, kind
        assert out.stats.tau > 1.0, kind  # trained: drafts get accepted (random heads: tau 1.0)
