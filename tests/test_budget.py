"""The adaptive tree budget: cost curves, acceptance statistics, the chooser, the wrapper."""

from __future__ import annotations

import itertools
import statistics

import pytest
from conftest import build, oracle_table
from test_eagle import random_head

import treespec
from treespec.budget import (
    AcceptanceStats,
    AdaptiveProposer,
    BudgetChooser,
    BudgetMemory,
    CostModel,
    StepThroughput,
)
from treespec.proposers import EagleProposer, ProposalRequest, Proposer
from treespec.proposers.base import RequestResult, StepResult
from treespec.sampling import SamplingParams
from treespec.target import Target
from treespec.tree import TokenTree, best_paths

RATES = [[0.8, 0.3, 0.1], [0.7, 0.2, 0.1], [0.6, 0.2], [0.5, 0.2], [0.5]]


def test_larger_trees_when_verification_is_cheap_smaller_when_expensive():
    cheap = CostModel([1, 16, 64, 256], [1.0, 1.05, 1.2, 2.0])  # a GPU-like flat curve
    steep = CostModel([1, 16, 64, 256], [1.0, 4.0, 14.0, 52.0])  # a CPU-like curve
    n_cheap, depth_cheap, _ = BudgetChooser(cheap).choose(RATES, batch_size=1)
    n_steep, _, _ = BudgetChooser(steep).choose(RATES, batch_size=1)
    assert n_cheap > n_steep >= 0 and depth_cheap >= 3
    # A growing batch shrinks the tree: B requests' trees share one forward.
    sizes = [BudgetChooser(cheap).choose(RATES, batch_size=b)[0] for b in (1, 4, 16, 64)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    # Nothing is accepted: no tree at all.
    assert BudgetChooser(cheap).choose([[0.0]], batch_size=1)[0] == 0


def test_expected_tokens_match_the_best_tree_no_deeper_than_each_cap():
    from treespec.tree import best_tree, expected_accepted_length

    tables = BudgetChooser(CostModel([1, 2], [1.0, 1.0])).expected_by_depth(RATES, 8)
    assert len(tables) == len(RATES)
    for cap, totals in enumerate(tables, start=1):
        for n in range(1, len(totals)):
            shape = best_tree(RATES[:cap], n)  # the best tree of n nodes that the cap allows
            assert totals[n] == pytest.approx(1 + expected_accepted_length(shape, RATES[:cap]))
            assert shape.max_depth <= cap
    assert len(tables[-1]) == 9 and tables[-1][8] >= tables[0][-1]


def test_acceptance_stats_count_depth_and_rank():
    stats = AcceptanceStats(max_depth=3, max_rank=3, prior_weight=0.0)
    tokens, parents = [9, 1, 2, 3, 4], [-1, 0, 0, 1, 2]  # root -> {1, 2}; 1 -> 3; 2 -> 4
    stats.update(tokens, parents, [0, 2, 4])  # rank 1 at depth 1, rank 0 at depth 2
    stats.update(tokens, parents, [0])  # nothing accepted
    rates = stats.rates()
    assert rates[0][:2] == [0.0, 0.5] and rates[1][0] == 1.0


def test_cost_model_interpolates_and_measures():
    model = CostModel([1, 8, 64], [1.0, 2.0, 9.0])
    assert (
        model(4) == pytest.approx(1 + 3 / 7) and model(64) == 9.0 and model(128) == pytest.approx(17.0)
    )  # the last slope, extended
    measured = CostModel.measure(Target(build("llama")), batch_size=2, context=16, sizes=(1, 4, 8), repeats=1)
    assert measured.sizes == [1, 4, 8] and all(t > 0 for t in measured.seconds)
    assert measured.seconds == sorted(measured.seconds)
    # a size disturbed upwards (8 tokens dearer than 16) takes the larger size's time
    assert CostModel.monotone([48.0, 65.0, 132.0, 93.0, 123.0]) == [48.0, 65.0, 93.0, 93.0, 123.0]
    with pytest.raises(ValueError):
        CostModel([1], [1.0])
    # steps actually run update the curve; a fresh point is trusted and the curve stays non-decreasing
    curve = CostModel([1, 8, 64], [1.0, 2.0, 9.0])
    curve.update(8, 2.2)  # within noise: a quarter of the way, the larger sizes by the same factor
    assert curve.seconds == pytest.approx([1.0, 2.05, 9.0 * 2.05 / 2.0])
    curve = CostModel([1, 8, 64], [1.0, 2.0, 9.0])
    curve.update(8, 6.0, weight=0.25)  # 3x what the curve said: not noise, half of the way
    assert curve.seconds == pytest.approx([1.0, 4.0, 18.0])
    curve.update(16, 20.0)  # a new size: taken as it is; 64 moves by its factor over the curve's 6.0
    assert curve.sizes == [1, 8, 16, 64] and curve.seconds == pytest.approx([1.0, 4.0, 20.0, 60.0])
    curve.update(2, 0.5)  # smaller sizes are lowered to the fresh point
    assert curve.sizes == [1, 2, 8, 16, 64] and curve.seconds[:2] == [0.5, 0.5]
    assert curve.seconds == sorted(curve.seconds) and curve.seconds[2] == pytest.approx(
        4.0 * 0.5 / (1 + 3 / 7)
    )
    # the n-gram proposer's token cost: the mean slope over the first drafted tokens, per plain step
    gentle = CostModel([1, 5, 10, 20], [1.0, 1.4, 2.0, 4.0])
    assert gentle.token_cost() == pytest.approx(0.1)  # 4 drafted tokens cost 0.4 of a plain step
    assert gentle.token_cost(batch_size=2, drafted=4) == pytest.approx((2.0 - 1.1) / (4 * 1.1))
    assert CostModel([1, 8], [1.0, 1.0]).token_cost() == 0.0


def test_adaptive_proposer_keeps_output_exact_and_adapts():
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22]]
    model, want = oracle_table(prompts, 14)("llama")
    eagle = EagleProposer(random_head(model), model, top_k=3, depth=4, total_tokens=12)
    chooser = BudgetChooser(CostModel([1, 8, 64], [1.0, 1.1, 1.5]))
    # A clock that ticks one second per reading: every step measures one second of forward pass
    # whatever its size, so the cost curve stays flat and only acceptance moves the budget (the
    # real clock would put milliseconds into a curve given in seconds, and the result on timing).
    ticks = iter(range(10**6))
    proposer = AdaptiveProposer(eagle, chooser, clock=lambda: float(next(ticks)))
    out = treespec.generate(model, prompts, max_new_tokens=14, proposer=proposer)
    assert out.sequences == want
    assert proposer.chosen[0] == 12  # a flat cost curve and the prior: the whole budget
    assert proposer.chosen[-1] < proposer.chosen[0]  # a random head is never accepted: it shrinks

    class Fixed(Proposer):  # a tree size of its own
        def propose(self, requests):
            return TokenTree.roots([r.tokens[-1] for r in requests])

    with pytest.raises(TypeError, match="set_budget"):
        AdaptiveProposer(Fixed(), chooser)


def test_a_pessimistic_budget_still_probes_and_learns():
    """A cost curve where no tree pays: the proposer drafts nothing most steps, but probes with
    the best non-empty tree after probe_every idle steps, backing off while probes do not pay,
    and the statistics see the probes."""
    model = build("llama")
    eagle = EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=6)
    steep = BudgetChooser(CostModel([1, 8, 64], [1.0, 8.0, 64.0]))
    ticks = iter(range(10**6))  # one second per clock reading: measured steps agree with the curve
    proposer = AdaptiveProposer(eagle, steep, probe_every=4, clock=lambda: float(next(ticks)),
                                probe_share=1.0)  # drafting here costs a step: the waits are the doubling's  # fmt: skip
    treespec.generate(model, [[5, 6, 7]], max_new_tokens=40, proposer=proposer)
    probes = [i for i, n in enumerate(proposer.chosen) if n]
    assert probes[:3] == [3, 11, 27]  # waits of 4, then 8, then 16 idle steps (a random head never pays)
    assert proposer.stats.trials[0] >= 1


def test_set_budget_never_drafts_deeper_than_its_nodes():
    """Every level costs a pass of the head: a budget of n nodes stops at depth n."""
    from treespec.proposers import DraftModelProposer

    model = build("llama")
    eagle = EagleProposer(random_head(model), model, depth=6, top_k=4, total_tokens=31)
    eagle.set_budget(2, depth=6)
    assert (eagle.total_tokens, eagle.depth) == (2, 2)
    eagle.set_budget(31, depth=1)  # deepened until the nodes fit: 4 + 4 * 16 >= 31
    assert (eagle.total_tokens, eagle.depth) == (31, 3)
    draft = DraftModelProposer(build("llama", seed=1), target_model=model, dynamic=(4, 6, 31))
    draft.set_budget(3, depth=6)
    assert draft.dynamic == (4, 3, 3)


class ChainOfBudget(Proposer):
    """Drafts a chain of as many nodes as its budget says (tokens 1, 2, 3, ...)."""

    has_budget = True
    max_tree_nodes = 9

    def __init__(self):
        self.nodes = 8

    def set_budget(self, num_nodes, depth):
        self.nodes = num_nodes

    def propose(self, requests):
        return TokenTree.from_lists([[r.tokens[-1]] + list(range(1, self.nodes + 1)) for r in requests])


def test_a_budget_that_cannot_lose_follows_the_measured_steps():
    """A fake clock runs each step at a cost that depends on the tree: trees are nearly free for
    100 steps, then each drafted node costs 10x a plain step. The target accepts everything, so
    the acceptance model always favours trees and the start-up cost curve (flat) never changes
    on its own: only the steps actually run can tell the proposer to stop drafting."""
    now = [0.0]
    proposer = AdaptiveProposer(ChainOfBudget(), BudgetChooser(CostModel([1, 8, 64], [1.0, 1.0, 1.0])),
                                clock=lambda: now[0])  # fmt: skip
    request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)
    for step in range(220):
        tree = proposer.propose([request])
        nodes = tree.num_nodes - 1
        now[0] += 1.0 + (0.01 if step < 100 else 10.0) * nodes  # the step's cost
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        everything = RequestResult(0, tokens, parents, list(range(len(tokens))), tokens[1:] + [0])
        proposer.observe(StepResult([everything]))
    cheap, dear = proposer.chosen[50:100], proposer.chosen[160:]
    assert sum(n > 0 for n in cheap) >= 45  # trees pay: drafted almost every step (baseline steps aside)
    assert sum(n > 0 for n in dear) <= 10  # trees lose: only probes draft
    assert proposer.throughput.trees_lose() or not proposer.throughput.tree
    assert proposer.chooser.forward_cost(9) > 10.0  # the curve learnt what a 9-token step costs now


def test_trees_that_lose_from_the_first_step_are_caught_within_a_few_steps():
    """A fresh proposer (one per prompt, as the benchmark builds them) whose model of the step
    says trees pay from the start (every node reported accepted, a flat cost) while the steps
    actually run say they lose (a tree step takes twice a plain one and commits one token): the
    guard needs two measured baseline steps, so they come every probe_every // 2 tree steps
    until it has them (not after 4 * probe_every), and drafting stops right after."""
    now = [0.0]
    proposer = AdaptiveProposer(ChainOfBudget(), BudgetChooser(CostModel([1, 8, 64], [1.0, 1.0, 1.0])),
                                probe_every=8, clock=lambda: now[0])  # fmt: skip
    request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)
    for _ in range(40):
        tree = proposer.propose([request])
        now[0] += 2.0 if tree.num_nodes > 1 else 1.0
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        claimed = RequestResult(0, tokens, parents, list(range(len(tokens))), [0])  # one token committed
        proposer.observe(StepResult([claimed]))
    assert min(proposer.chosen[:4]) > 0  # the model's choice: trees
    baseline = [i for i, n in enumerate(proposer.chosen[:10]) if n == 0]
    assert baseline[0] == 4  # after 4 tree steps (the measured steps then move the cost curve too)
    assert sum(n > 0 for n in proposer.chosen[10:]) <= 3  # then only probes draft


class TimedChain(ChainOfBudget):
    """A chain whose drafting advances a fake clock by ``base + per_node * nodes`` seconds."""

    def __init__(self, now):
        super().__init__()
        self.now, self.base, self.per_node = now, 0.5, 0.1

    def propose(self, requests):
        self.now[0] += self.base + self.per_node * self.nodes
        return super().propose(requests)


class ScriptedChooser(BudgetChooser):
    """Picks the sizes it is given, in turn, whatever the costs say."""

    def __init__(self, sizes):
        super().__init__(CostModel([1, 8, 64], [1.0, 1.0, 1.0]))
        self.sizes = itertools.cycle(sizes)

    def allocate(self, tables, *, cap=None, min_nodes=0, batch_size=None):
        return len(tables), next(self.sizes), 1, 1.0  # every request drafts


def test_the_drafting_cost_is_the_line_through_the_recent_proposals_and_follows_new_ones():
    """The chooser asks the drafting cost of every candidate size each step; the answer is the
    least-squares line through the recent proposals, refitted as soon as one is added."""
    now = [0.0]
    chain = TimedChain(now)
    proposer = AdaptiveProposer(chain, ScriptedChooser([2, 4, 6, 8]), clock=lambda: now[0])
    cost = proposer.chooser.propose_cost
    assert cost(5) == 0.0  # nothing measured yet: drafting looks free
    request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)

    def steps(count):
        for _ in range(count):
            tree = proposer.propose([request])
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            everything = RequestResult(0, tokens, parents, list(range(len(tokens))), tokens[1:] + [0])
            proposer.observe(StepResult([everything]))  # trees pay: they stay chosen
            now[0] += 1.0

    steps(3)
    assert cost(20) == pytest.approx(0.5 + 0.1 * 20)
    chain.base, chain.per_node = 1.0, 0.3  # drafting became dearer
    steps(1)
    assert cost(20) > 0.5 + 0.1 * 20 + 0.1  # one new proposal already moves the line
    steps(100)  # the old proposals leave the window of 64
    assert cost(20) == pytest.approx(1.0 + 0.3 * 20)


def test_greedy_steps_without_a_tree_skip_the_tree_sampler(monkeypatch):
    """A step whose trees are roots only picks each bonus token as plain decoding does (the
    argmax), without the tree sampler: the output is the same, and the sampler runs only in
    the steps that drafted."""
    import treespec.engine.picking

    calls = []
    real_verify = treespec.engine.picking.verify
    monkeypatch.setattr(
        treespec.engine.picking, "verify", lambda *a, **k: calls.append(1) or real_verify(*a, **k)
    )
    model = build("llama")
    want = treespec.generate(model, [[5, 6, 7]], max_new_tokens=30).sequences
    eagle = EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=6)
    steep = BudgetChooser(CostModel([1, 8, 64], [1.0, 8.0, 64.0]))  # no tree pays but for probes
    ticks = iter(range(10**6))
    proposer = AdaptiveProposer(eagle, steep, probe_every=4, clock=lambda: float(next(ticks)))
    assert treespec.generate(model, [[5, 6, 7]], max_new_tokens=30, proposer=proposer).sequences == want
    drafted = sum(n > 0 for n in proposer.chosen)
    assert 0 < drafted < len(proposer.chosen)
    assert len(calls) == drafted


def test_a_proposer_for_the_next_request_starts_from_the_measured_rates():
    """The rates of steps with and without trees are the machine's, not the text's: a proposer
    given the StepThroughput of one that found trees losing drafts nothing from its first step
    (but for probes), while its acceptance statistics start fresh."""
    now = [0.0]
    shared = StepThroughput()

    def run(proposer, steps):
        request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)
        for _ in range(steps):
            tree = proposer.propose([request])
            now[0] += 2.0 if tree.num_nodes > 1 else 1.0  # trees take twice as long...
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            claimed = RequestResult(0, tokens, parents, list(range(len(tokens))), [0])  # ...for one token
            proposer.observe(StepResult([claimed]))

    def fresh():
        chooser = BudgetChooser(CostModel([1, 8, 64], [1.0, 1.0, 1.0]))
        return AdaptiveProposer(ChainOfBudget(), chooser, clock=lambda: now[0], throughput=shared)

    first = fresh()
    run(first, 20)
    assert shared.trees_lose()
    second = fresh()
    run(second, 7)
    assert second.chosen == [0] * 7  # no probe is due yet
    assert second.stats.trials == AcceptanceStats().trials


def test_the_expected_tokens_are_kept_between_refreshes_not_summed_every_step():
    """Summing the best paths is the chooser's costly part: the proposer sums them after every
    step while its estimates are young (refresh steps), then every refresh-th step, and the
    table it keeps is then exactly what the statistics of that step give."""
    now = [0.0]
    chooser = BudgetChooser(CostModel([1, 8, 64], [1.0, 1.0, 1.0]))
    calls = []
    summed = chooser.expected_by_depth
    chooser.expected_by_depth = lambda rates, n: calls.append(n) or summed(rates, n)
    proposer = AdaptiveProposer(ChainOfBudget(), chooser, clock=lambda: now[0], refresh=8)
    request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)
    for step in range(96):
        tree = proposer.propose([request])
        now[0] += 1.0
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        accepted = list(range(len(tokens))) if step % 3 else [0]  # two steps in three accept everything
        proposer.observe(StepResult([RequestResult(0, tokens, parents, accepted, [0] * len(accepted))]))
        if step == 63:
            fresh = summed(proposer.stats.rates(), proposer._table_cap)
    # young: at most every step for 8 steps, then every 8th; each time the shared table and this
    # request's own (its trees win other than the shared statistics say: its scale is not 1)
    assert len(calls) <= 2 * (8 + 88 // 8 + 1)
    cap, kept = proposer._table_cap, proposer._table
    if proposer._since_table < 8:  # not due: the kept table comes back as it is
        assert proposer._expected(cap) is kept
    proposer._since_table = 8  # due: summed again from the statistics now
    assert proposer._expected(cap) == summed(proposer.stats.rates(), cap) != fresh


def test_a_wide_shallow_tree_wins_when_drafting_pays_per_level():
    """Acceptance that barely grows past depth 1 and drafting that costs a step per level: the
    chooser takes a shallow tree of several siblings, where with free levels it goes deep. Each
    depth cap's table is the best trees no deeper than it (one pass of best_paths)."""
    rates = [[0.6, 0.3, 0.2, 0.1], [0.5, 0.2, 0.1, 0.05], [0.5, 0.2, 0.1, 0.05], [0.5, 0.2, 0.1, 0.05]]
    flat = CostModel([1, 8, 64], [1.0, 1.0, 1.0])
    tables = BudgetChooser(flat).expected_by_depth(rates, 12)
    assert [len(t) - 1 for t in tables] == [4, 12, 12, 12]  # depth 1 holds four paths at most
    for depth, table in enumerate(tables, start=1):  # the first n paths no longer than the cap
        allowed = [p for p, path in itertools.islice(best_paths(rates), 500) if len(path) <= depth][:12]
        assert table == pytest.approx(list(itertools.accumulate(allowed, initial=1.0)))
    per_level = BudgetChooser(flat, propose_cost=lambda nodes, depth: 1.0 * depth)
    free = BudgetChooser(flat, propose_cost=lambda nodes, depth: 0.0)
    nodes, depth, _ = per_level.choose(rates, 1, cap=12)
    assert depth == 1 and nodes >= 2
    assert free.choose(rates, 1, cap=12)[1] >= 3
    assert per_level.choose(rates, 1, cap=12, min_nodes=1)[0] >= 1


def test_a_dear_probe_pushes_the_next_one_out_so_probing_stays_within_its_share():
    """Trees that lose, drafted by a proposer whose drafting costs 50 plain steps (a draft model
    catching up a long prompt): after the first probe the next waits until that cost is at most
    probe_share of the steps in between, so over 500 steps probing costs about 2 % of them, where
    the doubling alone (waits of 8, 16, 32, 64, 64, ...) would have probed ten times (50 % more
    time)."""
    now = [0.0]

    class DearChain(ChainOfBudget):
        def propose(self, requests):
            now[0] += 50.0
            return super().propose(requests)

    steep = BudgetChooser(CostModel([1, 8, 64], [1.0, 8.0, 64.0]))  # no tree pays
    proposer = AdaptiveProposer(DearChain(), steep, probe_every=8, clock=lambda: now[0])
    request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)
    for _ in range(500):
        tree = proposer.propose([request])
        now[0] += 1.0
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        proposer.observe(StepResult([RequestResult(0, tokens, parents, [0], [0])]))
    probes = [i for i, n in enumerate(proposer.chosen) if n]
    assert probes[0] == 7 and len(probes) == 1  # 50 / (0.02 x 1) = 2,500 steps to the next
    assert proposer.memory.wait == 2500


def test_the_drafting_cost_leaves_out_the_catch_up_of_idle_steps():
    """A head that catches up its cache before drafting pays for the steps since its last tree,
    not for the tree: the fitted drafting cost is the tree's alone, while the step's forward is
    still measured net of the whole proposal."""
    now = [0.0]

    class CatchingUp(TimedChain):
        def propose(self, requests):
            self.catch_up_s = 5.0  # the context since the last tree, through the head
            now[0] += self.catch_up_s
            return super().propose(requests)

    chain = CatchingUp(now)
    proposer = AdaptiveProposer(chain, ScriptedChooser([2, 4, 6, 8]), clock=lambda: now[0])
    request = ProposalRequest(0, [7], 1, SamplingParams(), 1000)
    for _ in range(8):
        tree = proposer.propose([request])
        now[0] += 1.0  # the forward
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        everything = RequestResult(0, tokens, parents, list(range(len(tokens))), tokens[1:] + [0])
        proposer.observe(StepResult([everything]))
    assert proposer.chooser.propose_cost(20, 1) == pytest.approx(0.5 + 0.1 * 20)
    assert proposer.chooser.forward_cost(9) == pytest.approx(
        1.0, abs=0.3
    )  # not 6: the catch-up is no forward


# --------------------------------------------------------------------------------------------
# The learning budget (issue 54): a simulated world whose acceptance and costs change mid-run
# --------------------------------------------------------------------------------------------


class SimulatedChain(Proposer):
    """Drafts a chain of min(nodes, depth) tokens (1, 2, 3, ...) per request: what the world
    below accepts of it is decided by its acceptance rate, not by the tokens."""

    has_budget = True
    max_tree_nodes = 17

    def __init__(self):
        self.nodes = self.depth = 16

    def set_budget(self, num_nodes, depth):
        self.nodes, self.depth = num_nodes, depth

    def propose(self, requests):
        k = min(self.nodes, self.depth)
        return TokenTree.from_lists([[r.tokens[-1]] + list(range(1, k + 1)) for r in requests])


def simulate(proposer, requests, phases, now, seed=0):
    """Run ``phases`` of (steps, acceptance per request, cost per drafted row): a step costs one
    plain step plus that per drafted row (the fake clock), each drafted node is accepted with its
    request's rate given its parent was, and the bonus comes on top."""
    import random

    rng = random.Random(seed)
    for steps, rates, per_row in phases:
        for _ in range(steps):
            tree = proposer.propose(requests)
            now[0] += 1.0 + per_row * (tree.num_nodes - len(requests))
            cu, tokens, parents = tree.cu_list(), tree.tokens.tolist(), tree.parents.tolist()
            results = []
            for b, request in enumerate(requests):
                own, own_parents = tokens[cu[b] : cu[b + 1]], parents[cu[b] : cu[b + 1]]
                accepted = [0]
                while len(accepted) < len(own) and rng.random() < rates[b]:
                    accepted.append(len(accepted))
                committed = [own[n] for n in accepted[1:]] + [0]
                results.append(RequestResult(request.request_id, own, own_parents, accepted, committed))
            proposer.observe(StepResult(results))


def simulated(probe_every=4, memory=None):
    now = [0.0]
    chooser = BudgetChooser(CostModel([1, 8, 64], [1.0, 1.0, 1.0]))  # a start-up curve that knows nothing
    proposer = AdaptiveProposer(SimulatedChain(), chooser, probe_every=probe_every, clock=lambda: now[0],
                                memory=memory)  # fmt: skip
    return proposer, now


def ask(request_id):
    return ProposalRequest(request_id, [7], 1, SamplingParams(), 10**6)


def test_the_budget_follows_acceptance_and_cost_that_change_mid_run():
    """Four phases on one request. The best chain (8 deep at most: the statistics' depth) for
    each: (1) 200 steps of acceptance 0.9, a drafted row 0.05 of a step: 8 nodes; (2) 200 of
    acceptance 0.4: 2-3 nodes (tokens per step 1.42 at 2, 1.41 at 3, 1.38 at 4); (3) 200 where
    a row costs 3 steps: none; (4) 400 as (1) again. The budget must reach each within a bounded
    number of steps: the acceptance change within 30 (a request's own evidence fades by 0.9 a
    tree), the dear rows within 10 (the measured steps), and the return of cheap rows with a
    first tree within 170 steps (a probe that cost 3 steps more than a plain step waits
    3 / 0.02 = 150 steps for the next: probing costs at most 2 %) and the best size within 300
    (the steps one size up that keep the cost curve measured grow it)."""
    proposer, now = simulated()
    simulate(
        proposer,
        [ask(0)],
        [(200, [0.9], 0.05), (200, [0.4], 0.05), (200, [0.9], 3.0), (400, [0.9], 0.05)],
        now,
    )
    chosen = proposer.chosen
    assert statistics.median(chosen[100:200]) >= 8
    later = sorted(chosen[230:400])  # a step one size up comes every 8 tree steps
    assert later[int(0.85 * len(later))] <= 5 and 2 <= statistics.median(later) <= 4
    assert sum(n > 0 for n in chosen[410:600]) <= 12  # probes only
    assert any(chosen[600:770])
    assert statistics.median(chosen[900:1000]) >= 8


def test_when_every_tree_loses_the_budget_converges_to_plain_decoding():
    """Nothing is ever accepted (or every drafted row costs half a step while 0.9 are accepted
    at a row cost of 3): after the first steps only cheap probes draft, and the whole run keeps
    at least 98 % of plain decoding's rate (one token a step, one second a step)."""
    for rate, per_row in ((0.0, 0.5), (0.9, 3.0)):
        proposer, now = simulated(probe_every=8)
        simulate(proposer, [ask(0)], [(10, [rate], per_row)], now)  # the flat start-up curve's first trees
        start = now[0]
        simulate(proposer, [ask(0)], [(990, [rate], per_row)], now, seed=1)
        assert 990 / (now[0] - start) >= 0.98
        assert sum(n > 0 for n in proposer.chosen[100:]) <= 20
        assert max(proposer.chosen[100:]) <= proposer.probe_nodes  # a probe is shallow


def test_at_batch_two_only_the_request_whose_trees_win_drafts():
    """Request 0's drafts are accepted at 0.9, request 1's never, and a drafted row costs 0.1 of
    a step: request 0 drafts a tree nearly every step, request 1 nothing but a retry now and
    then (its evidence fades while it does not draft, so a request whose text changes is seen)."""
    proposer, now = simulated()
    trees_of = {0: 0, 1: 0}
    original = proposer.proposer.propose

    def counting(requests):
        for r in requests:
            trees_of[r.request_id] += 1
        return original(requests)

    proposer.proposer.propose = counting
    simulate(proposer, [ask(0), ask(1)], [(300, [0.9, 0.0], 0.1)], now)
    assert trees_of[0] >= 250 and 1 <= trees_of[1] <= 30
    assert proposer.scale(0) > 0.9 and proposer.scale(1) < 0.8  # (its evidence fades between retries)
    assert statistics.median(proposer.chosen[50:]) >= 4
    proposer.release(1)
    assert proposer.scale(1) == 1.0  # forgotten with the request


def test_what_the_budget_learnt_outlives_the_request():
    """A second proposer given the first one's memory (the next prompt of a benchmark, the next
    generate call) starts where the first stopped: the same statistics, step rates, drafting
    times and probe schedule, and it drafts no tree while the first had learnt trees lose."""
    proposer, now = simulated(probe_every=8)
    simulate(proposer, [ask(0)], [(300, [0.0], 0.5)], now)
    memory = proposer.memory
    assert memory.observed == 300 and memory.throughput.trees_lose() and memory.wait > 8
    due = memory.wait - memory.idle - 1  # the step of the next probe on the schedule carried over
    second, now2 = simulated(probe_every=8, memory=memory)
    now2[0] = now[0]
    simulate(second, [ask(0)], [(due + 1, [0.0], 0.5)], now2)
    assert second.chosen[:due] == [0] * due and 0 < second.chosen[due] <= second.probe_nodes
    assert second.stats is proposer.stats and memory.observed == 300 + due + 1
    with pytest.raises(ValueError, match="fade"):
        BudgetMemory(fade=0.0)
    with pytest.raises(ValueError, match="probe_nodes"):
        AdaptiveProposer(SimulatedChain(), BudgetChooser(CostModel([1, 8], [1.0, 1.0])), probe_nodes=0)


def test_statistics_fade_so_a_new_kind_of_prompt_is_learnt():
    stats = AcceptanceStats(max_depth=2, max_rank=2, prior_weight=0.0)
    tokens, parents = [9, 1], [-1, 0]
    for _ in range(100):
        stats.update(tokens, parents, [0, 1])  # always accepted
    for _ in range(100):
        stats.fade(0.95)
        stats.update(tokens, parents, [0])  # never any more
    assert stats.rates()[0][0] < 0.05  # 100 acceptances faded to 0.6 against 20 recent trials


def test_allocate_drafts_for_the_requests_whose_trees_win_at_the_batch_marginal_cost():
    chooser = BudgetChooser(CostModel([1, 2, 4, 8, 64], [1.0, 1.0, 1.2, 2.0, 16.0]))
    good = chooser.expected_by_depth([[0.9], [0.9], [0.9]], 6)
    bad = chooser.expected_by_depth([[0.05], [0.05], [0.05]], 6)
    k, nodes, depth, rate = chooser.allocate([good, bad])
    assert k == 1 and nodes >= 1 and rate > 2 / chooser.forward_cost(2)
    assert chooser.allocate([bad, bad])[0] == 0  # neither pays: no tree
    # the probe: the best tree of at least one node for the one candidate, in a batch of two
    assert chooser.allocate([bad], cap=2, min_nodes=1, batch_size=2)[:2] == (1, 1)


def test_a_subset_of_the_batch_drafts_and_the_output_stays_exact():
    """Requests left out of the trees decode their root alone beside the others' trees: greedy
    output equals HF's for EAGLE (which catches the left-out requests up at their next tree)."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], [3, 4, 3, 4, 3]]
    model, want = oracle_table(prompts, 12)("llama")

    class Alternating(BudgetChooser):  # the first request drafts on even steps, the others on odd
        step = 0

        def allocate(self, tables, *, cap=None, min_nodes=0, batch_size=None):
            self.step += 1
            return (1 if self.step % 2 else len(tables) - 1), 4, 3, 1.0

    eagle = EagleProposer(random_head(model), model, top_k=3, depth=4, total_tokens=12)
    ticks = iter(range(10**6))
    proposer = AdaptiveProposer(eagle, Alternating(CostModel([1, 8], [1.0, 1.0])),
                                clock=lambda: float(next(ticks)))  # fmt: skip
    out = treespec.generate(model, prompts, max_new_tokens=12, proposer=proposer)
    assert out.sequences == want
    assert (
        0 < min(proposer.drafters)
        and max(proposer.drafters) < len(prompts)
        or len(set(proposer.drafters)) > 1
    )


def test_a_fixed_budget_names_nodes_and_an_optional_depth():
    from treespec.budget import fixed_budget

    assert fixed_budget("adaptive") is None and fixed_budget("fixed") is None
    assert (
        fixed_budget("8") == (8, None) and fixed_budget("8:3") == (8, 3) and fixed_budget("31:6") == (31, 6)
    )
    for bad in ("0", "32", "8:0", "8:9", "eight", "8:3:1", ""):
        with pytest.raises(ValueError, match="N:D"):
            fixed_budget(bad)
