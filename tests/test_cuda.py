"""The speculative engine end to end on a CUDA GPU; every test here is skipped without one.

Every model, head and tensor lives on the GPU. The oracles are the CPU suite's: fp32 greedy
output equals HF ``generate(do_sample=False)`` for every proposer; seeded sampling reproduces
itself and stays in the vocabulary; the engine runs the Triton tree-attention kernel, and its
output equals the reference backend's.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import VOCAB, build
from test_eagle import random_head
from test_heads import random_heads

import treespec
from treespec import Target
from treespec.proposers import DraftModelProposer, EagleProposer, MedusaProposer, NgramProposer
from treespec.proposers.hybrid import HybridProposer
from treespec.tree import full_tree

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
# Repetitive prompts so that the n-gram proposer (alone and in the hybrid) finds something to copy.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], list(range(30, 60)) + list(range(30, 40)), [7]]
NEW = 17
KINDS = ["ngram", "draft", "medusa", "eagle", "hybrid"]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle, on the model's device: HF's greedy generate of one unpadded prompt."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def oracle():
    """family -> (tiny fp32 model on the GPU, HF greedy continuations of PROMPTS), built once."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = build(family).to(DEVICE)
            cache[family] = (model, [hf_greedy(model, p, NEW) for p in PROMPTS])
        return cache[family]

    return get


def make_proposer(kind: str, family: str, model, *, sample: bool = False):
    """A fresh proposer of ``kind`` with random heads (or another random model as draft), on the
    GPU in the target's dtype."""
    dtype = model.dtype
    if kind == "ngram":
        return NgramProposer(max_depth=4)
    if kind == "draft":
        draft = build(family, seed=3).to(DEVICE, dtype)
        if sample:  # sampled children: the draft draws them with its own GPU generator
            generator = torch.Generator(device=DEVICE).manual_seed(1)
            return DraftModelProposer(draft, shape=full_tree(2, 2), sample=True, generator=generator)
        return DraftModelProposer(draft, dynamic=(2, 3, 6))
    if kind == "medusa":
        return MedusaProposer(random_heads(model).to(DEVICE, dtype), model, dynamic=(2, 7))
    if kind == "eagle":
        return EagleProposer(random_head(model).to(DEVICE, dtype), model, top_k=3, depth=4, total_tokens=10)
    eagle = EagleProposer(random_head(model).to(DEVICE, dtype), model, top_k=2, depth=3, total_tokens=5)
    return HybridProposer(eagle, NgramProposer(max_depth=4))


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding windows in the kernel
@pytest.mark.parametrize("kind", KINDS)
def test_every_proposer_matches_hf_greedy(family, kind, oracle):
    model, want = oracle(family)
    target = Target(model)
    for batch in (1, 4):
        for chunk in (None, 4):
            out = treespec.generate(target, PROMPTS[:batch], max_new_tokens=NEW, prefill_chunk_size=chunk,
                                    proposer=make_proposer(kind, family, model))  # fmt: skip
            assert out.sequences == want[:batch], (kind, batch, chunk)
    assert out.stats.tau >= 1.0


def triton_calls(monkeypatch) -> list[int]:
    """Counts calls of the Triton kernel's wrapper, wherever treespec's modules hold it."""
    calls: list[int] = []
    for module in [m for name, m in sys.modules.items() if name.startswith("treespec") and m is not None]:
        kernel = getattr(module, "tree_attention_triton", None)
        if kernel is not None:

            def counted(*args, _kernel=kernel, **kwargs):
                calls.append(1)
                return _kernel(*args, **kwargs)

            monkeypatch.setattr(module, "tree_attention_triton", counted)
    return calls


def test_the_engine_attends_with_the_triton_kernel(oracle, monkeypatch):
    model, want = oracle("llama")
    target = Target(model)
    assert target.attention_backend == "triton"
    calls = triton_calls(monkeypatch)
    out = treespec.generate(target, PROMPTS, max_new_tokens=NEW, proposer=NgramProposer(max_depth=4))
    assert out.sequences == want
    assert len(calls) >= model.config.num_hidden_layers * out.stats.steps  # every layer of every step


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", [None, "ngram", "eagle"])
def test_triton_and_reference_backends_give_the_same_output(family, kind, oracle):
    model, want = oracle(family)
    outputs = {}
    for backend in ("triton", "reference"):
        target = Target(model, attention_backend=backend)
        assert target.attention_backend == backend
        proposer = None if kind is None else make_proposer(kind, family, model)
        outputs[backend] = treespec.generate(target, PROMPTS, max_new_tokens=NEW, proposer=proposer).sequences
    assert outputs["triton"] == outputs["reference"] == want


@pytest.mark.parametrize("kind", [None, "ngram", "draft", "eagle"])
def test_seeded_sampling_reproduces_and_stays_in_the_vocabulary(kind, oracle):
    model, _ = oracle("llama")
    runs = []
    for _ in range(2):
        generator = torch.Generator(device=DEVICE).manual_seed(0)
        proposer = None if kind is None else make_proposer(kind, "llama", model, sample=True)
        out = treespec.generate(Target(model), PROMPTS, max_new_tokens=NEW, temperature=0.9, top_k=50,
                                top_p=0.95, proposer=proposer, generator=generator)  # fmt: skip
        runs.append(out.sequences)
    assert runs[0] == runs[1]
    assert all(len(seq) == NEW and all(0 <= t < VOCAB for t in seq) for seq in runs[0])


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_runs_with_every_proposer(kind):
    """The dtype the benchmarks use: bf16 through the kernel completes with valid tokens (bf16
    rounding may flip near-ties, so the output is not compared with HF's)."""
    model = build("llama").to(DEVICE, torch.bfloat16)
    out = treespec.generate(
        Target(model), PROMPTS, max_new_tokens=NEW, proposer=make_proposer(kind, "llama", model)
    )
    assert all(len(seq) == NEW and all(0 <= t < VOCAB for t in seq) for seq in out.sequences)


def test_a_generator_on_another_device_is_refused(oracle):
    model, _ = oracle("llama")
    with pytest.raises(ValueError, match="generator is on cpu but the model on cuda"):
        treespec.generate(model, PROMPTS[:1], max_new_tokens=2, temperature=1.0, generator=torch.Generator())
