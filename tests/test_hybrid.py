"""Hybrid trees: two proposers' branches merged into one trie, verified in one forward."""

from __future__ import annotations

import pytest
from conftest import build, oracle_table
from test_eagle import random_head

import treespec
from treespec.proposers import EagleProposer, NgramProposer, ProposalRequest
from treespec.proposers.hybrid import HybridProposer
from treespec.sampling import SamplingParams
from treespec.tree import TokenTree

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], list(range(30, 50)) * 2]
NEW = 16


class Fixed:
    """A proposer that returns given trees (for the merge logic)."""

    sampled_children = False

    def __init__(self, tokens, parents):
        self.tokens, self.parents = tokens, parents
        self.max_tree_nodes = len(tokens)
        self.seen = []

    def propose(self, requests):
        return TokenTree.from_lists([self.tokens], [self.parents])

    def observe(self, request_id, committed):
        self.seen.append(committed)

    def release(self, request_id):
        pass


def test_merge_deduplicates_shared_prefixes():
    a = Fixed([9, 1, 2, 3], [-1, 0, 1, 1])  # 9 -> 1 -> {2, 3}
    b = Fixed([9, 1, 2, 4, 5], [-1, 0, 1, 2, 0])  # 9 -> 1 -> 2 -> 4, 9 -> 5
    hybrid = HybridProposer(a, b)
    assert hybrid.max_tree_nodes == 1 + 3 + 4
    tree = hybrid.propose([ProposalRequest(0, [9], 1, SamplingParams(), 10)])
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 2, 0]
    hybrid.observe(0, [1, 2])
    assert a.seen == b.seen == [[1, 2]]


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


def test_bad_hybrids():
    model = build("llama")
    with pytest.raises(ValueError, match="at least two"):
        HybridProposer(NgramProposer())
    from treespec.proposers import DraftModelProposer

    with pytest.raises(ValueError, match="deterministic children"):
        HybridProposer(NgramProposer(), DraftModelProposer(model, sample=True))
    eagle3 = random_head(model, eagle3=True)
    with pytest.raises(ValueError, match="different target features"):
        HybridProposer(EagleProposer(random_head(model), model), EagleProposer(eagle3, model))
