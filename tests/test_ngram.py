"""NgramProposer: hand-written tries and chains, the caps, batching, and the index against the scan."""

from __future__ import annotations

import itertools
import random

import pytest

from treespec.proposers.base import ProposalRequest, Proposer, RequestResult, StepResult
from treespec.proposers.ngram import NgramProposer, build_trie, scan_match_ends
from treespec.sampling import SamplingParams

# The tail (7, 8) occurs earlier ending at p = 1, 5, 9; most recent first, the continuations
# are [4, 5], [1, 3], [1, 2]. Token 1 is backed by two matches, so it leads although [4, 5] is
# the most recent; under it, 3 (match 5) comes before 2 (match 1) by recency.
TRIE_CONTEXT = [7, 8, 1, 2, 7, 8, 1, 3, 7, 8, 4, 5, 6, 7, 8]
TRIE_TOKENS = [8, 1, 4, 3, 2, 5]
TRIE_PARENTS = [-1, 0, 0, 1, 1, 2]

# The tail (1, 2, 3) occurs once before, ending at p = 2.
CHAIN_CONTEXT = [1, 2, 3, 4, 5, 9, 1, 2, 3]


def request(tokens: list[int], max_new: int = 100, request_id: int = 0) -> ProposalRequest:
    return ProposalRequest(
        request_id=request_id,
        tokens=tokens,
        prompt_len=len(tokens),
        sampling=SamplingParams(),
        max_new=max_new,
    )


def propose_one(
    proposer: NgramProposer, tokens: list[int], max_new: int = 100
) -> tuple[list[int], list[int]]:
    tree = proposer.propose([request(tokens, max_new)])
    tree.validate()
    assert tree.num_requests == 1 and tree.draft_probs is None
    return tree.tokens.tolist(), tree.parents.tolist()


def observe(proposer, request_id: int, committed: list[int], tree=None, accepted: int = 0) -> None:
    """Tell the proposer a step committed these tokens; ``tree`` (one request's TokenTree, or None
    for the root alone) with its first ``accepted`` drafted nodes along the chain accepted."""
    tokens, parents = (
        ([committed[0]], [-1]) if tree is None else (tree.tokens.tolist(), tree.parents.tolist())
    )
    result = RequestResult(request_id, tokens, parents, list(range(accepted + 1)), committed)
    proposer.observe(StepResult([result]))


def chain(tokens: list[int]) -> tuple[list[int], list[int]]:
    return tokens, list(range(-1, len(tokens) - 1))


def test_follows_the_protocol():
    proposer = NgramProposer()
    assert isinstance(proposer, Proposer)
    assert proposer.sampled_children is False
    assert proposer.max_tree_nodes == 33
    assert NgramProposer(max_depth=2, max_matches=3).max_tree_nodes == 7
    assert NgramProposer(tree=False).max_tree_nodes == 9
    assert NgramProposer(tree=False, max_nodes=4).max_tree_nodes == 5


def test_chain_is_the_most_recent_continuation():
    assert propose_one(NgramProposer(tree=False), CHAIN_CONTEXT) == chain([3, 4, 5, 9, 1, 2, 3])
    assert propose_one(NgramProposer(tree=False, max_depth=2), TRIE_CONTEXT) == chain([8, 4, 5])


def test_trie_orders_siblings_by_support_then_recency():
    assert propose_one(NgramProposer(max_depth=2), TRIE_CONTEXT) == (TRIE_TOKENS, TRIE_PARENTS)


def test_trie_of_a_single_match_is_the_chain():
    assert propose_one(NgramProposer(), CHAIN_CONTEXT) == chain([3, 4, 5, 9, 1, 2, 3])


def test_largest_n_wins():
    # 3 follows (1, 2, 3) at p = 3 (continuation 9) and alone at p = 7 (7) and p = 5 (4).
    context = [5, 1, 2, 3, 9, 3, 4, 3, 7, 1, 2, 3]
    assert propose_one(NgramProposer(max_depth=1), context) == ([3, 9], [-1, 0])
    assert propose_one(NgramProposer(max_ngram=1, max_depth=1), context) == ([3, 7, 4, 9], [-1, 0, 0, 0])
    assert propose_one(NgramProposer(max_ngram=2, max_depth=1), context) == ([3, 9], [-1, 0])


def test_min_ngram_excludes_short_matches():
    context = [4, 3, 5, 6, 3]  # only the 1-gram 3 matches earlier
    assert propose_one(NgramProposer(max_depth=1), context) == ([3, 5], [-1, 0])
    assert propose_one(NgramProposer(min_ngram=2, max_depth=1), context) == ([3], [-1])


def test_no_match_is_the_root_alone():
    assert propose_one(NgramProposer(), [1, 2, 3, 4]) == ([4], [-1])
    assert propose_one(NgramProposer(), [5]) == ([5], [-1])
    assert propose_one(NgramProposer(tree=False), [5, 6]) == ([6], [-1])


def test_overlapping_matches_and_a_continuation_cut_by_the_end():
    # The 3-gram (2, 2, 2) ends earlier at p = 2 only, and only [2] follows it.
    assert propose_one(NgramProposer(), [2, 2, 2, 2]) == chain([2, 2])
    # The 1-gram 2 ends earlier at p = 2, 1, 0: continuations [2], [2, 2], [2, 2, 2] share one path.
    assert propose_one(NgramProposer(max_ngram=1), [2, 2, 2, 2]) == chain([2, 2, 2, 2])


def test_max_depth_cuts_continuations():
    assert propose_one(NgramProposer(max_depth=3), CHAIN_CONTEXT) == chain([3, 4, 5, 9])
    assert propose_one(NgramProposer(max_depth=1), TRIE_CONTEXT) == ([8, 1, 4], [-1, 0, 0])


@pytest.mark.parametrize(
    ("max_nodes", "expected"),
    [
        # Drafted nodes ranked by (support, depth, recency): 1, 4, 5, 3, 2.
        (1, ([8, 1], [-1, 0])),
        (2, ([8, 1, 4], [-1, 0, 0])),
        (3, ([8, 1, 4, 5], [-1, 0, 0, 2])),
        (4, ([8, 1, 4, 3, 5], [-1, 0, 0, 1, 2])),
        (5, (TRIE_TOKENS, TRIE_PARENTS)),
        (6, (TRIE_TOKENS, TRIE_PARENTS)),
    ],
)
def test_max_nodes_keeps_the_best_supported_nodes(max_nodes, expected):
    assert propose_one(NgramProposer(max_depth=2, max_nodes=max_nodes), TRIE_CONTEXT) == expected


def test_max_nodes_caps_the_chain():
    assert propose_one(NgramProposer(tree=False, max_nodes=2), CHAIN_CONTEXT) == chain([3, 4, 5])


def test_max_matches_keeps_the_most_recent():
    # Matches 9 and 5 only: [4, 5] and [1, 3] tie on support, so recency puts 4 first.
    expected = ([8, 4, 1, 5, 3], [-1, 0, 0, 1, 2])
    assert propose_one(NgramProposer(max_depth=2, max_matches=2), TRIE_CONTEXT) == expected
    assert propose_one(NgramProposer(max_depth=2, max_matches=1), TRIE_CONTEXT) == chain([8, 4, 5])


@pytest.mark.parametrize(
    ("max_new", "expected"),
    [
        (0, ([8], [-1])),
        (1, ([8], [-1])),
        (2, ([8, 1, 4], [-1, 0, 0])),
        (3, (TRIE_TOKENS, TRIE_PARENTS)),
        (50, (TRIE_TOKENS, TRIE_PARENTS)),
    ],
)
def test_max_new_caps_the_depth(max_new, expected):
    assert propose_one(NgramProposer(max_depth=2), TRIE_CONTEXT, max_new=max_new) == expected
    tokens, parents = propose_one(NgramProposer(), TRIE_CONTEXT, max_new=max_new)
    assert tokens[0] == 8
    depth = [0]
    for parent in parents[1:]:
        depth.append(depth[parent] + 1)
    assert max(depth) <= max(0, max_new - 1)


def test_several_requests_in_one_tree():
    proposer = NgramProposer(max_depth=2)
    requests = [
        request(TRIE_CONTEXT, request_id=7),
        request([1, 2, 3, 4], request_id=3),
        request(CHAIN_CONTEXT, request_id=12),
        request(TRIE_CONTEXT, max_new=1, request_id=40),
    ]
    tree = proposer.propose(requests)
    tree.validate()
    assert tree.cu_nodes.tolist() == [0, 6, 7, 10, 11]
    tokens, parents, cu = tree.tokens.tolist(), tree.parents.tolist(), tree.cu_nodes.tolist()
    per_request = [(tokens[a:b], parents[a:b]) for a, b in itertools.pairwise(cu)]
    assert per_request == [(TRIE_TOKENS, TRIE_PARENTS), ([4], [-1]), chain([3, 4, 5]), ([8], [-1])]
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 2, 0, 0, 1, 2, 0]


def test_observe_extends_the_index_like_a_fresh_build():
    context = TRIE_CONTEXT[:10]
    proposer = NgramProposer(max_depth=2)
    proposer.propose([request(context, request_id=5)])
    committed = TRIE_CONTEXT[10:]
    observe(proposer, 5, committed)
    grown = proposer.propose([request(TRIE_CONTEXT, request_id=5)])
    assert grown.tokens.tolist() == TRIE_TOKENS and grown.parents.tolist() == TRIE_PARENTS


def test_propose_does_not_need_observe():
    proposer = NgramProposer(max_depth=2)
    proposer.propose([request(TRIE_CONTEXT[:6], request_id=5)])
    assert propose_one(proposer, TRIE_CONTEXT) == (TRIE_TOKENS, TRIE_PARENTS)


def test_a_context_that_is_not_an_extension_rebuilds_the_index():
    proposer = NgramProposer(max_depth=2)
    proposer.propose([request(TRIE_CONTEXT, request_id=0)])
    observe(proposer, 0, [9, 9, 9])  # committed, then the engine cut the context differently
    assert propose_one(proposer, CHAIN_CONTEXT) == chain([3, 4, 5])
    assert propose_one(proposer, TRIE_CONTEXT) == (TRIE_TOKENS, TRIE_PARENTS)


def test_release_forgets_and_observe_ignores_unknown_ids():
    proposer = NgramProposer()
    observe(proposer, 1, [1, 2, 3])
    assert proposer.indexed_requests == []
    proposer.propose([request(CHAIN_CONTEXT, request_id=1), request(TRIE_CONTEXT, request_id=2)])
    assert proposer.indexed_requests == [1, 2]
    proposer.release(1)
    proposer.release(99)
    assert proposer.indexed_requests == [2]


def test_the_index_agrees_with_the_scan_on_random_contexts():
    rng = random.Random(0)
    for trial in range(200):
        vocab, length = rng.randint(2, 6), rng.randint(1, 60)
        context = [rng.randrange(vocab) for _ in range(length)]
        settings = dict(
            max_ngram=rng.randint(1, 4), max_depth=rng.randint(1, 5), max_matches=rng.randint(1, 5)
        )
        settings["min_ngram"] = rng.randint(1, settings["max_ngram"])
        proposer = NgramProposer(max_nodes=rng.randint(1, 12), **settings)
        max_new = rng.randint(1, 8)
        start = rng.randint(1, length)  # grow the context through observe in random chunks
        proposer.propose([request(context[:start], request_id=trial)])
        while start < length:
            stop = rng.randint(start + 1, length)
            observe(proposer, trial, context[start:stop])
            start = stop
        got = proposer.propose([request(context, max_new=max_new, request_id=trial)])
        assert got.num_nodes <= proposer.max_tree_nodes
        depth = min(settings["max_depth"], max_new - 1)
        ends = scan_match_ends(
            context,
            min_ngram=settings["min_ngram"],
            max_ngram=settings["max_ngram"],
            max_matches=settings["max_matches"],
        )
        continuations = [context[p + 1 : p + 1 + depth] for p in ends] if depth >= 1 else []
        want = build_trie(context[-1], continuations, proposer.max_nodes)
        assert (got.tokens.tolist(), got.parents.tolist()) == want, (context, settings, max_new)


def test_trie_invariants_on_random_continuations():
    rng = random.Random(1)
    for _ in range(200):
        continuations = [
            [rng.randrange(3) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(0, 6))
        ]
        max_nodes = rng.randint(1, 20)
        tokens, parents = build_trie(9, continuations, max_nodes)
        full_tokens, _ = build_trie(9, continuations, 10**6)
        assert tokens[0] == 9 and parents[0] == -1
        assert len(tokens) == 1 + min(max_nodes, len(full_tokens) - 1)
        paths = [()]
        for node in range(1, len(tokens)):
            assert 0 <= parents[node] < node
            paths.append(paths[parents[node]] + (tokens[node],))
        assert len(set(paths)) == len(paths)  # distinct siblings
        support = [sum(list(path) == c[: len(path)] for c in continuations) for path in paths]
        assert all(s >= 1 for s in support[1:])  # every path is a prefix of some continuation
        for node in range(2, len(tokens)):  # later siblings never have more support
            if parents[node] == parents[node - 1]:
                assert support[node] <= support[node - 1]


def test_build_trie_tie_breaks_on_recency():
    assert build_trie(0, [[5], [6], [6], [5]], 10) == ([0, 5, 6], [-1, 0, 0])
    assert build_trie(0, [[6], [5], [6], [5]], 10) == ([0, 6, 5], [-1, 0, 0])
    assert build_trie(0, [[5], [6], [6]], 10) == ([0, 6, 5], [-1, 0, 0])
    assert build_trie(0, [], 10) == ([0], [-1])


def test_scan_match_ends_most_recent_first():
    assert scan_match_ends(TRIE_CONTEXT, min_ngram=1, max_ngram=3, max_matches=8) == [9, 5, 1]
    assert scan_match_ends(TRIE_CONTEXT, min_ngram=1, max_ngram=3, max_matches=2) == [9, 5]
    assert scan_match_ends([1, 2, 3, 4], min_ngram=1, max_ngram=3, max_matches=8) == []


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(max_ngram=0), "max_ngram"),
        (dict(min_ngram=0), "min_ngram"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram"),
        (dict(max_depth=0), "max_depth"),
        (dict(max_nodes=0), "max_nodes"),
        (dict(max_matches=0), "max_matches"),
        (dict(max_depth=2.0), "max_depth"),
        (dict(max_nodes=True), "max_nodes"),
        (dict(tree="yes"), "tree"),
    ],
)
def test_bad_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NgramProposer(**kwargs)


def test_bad_requests_raise():
    with pytest.raises(ValueError, match="at least one request"):
        NgramProposer().propose([])
    with pytest.raises(ValueError, match="no tokens"):
        NgramProposer().propose([request([])])


# --------------------------------------------------------------------------- adaptive depth


def drafted_depth(tree) -> int:
    return int(tree.depth.max())


def test_token_cost_zero_always_drafts_full_depth():
    proposer = NgramProposer(max_depth=4, tree=False)
    context = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    for _ in range(3):
        tree = proposer.propose([request(context)])
        assert drafted_depth(tree) == 4
        observe(proposer, 0, [9], tree)  # rejected at once: no effect without a token cost


def test_rejections_shrink_the_depth_to_nothing_then_it_probes_again():
    proposer = NgramProposer(max_depth=6, tree=False, token_cost=0.3)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    depths = []
    for _ in range(40):
        tree = proposer.propose([request(context)])
        depths.append(drafted_depth(tree))
        observe(proposer, 0, [99], tree)  # only the bonus: every drafted token rejected
    assert depths[0] >= 1  # the prior (1/2) is worth a probe at this cost
    assert 0 in depths  # after rejections, drafting stops
    assert depths.index(0) < 5
    later = depths[depths.index(0) :]
    assert any(d >= 1 for d in later)  # forgetting brings a probe back


def test_acceptances_grow_the_depth():
    proposer = NgramProposer(max_depth=6, tree=False, token_cost=0.3)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    first = drafted_depth(proposer.propose([request(context)]))
    for _ in range(10):
        tree = proposer.propose([request(context)])
        depth = drafted_depth(tree)
        observe(proposer, 0, list(range(depth + 1)), tree, accepted=depth)  # all accepted, plus the bonus
    assert drafted_depth(proposer.propose([request(context)])) > first
    with pytest.raises(ValueError, match="token_cost"):
        NgramProposer(token_cost=-1)


def test_set_budget_sizes_the_next_trees_as_the_constructor_would():
    """The adaptive budget (or a fixed ``--budget N``) sizes the trie: the same tree as a proposer
    built with those sizes, never beyond the sizes given at construction."""
    proposer = NgramProposer(max_depth=4, max_nodes=6)
    assert proposer.has_budget
    proposer.set_budget(2, depth=2)
    assert propose_one(proposer, TRIE_CONTEXT) == propose_one(
        NgramProposer(max_depth=2, max_nodes=2), TRIE_CONTEXT
    )
    proposer.set_budget(100, depth=100)  # clamped to the constructor's
    assert propose_one(proposer, TRIE_CONTEXT) == propose_one(
        NgramProposer(max_depth=4, max_nodes=6), TRIE_CONTEXT
    )
    assert proposer.max_tree_nodes == 7  # the cache is sized by the constructor's bound
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_nodes"):
            proposer.set_budget(bad, depth=2)


def test_the_adaptive_budget_keeps_n_gram_output_exact():
    """n-gram lookup under the learning budget (as ``treespec bench`` and ``proposer="auto"``
    without heads run it): greedy output equal to HF's, trees drafted on the repetitive prompt."""
    from conftest import oracle_table

    import treespec
    from treespec.budget import AdaptiveProposer, BudgetChooser, CostModel

    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [20, 21, 22]]
    model, want = oracle_table(prompts, 16)("llama")
    ticks = iter(range(10**6))
    proposer = AdaptiveProposer(NgramProposer(), BudgetChooser(CostModel([1, 8, 64], [1.0, 1.05, 1.5])),
                                clock=lambda: float(next(ticks)))  # fmt: skip
    out = treespec.generate(model, prompts, max_new_tokens=16, proposer=proposer)
    assert out.sequences == want and max(proposer.chosen) > 0
