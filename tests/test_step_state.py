"""The step's own modules: its rows (step_batch), its token choices (picking), the features it
hands over (handover), its state and timers (step_state)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from treespec import Engine, SamplingParams, Target
from treespec.engine.handover import HiddenHandover, committed_features
from treespec.engine.picking import TokenPicker
from treespec.engine.requests import Request
from treespec.engine.step_batch import StepBatch, TreeOutcome, read_back
from treespec.engine.step_state import STAGES, StepTimer
from treespec.proposers import NgramProposer, Proposer
from treespec.tree import TokenTree, chain_mask

GREEDY = SamplingParams()


def request(rid: int, prompt: list[int], prefilled: int = 0, output: tuple[int, ...] = ()) -> Request:
    r = Request(rid, prompt, 16, frozenset(), GREEDY, slot=rid, num_prefilled=prefilled)
    r.output.extend(output)
    return r


def one_hot_logits(argmaxes: list[int], vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


TREE = ([10, 11, 12], [-1, 0, 0])


def test_rows_are_laid_out_in_running_order_logit_rows_prefill_first():
    chunked = request(0, [1, 2, 3, 4, 5])  # its first chunk of 3: not its last
    decoding = request(1, [6, 7], prefilled=2, output=(10,))
    finishing = request(2, [8, 9, 20, 21], prefilled=2)  # its last chunk: [20, 21]
    trees = TokenTree.from_lists([TREE[0]], [TREE[1]])
    batch = StepBatch.build(
        [chunked, decoding, finishing], {0: [1, 2, 3], 2: [20, 21]}, trees, torch.device("cpu")
    )
    assert batch.cu == [0, 3, 6, 8]
    assert batch.tokens.tolist() == [1, 2, 3, 10, 11, 12, 20, 21]
    assert batch.depth.tolist() == [0, 1, 2, 0, 1, 1, 0, 1]
    assert batch.logit_rows.tolist() == [7, 3, 4, 5] and batch.num_prefill_logits == 1
    assert (
        batch.final_chunk == {2} and batch.finishes_prefill(finishing) and not batch.finishes_prefill(chunked)
    )
    assert batch.chunk_len == {0: 3, 2: 2}
    assert batch.prefill_accepted == {0: range(3), 2: range(2)}
    width = batch.tree_mask.shape[1]
    pad = torch.nn.functional.pad
    assert torch.equal(batch.tree_mask[0:3], pad(chain_mask(3), (0, width - chain_mask(3).shape[1])))
    assert torch.equal(batch.tree_mask[3:6], pad(trees.tree_mask, (0, width - trees.tree_mask.shape[1])))


def test_a_step_of_roots_alone_is_causal_without_a_mask():
    trees = TokenTree.roots([4, 5])
    batch = StepBatch.build(
        [request(0, [1], 1, (4,)), request(1, [2], 1, (5,))], {}, trees, torch.device("cpu")
    )
    assert batch.tree_mask is None and batch.tokens.tolist() == [4, 5] and batch.logit_rows.tolist() == [0, 1]


@pytest.mark.parametrize("on_device", [False, True], ids=["host-tree", "device-tree"])
def test_one_read_brings_back_first_tokens_kept_nodes_and_the_trees(on_device):
    if on_device:  # drafted on the device: the host knows the shape, not the tokens
        trees = TokenTree.from_parents(torch.tensor(TREE[0]), [TREE[1]])
    else:
        trees = TokenTree.from_lists([TREE[0]], [TREE[1]])
    decoding = [request(1, [6, 7], 2, (10,))]
    picker = TokenPicker(NgramProposer(), None, "hf", debug=True)
    # the root predicts 11 (node 1 kept), node 1 predicts 5: the bonus
    table = picker.verify_table(decoding, trees, one_hot_logits([11, 5, 3]))
    first = picker.first_tokens([request(2, [1], 1)], one_hot_logits([9]))
    back = read_back(first, table, trees, None)
    assert back.first_tokens == (9,)
    assert back.trees == (TreeOutcome(tuple(TREE[0]), tuple(TREE[1]), (0, 1), (11, 5)),)
    assert back.suspect is False
    assert read_back(first, table, trees, torch.tensor(True)).suspect is True


def test_plain_decoding_picks_each_next_token_as_hf_does():
    picker = TokenPicker(None, None, "hf", debug=True)
    decoding = [request(0, [1], 1, (4,)), request(1, [2], 1, (5,))]
    table = picker.verify_table(decoding, TokenTree.roots([4, 5]), one_hot_logits([7, 8]))
    back = read_back(torch.empty(0, dtype=torch.long), table, TokenTree.roots([4, 5]), None)
    assert [(o.accepted, o.committed) for o in back.trees] == [((0,), (7,)), ((0,), (8,))]


@pytest.mark.parametrize("sampler", ["hf", "inverse-cdf"])
def test_a_seeded_request_draws_the_same_token_whatever_its_batch(sampler):
    picker = TokenPicker(None, torch.Generator().manual_seed(0), sampler, debug=True)
    logits = torch.randn(3, 32)

    def seeded(rid: int) -> Request:
        r = Request(rid, [1], 4, frozenset(), SamplingParams(temperature=1.0, seed=7), slot=rid)
        r.generator = torch.Generator().manual_seed(7)
        return r

    other = Request(9, [1], 4, frozenset(), SamplingParams(temperature=1.0), slot=9)
    alone = picker.first_tokens([seeded(0)], logits[1:2])
    batched = picker.first_tokens([other, seeded(0), request(3, [1])], logits)
    assert batched[1] == alone[0]
    assert batched[2] == logits[2].argmax()  # greedy rows stay greedy in a mixed batch


class Pairs(Proposer):
    needs_hidden = True

    def __init__(self):
        self.pairs: dict[int, list[tuple[int, float]]] = {}

    def propose(self, requests):
        raise AssertionError("not called")

    def observe_prefill(self, request_id, tokens, hidden):
        self.pairs.setdefault(request_id, []).extend(zip(tokens, hidden[:, 0].tolist(), strict=True))


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_prefill_pairs_each_hidden_state_with_the_next_token_whatever_the_chunking(chunk):
    prompt = [1, 2, 3, 4, 5, 6, 7]
    proposer, r = Pairs(), request(0, prompt)
    handover = HiddenHandover(proposer)
    while r.prefilling:
        piece = prompt[r.num_prefilled : r.num_prefilled + chunk]
        batch = StepBatch.build([r], {0: piece}, None, torch.device("cpu"))
        hidden = torch.arange(r.num_prefilled, r.num_prefilled + len(piece), dtype=torch.float)[:, None]
        handover.prefill(hidden, batch, [r])
        r.num_prefilled += len(piece)
    # h_t pairs with x_{t+1}; the prompt's last state waits for the first generated token
    assert proposer.pairs[0] == [(prompt[t + 1], float(t)) for t in range(len(prompt) - 1)]
    assert handover.carry == {}


def test_committed_features_are_the_rows_that_produced_the_kept_tokens():
    decoding, finishing = request(0, [6], 1, (10,)), request(1, [8, 9], 0)
    trees = TokenTree.from_lists([TREE[0]], [TREE[1]])
    batch = StepBatch.build([decoding, finishing], {1: [8, 9]}, trees, torch.device("cpu"))
    hidden = torch.arange(5, dtype=torch.float)[:, None]  # rows: tree 0-2, prompt 3-4
    prefill, decode = committed_features(
        hidden, batch, [decoding, finishing], [finishing], [decoding], [[0, 2]]
    )
    assert prefill[0].flatten().tolist() == [4.0]  # the prompt's last row
    assert decode[0].flatten().tolist() == [0.0, 2.0]  # the root, then the kept node


def test_the_timer_waits_for_an_asynchronous_device_at_every_mark(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    timer = StepTimer(torch.device("cuda"))
    for _ in STAGES:
        timer.mark()
    times = timer.times()
    assert waited == [torch.device("cuda")] * (len(STAGES) + 1)
    parts = times.propose_s + times.forward_s + times.verify_s + times.commit_s + times.advance_s
    assert times.step_s == pytest.approx(parts) and min(parts, times.step_s) >= 0
    with pytest.raises(RuntimeError, match="all were marked"):
        timer.mark()
    cpu = StepTimer(torch.device("cpu"))
    assert cpu.synchronize is None
    with pytest.raises(RuntimeError, match="0 of the step's 5 stages"):
        cpu.times()


def test_the_engine_keeps_its_last_step_as_one_frozen_value():
    model = tiny_llama().eval()
    engine = Engine(Target(model), proposer=NgramProposer(), prefill_chunk_size=4)
    rid = engine.add_request([3, 4, 5, 3, 4, 5, 3, 4], max_new_tokens=6)
    engine.step()  # the first chunk: nothing finishes
    first = engine.last_step
    assert first.plan.finishing == () and first.plan.decoding == () and first.committed == {}
    engine.step()  # the last chunk: the first token
    assert [r.request_id for r in engine.last_step.plan.finishing] == [rid]
    assert engine.last_step.committed == {rid: engine.output(rid)}
    before = engine.output(rid)
    engine.step()  # a tree
    step = engine.last_step
    assert [r.request_id for r in step.plan.decoding] == [rid] and step.plan.trees is not None
    assert before + step.committed[rid][: 6 - len(before)] == engine.output(rid)
    (result,) = step.results  # one record per request
    assert (
        result.request_id == rid and result.accepted[0] == 0 and len(result.accepted) == len(result.committed)
    )
    with pytest.raises(AttributeError):
        step.results = ()  # frozen
    assert engine.stats.steps == 3 and engine.stats.advance_s > 0
    assert engine.stats.step_s >= engine.stats.propose_s + engine.stats.forward_s + engine.stats.verify_s
