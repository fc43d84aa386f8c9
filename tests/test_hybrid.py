"""Hybrid trees: two proposers' branches merged into one trie, verified in one forward."""

from __future__ import annotations

import pytest
from conftest import build, oracle_table
from test_eagle import random_head

import treespec
from treespec.proposers import DraftModelProposer, EagleProposer, NgramProposer, ProposalRequest, Proposer
from treespec.proposers.base import RequestResult, StepResult
from treespec.proposers.hybrid import HybridProposer
from treespec.sampling import SamplingParams
from treespec.tree import TokenTree

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], list(range(30, 50)) * 2]
NEW = 16


class Fixed(Proposer):
    """A proposer that returns given trees (for the merge logic)."""

    def __init__(self, tokens, parents):
        self.tokens, self.parents = tokens, parents
        self.max_tree_nodes = len(tokens)
        self.seen = []

    def propose(self, requests):
        return TokenTree.from_lists([self.tokens], [self.parents])

    def observe(self, result):
        self.seen += result.requests


def test_merge_deduplicates_shared_prefixes():
    a = Fixed([9, 1, 2, 3], [-1, 0, 1, 1])  # 9 -> 1 -> {2, 3}
    b = Fixed([9, 1, 2, 4, 5], [-1, 0, 1, 2, 0])  # 9 -> 1 -> 2 -> 4, 9 -> 5
    hybrid = HybridProposer(a, b)
    assert hybrid.max_tree_nodes == 1 + 3 + 4
    tree = hybrid.propose([ProposalRequest(0, [9], 1, SamplingParams(), 10)])
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 2, 0]
    # The target accepted 9 -> 1 -> 2 (merged nodes 0, 1, 2), then its bonus 7.
    hybrid.observe(
        StepResult([RequestResult(0, tree.tokens.tolist(), tree.parents.tolist(), [0, 1, 2], [1, 2, 7])])
    )
    (seen_a,), (seen_b,) = a.seen, b.seen
    assert (seen_a.tree_tokens, seen_a.tree_parents) == (a.tokens, a.parents)  # each member's own tree
    assert (seen_b.tree_tokens, seen_b.tree_parents) == (b.tokens, b.parents)
    assert seen_a.accepted == [0, 1, 2] and seen_b.accepted == [0, 1, 2]  # in its own node indices
    assert seen_a.committed == seen_b.committed == [1, 2, 7]
    hybrid.propose([ProposalRequest(0, [9], 1, SamplingParams(), 10)])
    hybrid.observe(
        StepResult([RequestResult(0, tree.tokens.tolist(), tree.parents.tolist(), [0, 5], [5, 7])])
    )
    assert a.seen[-1].accepted == [0] and b.seen[-1].accepted == [0, 4]  # 9 -> 5 is b's node 4 only


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eagle_plus_ngram_keeps_the_output_exact(family):
    model, want = oracle_table(PROMPTS, NEW)(family)
    head = random_head(model)
    for chunk in (None, 4):
        proposer = HybridProposer(EagleProposer(head, model, top_k=2, depth=3, total_tokens=5),
                                  NgramProposer(max_depth=4))  # fmt: skip
        out = treespec.generate(
            model, PROMPTS, max_new_tokens=NEW, proposer=proposer, prefill_chunk_size=chunk
        )
        assert out.sequences == want
    assert out.stats.tau > 1.0  # the repetitive prompts give the n-gram branches accepted tokens


class CatchingUp(Fixed):
    """A Fixed proposer whose every propose spends ``seconds`` catching up."""

    def __init__(self, tokens, parents, seconds):
        super().__init__(tokens, parents)
        self.seconds = seconds

    def propose(self, requests):
        self.catch_up_s = self.seconds
        return super().propose(requests)


def test_a_hybrids_catch_up_is_its_members():
    """The adaptive budget leaves a proposer's catch-up out of the drafting cost it fits: a hybrid
    reports its members' catch-ups together."""
    hybrid = HybridProposer(CatchingUp([1, 2], [-1, 0], 0.003), CatchingUp([1, 3], [-1, 0], 0.002))
    hybrid.propose([ProposalRequest(0, [5, 1], 1, SamplingParams(), 8)])
    assert hybrid.catch_up_s == pytest.approx(0.005)


def test_bad_hybrids():
    model = build("llama")
    with pytest.raises(ValueError, match="at least two"):
        HybridProposer(NgramProposer())
    with pytest.raises(ValueError, match="deterministic children"):
        HybridProposer(NgramProposer(), DraftModelProposer(model, sample=True))
    eagle3 = random_head(model, eagle3=True)
    with pytest.raises(ValueError, match="different target features"):
        HybridProposer(EagleProposer(random_head(model), model), EagleProposer(eagle3, model))


def test_one_budget_sizes_every_member_when_each_has_one():
    """A hybrid of members that all have a settable budget has one: set_budget sizes each (the
    adaptive budget then sizes the merged tree); with a member of fixed size it has none."""
    first, second = (
        NgramProposer(max_depth=8, max_nodes=8),
        NgramProposer(tree=False, max_depth=6, max_nodes=6),
    )
    hybrid = HybridProposer(first, second)
    assert hybrid.has_budget
    hybrid.set_budget(3, depth=2)
    assert first._budget == (3, 2) and second._budget == (3, 2)

    class Fixed(Proposer):
        def propose(self, requests):
            return TokenTree.roots([r.tokens[-1] for r in requests])

    assert not HybridProposer(first, Fixed()).has_budget
