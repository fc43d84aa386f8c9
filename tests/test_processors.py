"""Logits processors on trees (treespec.processors): every row against HF's own processor
classes on that row's full context, greedy generation with each processor against HF
``generate`` with every proposer, per-request seeds, and bad input."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB, build, chi2
from test_eagle import random_head
from test_heads import random_heads
from test_speculative import tiny_pair
from transformers import LogitsProcessor
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

import treespec
from treespec import Engine, SamplingParams, Target
from treespec.processors import RowContexts, process, tree_paths
from treespec.proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    MedusaProposer,
    NgramProposer,
)
from treespec.sampling import logits_to_probs
from treespec.tree import full_tree

EOS = 3

# Each case: treespec's SamplingParams fields, and HF's processors for a context of prompt length
# P (the oracle, applied to one row's whole context).
CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.8), lambda P: [RepetitionPenaltyLogitsProcessor(1.8)]),
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), lambda P: [NoRepeatNGramLogitsProcessor(2)]),
    "bad_words_ids": (
        dict(bad_words_ids=[[7], [9, 10], [EOS], [4, 5, 6]]),
        lambda P: [NoBadWordsLogitsProcessor([[7], [9, 10], [EOS], [4, 5, 6]], eos_token_id=EOS)],
    ),
    "min_new_tokens": (dict(min_new_tokens=6), lambda P: [MinNewTokensLengthLogitsProcessor(P, 6, EOS)]),
    "suppress_tokens": (dict(suppress_tokens=[1, 2, 30]), lambda P: [SuppressTokensLogitsProcessor([1, 2, 30])]),
    "begin_suppress_tokens": (
        dict(begin_suppress_tokens=[11, 12]), lambda P: [SuppressTokensAtBeginLogitsProcessor([11, 12], P)]
    ),
    "logit_bias": (dict(logit_bias={5: 4.0, 6: -2.5}), lambda P: [SequenceBiasLogitsProcessor({(5,): 4.0, (6,): -2.5})]),
}  # fmt: skip


class OutputPenalties(LogitsProcessor):
    """vLLM's frequency and presence penalties over the output (not the prompt): the oracle."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


CASES["frequency_presence"] = (
    dict(frequency_penalty=0.7, presence_penalty=1.5), lambda P: [OutputPenalties(P, 0.7, 1.5)]
)  # fmt: skip
CASES["all_together"] = (
    {k: v for case in ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "logit_bias") for k, v in CASES[case][0].items()},
    lambda P: [CASES["logit_bias"][1](P)[0], RepetitionPenaltyLogitsProcessor(1.8), NoRepeatNGramLogitsProcessor(2),
               MinNewTokensLengthLogitsProcessor(P, 6, EOS)],
)  # fmt: skip


def random_tree(rng: random.Random, root: int, size: int) -> tuple[list[int], list[int]]:
    tokens, parents = [root], [-1]
    for i in range(1, size):
        parents.append(rng.randrange(i))
        tokens.append(rng.choice([4, 5, 6, 9, 10, 7, rng.randrange(VOCAB)]))  # repeats, bad-word prefixes
    return tokens, parents


@pytest.mark.parametrize("case", list(CASES))
def test_every_row_matches_hf_on_its_own_context(case):
    """Two requests' trees and a prompt's last row in one flattened batch: each row processed as
    HF processes that row's whole context (committed sequence + its own path)."""
    fields, hf = CASES[case]
    rng = random.Random(0)
    params = SamplingParams(**fields)
    sequences = [[1, 4, 5, 6, 9, 10, 4, 5], [8, 9, 10, 9, 10, 2], [12, 9]]  # committed: prompt + output
    prompt_lens = [5, 6, 2]  # the second has no output yet; the third is a prompt's last row
    trees = [random_tree(rng, sequences[0][-1], 12), random_tree(rng, sequences[1][-1], 7)]
    row_request, paths = [2], [[]]
    for b, (tokens, parents) in enumerate(trees):
        for path in tree_paths(tokens, parents):
            row_request.append(b)
            paths.append(path)
    logits = torch.randn(len(paths), VOCAB)
    rows = RowContexts(sequences, prompt_lens, [params] * 3, [frozenset({EOS})] * 3, row_request, paths)
    got = process(logits, rows)
    for i, (b, path) in enumerate(zip(row_request, paths, strict=True)):
        ids = torch.tensor([sequences[b] + path])
        want = logits[i : i + 1].clone()
        for processor in hf(prompt_lens[b]):
            want = processor(ids, want)
        assert torch.equal(got[i], want[0]), (case, i, path)
    assert process(logits, RowContexts(sequences, prompt_lens, [SamplingParams()] * 3, [frozenset()] * 3,
                                       row_request, paths)) is logits  # fmt: skip  # nothing on: untouched


def test_a_node_sees_its_own_path_not_the_tree():
    """Siblings differ: each is penalised for the tokens on its own path only."""
    sequence, params = [1, 2, 3], SamplingParams(repetition_penalty=2.0)
    tokens, parents = [3, 40, 41, 50], [-1, 0, 0, 1]  # 40 and 41 siblings, 50 under 40
    paths = tree_paths(tokens, parents)
    assert paths == [[], [40], [41], [40, 50]]
    logits = torch.full((4, VOCAB), 2.0)
    out = process(logits, RowContexts([sequence], [2], [params], [frozenset()], [0] * 4, paths))
    assert out[1, 40] == 1.0 and out[1, 41] == 2.0  # node 40 saw 40, not its sibling 41
    assert out[2, 41] == 1.0 and out[2, 40] == 2.0
    assert out[3, 40] == out[3, 50] == 1.0 and out[3, 41] == 2.0
    assert out[0, 1] == out[0, 3] == 1.0 and out[0, 40] == 2.0  # the root: the committed tokens only


def test_min_p_matches_hf_after_the_other_warpers():
    logits = torch.randn(6, VOCAB) * 3
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.1)
    want = logits / 0.7
    want = want.masked_fill(want < want.topk(40).values[:, -1:], float("-inf"))
    from transformers.generation.logits_process import TopPLogitsWarper

    want = MinPLogitsWarper(0.1)(None, TopPLogitsWarper(0.9)(None, want))
    assert torch.allclose(logits_to_probs(logits, params), want.softmax(-1), atol=1e-6)


# ----------------------------------------------------------------------- generation against HF

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], list(range(30, 50)) + list(range(30, 40)), [7, 9]]
NEW = 16
HF_NAMES = {"repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "min_new_tokens", "suppress_tokens",
            "begin_suppress_tokens"}  # fmt: skip


def hf_continuation(model, prompt, fields) -> list[int]:
    """HF generate, greedy, one unpadded prompt, with the same processors."""
    ids = torch.tensor([prompt])
    kwargs = {k: v for k, v in fields.items() if k in HF_NAMES}
    processors = []
    if "logit_bias" in fields:
        kwargs["sequence_bias"] = {(t,): v for t, v in fields["logit_bias"].items()}
    if "frequency_penalty" in fields:
        processors.append(
            OutputPenalties(len(prompt), fields["frequency_penalty"], fields["presence_penalty"])
        )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0, logits_processor=processors, **kwargs)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def target():
    return build("llama")


def speculators(model):
    return {
        "none": None,
        "ngram": NgramProposer(max_depth=4),
        "self-draft": DraftModelProposer(model, shape=full_tree(2, 3)),  # deep accepted paths
        "draft": DraftModelProposer(build("llama", seed=3), shape=full_tree(2, 2)),
        "eagle": EagleProposer(random_head(model), model, top_k=3, depth=4, total_tokens=10),
        "medusa": MedusaProposer(random_heads(model), model, dynamic=(2, 7)),
        "hybrid": HybridProposer(
            EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=6),
            NgramProposer(max_depth=3),
        ),  # fmt: skip
    }


# Per case: the processor's fields for generation (chosen so that each changes the tiny model's
# greedy output), and the same without that processor (the control the output must differ from).
GENERATION = {
    "repetition_penalty": (CASES["repetition_penalty"][0], {}),
    "no_repeat_ngram_size": (CASES["no_repeat_ngram_size"][0], {}),
    "bad_words_ids": (dict(bad_words_ids=[[72], [26, 119], [EOS], [58, 66]]), {}),
    "min_new_tokens": (dict(min_new_tokens=6, logit_bias={EOS: 0.5}), dict(logit_bias={EOS: 0.5})),
    "suppress_tokens": (dict(suppress_tokens=[22, 58, 119]), {}),
    "begin_suppress_tokens": (dict(begin_suppress_tokens=[41, 22, 80]), {}),
    "logit_bias": (dict(logit_bias={41: 3.0, 22: -2.5, 77: 1.5}), {}),
    "frequency_presence": (CASES["frequency_presence"][0], {}),
    "all_together": (CASES["all_together"][0], {}),
}


@pytest.mark.parametrize("case", list(GENERATION))
def test_greedy_with_each_processor_equals_hf(case, target):
    fields, control = GENERATION[case]
    want = [hf_continuation(target, p, fields) for p in PROMPTS]
    for name, proposer in speculators(target).items():
        for batch in (1, 4):
            out = treespec.generate(target, PROMPTS[:batch], max_new_tokens=NEW, proposer=proposer,
                                    eos_token_id=EOS, sampling=SamplingParams(**fields))  # fmt: skip
            assert out.sequences == want[:batch], (case, name, batch)
    plain = [hf_continuation(target, p, control) for p in PROMPTS]
    assert want != plain, "the processor changed nothing: the test would not see it ignored"


def test_a_seeded_request_draws_the_same_alone_and_in_a_mixed_batch(target):
    mine = SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.3, seed=1234)
    others = [
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(),
        SamplingParams(temperature=1.2, top_p=0.9),
    ]
    for proposer in (None, NgramProposer(max_depth=4)):
        alone = treespec.generate(
            target, [PROMPTS[0]], max_new_tokens=NEW, proposer=proposer, sampling=[mine]
        )
        mixed = treespec.generate(target, [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]], max_new_tokens=NEW,
                                  proposer=proposer, sampling=[others[0], mine, others[1], others[2]],
                                  generator=torch.Generator().manual_seed(9))  # fmt: skip
        assert mixed.sequences[1] == alone.sequences[0]
    other_seed = treespec.generate(target, [PROMPTS[0]], max_new_tokens=NEW, sampling=[SamplingParams(
        temperature=1.0, top_k=20, repetition_penalty=1.3, seed=4321)])  # fmt: skip
    assert other_seed.sequences != alone.sequences  # the seed does steer the draws


def test_bad_processor_arguments_are_named(target):
    bad = {
        "repetition_penalty must be a number > 0": dict(repetition_penalty=0.0),
        "frequency_penalty must be a finite number": dict(frequency_penalty=float("nan")),
        "no_repeat_ngram_size must be an int >= 0": dict(no_repeat_ngram_size=-1),
        "min_new_tokens must be an int >= 0": dict(min_new_tokens=1.5),
        "min_p must be in": dict(min_p=1.5),
        "logit_bias must map token ids": dict(logit_bias={"a": 1.0}),
        "bad_words_ids must be a list of non-empty lists": dict(bad_words_ids=[[]]),
        "suppress_tokens must be a list of token ids": dict(suppress_tokens=[-1]),
        "seed must be an int": dict(seed="x"),
    }
    for message, fields in bad.items():
        with pytest.raises(ValueError, match=message):
            SamplingParams(**fields)
    engine = Engine(Target(target), max_batch_size=1)
    with pytest.raises(ValueError, match=f"name token id {VOCAB + 1}, outside the vocabulary"):
        engine.add_request([1, 2], max_new_tokens=2, sampling=SamplingParams(bad_words_ids=[[VOCAB + 1]]))
    assert hash(SamplingParams(logit_bias={1: 2.0})) == hash(SamplingParams(logit_bias=((1, 2.0),)))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['repetition_penalt'\]"):
        treespec.generate(target, [[1, 2]], max_new_tokens=2, repetition_penalt=1.2)
    with pytest.raises(ValueError, match=r"not both: got sampling and \['temperature', 'min_p'\]"):
        treespec.generate(
            target, [[1, 2]], max_new_tokens=2, sampling=SamplingParams(), temperature=1.0, min_p=0.1
        )
    with pytest.raises(ValueError, match=r"one per prompt \(2\), got 1 item"):
        treespec.generate(target, [[1, 2], [3]], max_new_tokens=2, sampling=[SamplingParams()])
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        treespec.generate(target, [[1, 2]], max_new_tokens=2, stop_strings="x")


# ----------------------------------------------------------------------- sampling: still lossless


def processed_pair_distribution(model, prompt, vocab, params: SamplingParams) -> torch.Tensor:
    """Exact distribution of generated tokens 2 and 3 when the target alone samples with these
    processors, [V, V]: every context processed as HF would (processors, then warpers)."""

    def dist(contexts: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1].double()
        if params.repetition_penalty != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(
                torch.tensor(contexts), logits
            )
        if params.min_p:
            logits = MinPLogitsWarper(params.min_p)(None, logits / params.temperature)
        return logits.softmax(-1)

    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(vocab)])
    p3 = dist([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    return torch.einsum("a,ab,abc->bc", p1, p2, p3)


@pytest.mark.parametrize("sample", [True, False], ids=["sampled-children", "top-k-children"])
@pytest.mark.parametrize(
    "fields", [dict(repetition_penalty=3.0), dict(min_p=0.25)], ids=["repetition_penalty", "min_p"]
)
def test_sampling_with_processors_is_lossless(fields, sample):
    """Many identical prompts at T=1 with a tree draft: generated tokens 2 and 3 follow the
    processed target distribution (chi-square, p = 1e-4), and not the unprocessed one (power)."""
    vocab, draws, prompt = 8, 4000, [1, 2, 3]
    target, draft = tiny_pair(vocab)
    params = SamplingParams(temperature=1.0, **fields)
    proposer = DraftModelProposer(draft, shape=full_tree(2, 2), sample=sample, max_batch_size=draws, max_len=16,
                                  generator=torch.Generator().manual_seed(5))  # fmt: skip
    out = treespec.generate(target, [prompt] * draws, max_new_tokens=4, proposer=proposer, sampling=params,
                            generator=torch.Generator().manual_seed(6))  # fmt: skip
    pairs = torch.tensor([seq[1:3] for seq in out.sequences])
    counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab).double()
    expected = processed_pair_distribution(target, prompt, vocab, params).reshape(-1) * draws
    stat, critical = chi2(counts, expected)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}"
    plain = (
        processed_pair_distribution(target, prompt, vocab, SamplingParams(temperature=1.0)).reshape(-1)
        * draws
    )
    wrong, critical = chi2(counts, plain)
    assert wrong > critical, (
        f"the test cannot tell the processed distribution from the plain one ({wrong:.1f})"
    )
    assert out.stats.tau > 1.3  # the draft was used


@pytest.mark.parametrize("kind", ["eagle", "draft-dynamic", "draft-shape"])
def test_drafts_follow_the_requests_processors(target, kind):
    """The drafter's scores get the request's processors on each node's path, so a suppressed
    token is never drafted (acceptance only: the output is the target's either way, as the tests
    above check; a sampling draft records the processed q, which the chi-square test covers)."""
    from conftest import record_drafted

    def drafted(**fields) -> set[int]:
        proposer = {
            "eagle": lambda: EagleProposer(random_head(target), target, top_k=3, depth=4, total_tokens=10),
            "draft-dynamic": lambda: DraftModelProposer(build("llama", seed=3), dynamic=(3, 3, 8)),
            "draft-shape": lambda: DraftModelProposer(build("llama", seed=3), shape=full_tree(2, 3)),
        }[kind]()
        seen = record_drafted(proposer)
        treespec.generate(
            target, PROMPTS, max_new_tokens=NEW, proposer=proposer, sampling=SamplingParams(**fields)
        )
        return seen

    free = drafted()
    banned = sorted(free)[::3]
    assert banned and not drafted(suppress_tokens=banned) & set(banned)
