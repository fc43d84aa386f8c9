"""Tiny random models built from configs: the fast oracles of the test suite."""

from __future__ import annotations

import math
import os

import torch

# Without a GPU the Triton kernel runs through Triton's interpreter; the switch is read when the
# kernel is decorated, i.e. before treespec.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every engine in the tests runs the full, host-side checks of each proposed tree and of
# verification's inputs (Engine(debug=...)), which the decode loop skips by default.
os.environ.setdefault("TREESPEC_DEBUG", "1")

import pytest
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{"num_hidden_layers": 2, **COMMON, **overrides}))


def tiny_qwen2() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=2, **COMMON))


def tiny_qwen3() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, head_dim=16, **COMMON))


def tiny_gemma3(**overrides) -> Gemma3ForCausalLM:
    # A window of 8 is shorter than the test prompts, so the sliding layers really slide.
    config = Gemma3TextConfig(
        num_hidden_layers=4,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        **{**COMMON, **overrides},
    )
    return Gemma3ForCausalLM(config)


FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


def build(name: str, seed: int = 0, **overrides):
    """A tiny model in fp32 eval mode whose generation never stops early on EOS."""
    torch.manual_seed(seed)
    model = FAMILIES[name](**overrides).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: HF's own greedy generate, one unpadded prompt at a time."""
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: HF would otherwise mask prompt tokens equal to the pad id
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(params=list(FAMILIES))
def family(request) -> str:
    return request.param


def oracle_table(prompts: list[list[int]], max_new_tokens: int):
    """A getter family -> (model, HF greedy continuations of prompts), each family built once."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = build(family)
            cache[family] = (model, [hf_greedy(model, p, max_new_tokens) for p in prompts])
        return cache[family]

    return get


def record_drafted(proposer) -> set[int]:
    """Wrap ``proposer.propose`` so that every drafted token (the roots left out) lands in the
    returned set, which fills as the proposer runs."""
    drafted: set[int] = set()
    original = proposer.propose

    def recording(requests):
        tree = original(requests)
        roots = set(tree.cu_nodes[:-1].tolist())
        drafted.update(t for i, t in enumerate(tree.tokens.tolist()) if i not in roots)
        return tree

    proposer.propose = recording
    return drafted


def chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of observed ``counts`` against ``expected`` (cells expected below 5
    pooled into one), and its critical value at p = 1e-4 (Wilson-Hilferty)."""
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, dof * (1 - 2 / (9 * dof) + 3.719 * math.sqrt(2 / (9 * dof))) ** 3
