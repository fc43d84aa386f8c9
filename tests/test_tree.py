"""Tree shapes, best_tree, the builders and TokenTree validation, against hand-written oracles."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from treespec.tree import (
    PRESETS,
    TokenTree,
    TreeShape,
    best_tree,
    build_dynamic_tree,
    build_static_tree,
    chain,
    expected_accepted_length,
    full_tree,
    pack_ancestor_mask,
)

# ---------------------------------------------------------------------------- TreeShape literals


def test_shape_from_paths_derives_everything():
    # Given out of order, with the root: sorted by (len, path), root dropped.
    shape = TreeShape.from_paths([(1, 0), (0,), (), (0, 1), (1,), (0, 0)])
    #  node: 0 ()  1 (0,)  2 (1,)  3 (0,0)  4 (0,1)  5 (1,0)
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert shape.num_nodes == 6
    assert shape.parents == (-1, 0, 0, 1, 1, 2)
    assert shape.depth == (0, 1, 1, 2, 2, 2)
    assert shape.ranks == (-1, 0, 1, 0, 1, 0)
    assert shape.leaf_paths == ((0, 0), (0, 1), (1, 0))
    assert shape.leaf_nodes == (3, 4, 5)
    assert shape.max_depth == 2
    assert shape.max_rank == 1
    assert shape.nodes_per_depth == (1, 2, 3)
    # Rows as bits, node 0 in the lowest bit: 0b1, 0b11, 0b101, 0b1011, 0b10011, 0b100101.
    assert shape.tree_mask.dtype == torch.int32
    assert shape.tree_mask.tolist() == [[1], [3], [5], [11], [19], [37]]
    assert shape == TreeShape(((0,), (1,), (0, 0), (0, 1), (1, 0)))  # compared by paths only
    assert hash(shape) == hash(TreeShape.from_paths(shape.paths))


def test_root_alone():
    shape = TreeShape.from_paths([()])
    assert (shape.num_nodes, shape.parents, shape.leaf_paths, shape.max_depth) == (1, (-1,), ((),), 0)
    assert shape.tree_mask.tolist() == [[1]]
    assert chain(0) == shape


def test_chain_3_and_full_tree_2_2_literals():
    c = chain(3)
    assert c.paths == ((0,), (0, 0), (0, 0, 0))
    assert c.parents == (-1, 0, 1, 2)
    assert c.tree_mask.tolist() == [[1], [3], [7], [15]]
    assert c.leaf_paths == ((0, 0, 0),)

    f = full_tree(2, 2)
    assert f.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1))
    assert f.parents == (-1, 0, 0, 1, 1, 2, 2)
    assert f.depth == (0, 1, 1, 2, 2, 2, 2)
    assert f.ranks == (-1, 0, 1, 0, 1, 0, 1)
    assert f.tree_mask.tolist() == [[1], [3], [5], [11], [19], [37], [69]]
    assert f.leaf_paths == ((0, 0), (0, 1), (1, 0), (1, 1))


def test_chain_of_40_crosses_the_word_boundary():
    shape = chain(39)  # 40 nodes with the root: two 32-bit words per row
    mask = shape.tree_mask
    assert mask.shape == (40, 2)
    assert mask[0].tolist() == [1, 0]
    assert mask[30].tolist() == [2147483647, 0]  # bits 0..30
    assert mask[31].tolist() == [-1, 0]  # bit 31 set: negative in int32
    assert mask[32].tolist() == [-1, 1]
    assert mask[33].tolist() == [-1, 3]
    assert mask[39].tolist() == [-1, 255]  # bits 32..39
    assert shape.leaf_nodes == (39,)


def test_presets_are_shapes_of_the_named_size():
    assert PRESETS["chain-4"] == chain(4)
    assert PRESETS["binary-3"].num_nodes == 1 + 2 + 4 + 8
    assert PRESETS["ternary-2"].num_nodes == 1 + 3 + 9
    assert all(isinstance(s, TreeShape) for s in PRESETS.values())


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        ([(0,), (0, 1, 0)], r"\(0, 1, 0\) lacks its parent \(0, 1\)"),
        ([(1, 0)], r"\(1, 0\) lacks its parent \(1,\)"),
        ([(0,), (0, -1)], r"\(0, -1\) has a negative rank"),
        ([(0,), (1,), (0,)], r"\(0,\) is given twice"),
        ([(0,), (0, 1.0)], r"\(0, 1.0\) is not a tuple of ints"),
        ([(0,), (True,)], r"\(True,\) is not a tuple of ints"),
        ([0, 1], r"path 0 is not a tuple of ints"),
        (["01"], r"path '01' is not a tuple of ints"),
    ],
)
def test_shape_validation_names_the_path(paths, message):
    with pytest.raises(ValueError, match=message):
        TreeShape.from_paths(paths)


def test_preset_arguments_are_checked():
    with pytest.raises(ValueError):
        chain(-1)
    with pytest.raises(ValueError):
        full_tree(0, 2)


# ---------------------------------------------------------------------------- best_tree

RATES = [[0.8, 0.15], [0.6, 0.25], [0.5]]
# Path probabilities, best first: (0,) .8, (0,0) .48, (0,0,0) .24, (0,1) .2, (1,) .15,
# (0,1,0) .1, (1,0) .09, (1,0,0) .045, (1,1) .0375, ...


@pytest.mark.parametrize(
    ("n", "paths"),
    [
        (1, [(0,)]),
        (3, [(0,), (0, 0), (0, 0, 0)]),
        (4, [(0,), (0, 0), (0, 1), (0, 0, 0)]),
        (6, [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 1, 0)]),
    ],
)
def test_best_tree_by_hand(n, paths):
    assert best_tree(RATES, n).paths == tuple(paths)


def test_expected_accepted_length_is_the_sum_of_path_probabilities():
    assert expected_accepted_length(best_tree(RATES, 4), RATES) == pytest.approx(0.8 + 0.48 + 0.24 + 0.2)
    assert expected_accepted_length(chain(0), RATES) == 0.0


def test_best_tree_is_a_chain_when_only_rank_0_is_ever_accepted():
    rates = [[0.9, 0.0, 0.0], [0.8, 0.0, 0.0], [0.7, 0.0, 0.0], [0.6, 0.0, 0.0]]
    assert best_tree(rates, 4) == chain(4)
    assert best_tree(torch.tensor(rates), 4) == chain(4)  # a tensor table works too


def test_best_tree_ties_go_to_shorter_then_lower_ranked_paths():
    assert best_tree([[0.5, 0.5], [1.0]], 1).paths == ((0,),)
    assert best_tree([[0.5, 0.5], [1.0]], 2).paths == ((0,), (1,))  # (1,) and (0, 0) tie: shorter first


def closed_sets(candidates: list[tuple[int, ...]], size: int):
    for subset in itertools.combinations(candidates, size):
        chosen = set(subset)
        if all(len(p) == 1 or p[:-1] in chosen for p in chosen):
            yield subset


@pytest.mark.parametrize("seed", range(4))
def test_best_tree_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    rates = torch.rand(3, 2, generator=gen, dtype=torch.float64).tolist()  # any order of ranks
    grid = [p for d in (1, 2, 3) for p in itertools.product(range(2), repeat=d)]  # 14 paths
    for n in range(1, 8):
        best = max(expected_accepted_length(TreeShape.from_paths(s), rates) for s in closed_sets(grid, n))
        greedy = best_tree(rates, n)
        assert greedy.num_nodes == n + 1
        assert expected_accepted_length(greedy, rates) == pytest.approx(best, rel=1e-12)


def test_best_tree_uses_only_ranks_in_the_table_and_checks_inputs():
    shape = best_tree([[0.9, 0.5, 0.4], [0.9]], 6)  # rows of different length
    assert shape.paths == ((0,), (1,), (2,), (0, 0), (1, 0), (2, 0))
    with pytest.raises(ValueError, match="allows only 6 nodes"):
        best_tree([[0.9, 0.5, 0.4], [0.9]], 7)
    with pytest.raises(ValueError, match=r"acceptance\[1\]\[0\] = 1.5"):
        best_tree([[0.5], [1.5]], 1)
    with pytest.raises(ValueError, match="not a probability"):
        best_tree([[float("nan")]], 1)
    with pytest.raises(ValueError, match="num_nodes must be >= 1"):
        best_tree(RATES, 0)
    with pytest.raises(ValueError, match="at least one"):
        best_tree([], 1)
    with pytest.raises(ValueError, match=r"must be \[depth, ranks\]"):
        best_tree(torch.tensor([0.5, 0.5]), 1)
    with pytest.raises(ValueError, match="no acceptance rate for rank 2 at depth 1"):
        expected_accepted_length(full_tree(3, 1), RATES)


# ---------------------------------------------------------------------------- TokenTree validation


def test_from_lists_rejects_bad_trees():
    with pytest.raises(ValueError, match="two children with token 7"):
        TokenTree.from_lists([[5, 7, 7]], [[-1, 0, 0]])
    with pytest.raises(ValueError, match="parent of node 2 is 5"):
        TokenTree.from_lists([[5, 7, 8]], [[-1, 0, 5]])  # out of range
    with pytest.raises(ValueError, match="parent of node 1 is 2"):
        TokenTree.from_lists([[5, 7, 8]], [[-1, 2, 0]])  # after its child
    with pytest.raises(ValueError, match="parent of node 0 is 0"):
        TokenTree.from_lists([[5, 7]], [[0, 0]])  # no root
    with pytest.raises(ValueError, match="2 tokens and 1 parents"):
        TokenTree.from_lists([[5, 7]], [[-1]])
    with pytest.raises(ValueError, match="2 token lists but 1 parent lists"):
        TokenTree.from_lists([[5], [6]], [[-1]])
    # The same token under different parents is fine.
    TokenTree.from_lists([[5, 7, 8, 7]], [[-1, 0, 0, 2]]).validate()


def test_validate_catches_corrupted_trees():
    tree = TokenTree.from_lists([[5, 7, 8], [1, 2]], [[-1, 0, 0], [-1, 0]])
    tree.validate()
    with pytest.raises(ValueError, match="two children with token 7"):
        dataclasses.replace(tree, tokens=torch.tensor([5, 7, 7, 1, 2])).validate()
    with pytest.raises(ValueError, match="parent of node 1 is 1"):
        dataclasses.replace(tree, parents=torch.tensor([-1, 1, 0, -1, 0])).validate()
    with pytest.raises(ValueError, match="depth"):
        dataclasses.replace(tree, depth=torch.tensor([0, 1, 2, 0, 1])).validate()
    with pytest.raises(ValueError, match="bitmask"):
        dataclasses.replace(
            tree, tree_mask=torch.tensor([[1], [3], [3], [1], [3]], dtype=torch.int32)
        ).validate()
    with pytest.raises(ValueError, match="cu_nodes"):
        dataclasses.replace(tree, cu_nodes=torch.tensor([0, 3, 4])).validate()
    with pytest.raises(ValueError, match="draft_probs has 2 rows"):
        dataclasses.replace(tree, draft_probs=torch.zeros(2, 4)).validate()


def test_validate_catches_a_host_mirror_that_disagrees_with_the_tensors():
    """The engine lays out a step from TokenTree.host: a stale mirror must not pass debug mode."""
    tree = TokenTree.from_lists([[5, 7, 8], [1, 2]], [[-1, 0, 0], [-1, 0]])
    stale_tokens = dataclasses.replace(tree, tokens=torch.tensor([5, 7, 9, 1, 2]))  # host still says 8
    with pytest.raises(ValueError, match="host mirror disagrees.*tokens differ"):
        stale_tokens.validate()
    for field, value, message in [
        ("sizes", (2, 3), "sizes"),
        ("max_depth", 0, "max_depth 0 < 1"),
        ("max_children", 1, "max_children 1 < 2"),
        ("parents", (-1, 0, 1, -1, 0), "parents differ"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(tree, host=dataclasses.replace(tree.host, **{field: value})).validate()
    device_built = dataclasses.replace(tree, host=dataclasses.replace(tree.host, tokens=None, parents=None))
    device_built.validate()  # a mirror without tokens and parents (drafted on the device) is fine


# ---------------------------------------------------------------------------- build_static_tree


def assert_trees_equal(got: TokenTree, want: TokenTree) -> None:
    for name in ("tokens", "parents", "depth", "cu_nodes", "tree_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_static_tree_by_hand_with_duplicates_dropped_per_request():
    shape = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    #  node: 0 ()  1 (0,)  2 (1,)  3 (0,0)  4 (0,1)  5 (1,0)
    roots = torch.tensor([100, 200, 300])
    candidates = torch.tensor(
        [
            [[10, 11, 99], [20, 21, 99]],  # distinct: every node
            [[10, 10, 99], [20, 21, 99]],  # (1,) repeats (0,): drop it and (1, 0)
            [[10, 11, 99], [20, 20, 99]],  # (0, 1) repeats (0, 0): drop it only
        ]
    )  # [B=3, D=2, K=3]; rank 2 unused
    tree = build_static_tree(shape, roots, candidates)
    want = TokenTree.from_lists(
        [[100, 10, 11, 20, 21, 20], [200, 10, 20, 21], [300, 10, 11, 20, 20]],
        [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 1], [-1, 0, 0, 1, 2]],
    )
    assert_trees_equal(tree, want)
    assert tree.sizes() == [6, 4, 5]
    assert tree.draft_probs is None
    tree.validate()


def test_static_tree_draft_probs_rows_follow_depth():
    shape = chain(2)
    vocab = 5
    draft_probs = torch.arange(2 * 2 * vocab, dtype=torch.float32).reshape(2, 2, vocab)  # [B, D, V]
    tree = build_static_tree(shape, torch.tensor([1, 2]), torch.tensor([[[3], [4]], [[3], [4]]]), draft_probs)
    assert tree.draft_probs.shape == (6, vocab)
    for b in range(2):
        rows = tree.draft_probs[3 * b : 3 * b + 3]
        assert torch.equal(rows[0], draft_probs[b, 0])  # the root's children came from row 0
        assert torch.equal(rows[1], draft_probs[b, 1])
        assert torch.equal(rows[2], torch.zeros(vocab))  # depth 2 = D: nothing drafted below


def test_static_tree_matches_from_lists_on_a_wide_random_shape():
    gen = torch.Generator().manual_seed(0)
    shape = full_tree(3, 3)  # 40 nodes: two mask words
    batch = 4
    candidates = torch.stack([torch.randperm(50, generator=gen)[:9].reshape(3, 3) for _ in range(batch)])
    roots = torch.randint(0, 50, (batch,), generator=gen)
    tree = build_static_tree(shape, roots, candidates)
    tokens = [
        [int(roots[b])] + [int(candidates[b, len(p) - 1, p[-1]]) for p in shape.paths] for b in range(batch)
    ]
    assert_trees_equal(tree, TokenTree.from_lists(tokens, [list(shape.parents)] * batch))
    assert tree.tree_mask.shape == (batch * 40, 2)
    assert torch.equal(tree.tree_mask[:40], shape.tree_mask)


def test_static_tree_checks_its_inputs():
    shape = full_tree(2, 2)
    with pytest.raises(ValueError, match="need D >= depth and K > max rank"):
        build_static_tree(shape, torch.tensor([1]), torch.zeros(1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="need D >= depth and K > max rank"):
        build_static_tree(shape, torch.tensor([1]), torch.zeros(1, 2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"candidates \[B, D, K\]"):
        build_static_tree(shape, torch.tensor([1, 2]), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_probs must be"):
        build_static_tree(shape, torch.tensor([1]), torch.tensor([[[1, 2], [3, 4]]]), torch.zeros(1, 3, 7))


# ---------------------------------------------------------------------------- build_dynamic_tree

VOCAB = 12
GEN = torch.Generator().manual_seed(1234)
TOKEN_TABLE = torch.randn(VOCAB, VOCAB, generator=GEN, dtype=torch.float64)
ID_TABLE = torch.randn(64, VOCAB, generator=GEN, dtype=torch.float64)
REQUEST_TABLE = torch.randn(3, VOCAB, generator=GEN, dtype=torch.float64)


def fake_logprobs(request: int, path: tuple[int, ...]) -> torch.Tensor:
    """A deterministic 'draft head': depends on the request, the node's token and its whole path."""
    key = sum((token + 1) * 13**i for i, token in enumerate(path)) % len(ID_TABLE)
    return (TOKEN_TABLE[path[-1]] + ID_TABLE[key] + REQUEST_TABLE[request]).log_softmax(-1)


def fake_expand(calls: list):
    """Follows each frontier node's path through the parent slots the builder hands over."""
    paths: list[list[tuple[int, ...]]] = []  # per request, the previous frontier's paths

    def expand(step, frontier_tokens, parent_slots):
        tokens, slots = frontier_tokens.tolist(), parent_slots.tolist()
        paths[:] = [
            [(paths[b][s] if s >= 0 else ()) + (t,) for t, s in zip(tokens[b], slots[b], strict=True)]
            for b in range(len(tokens))
        ]
        calls.append((step, tokens, [list(p) for p in paths]))
        return torch.stack(
            [torch.stack([fake_logprobs(b, path) for path in row]) for b, row in enumerate(paths)]
        )

    return expand


def top(values: list[float], k: int) -> list[int]:
    return sorted(range(len(values)), key=lambda v: -values[v])[:k]


def reference_dynamic_tree(b, root, root_logprobs, top_k, depth, num_nodes, calls):
    """One request, plain Python: the algorithm of build_dynamic_tree's docstring."""
    pool = [dict(token=root, score=0.0, parent=-1, path=())]  # drafting order
    lp = root_logprobs.tolist()
    for v in top(lp, top_k):
        pool.append(dict(token=v, score=lp[v], parent=0, path=(v,)))
    frontier = list(range(1, top_k + 1))
    for step in range(1, depth):
        calls.append((step, [pool[f]["token"] for f in frontier], [pool[f]["path"] for f in frontier]))
        children = []
        for f in frontier:
            lp = fake_logprobs(b, pool[f]["path"]).tolist()
            for v in top(lp, top_k):
                children.append(len(pool))
                pool.append(
                    dict(token=v, score=pool[f]["score"] + lp[v], parent=f, path=pool[f]["path"] + (v,))
                )
        frontier = sorted(children, key=lambda i: (-pool[i]["score"], i))[:top_k]
    kept = sorted(sorted(range(len(pool)), key=lambda i: (-pool[i]["score"], i))[: num_nodes + 1])
    index = {node: i for i, node in enumerate(kept)}
    tokens = [pool[i]["token"] for i in kept]
    parents = [-1] + [index[pool[i]["parent"]] for i in kept[1:]]  # KeyError = not closed
    return tokens, parents, [pool[i]["score"] for i in kept]


@pytest.mark.parametrize(("top_k", "depth", "num_nodes"), [(3, 4, 10), (2, 3, 10), (4, 1, 3), (3, 3, 1)])
def test_dynamic_tree_matches_the_reference(top_k, depth, num_nodes):
    roots = torch.tensor([3, 7, 3])  # requests 0 and 2 share a root but not their draft
    root_logprobs = torch.stack([fake_logprobs(b, (int(roots[b]),)) for b in range(3)])  # [B, V]
    calls: list = []
    tree, scores = build_dynamic_tree(
        roots,
        root_logprobs,
        fake_expand(calls),
        top_k=top_k,
        depth=depth,
        num_nodes=num_nodes,
        return_scores=True,
    )
    tree.validate()  # closed under ancestors, parents before children, distinct siblings
    assert tree.sizes() == [num_nodes + 1] * 3
    want_calls: list = [[] for _ in range(3)]
    want = [
        reference_dynamic_tree(b, int(roots[b]), root_logprobs[b], top_k, depth, num_nodes, want_calls[b])
        for b in range(3)
    ]
    assert_trees_equal(tree, TokenTree.from_lists([w[0] for w in want], [w[1] for w in want]))
    assert scores.tolist() == [s for w in want for s in w[2]]
    # expand saw every request's frontier, batched, and its parent slots led to the right paths.
    assert [c[0] for c in calls] == list(range(1, depth))
    for step, (got_step, got_tokens, got_paths) in enumerate(calls):
        for b in range(3):
            assert (got_step, got_tokens[b], got_paths[b]) == want_calls[b][step]


def test_a_reduced_readout_grows_the_tree_the_widened_one_grows():
    """Log-probs over a few columns whose ids ``token_ids`` names (a reduced read-out, out of
    order) give the tree that the same values placed in the whole vocabulary (-inf elsewhere)
    give, and ``expand`` sees token ids, not columns."""
    wide_vocab = 40
    ids = torch.tensor([31, 4, 17, 9, 22, 38, 0, 12, 27, 6, 35, 19])  # column c is token ids[c]
    assert len(ids) == VOCAB

    def widened(logprobs: torch.Tensor) -> torch.Tensor:
        full = logprobs.new_full((*logprobs.shape[:-1], wide_vocab), float("-inf"))
        return full.index_copy_(-1, ids, logprobs)

    def reduced_expand(calls):
        def expand(step, frontier_tokens, parent_slots):  # the fake head reads columns
            columns = (frontier_tokens[..., None] == ids).float().argmax(-1)
            calls.append(frontier_tokens.tolist())
            return inner(step, columns, parent_slots)

        inner = fake_expand([])
        return expand

    roots = torch.tensor([3, 7])
    root_logprobs = torch.stack([fake_logprobs(b, (int(roots[b]),)) for b in range(2)])
    seen: list = []
    got = build_dynamic_tree(roots, root_logprobs, reduced_expand(seen), top_k=3, depth=3, num_nodes=8,
                             token_ids=ids)  # fmt: skip
    inner = fake_expand([])

    def wide_expand(step, frontier_tokens, parent_slots):
        columns = (frontier_tokens[..., None] == ids).float().argmax(-1)
        return widened(inner(step, columns, parent_slots))

    want = build_dynamic_tree(roots, widened(root_logprobs), wide_expand, top_k=3, depth=3, num_nodes=8)
    assert_trees_equal(got, want)
    assert set(got.tokens.tolist()) - set(roots.tolist()) <= set(ids.tolist())
    for bad in (ids[:-1], ids.float(), ids[None]):  # one id per column, integers, 1-D
        with pytest.raises(ValueError, match="token_ids must be 1-D integer ids, one per log-prob column"):
            build_dynamic_tree(
                roots, root_logprobs, reduced_expand([]), top_k=3, depth=3, num_nodes=8, token_ids=bad
            )
    assert all(t in ids.tolist() for call in seen for row in call for t in row)


def test_dynamic_tree_keeps_parents_on_ties():
    # A certain draft: log(1) = 0, so the chain of token 2 ties with the root (score 0) and every
    # other child ties at -inf. Kept nodes must still be closed under ancestors.
    vocab = 4
    one_hot = torch.full((vocab,), float("-inf"))
    one_hot[2] = 0.0  # the draft is certain: log-prob 0 for token 2

    def expand(step, frontier_tokens, parent_slots):
        return one_hot.expand(*frontier_tokens.shape, vocab)

    tree = build_dynamic_tree(
        torch.tensor([1, 2]), one_hot.expand(2, vocab), expand, top_k=2, depth=3, num_nodes=5
    )
    tree.validate()
    assert tree.sizes() == [6, 6]
    # Kept: the root, the certain chain 2, 2, 2 (score 0), then the two first-drafted -inf nodes
    # (the root's 2nd child, the 2nd child of the chain's first node). In drafting order:
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3] * 2
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 3] * 2
    assert tree.tokens[[0, 1, 3, 5, 6, 7, 9, 11]].tolist() == [1, 2, 2, 2, 2, 2, 2, 2]


def test_dynamic_tree_checks_its_inputs():
    logprobs = torch.zeros(1, 5).log_softmax(-1)

    def expand(step, frontier_tokens, parent_slots):
        return torch.zeros(*frontier_tokens.shape, 5).log_softmax(-1)

    with pytest.raises(ValueError, match="num_nodes"):
        build_dynamic_tree(torch.tensor([1]), logprobs, expand, top_k=2, depth=2, num_nodes=7)  # 2 + 4 max
    with pytest.raises(ValueError, match="top_k"):
        build_dynamic_tree(torch.tensor([1]), logprobs, expand, top_k=6, depth=1, num_nodes=1)
    with pytest.raises(ValueError, match="root_logprobs"):
        build_dynamic_tree(torch.tensor([1, 2]), logprobs, expand, top_k=2, depth=2, num_nodes=2)
    with pytest.raises(ValueError, match="expand returned"):
        build_dynamic_tree(
            torch.tensor([1]), logprobs, lambda s, t, i: torch.zeros(1, 5), top_k=2, depth=2, num_nodes=2
        )
    with pytest.raises(ValueError, match="closed under ancestors"):  # raw logits, not log-probs
        build_dynamic_tree(
            torch.tensor([1]),
            logprobs,
            lambda s, t, i: torch.full((1, 2, 5), 3.0),
            top_k=2,
            depth=2,
            num_nodes=4,
        )


def test_pack_ancestor_mask_agrees_with_builders_on_ragged_sizes():
    # The two-word case through the vectorised packer: one request drops a subtree, one does not.
    shape = full_tree(2, 5)  # 63 nodes
    candidates = torch.tensor([[[1, 2]] * 5, [[1, 1]] + [[3, 4]] * 4])  # request 1: (1,) repeats (0,)
    tree = build_static_tree(shape, torch.tensor([0, 0]), candidates)
    assert tree.sizes() == [63, 32]
    assert tree.tree_mask.shape == (95, 2)
    assert torch.equal(tree.tree_mask[:63], pack_ancestor_mask(list(shape.parents)))
    tree.validate()


def test_a_step_that_drafts_nothing_has_one_root_per_request():
    roots = TokenTree.roots([5, 9, 5])
    want = TokenTree.from_lists([[5], [9], [5]])
    assert roots.num_nodes == roots.num_requests == 3 and roots.sizes() == [1, 1, 1]
    for name in ("tokens", "parents", "depth", "cu_nodes"):
        assert torch.equal(getattr(roots, name), getattr(want, name)), name
    assert roots.max_depth() == 0


def test_one_check_refuses_a_dynamic_tree_that_cannot_exist_in_every_proposer():
    """The dynamic-tree budget is checked in one place (tree.check_dynamic_budget): the tree
    builder and the EAGLE, Medusa and draft proposers refuse with the same message, in the
    caller's own argument names."""
    from conftest import build
    from test_eagle import random_head

    from treespec.heads import MedusaConfig, MedusaHeads
    from treespec.proposers import DraftModelProposer, EagleProposer, MedusaProposer
    from treespec.tree import check_dynamic_budget

    check_dynamic_budget(2, 3, 10, vocab=50)  # 2 + 2 * 4 = 10 nodes fit
    with pytest.raises(
        ValueError,
        match=r"1 <= num_nodes <= top_k \+ \(depth - 1\) \* top_k\^2; got top_k=2, depth=3, num_nodes=11",
    ):
        check_dynamic_budget(2, 3, 11, vocab=50)
    with pytest.raises(ValueError, match=r"1 <= top_k <= the vocabulary it ranks \(50\)"):
        check_dynamic_budget(51, 1, 1, vocab=50)
    model = build("llama")
    with pytest.raises(ValueError, match="total_tokens=100"):
        EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=100)
    with pytest.raises(ValueError, match="got dynamic top_k=2, depth=2, num_nodes=9"):
        DraftModelProposer(model, dynamic=(2, 2, 9))
    with pytest.raises(ValueError, match="got dynamic top_k=2, heads=2, num_nodes=100"):
        MedusaProposer(MedusaHeads(MedusaConfig(64, 128, num_heads=2)), model, dynamic=(2, 100))


def test_roots_alone_are_the_tree_from_lists_would_build():
    """A step of plain decoding builds its roots-only tree directly; it must be the tree
    ``from_lists`` builds (tokens, parents, depths, offsets, masks and what the host knows)."""
    direct, built = TokenTree.roots([5, 7, 9]), TokenTree.from_lists([[5], [7], [9]])
    for name in ("tokens", "parents", "depth", "cu_nodes", "tree_mask"):
        mine, theirs = getattr(direct, name), getattr(built, name)
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    assert direct.host == built.host and direct.draft_probs is None
    direct.validate()
    with pytest.raises(ValueError, match="at least one"):
        TokenTree.roots([])
