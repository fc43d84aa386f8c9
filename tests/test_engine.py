"""The engine's side of the proposer protocol: one step result per step, capacity, checks."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import build, hf_greedy
from test_eagle import random_head
from test_heads import random_heads

import treespec
from treespec import Engine, SamplingParams, Target
from treespec.proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    MedusaProposer,
    NgramProposer,
    Proposer,
)
from treespec.proposers.base import RequestResult, WrappingProposer
from treespec.tree import TokenTree


class Checker(WrappingProposer):
    """Wraps a proposer and checks every step result against the trees it proposed."""

    def __init__(self, inner: Proposer):
        super().__init__(inner)
        self.trees: dict[int, tuple[list[int], list[int]]] = {}
        self.results = []

    def propose(self, requests):
        tree = self.proposer.propose(requests)
        cu = tree.cu_nodes.tolist()
        for b, r in enumerate(requests):
            self.trees[r.request_id] = (
                tree.tokens[cu[b] : cu[b + 1]].tolist(),
                tree.parents[cu[b] : cu[b + 1]].tolist(),
            )
        return tree

    def observe(self, result):
        for r in result.requests:
            proposed = self.trees.pop(r.request_id, None)
            if proposed is not None:  # a decoding step: the tree as proposed
                assert (list(r.tree_tokens), list(r.tree_parents)) == proposed
            else:  # the first token: the prompt's last token as a root-alone tree
                assert r.tree_parents == (-1,) and r.accepted == (0,)
            assert r.accepted[0] == 0
            for parent, child in itertools.pairwise(r.accepted):  # a root-to-node path
                assert r.tree_parents[child] == parent
            # committed = the accepted drafted tokens then the bonus, cut at EOS / max_new_tokens
            drafted = [r.tree_tokens[n] for n in r.accepted[1:]]
            assert list(r.committed[: len(drafted)]) == drafted[: len(r.committed)]
            assert r.hidden is None or r.hidden.shape[0] == len(r.committed)
            self.results.append(r)
        self.proposer.observe(result)


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [20, 21, 22], [9, 9, 9, 9, 9, 9]]


def test_step_results_carry_the_tree_the_accepted_nodes_and_the_tokens():
    model = build("llama")
    want = [hf_greedy(model, p, 12) for p in PROMPTS]
    for inner in (NgramProposer(max_depth=4), DraftModelProposer(model, dynamic=(2, 3, 5)),
                  EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=5)):  # fmt: skip
        checker = Checker(inner)
        out = treespec.generate(model, PROMPTS, max_new_tokens=12, proposer=checker)
        assert out.sequences == want
        assert not checker.trees  # every proposed tree was observed
        if isinstance(inner, DraftModelProposer):  # the target as its own draft: paths are accepted
            assert any(len(r.accepted) > 2 for r in checker.results)


def test_request_result_counts_the_kept_drafted_tokens():
    tree = dict(tree_tokens=[9, 1, 2, 3], tree_parents=[-1, 0, 1, 1])  # 9 -> 1 -> {2, 3}
    whole = RequestResult(0, **tree, accepted=[0, 1, 2], committed=[1, 2, 5])
    cut = RequestResult(0, **tree, accepted=[0, 1, 2], committed=[1])  # an EOS at the first drafted token
    first = RequestResult(0, [9], [-1], [0], [4])  # the token after prefill: a root alone
    assert (whole.num_accepted, cut.num_accepted, first.num_accepted) == (2, 1, 0)
    assert (
        not whole.rejected_at_last()
        and RequestResult(0, **tree, accepted=[0, 1], committed=[1, 7]).rejected_at_last()
    )
    assert not first.rejected_at_last()


def _one_thousand_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 128, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 6, (1000,), generator=generator)
    ]


@pytest.fixture(scope="module")
def plain_thousand():
    """A model, 1,000 prompts and their plain (no proposer) continuations, computed once."""
    model = build("llama")
    prompts = _one_thousand_prompts()
    return model, prompts, treespec.generate(model, prompts, max_new_tokens=3).sequences


@pytest.mark.parametrize("kind", ["draft", "eagle", "medusa", "ngram", "hybrid"])
def test_a_thousand_prompts_complete_with_any_proposer(kind, plain_thousand):
    """generate() with 1,000 prompts: the engine admits no more requests than the proposer holds
    (8, the draft model's and EAGLE's default capacity, used to overflow), the queue drains and
    every output equals plain decoding's."""
    model, prompts, plain = plain_thousand
    proposer = {
        "draft": lambda: DraftModelProposer(build("llama", seed=3)),
        "eagle": lambda: EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=3),
        "medusa": lambda: MedusaProposer(random_heads(model), model),
        "ngram": lambda: NgramProposer(max_depth=2),
        "hybrid": lambda: HybridProposer(
            EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=3),
            NgramProposer(max_depth=2),
        ),
    }[kind]()
    out = treespec.generate(model, prompts, max_new_tokens=3, proposer=proposer)
    assert len(out.sequences) == 1000 and out.sequences == plain


def test_the_engine_runs_no_more_requests_than_the_proposer_holds():
    model = build("llama")
    engine = Engine(
        Target(model), max_batch_size=8, proposer=DraftModelProposer(build("llama", seed=3), max_batch_size=3)
    )
    assert engine.max_running == 3 and engine.cache.num_free == 3
    for p in PROMPTS * 3:
        engine.add_request(p, max_new_tokens=4)
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, len(engine._running))
    assert most == 3
    with pytest.raises(ValueError, match="max_batch_size"):
        treespec.generate(model, PROMPTS, max_new_tokens=2, max_batch_size=0)


class Malformed(Proposer):
    """A tree whose bitmask does not match its parents: only the full (debug) check sees it."""

    max_tree_nodes = 4

    def propose(self, requests):
        tree = TokenTree.from_lists([[r.tokens[-1], 1, 2] for r in requests], [[-1, 0, 0] for _ in requests])
        return TokenTree(
            tree.tokens, tree.parents, tree.depth, tree.cu_nodes, torch.ones_like(tree.tree_mask)
        )


def test_full_validation_runs_only_in_debug_mode():
    model = build("llama")
    target = Target(model)
    with pytest.raises(ValueError, match="malformed tree: tree_mask"):
        engine = Engine(target, proposer=Malformed(), debug=True)
        engine.add_request(PROMPTS[1], max_new_tokens=4)
        while engine.has_unfinished():
            engine.step()
    engine = Engine(target, proposer=Malformed(), debug=False)  # the cheap check passes it
    engine.add_request(PROMPTS[1], max_new_tokens=4)
    while engine.has_unfinished():
        engine.step()


def test_typical_acceptance_is_reachable_from_sampling_params():
    """Lossy and opt-in: with the target as its own draft every drafted token is typical."""
    model = build("llama")
    params = SamplingParams(temperature=1.0, typical_acceptance=(0.09, 0.3))
    engine = Engine(Target(model), proposer=DraftModelProposer(model, dynamic=(1, 3, 3)),
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert (
        engine.picker.mode(params) == "typical"
        and engine.picker.mode(SamplingParams(temperature=1.0)) == "deterministic"
    )
    rid = engine.add_request(PROMPTS[0], max_new_tokens=13, sampling=params)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop(rid).output) == 13
    with pytest.raises(ValueError, match="typical_acceptance"):
        SamplingParams(temperature=1.0, typical_acceptance=(0.0, 0.3))


# --------------------------------------------------------------------------- pinned prefixes


def _drain(engine: Engine, prompts, max_new_tokens=5, sampling=None) -> list[list[int]]:
    ids = [engine.add_request(p, max_new_tokens=max_new_tokens, sampling=sampling) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop(i).output for i in ids]


@pytest.mark.parametrize("chunk", [None, 3])
@pytest.mark.parametrize("proposer", [None, "ngram"])
def test_a_pinned_prefix_changes_no_output(family, chunk, proposer):
    """Prompts equal to the pinned prefix, longer, sharing part of it or none of it: the same
    tokens as without it, and only the shared part (never a prompt's last token) is copied."""
    model = build(family)
    prefix = [5, 9, 2, 7, 7, 1, 3, 8]
    prompts = [prefix, prefix + [4, 6], prefix[:5] + [11, 12], [13, 14, 15], prefix[:1]]

    def run(pin: bool) -> tuple[list[list[int]], Engine]:
        engine = Engine(Target(model), max_batch_size=3, max_len=32, prefill_chunk_size=chunk,
                        proposer=NgramProposer(max_depth=2) if proposer else None)  # fmt: skip
        if pin:
            engine.pin_prefix(prefix)
        return _drain(engine, prompts), engine

    plain, _ = run(False)
    pinned, engine = run(True)
    assert pinned == plain
    assert plain == [hf_greedy(model, p, 5) for p in prompts]
    assert engine.stats.reused_prompt_tokens == 7 + 8 + 5 + 0 + 0
    assert engine.cache.num_free == engine.cache.num_slots  # the pinning slot went back


def test_a_pinned_prefix_keeps_seeded_sampling():
    model = build("llama")
    prefix = [5, 9, 2, 7]
    seeded = SamplingParams(temperature=1.0, seed=4)
    plain = _drain(Engine(Target(model), max_len=32), [prefix + [1], prefix], 6, seeded)
    engine = Engine(Target(model), max_len=32)
    engine.pin_prefix(prefix)
    assert _drain(engine, [prefix + [1], prefix], 6, seeded) == plain


def test_pinning_a_prefix_is_refused_clearly():
    model = build("llama")
    eagle = Engine(
        Target(model), proposer=EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=3)
    )
    with pytest.raises(ValueError, match="reads no target hidden states: EagleProposer"):
        eagle.pin_prefix([1, 2, 3])
    full = Engine(Target(model), max_batch_size=1, max_len=32)
    full.add_request([1, 2], max_new_tokens=3)
    full.step()
    with pytest.raises(ValueError, match="needs a free cache slot"):
        full.pin_prefix([1, 2, 3])
    with pytest.raises(ValueError, match="exceeds the cache length 32"):
        Engine(Target(model), max_len=32).pin_prefix(list(range(40)))
    with pytest.raises(ValueError, match="empty prompt"):
        Engine(Target(model), max_len=32).pin_prefix([])


def test_a_wrapper_declares_what_the_wrapped_proposer_declares_without_copying():
    """Capabilities read through a WrappingProposer (and the adaptive budget) to the wrapped
    proposer: a budget that changes the wrapped one's tree size shows through at once; the
    adaptive budget declares no settable budget of its own and refuses set_budget."""
    from test_eagle import random_head

    from treespec.budget import AdaptiveProposer, BudgetChooser, CostModel
    from treespec.proposers import EagleProposer
    from treespec.proposers.base import CAPABILITIES, Capabilities

    model = build("llama")
    eagle = EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=6, max_batch_size=3)
    checker = Checker(eagle)
    assert checker.capabilities == eagle.capabilities
    caps = eagle.capabilities
    assert (caps.max_tree_nodes, caps.max_batch_size, caps.needs_hidden, caps.has_budget) == (
        7,
        3,
        True,
        True,
    )
    assert set(CAPABILITIES) == {f.name for f in dataclasses.fields(Capabilities)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.max_tree_nodes = 9
    adaptive = AdaptiveProposer(eagle, BudgetChooser(CostModel([1, 8], [1.0, 1.0])))
    assert adaptive.capabilities == dataclasses.replace(eagle.capabilities, has_budget=False)
    eagle.max_tree_nodes = 4  # the wrapped one changes: nothing was copied
    assert checker.max_tree_nodes == adaptive.max_tree_nodes == 4
    with pytest.raises(TypeError, match="no settable budget"):
        adaptive.set_budget(3, 2)
    with pytest.raises(TypeError, match="expected a Proposer"):
        Checker(object())


def test_one_default_context_and_requests_longer_than_a_proposer_holds_are_refused_up_front():
    """The engine and the proposers with caches of their own size by one default
    (treespec.target.cache.default_max_len); a proposer declares what it holds (max_context), read
    through wrappers, and an engine that may need more refuses with both numbers."""
    from test_eagle import random_head

    from treespec.budget import AdaptiveProposer, BudgetChooser, CostModel
    from treespec.presets import DEFAULT_MAX_LEN
    from treespec.proposers import DraftModelProposer, EagleProposer, HybridProposer
    from treespec.target import Target
    from treespec.target.cache import default_max_len

    model = build("llama")
    context = model.config.max_position_embeddings
    assert default_max_len(None) == DEFAULT_MAX_LEN and default_max_len(100) == min(100, DEFAULT_MAX_LEN)
    eagle = EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=4)
    draft = DraftModelProposer(model, max_len=64)
    assert eagle.max_context == default_max_len(context) and draft.max_context == 64
    assert Engine(Target(model)).max_len == default_max_len(context)
    hybrid = HybridProposer(AdaptiveProposer(eagle, BudgetChooser(CostModel([1, 8], [1.0, 1.0]))), draft)
    assert hybrid.max_context == 64
    with pytest.raises(ValueError, match="need 65 context tokens, but DraftModelProposer holds 64"):
        Engine(Target(model), max_len=65, proposer=draft)
    Engine(Target(model), max_len=64, proposer=draft)
    with pytest.raises(ValueError, match="build the proposer .* with max_len=80"):
        treespec.generate(model, [[5] * 70], max_new_tokens=10, proposer=hybrid)
    assert treespec.generate(model, [[5, 6, 7]], max_new_tokens=4, proposer=draft).sequences


class Recorder(WrappingProposer):
    """Wraps a proposer and records, per call, every request id it is asked about, fed, or told
    to forget (``seen``: all of them)."""

    def __init__(self, inner: Proposer):
        super().__init__(inner)
        self.proposed: set[int] = set()
        self.observed: set[int] = set()
        self.prefilled: set[int] = set()
        self.released: set[int] = set()

    @property
    def seen(self) -> set[int]:
        return self.proposed | self.observed | self.prefilled | self.released

    def propose(self, requests):
        self.proposed |= {r.request_id for r in requests}
        return self.proposer.propose(requests)

    def observe(self, result):
        self.observed |= {r.request_id for r in result.requests}
        self.proposer.observe(result)

    def observe_prefill(self, request_id, tokens, hidden):
        self.prefilled.add(request_id)
        self.proposer.observe_prefill(request_id, tokens, hidden)

    def release(self, request_id):
        self.released.add(request_id)
        self.proposer.release(request_id)


@pytest.mark.parametrize("kind", ["eagle", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_requests_that_do_not_speculate_run_beside_those_that_do(kind, temperature):
    """speculate=False: the proposer never hears of the request and its trees are its root alone.
    Greedy, every output is the one it gets with the proposer; sampled (seeded), a request that
    does not speculate draws what it draws when no request speculates, whatever speculates
    around it."""
    model = build("llama")
    prompts = [list(range(5, 12)) * 2, [20, 21, 22, 20, 21, 22, 20], list(range(30, 45)), [7, 8, 7, 8, 7, 8]]
    params = [SamplingParams(temperature=temperature, seed=10 + i) for i in range(len(prompts))]

    def inner():
        if kind == "eagle":
            return EagleProposer(
                random_head(model), model, top_k=2, depth=3, total_tokens=5, max_batch_size=4
            )
        return NgramProposer(max_depth=3)

    def run(speculate: list[bool]):
        proposer = Recorder(inner())
        engine = Engine(Target(model), max_batch_size=4, proposer=proposer, prefill_chunk_size=4)
        ids = [engine.add_request(p, max_new_tokens=12, sampling=s, speculate=flag)
               for p, s, flag in zip(prompts, params, speculate, strict=True)]  # fmt: skip
        while engine.has_unfinished():
            engine.step()
        return [engine.pop(i).output for i in ids], proposer.seen, ids, engine.stats

    everyone, _, _, _ = run([True] * 4)
    mixed, seen, ids, stats = run([False, True, False, True])
    none, nobody, _, _ = run([False] * 4)
    assert seen == {ids[1], ids[3]} and not nobody
    assert set(stats.accepted_lengths) == set(ids)
    for i in (0, 2):  # one token a step
        assert set(stats.accepted_lengths[ids[i]]) == {1}
    assert [mixed[0], mixed[2]] == [none[0], none[2]]
    if temperature == 0.0:
        assert mixed == everyone == none
    with pytest.raises(TypeError, match="speculate must be a bool"):
        Engine(Target(model)).add_request([1, 2], max_new_tokens=2, speculate="no")


def test_an_aborted_request_frees_its_slot_and_the_proposers_state_at_once():
    """abort() between steps: a running request's cache slot is free before the next step and the
    proposer is told to forget it; a waiting one never starts; the others' outputs are unchanged."""
    model = build("llama")
    prompts = [list(range(5, 12)), [20, 21, 22], list(range(30, 45))]
    plain = [hf_greedy(model, p, 10) for p in prompts]
    proposer = Recorder(
        EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=3, max_batch_size=2)
    )
    released = []
    original = proposer.proposer.release
    proposer.proposer.release = lambda rid: (released.append(rid), original(rid))[1]
    engine = Engine(Target(model), max_batch_size=2, proposer=proposer)
    ids = [engine.add_request(p, max_new_tokens=10, eos_token_id=[]) for p in prompts]
    engine.step()
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    free = engine.cache.num_free
    engine.abort(ids[0])
    assert engine.cache.num_free == free + 1 and released == [ids[0]]
    assert engine.num_running == 1
    engine.abort(ids[0])  # already ended: nothing more
    while engine.has_unfinished():
        engine.step()
    aborted = engine.pop(ids[0])
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output) < 10
    assert [engine.pop(i).output for i in ids[1:]] == plain[1:]
    waiting = Engine(Target(model), max_batch_size=1)
    first, second = (waiting.add_request(p, max_new_tokens=3) for p in prompts[:2])
    waiting.abort(second)
    while waiting.has_unfinished():
        waiting.step()
    assert waiting.pop(second).output == [] and waiting.pop(first).finish_reason in ("eos", "length")
    with pytest.raises(ValueError, match="no request 99"):
        waiting.abort(99)


@pytest.mark.parametrize("kind", ["none", "eagle"])
def test_a_prefill_budget_bounds_each_steps_prompt_tokens_and_keeps_the_output(kind):
    """max_prefill_tokens: no step runs more prompt tokens than the budget across requests (each
    chunk still at most prefill_chunk_size), prompts are taken in admission order, a request left
    out of a step waits, and every output is the one the engine gives without a budget."""
    model = build("llama")
    prompts = [list(range(5, 40)), [20, 21, 22, 20, 21, 22, 20], list(range(30, 75)), [7, 8, 7, 8, 7, 8]]

    def run(budget):
        proposer = None
        if kind == "eagle":
            proposer = EagleProposer(
                random_head(model), model, top_k=2, depth=3, total_tokens=5, max_batch_size=4
            )
        engine = Engine(Target(model), max_batch_size=4, proposer=proposer, prefill_chunk_size=8,
                        max_prefill_tokens=budget)  # fmt: skip
        ids = [engine.add_request(p, max_new_tokens=10, eos_token_id=[]) for p in prompts]
        prefilled, prompt_tokens = dict.fromkeys(ids, 0), []
        while engine.has_unfinished():
            pending = [i for i, p in zip(ids, prompts, strict=True) if prefilled[i] < len(p)]
            engine.step()
            chunks = engine.last_step.plan.batch.chunk_len
            assert list(chunks) == pending[: len(chunks)]  # the oldest prompts first, none skipped
            prompt_tokens.append(sum(chunks.values()))
            for i, n in chunks.items():
                prefilled[i] += n
        return [engine.pop(i).output for i in ids], prompt_tokens

    free, free_tokens = run(None)
    bounded, tokens = run(12)
    assert bounded == free
    assert max(free_tokens) == 8 + 7 + 8 + 6 and max(tokens) == 12  # every first chunk at once, or 12
    assert sum(tokens) == sum(map(len, prompts))
    with pytest.raises(ValueError, match="max_prefill_tokens must be an int >= 1 or None, got 0"):
        Engine(Target(model), max_prefill_tokens=0)


class FailsOn(WrappingProposer):
    """Raises whenever it is asked for a tree for request ``bad`` (alone or in a batch)."""

    def __init__(self, inner, bad):
        super().__init__(inner)
        self.bad = bad

    def propose(self, requests):
        if any(r.request_id == self.bad for r in requests):
            raise IndexError(f"no draft for request {self.bad}")
        return self.proposer.propose(requests)


def test_a_proposer_that_raises_fails_only_its_request_and_names_the_error():
    """The proposer raises on request 1's context: request 1 ends with finish reason "error" and
    the exception named; requests 0 and 2 go on in the same steps with their exact output;
    ``generate`` refuses to return a cut output."""
    model = build("llama")
    engine = Engine(Target(model), proposer=FailsOn(NgramProposer(), bad=1), max_batch_size=3)
    ids = [engine.add_request(p, max_new_tokens=10) for p in PROMPTS]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].finish_reason == "error"
    assert "FailsOn.propose raised IndexError: no draft for request 1" in finished[ids[1]].error
    for n in (0, 2):
        assert finished[ids[n]].finish_reason == "length"
        assert engine.output(ids[n]) == hf_greedy(model, PROMPTS[n], 10)
    # a step in which every request fails in drafting runs nothing, and is still the last step
    alone = Engine(Target(model), proposer=FailsOn(NgramProposer(), bad=0))
    rid = alone.add_request(PROMPTS[0], max_new_tokens=10)
    while alone.has_unfinished():
        outputs = alone.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(rid, "error")]
    assert alone.last_step.plan.failed[0].request_id == rid and alone.last_step.results == ()
    assert alone.cache.num_free == alone.max_running
    with pytest.raises(RuntimeError, match="prompt 1 failed .*IndexError"):
        treespec.generate(model, PROMPTS, max_new_tokens=10, proposer=FailsOn(NgramProposer(), bad=1))
