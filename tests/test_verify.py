"""The tree rejection sampler: exact oracles for greedy and one-hot targets, and a statistical
test of losslessness (with a demonstration that the test catches lossy rules)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from treespec.sampling import SamplingParams
from treespec.tree import TokenTree
from treespec.verify import VerifyOutput, children_table, verify

V = 10


def crafted_logits(num_nodes: int, argmax: dict[int, int]) -> torch.Tensor:
    logits = torch.full((num_nodes, V), -4.0)
    for row, token in argmax.items():
        logits[row, token] = 4.0
    return logits


def test_children_table_literal():
    tree = TokenTree.make_dummy([[9, 1, 2, 3], [9, 4]], [[-1, 0, 0, 1], [-1, 0]])
    assert children_table(tree).tolist() == [[1, 2], [3, -1], [-1, -1], [-1, -1], [5, -1], [-1, -1]]


def test_greedy_crafted_batch_with_non_contiguous_path():
    #   request 0:  0 ─ 1(t1) ─ 3(t3) ─ 5(t5)      request 1: a chain 0 ─ 1(t4)
    #                 └ 2(t2) ─ 4(t6)               request 2: a root alone
    tree = TokenTree.make_dummy(
        [[9, 1, 2, 3, 6, 5], [9, 4], [9]],
        [[-1, 0, 0, 1, 2, 3], [-1, 0], [-1]],
    )
    # Request 0 goes root -> node 2 -> node 4 (non-contiguous), bonus 8.
    # Request 1 rejects its only child (argmax 0), bonus 0. Request 2: bonus 7.
    logits = crafted_logits(9, {0: 2, 2: 6, 4: 8, 6: 0, 8: 7})
    out = verify(tree, logits, SamplingParams())
    assert out.accepted_lists() == [[0, 2, 4], [0], [0]]
    assert out.num_accepted.tolist() == [2, 0, 0]
    assert out.bonus_tokens.tolist() == [8, 0, 7]
    assert out.committed_tokens(tree) == [[2, 6, 8], [0], [7]]
    assert out.cu_accepted.tolist() == [0, 3, 4, 5]


def markov_tables(vocab: int, seed: int, concentration: float = 1.0):
    """A target (or draft) whose next-token distribution depends on the current token only."""
    torch.manual_seed(seed)  # torch.distributions draws from the global generator
    dirichlet = torch.distributions.Dirichlet(torch.full((vocab,), concentration))
    return dirichlet.sample(), dirichlet.sample((vocab,))  # [V] at the root, [V, V] given a token


def random_tree(num_nodes: int, vocab: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    parents = [-1]
    tokens = [0]
    for node in range(1, num_nodes):
        parent = int(torch.randint(0, node, (1,), generator=gen))
        used = {t for t, p in zip(tokens, parents, strict=False) if p == parent}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            continue
        parents.append(parent)
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=gen))])
    return tokens, parents


def test_greedy_equals_greedy_decoding_of_the_target():
    """On random trees over a Markov target, what is committed is greedy decoding's prefix."""
    first, table = markov_tables(V, seed=1)
    gen = torch.Generator().manual_seed(2)
    trees = [random_tree(int(torch.randint(1, 30, (1,), generator=gen)), V, gen) for _ in range(40)]
    # Plant the greedy path in half of the trees so that long acceptances happen too.
    greedy = [int(first.argmax())]
    for _ in range(6):
        greedy.append(int(table[greedy[-1]].argmax()))
    for tokens, parents in trees[::2]:
        parent = 0
        for token in greedy[:4]:
            child = next(
                (
                    i
                    for i, (t, p) in enumerate(zip(tokens, parents, strict=False))
                    if p == parent and t == token
                ),
                None,
            )
            if child is None:
                tokens.append(token)
                parents.append(parent)
                child = len(tokens) - 1
            parent = child
    tree = TokenTree.make_dummy([t for t, _ in trees], [p for _, p in trees])
    logits = torch.stack(
        [
            first.log() if p < 0 else table[t].log()
            for t, p in zip(tree.tokens.tolist(), tree.parents.tolist(), strict=False)
        ]
    )
    out = verify(tree, logits, SamplingParams())
    committed = out.committed_tokens(tree)
    for b, tokens in enumerate(committed):
        assert tokens == greedy[: len(tokens)], b
    assert max(out.num_accepted.tolist()) >= 4


@pytest.mark.parametrize("mode", ["deterministic", "sampled", "typical"])
def test_one_hot_target_makes_stochastic_modes_exact(mode):
    tree = TokenTree.make_dummy(
        [[9, 1, 2, 3, 6, 5], [9, 4], [9]],
        [[-1, 0, 0, 1, 2, 3], [-1, 0], [-1]],
        draft_probs=torch.softmax(torch.randn(9, V), -1),
    )
    logits = torch.full((9, V), float("-inf"))
    for row, token in {0: 2, 1: 0, 2: 6, 3: 0, 4: 8, 5: 0, 6: 0, 7: 0, 8: 7}.items():
        logits[row, token] = 0.0  # p is exactly one-hot at every node
    for seed in range(5):
        out = verify(
            tree,
            logits,
            SamplingParams(temperature=0.7),
            mode=mode,
            generator=torch.Generator().manual_seed(seed),
        )
        assert out.committed_tokens(tree) == [[2, 6, 8], [0], [7]]


# --------------------------------------------------------------------------- losslessness

DRAWS = 100_000
STAT_VOCAB = 8


def chi2_critical(dof: int, z: float = 4.265) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 4.265 is p = 1e-5 one-sided."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def build_batch_of_trees(branching: list[int], sampled: bool, draft_first, draft_table, gen) -> TokenTree:
    """DRAWS copies of one shape; children of a node are the draft's top-k (deterministic) or
    drawn from the draft without replacement (Gumbel top-k), per copy."""
    tokens = [torch.zeros(DRAWS, dtype=torch.long)]  # roots (their token is irrelevant)
    parents = [-1]
    q_rows = [draft_first.expand(DRAWS, -1)]
    frontier = [0]
    for width in branching:
        new_frontier = []
        for node in frontier:
            q = q_rows[node]
            scores = q.log()
            if sampled:
                scores = scores - torch.log(-torch.log(torch.rand(q.shape, generator=gen)))  # Gumbel
            picks = scores.topk(width, dim=-1).indices  # distinct siblings
            for rank in range(width):
                tokens.append(picks[:, rank])
                parents.append(node)
                q_rows.append(draft_table[picks[:, rank]])
                new_frontier.append(len(tokens) - 1)
        frontier = new_frontier
    num = len(tokens)
    flat_tokens = torch.stack(tokens, dim=1).reshape(-1)  # request-major
    one = TokenTree.make_dummy([list(range(num))], [parents])  # shape, mask and depth of one copy
    return TokenTree(
        tokens=flat_tokens,
        parents=one.parents.repeat(DRAWS),
        depth=one.depth.repeat(DRAWS),
        cu_nodes=torch.arange(DRAWS + 1) * num,
        tree_mask=one.tree_mask.repeat(DRAWS, 1),
        draft_probs=torch.stack(q_rows, dim=1).reshape(-1, STAT_VOCAB),
    )


def first_two_tokens(out: VerifyOutput, tree: TokenTree, target_table, gen) -> torch.Tensor:
    """[DRAWS, 2]: the first two committed tokens; when only the bonus was committed, the second
    comes from an exact draw of the target (what the next step would do)."""
    starts = tree.cu_nodes[:-1]
    first_accepted = out.accepted_nodes[(out.cu_accepted[:-1] + 1).clamp(max=len(out.accepted_nodes) - 1)]
    second_accepted = out.accepted_nodes[(out.cu_accepted[:-1] + 2).clamp(max=len(out.accepted_nodes) - 1)]
    n = out.num_accepted
    x1 = torch.where(n >= 1, tree.tokens[first_accepted + starts], out.bonus_tokens)
    x2_tree = torch.where(n >= 2, tree.tokens[second_accepted + starts], out.bonus_tokens)
    x2_fresh = torch.multinomial(target_table[x1], 1, generator=gen).squeeze(-1)
    return torch.stack([x1, torch.where(n >= 1, x2_tree, x2_fresh)], dim=1)


def chi_square(pairs: torch.Tensor, target_first, target_table) -> tuple[float, float]:
    counts = torch.bincount(pairs[:, 0] * STAT_VOCAB + pairs[:, 1], minlength=STAT_VOCAB**2).double()
    expected = (target_first[:, None] * target_table).reshape(-1).double() * len(pairs)
    big = expected >= 5  # pool the rare cells into one
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, chi2_critical(int(keep.sum()) - 1)


CASES = {
    # name: (children per level, sampled children?, verification mode)
    "chain": ([1, 1, 1], True, "sampled"),
    "deterministic-children tree": ([3, 2, 2], False, "deterministic"),
    "sampled-children tree": ([3, 2, 2], True, "sampled"),
    # The top-k rule stays lossless for any children chosen independently of its coin flips.
    "deterministic rule on sampled children": ([3, 2, 2], True, "deterministic"),
}


def run_case(branching, sampled, mode, seed=0, temperature=1.0, wrong_draft_probs=False):
    target_first, target_table = markov_tables(STAT_VOCAB, seed=10 + seed)
    draft_first, draft_table = markov_tables(STAT_VOCAB, seed=20 + seed, concentration=0.7)
    gen = torch.Generator().manual_seed(seed)
    tree = build_batch_of_trees(branching, sampled, draft_first, draft_table, gen)
    if wrong_draft_probs:  # children drawn from q, but the verifier is told q is uniform
        tree = dataclasses.replace(tree, draft_probs=torch.full_like(tree.draft_probs, 1 / STAT_VOCAB))
    num = tree.num_nodes // DRAWS
    # Row t holds the target's logits at node t: log p, so temperature 1 leaves p unchanged.
    logits = target_table[tree.tokens].log()
    logits.view(DRAWS, num, STAT_VOCAB)[:, 0] = target_first.log()
    out = verify(tree, logits, SamplingParams(temperature=temperature), mode=mode, generator=gen)
    pairs = first_two_tokens(out, tree, target_table, gen)
    return chi_square(pairs, target_first, target_table), out


@pytest.mark.parametrize("case", list(CASES))
def test_lossless_first_two_tokens(case):
    branching, sampled, mode = CASES[case]
    (stat, critical), out = run_case(branching, sampled, mode)
    assert stat < critical, f"{case}: chi2 {stat:.1f} >= {critical:.1f}"
    assert float(out.num_accepted.float().mean()) > 0.3  # the tree really is used


@pytest.mark.parametrize(
    "branching,sampled,mode,wrong_q",
    [
        ([3, 2, 2], False, "typical", False),  # Medusa's typical acceptance: lossy by design
        ([3, 2, 2], True, "sampled", True),  # min(1, p/q) with the wrong q
    ],
)
def test_the_statistical_test_has_power(branching, sampled, mode, wrong_q):
    (stat, critical), _ = run_case(branching, sampled, mode, wrong_draft_probs=wrong_q)
    assert stat > critical, f"a lossy rule passed: chi2 {stat:.1f} < {critical:.1f}"


# --------------------------------------------------------------------------- bad input


def small_tree(**kw) -> TokenTree:
    return TokenTree.make_dummy([[1, 2, 3]], [[-1, 0, 0]], **kw)


def test_shape_mismatch_between_tree_and_logits():
    with pytest.raises(ValueError, match=r"target_logits must be \[T=3, V\]"):
        verify(small_tree(), torch.zeros(4, V), SamplingParams())


def test_bad_parents_are_rejected():
    tree = small_tree()
    bad = TokenTree(tree.tokens, torch.tensor([-1, 0, 5]), tree.depth, tree.cu_nodes, tree.tree_mask)
    with pytest.raises(ValueError, match="parent 5"):
        verify(bad, torch.zeros(3, V), SamplingParams())
    later = TokenTree(tree.tokens, torch.tensor([-1, 2, 0]), tree.depth, tree.cu_nodes, tree.tree_mask)
    with pytest.raises(ValueError, match="comes before them"):
        verify(later, torch.zeros(3, V), SamplingParams())
    with pytest.raises(ValueError, match="two children with token"):
        TokenTree.make_dummy([[1, 2, 2]], [[-1, 0, 0]])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        verify(small_tree(), torch.zeros(3, V), SamplingParams(**kwargs))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_inf_logits_name_the_row(value):
    tree = TokenTree.make_dummy([[1], [1, 2, 3]], [[-1], [-1, 0, 0]])
    logits = torch.zeros(4, V)
    logits[2, 5] = value
    with pytest.raises(ValueError, match=r"row 2 \(request 1, node 1\)"):
        verify(tree, logits, SamplingParams())


def test_sampled_mode_needs_draft_probs_and_valid_uniforms():
    with pytest.raises(ValueError, match="draft_probs"):
        verify(small_tree(), torch.zeros(3, V), SamplingParams(temperature=1.0), mode="sampled")
    with pytest.raises(ValueError, match="uniforms"):
        verify(small_tree(), torch.zeros(3, V), SamplingParams(temperature=1.0), uniforms=torch.rand(3, 1))
    with pytest.raises(ValueError, match="needs temperature > 0"):
        verify(small_tree(), torch.zeros(3, V), SamplingParams(), mode="deterministic")


def test_uniforms_make_verification_a_function_of_its_inputs():
    tree = small_tree(draft_probs=torch.softmax(torch.randn(3, V), -1))
    logits = torch.randn(3, V)
    u = torch.rand(3, 2)
    a = verify(tree, logits, SamplingParams(temperature=1.0), uniforms=u)
    b = verify(tree, logits, SamplingParams(temperature=1.0), uniforms=u.clone())
    assert a.committed_tokens(tree) == b.committed_tokens(tree)
