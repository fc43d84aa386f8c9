"""The speculative loop: every proposer and tree form against HF greedy decoding, mechanical
oracles for the accepted length, end-to-end losslessness, and bad proposals."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from conftest import build, chi2, oracle_table, record_drafted
from transformers import LlamaConfig, LlamaForCausalLM

import treespec
from treespec import Engine, SamplingParams, Target
from treespec.proposers import DraftModelProposer, NgramProposer, Proposer
from treespec.tree import TokenTree, chain, full_tree

# Repetitive prompts so that the n-gram proposer finds something to copy.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], list(range(30, 60)) + list(range(30, 40)), [7]]
NEW = 21  # 1 token from prefill + 4 steps of 5


def proposers(family: str):
    draft = build(family, seed=3)  # another random model: it rarely agrees with the target
    return {
        "draft-chain": DraftModelProposer(draft, shape=chain(3)),
        "draft-tree": DraftModelProposer(draft, shape=full_tree(2, 2)),
        "draft-sampled-tree": DraftModelProposer(draft, shape=full_tree(2, 2), sample=True),
        "draft-dynamic": DraftModelProposer(draft, dynamic=(2, 3, 6)),
        "draft-reduced-readout": DraftModelProposer(draft, dynamic=(2, 3, 6), readout_ids=range(0, 128, 3)),
        "draft-reduced-sampled": DraftModelProposer(
            draft, shape=full_tree(2, 2), sample=True, readout_ids=range(1, 128, 2)
        ),  # fmt: skip
        "ngram-trie": NgramProposer(max_depth=4),
        "ngram-chain": NgramProposer(max_depth=4, tree=False),
        "ngram-adaptive": NgramProposer(max_depth=4, token_cost=0.3),
    }


@pytest.fixture(scope="module")
def expected():
    """HF greedy continuations of PROMPTS, per family, computed once."""
    return oracle_table(PROMPTS, NEW)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_every_proposer_is_exact_at_temperature_0(family, chunk, expected):
    model, want = expected(family)
    for name, proposer in proposers(family).items():
        for batch in (1, 4):
            out = treespec.generate(
                model, PROMPTS[:batch], max_new_tokens=NEW, proposer=proposer, prefill_chunk_size=chunk
            )
            assert out.sequences == want[:batch], (name, batch)


@pytest.mark.parametrize("shape", [chain(4), full_tree(2, 3)], ids=["chain-4", "binary-3"])
def test_target_as_its_own_draft_accepts_the_deepest_path(shape, expected):
    model, want = expected("llama")
    out = treespec.generate(
        model, PROMPTS, max_new_tokens=NEW, proposer=DraftModelProposer(model, shape=shape)
    )
    assert out.sequences == want
    depth = shape.max_depth
    assert out.stats.tau == depth + 1  # every step commits the whole deepest path + the bonus
    assert all(set(lengths) == {depth + 1} for lengths in out.stats.accepted_lengths)


def test_a_reduced_readout_keeps_the_token_ids(expected):
    """The target as its own draft, reading out through every row in a shuffled order: the ids
    map back, so every drafted path is accepted; a proper subset never drafts outside it."""
    model, want = expected("llama")
    shuffled = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    out = treespec.generate(model, PROMPTS, max_new_tokens=NEW,
                            proposer=DraftModelProposer(model, shape=chain(3), readout_ids=shuffled))  # fmt: skip
    assert out.sequences == want and out.stats.tau == 4
    subset = DraftModelProposer(model, dynamic=(2, 3, 6), readout_ids=range(0, 128, 2))
    seen = record_drafted(subset)
    assert treespec.generate(model, PROMPTS, max_new_tokens=NEW, proposer=subset).sequences == want
    assert seen and all(t % 2 == 0 for t in seen)
    with pytest.raises(ValueError, match="top_k"):
        DraftModelProposer(model, dynamic=(4, 2, 6), readout_ids=[1, 2])


def test_target_as_its_own_draft_in_a_dynamic_tree(expected):
    model, want = expected("llama")
    proposer = DraftModelProposer(model, dynamic=(3, 4, 12))
    out = treespec.generate(model, PROMPTS, max_new_tokens=NEW, proposer=proposer)
    assert out.sequences == want
    assert out.stats.tau > 2.5  # the draft agrees with itself: most of the depth is accepted
    with pytest.raises(ValueError, match="cannot be combined with sample"):
        DraftModelProposer(model, dynamic=(2, 2, 3), sample=True)
    with pytest.raises(ValueError, match="num_nodes"):
        DraftModelProposer(model, dynamic=(2, 2, 9))


def test_dynamic_stats_and_stage_times(expected):
    model, _ = expected("llama")
    out = treespec.generate(model, PROMPTS, max_new_tokens=NEW, proposer=NgramProposer())
    stats = out.stats
    assert len(stats.accepted_lengths) == len(PROMPTS)
    for lengths, seq in zip(stats.accepted_lengths, out.sequences, strict=True):
        assert sum(lengths) == len(seq) - 1  # the first token comes from prefill
    assert min(stats.propose_s, stats.forward_s, stats.verify_s, stats.commit_s) > 0
    assert stats.tau > 1.0  # the repetitive prompts get copied


def test_requests_finishing_early_leave_the_others_unchanged(expected):
    model, want = expected("qwen2")
    eos = want[1][2]  # request 1 stops at its 3rd token; the others go on
    alone = [
        treespec.generate(
            model, [p], max_new_tokens=NEW, eos_token_id=eos, proposer=NgramProposer()
        ).sequences[0]
        for p in PROMPTS
    ]
    together = treespec.generate(
        model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos, proposer=NgramProposer()
    )
    assert together.sequences == alone
    assert together.sequences[1] == want[1][:3]


def test_requests_join_a_speculating_batch(expected):
    model, want = expected("llama")
    engine = Engine(
        Target(model), max_batch_size=2, max_len=96, proposer=DraftModelProposer(model, shape=chain(3))
    )
    first = engine.add_request(PROMPTS[2], max_new_tokens=NEW)
    for _ in range(3):
        engine.step()
    later = engine.add_request(PROMPTS[0], max_new_tokens=NEW)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop(first).output == want[2]
    assert engine.pop(later).output == want[0]


# --------------------------------------------------------------------------- losslessness


def tiny_pair(vocab: int = 8):
    """A tiny target over a small vocabulary, and a draft that is a perturbed copy of it: close
    enough to be accepted often, different enough that rejections (and residuals) happen."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)  # peaked next-token distributions
    target.generation_config.eos_token_id = None
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * 0.5)
    return target, draft


def speculated_pair_distribution(model, prompt, vocab):
    """Exact distribution of generated tokens 2 and 3 under plain target sampling, [V, V].

    The first token comes from the prompt's last row; tokens 2 and 3 are the first two that a
    tree speculates (levels 1 and 2 of the same step), so they are the ones to test.
    """
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)  # [V]
        one = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = torch.softmax(model(one).logits[:, -1].double(), -1)  # [V(t1), V(t2)]
        two = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(model(two).logits[:, -1].double(), -1).view(vocab, vocab, vocab)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


@pytest.mark.parametrize(
    "shape,sample,readout",
    [(chain(2), True, None), (full_tree(2, 2), True, None), (full_tree(2, 2), False, None),
     (full_tree(2, 2), True, [0, 2, 3, 5, 6, 7])],  # a reduced read-out: q = 0 for tokens 1 and 4
    ids=["chain-sampled", "tree-sampled", "tree-top-k", "tree-sampled-reduced-readout"],
)  # fmt: skip
def test_end_to_end_sampling_is_lossless(shape, sample, readout):
    """Many identical prompts in one batch at temperature 1: generated tokens 2 and 3 follow plain
    target sampling (chi-square over 64 cells, rare cells pooled, p = 1e-4)."""
    vocab, draws, prompt = 8, 4000, [1, 2, 3]
    target, draft = tiny_pair(vocab)
    proposer = DraftModelProposer(draft, shape=shape, sample=sample, max_batch_size=draws, max_len=16,
                                  generator=torch.Generator().manual_seed(5), readout_ids=readout)  # fmt: skip
    out = treespec.generate(
        target, [prompt] * draws, max_new_tokens=4, temperature=1.0, proposer=proposer,
        generator=torch.Generator().manual_seed(6),
    )  # fmt: skip
    pairs = torch.tensor([seq[1:3] for seq in out.sequences])
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    expected = speculated_pair_distribution(target, prompt, vocab).reshape(-1) * draws
    stat, critical = chi2(counts, expected)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    assert out.stats.tau > 1.5  # the draft really was used, and rejections happened too
    assert out.stats.tau < 1 + shape.max_depth


# --------------------------------------------------------------------------- long runs


def _engine_run(target, prompts, sampling, sampler, new=2, generator_seed=6):
    engine = Engine(Target(target), max_batch_size=len(prompts), max_len=16, sampler=sampler,
                    generator=torch.Generator().manual_seed(generator_seed))  # fmt: skip
    ids = [engine.add_request(p, max_new_tokens=new, sampling=sampling) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop(i).output for i in ids]


@pytest.mark.parametrize("top_p", [None, 0.8])
def test_the_inverse_cdf_sampler_draws_the_target_distribution(top_p):
    """Plain decoding with one uniform per row: tokens 1 and 2 of many identical prompts follow
    the target's distribution after the warpers (chi-square over 64 cells, p = 1e-4)."""
    vocab, draws, prompt = 8, 4000, [1, 2, 3]
    target, _ = tiny_pair(vocab)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    out = _engine_run(target, [prompt] * draws, params, "inverse-cdf")
    pairs = torch.tensor(out)
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    with torch.no_grad():
        p1 = treespec.sampling.logits_to_probs(target(torch.tensor([prompt])).logits[0, -1:], params)[0]
        rows = target(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1]
        p2 = treespec.sampling.logits_to_probs(rows, params)  # [V(t1), V(t2)]
    expected = (p1.double()[:, None] * p2.double()).reshape(-1) * draws
    stat, critical = chi2(counts, expected)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    if top_p is not None:  # the nucleus cut really dropped tokens, and none was drawn
        assert (expected == 0).any() and (counts[expected == 0] == 0).all()


def test_the_inverse_cdf_sampler_keeps_each_seeded_stream_apart():
    """A request with a seed draws the same tokens alone or among others; unseeded rows share the
    engine's stream in row order, so the same batch gives the same tokens twice."""
    target, _ = tiny_pair(8)
    seeded = SamplingParams(temperature=1.0, seed=3)
    alone = _engine_run(target, [[1, 2, 3]], seeded, "inverse-cdf", new=6)
    engine = Engine(Target(target), max_batch_size=5, max_len=16, sampler="inverse-cdf",
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    ids = [engine.add_request([4, 5], max_new_tokens=6, sampling=SamplingParams(temperature=1.0))
           for _ in range(4)]  # fmt: skip
    mine = engine.add_request([1, 2, 3], max_new_tokens=6, sampling=seeded)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop(mine).output == alone[0]
    others = [engine.pop(i).output for i in ids]
    again = _engine_run(target, [[4, 5]] * 4, SamplingParams(temperature=1.0), "inverse-cdf", 6, 0)
    assert others == again


def test_an_unknown_sampler_is_named():
    target, _ = tiny_pair(8)
    with pytest.raises(ValueError, match="sampler must be 'hf' or 'inverse-cdf', got 'gumbel'"):
        Engine(Target(target), sampler="gumbel")
    with pytest.raises(ValueError, match="sampler must be"):
        treespec.generate(target, [[1, 2]], max_new_tokens=2, temperature=1.0, sampler="gumbel")
    out = treespec.generate(target, [[1, 2]] * 3, max_new_tokens=3, temperature=1.0, sampler="inverse-cdf",
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert [len(s) for s in out.sequences] == [3, 3, 3]


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_memory_stays_flat_over_1000_decode_steps():
    model = build("llama")
    engine = Engine(Target(model), max_batch_size=4, max_len=6000, proposer=NgramProposer(max_depth=2))
    for p in PROMPTS:
        engine.add_request(p, max_new_tokens=5000, eos_token_id=[])
    for _ in range(100):  # warm up allocators and caches
        engine.step()
    before = rss_bytes()
    steps = 0
    while engine.has_unfinished() and steps < 1000:
        engine.step()
        steps += 1
    growth = rss_bytes() - before
    assert steps == 1000
    assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 1000 steps"


# --------------------------------------------------------------------------- bad input


class FixedProposer(Proposer):
    """Returns whatever tree it is given, to test the engine's checks."""

    max_tree_nodes = 8

    def __init__(self, make_tree):
        self.make_tree = make_tree

    def propose(self, requests):
        return self.make_tree(requests)


def test_malformed_proposals_are_named(expected):
    model, _ = expected("llama")
    wrong_root = FixedProposer(lambda rs: TokenTree.make_dummy([[r.tokens[-1] + 1, 3] for r in rs]))
    with pytest.raises(ValueError, match=r"request 0: node 0 is token .* root must be"):
        treespec.generate(model, [PROMPTS[1]], max_new_tokens=4, proposer=wrong_root)
    too_few = FixedProposer(lambda rs: TokenTree.make_dummy([[rs[0].tokens[-1]]]))
    with pytest.raises(ValueError, match="1 trees for 2 requests"):
        treespec.generate(model, PROMPTS[:2], max_new_tokens=4, proposer=too_few)
    out_of_vocab = FixedProposer(lambda rs: TokenTree.make_dummy([[r.tokens[-1], 10_000] for r in rs]))
    with pytest.raises(ValueError, match="node 1 has a token outside the vocabulary"):
        treespec.generate(model, [PROMPTS[1]], max_new_tokens=4, proposer=out_of_vocab)
    too_big = FixedProposer(lambda rs: TokenTree.make_dummy([[r.tokens[-1]] + list(range(9)) for r in rs]))
    with pytest.raises(ValueError, match="max_tree_nodes"):
        treespec.generate(model, [PROMPTS[1]], max_new_tokens=4, proposer=too_big)
    with pytest.raises(TypeError, match="Proposer"):
        treespec.generate(model, [PROMPTS[1]], max_new_tokens=4, proposer=object())


def test_draft_vocabulary_must_match():
    target = build("llama")
    torch.manual_seed(0)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"draft's vocabulary \(64 tokens\) differs from the target's \(128\)"
    ):
        DraftModelProposer(other, target_model=target)
    with pytest.raises(ValueError, match="vocabulary"):
        treespec.generate(target, [PROMPTS[1]], max_new_tokens=4, proposer=DraftModelProposer(other))


def test_sampling_params_reach_the_proposer(expected):
    model, _ = expected("llama")
    seen = []

    def record(rs):
        seen.extend(r.sampling for r in rs)
        return TokenTree.make_dummy([[r.tokens[-1]] for r in rs])

    treespec.generate(
        model, [PROMPTS[1]], max_new_tokens=3, temperature=0.5, top_k=7, proposer=FixedProposer(record)
    )
    assert seen and all(s == SamplingParams(0.5, 7, None) for s in seen)
