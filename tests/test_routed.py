"""RoutedProposer: each request drafted by the member it names, several members in one engine."""

from __future__ import annotations

import pytest
import torch
from conftest import build
from test_eagle import random_head
from test_engine import Recorder

from treespec import Engine, generate
from treespec.proposers import EagleProposer, NgramProposer, RoutedProposer
from treespec.sampling import SamplingParams
from treespec.target import Target

PROMPTS = [list(range(5, 12)) * 2, [20, 21, 22, 20, 21, 22, 20], list(range(30, 45)), [7, 8, 7, 8, 7, 8]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_request_drafts_with_its_member_and_keeps_its_output(temperature):
    """Four requests, two routed to an EAGLE head, one to n-gram lookup, one left to the default
    (n-gram): each member hears only of its own requests (prefill, trees, commits, release), both
    draft, and every output is the one the request gets alone with its member (greedy), or with
    the same seed (sampled)."""
    model = build("llama")
    params = [SamplingParams(temperature=temperature, seed=10 + i) for i in range(len(PROMPTS))]

    def eagle():
        return EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=5, max_batch_size=4)

    members = {"ngram": Recorder(NgramProposer(max_depth=3)), "eagle": Recorder(eagle())}
    router = RoutedProposer(members, default="ngram")
    engine = Engine(Target(model), max_batch_size=4, proposer=router, prefill_chunk_size=4)
    routes = ["eagle", "ngram", "eagle", None]
    ids = []
    for prompt, sampling, route in zip(PROMPTS, params, routes, strict=True):
        ids.append(engine.add_request(prompt, max_new_tokens=12, sampling=sampling, eos_token_id=[]))
        router.route(ids[-1], route)
    assert [router.member_of(i) for i in ids] == ["eagle", "ngram", "eagle", "ngram"]
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.pop(i).output for i in ids]
    mine = {"eagle": {ids[0], ids[2]}, "ngram": {ids[1], ids[3]}}
    for name, member in members.items():
        assert member.proposed == member.observed == member.released == mine[name], name
    assert members["eagle"].prefilled == mine["eagle"] and not members["ngram"].prefilled
    if temperature == 0:  # drafts were accepted (a random model's samples rarely follow them)
        assert sum(n for i in ids for n in engine.stats.accepted_lengths[i]) > sum(
            len(engine.stats.accepted_lengths[i]) for i in ids
        )
    for b, route in enumerate(routes):
        alone = eagle() if route == "eagle" else NgramProposer(max_depth=3)
        want = generate(model, [PROMPTS[b]], max_new_tokens=12, proposer=alone, sampling=params[b],
                        eos_token_id=[]).sequences[0]  # fmt: skip
        assert outputs[b] == want, (b, route)
    assert router._route == {}  # every finished request left the router


def test_a_router_refuses_what_it_cannot_serve():
    model = build("llama")
    ngram = NgramProposer(max_depth=3)
    with pytest.raises(ValueError, match="non-empty dict of members"):
        RoutedProposer({}, default="ngram")
    with pytest.raises(TypeError, match="members must map names"):
        RoutedProposer({"ngram": object()}, default="ngram")
    with pytest.raises(ValueError, match=r"the default member must be one of \['ngram'\], got 'eagle'"):
        RoutedProposer({"ngram": ngram}, default="eagle")
    router = RoutedProposer({"ngram": ngram}, default="ngram")
    with pytest.raises(ValueError, match=r"proposer must be one of \['ngram'\], got 'medusa'"):
        router.route(0, "medusa")
    eagle3 = EagleProposer(
        random_head(model, eagle3=True, draft_vocab=32), model, top_k=2, depth=2, total_tokens=3
    )
    eagle1 = EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=3)
    with pytest.raises(ValueError, match="different target features"):
        RoutedProposer({"a": eagle1, "b": eagle3}, default="a")


def test_a_router_declares_what_its_members_need():
    model = build("llama")
    eagle = EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=9, max_batch_size=3)
    router = RoutedProposer(
        {"ngram": NgramProposer(max_depth=3, max_nodes=4), "eagle": eagle}, default="ngram"
    )
    caps = router.capabilities
    assert caps.needs_hidden and caps.has_budget and caps.max_batch_size == 3
    assert caps.max_tree_nodes == max(10, NgramProposer(max_depth=3, max_nodes=4).max_tree_nodes)
    router.set_budget(4, 2)
    assert (eagle.total_tokens, eagle.depth) == (4, 2)
    assert torch.is_tensor(eagle.cache.keys)
