"""Medusa heads: folder I/O, exact speculative output with random heads, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build, oracle_table, record_drafted

import treespec
from treespec import heads as heads_module
from treespec.heads import MedusaConfig, MedusaHeads
from treespec.proposers import MedusaProposer, ProposalRequest, Proposer
from treespec.proposers.base import RequestResult, StepResult
from treespec.sampling import SamplingParams
from treespec.tree import TokenTree, full_tree

PROMPTS = [list(range(5, 12)), [20, 21, 22], list(range(30, 60)), [7]]
NEW = 17


def random_heads(model, *, num_heads=3, own_lm_head=True, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    config = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads,
                          num_layers=2, own_lm_head=own_lm_head)  # fmt: skip
    heads = MedusaHeads(config)
    for p in heads.parameters():  # random, not Medusa's identity init: acceptance is poor
        torch.nn.init.normal_(p, std=0.2)
    return heads.eval()


def test_folder_round_trip(tmp_path):
    model = build("llama")
    heads = random_heads(model)
    heads.save(tmp_path / "medusa")
    assert json.loads((tmp_path / "medusa" / "config.json").read_text())["num_heads"] == 3
    loaded = heads_module.load(tmp_path / "medusa")
    hidden = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(loaded(hidden), heads(hidden), atol=0, rtol=0)
    assert loaded(hidden).shape == (5, 3, model.config.vocab_size)


def test_blocks_do_not_share_weights():
    heads = MedusaHeads(MedusaConfig(16, 32, num_heads=2, num_layers=2))
    pointers = {p.data_ptr() for p in heads.parameters()}
    assert len(pointers) == len(list(heads.parameters()))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("own_lm_head", [True, False])
def test_random_medusa_heads_keep_the_output_exact(family, own_lm_head):
    model, want = oracle_table(PROMPTS, NEW)(family)
    heads = random_heads(model, own_lm_head=own_lm_head)
    for tree in (None, full_tree(2, 3), "dynamic"):
        for chunk in (None, 3):
            if tree == "dynamic":  # EAGLE-2 growth over the heads' marginals, 7 drafted nodes
                proposer = MedusaProposer(heads, model, dynamic=(2, 7))
            else:
                proposer = MedusaProposer(heads, model, tree=tree)
            out = treespec.generate(
                model, PROMPTS, max_new_tokens=NEW, proposer=proposer, prefill_chunk_size=chunk
            )
            assert out.sequences == want
            assert len(out.stats.accepted_lengths[0]) > 0


def test_hidden_state_handed_over_is_the_one_behind_the_root():
    """With heads that copy the target's own LM head (identity blocks), head 0 guesses what the
    target predicts at the root's predecessor: the root itself, so it is rejected unless the
    model repeats tokens. The check: the proposer's stored hidden state equals the target's."""
    model, _ = oracle_table(PROMPTS, NEW)("llama")
    heads = MedusaHeads(
        MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=1, own_lm_head=False)
    )
    proposer = MedusaProposer(heads, model)
    seen = {}
    original = proposer.observe

    def spy(result):
        for r in result.requests:
            seen[r.request_id] = (list(r.committed), r.hidden.clone())
        original(result)

    proposer.observe = spy
    engine = treespec.Engine(treespec.Target(model), max_batch_size=1, max_len=64, proposer=proposer)
    rid = engine.add_request(PROMPTS[0], max_new_tokens=6)
    while engine.has_unfinished():
        engine.step()
    output = engine.pop(rid).output
    committed, hidden = seen[rid]
    context = PROMPTS[0] + output[: len(output) - len(committed)]
    with torch.no_grad():
        states = model(torch.tensor([context + committed[:-1]]), output_hidden_states=True).hidden_states[-1][
            0
        ]
    torch.testing.assert_close(hidden, states[len(context) - 1 :], atol=1e-4, rtol=1e-4)


def test_dynamic_medusa_tree_ranks_paths_by_the_heads_probabilities():
    model = build("llama")
    heads = random_heads(model)
    proposer = MedusaProposer(heads, model, dynamic=(3, 6))
    hidden = torch.randn(model.config.hidden_size)
    proposer.observe(StepResult([RequestResult(0, [1], [-1], [0], [5], hidden[None])]))

    tree = proposer.propose([ProposalRequest(0, [1, 5], 1, SamplingParams(), 10)])
    assert tree.num_nodes == 7 and tree.tokens[0] == 5
    with torch.no_grad():
        logprobs = torch.log_softmax(heads(hidden[None])[0], -1)  # [heads, V]
    # the best node of depth 1 is head 0's argmax; every child of it comes from head 1's top-3
    assert tree.tokens[1] == logprobs[0].argmax()
    children = tree.tokens[(tree.parents == 1)].tolist()
    assert set(children) <= set(logprobs[1].topk(3).indices.tolist())
    with pytest.raises(ValueError, match="dynamic"):
        MedusaProposer(heads, model, dynamic=(2, 100))


def test_bad_heads_and_folders(tmp_path):
    model = build("llama")
    with pytest.raises(ValueError, match="hidden size 32, the target 64"):
        MedusaProposer(MedusaHeads(MedusaConfig(32, 128)), model)
    with pytest.raises(ValueError, match="vocabulary of 100, the target 128"):
        MedusaProposer(MedusaHeads(MedusaConfig(64, 100)), model)
    with pytest.raises(ValueError, match="only 2 heads"):
        MedusaProposer(MedusaHeads(MedusaConfig(64, 128, num_heads=2)), model, tree=full_tree(2, 3))
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(64, 128, num_heads=0)
    folder = random_heads(model).save(tmp_path / "h")
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    del state["lm_heads.1.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: lm_heads\.1\.weight"):
        heads_module.load(folder)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"head_type": "hydra"}))
    with pytest.raises(ValueError, match="unknown head layout 'hydra'"):
        heads_module.load(tmp_path / "x")
    with pytest.raises(ValueError, match="no config.json"):
        heads_module.load(tmp_path)


# --------------------------------------------------------------------------- published layout


def published_medusa_state(num_heads=2, num_layers=2, hidden=16, vocab=40, seed=3):
    """A synthetic checkpoint in FasterDecoding/Medusa's layout with known weights."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_heads):
        for j in range(num_layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=gen)
            state[f"{i}.{j}.linear.bias"] = torch.randn(hidden, generator=gen)
        state[f"{i}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=gen)
    return state


def by_hand(state, hidden, head, num_layers):
    x = hidden
    for j in range(num_layers):
        x = x + torch.nn.functional.silu(
            x @ state[f"{head}.{j}.linear.weight"].T + state[f"{head}.{j}.linear.bias"]
        )
    return x @ state[f"{head}.{num_layers}.weight"].T


@pytest.mark.parametrize("file_format", ["safetensors", "pt"])
def test_published_medusa_layout_loads_with_known_weights(tmp_path, file_format):
    from safetensors.torch import save_file

    state = published_medusa_state()
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    if file_format == "safetensors":
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    heads = heads_module.load(tmp_path)
    assert heads.config == MedusaConfig(16, 40, num_heads=2, num_layers=2, own_lm_head=True)
    hidden = torch.randn(3, 16)
    out = heads(hidden)
    for head in range(2):
        torch.testing.assert_close(out[:, head], by_hand(state, hidden, head, 2), atol=1e-4, rtol=1e-4)


def test_export_then_import_round_trip(tmp_path):
    model = build("llama")
    for own in (True, False):
        heads = random_heads(model, own_lm_head=own)
        folder = heads_module.export_published_medusa(
            heads, tmp_path / f"out-{own}", target=model, base_model="tiny"
        )
        back = heads_module.load(folder)
        hidden = torch.randn(4, model.config.hidden_size)
        lm_head = None if own else model.get_output_embeddings()
        torch.testing.assert_close(back(hidden), heads(hidden, lm_head), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pass the target model, not its config"):
        heads_module.export_published_medusa(
            random_heads(model, own_lm_head=False), tmp_path / "x", target=model.config
        )
    other = build("llama", hidden_size=32)
    with pytest.raises(ValueError, match="hidden size 64, the target 32"):
        heads_module.export_published_medusa(random_heads(model), tmp_path / "x", target=other)
    assert not (tmp_path / "x").exists()


def test_published_medusa_missing_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    state = published_medusa_state()
    del state["1.0.linear.bias"]
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: 1\.0\.linear\.bias"):
        heads_module.load(tmp_path)


# --------------------------------------------------------------------------- hidden states across chunks


class PairRecorder(Proposer):
    """Records every (next token, hidden state) pair the engine hands over; proposes nothing."""

    needs_hidden = True

    def __init__(self):
        self.pairs: dict[int, list[tuple[int, torch.Tensor]]] = {}

    def propose(self, requests):
        return TokenTree.make_dummy([[r.tokens[-1]] for r in requests])

    def observe(self, result):
        for r in result.requests:
            self.pairs.setdefault(r.request_id, []).extend(zip(r.committed, r.hidden, strict=True))

    def observe_prefill(self, request_id, tokens, hidden):
        self.pairs.setdefault(request_id, []).extend(zip(tokens, hidden, strict=True))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_chunked_prefill_hands_over_the_same_pairs(family):
    """(h_t, x_{t+1}) for every position, whatever the chunking, with a second request that is
    decoding while the first still prefills. 17 tokens with chunks of 16 puts a boundary right
    before the prompt's last token."""
    model = build(family)
    prompts = [list(range(3, 20)), [40, 41, 42, 43, 44]]  # 17 and 5 tokens
    runs = {}
    for chunk in (1, 3, 16, None):
        recorder = PairRecorder()
        out = treespec.generate(model, prompts, max_new_tokens=3, proposer=recorder, prefill_chunk_size=chunk)
        runs[chunk] = (out.sequences, recorder.pairs)
    for b, prompt in enumerate(prompts):
        sequence = prompt + runs[None][0][b]
        with torch.no_grad():
            states = model(torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        for chunk, (_, pairs) in runs.items():
            tokens = [t for t, _ in pairs[b]]
            assert tokens == sequence[1:], (chunk, b)  # x_1 .. x_n, each exactly once, in order
            torch.testing.assert_close(torch.stack([h for _, h in pairs[b]]), states, atol=1e-4, rtol=1e-4)


def test_heads_on_the_targets_lm_head_read_out_once_for_all_heads():
    """One read-out call for every head gives each head's own logits, as separate calls would."""
    model = build("llama")
    heads = random_heads(model, own_lm_head=False)
    hidden = torch.randn(4, model.config.hidden_size)
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    logits = heads(hidden, model.lm_head)
    assert calls == [(12, model.config.hidden_size)]
    for i, blocks in enumerate(heads.blocks):
        torch.testing.assert_close(logits[:, i], model.lm_head(blocks(hidden)), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_a_reduced_medusa_readout_drafts_only_its_tokens_and_keeps_the_output(tree):
    model, want = oracle_table(PROMPTS, NEW)("llama")
    heads = random_heads(model, own_lm_head=False)
    ids = list(range(1, 90, 2))
    kwargs = {"dynamic": (2, 7)} if tree == "dynamic" else {"tree": full_tree(2, 3)}
    proposer = MedusaProposer(heads, model, readout_ids=ids, **kwargs)
    drafted = record_drafted(proposer)
    out = treespec.generate(model, PROMPTS, max_new_tokens=NEW, proposer=proposer)
    assert out.sequences == want
    assert drafted and drafted <= set(ids)
    with pytest.raises(ValueError, match="distinct"):
        MedusaProposer(heads, model, readout_ids=[3, 3, 4], **kwargs)
    with pytest.raises(ValueError, match="target's LM head"):
        MedusaProposer(random_heads(model, own_lm_head=True), model, readout_ids=ids, **kwargs)


def conditioned_heads(model, *, own_lm_head=False, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    config = MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3, num_layers=1,
                          own_lm_head=own_lm_head, conditioned=True)  # fmt: skip
    heads = MedusaHeads(config)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads.eval()


def test_a_new_conditioned_head_is_the_plain_head_and_round_trips(tmp_path):
    """Its input layers start by passing h through, so before training a conditioned head
    guesses what the plain head with the same blocks guesses, whatever the tokens before."""
    plain = MedusaHeads(MedusaConfig(16, 32, num_heads=2, num_layers=1))
    conditioned = MedusaHeads(MedusaConfig(16, 32, num_heads=2, num_layers=1, conditioned=True))
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.3)
    conditioned.load_state_dict(plain.state_dict(), strict=False)
    hidden, embeds = torch.randn(4, 16), torch.randn(4, 2, 16)
    torch.testing.assert_close(conditioned(hidden, embeds=embeds), plain(hidden), atol=1e-6, rtol=0)
    conditioned.save(tmp_path / "hydra")
    loaded = heads_module.load(tmp_path / "hydra")
    assert loaded.config.conditioned
    torch.testing.assert_close(
        loaded(hidden, embeds=embeds), conditioned(hidden, embeds=embeds), atol=0, rtol=0
    )
    with pytest.raises(ValueError, match=r"reads the embeddings of the 2 tokens before its guess"):
        conditioned(hidden, embeds=embeds[:, :1])
    with pytest.raises(ValueError, match="embeddings"):
        conditioned(hidden)


@pytest.mark.parametrize("own_lm_head", [True, False])
def test_random_conditioned_heads_keep_the_output_exact(own_lm_head):
    model, want = oracle_table(PROMPTS, NEW)("llama")
    heads = conditioned_heads(model, own_lm_head=own_lm_head)
    for chunk in (None, 3):
        proposer = MedusaProposer(heads, model, dynamic=(2, 7))
        out = treespec.generate(
            model, PROMPTS, max_new_tokens=NEW, proposer=proposer, prefill_chunk_size=chunk
        )
        assert out.sequences == want
        assert sum(map(len, out.stats.accepted_lengths)) > 0


def test_a_conditioned_tree_drafts_each_nodes_children_from_its_own_path():
    model = build("llama")
    heads = conditioned_heads(model)
    proposer = MedusaProposer(heads, model, dynamic=(3, 9))
    assert "conditioned" in proposer.drafting_paths()["medusa heads"]
    hidden = torch.randn(model.config.hidden_size)
    proposer.observe(StepResult([RequestResult(0, [1], [-1], [0], [5], hidden[None])]))
    tree = proposer.propose([ProposalRequest(0, [1, 5], 1, SamplingParams(), 10)])
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings()
    with torch.no_grad():
        first = heads.readout(0, heads.head_features(0, hidden[None], embed[[5]][None]), lm_head)[0]
        assert tree.tokens[1] == first.argmax()
        parents = tree.parents.tolist()
        for node in range(1, tree.num_nodes):
            children = [c for c in range(tree.num_nodes) if parents[c] == node]
            if not children or parents[node] != 0:
                continue
            path = embed[[5, int(tree.tokens[node])]][None]  # the root, then this depth-1 node
            logits = heads.readout(1, heads.head_features(1, hidden[None], path), lm_head)[0]
            assert {int(tree.tokens[c]) for c in children} <= set(logits.topk(3).indices.tolist())
    # two depth-1 nodes see different paths: their children's distributions differ
    depth1 = [n for n in range(1, tree.num_nodes) if parents[n] == 0][:2]
    with torch.no_grad():
        a, b = (heads.readout(1, heads.head_features(1, hidden[None], embed[[5, int(tree.tokens[n])]][None]),
                              lm_head) for n in depth1)  # fmt: skip
    assert not torch.equal(a, b)


def test_a_conditioned_budget_narrows_and_shallows_its_levels_and_a_plain_one_does_not():
    """Conditioned heads run each level's frontier, so a budget sets their width (round(sqrt(2n)))
    and depth as an EAGLE head's; plain heads score every depth in one read-out and keep the
    constructed width and every head. The trees drafted fit the budget."""
    model = build("llama")
    conditioned = MedusaProposer(conditioned_heads(model), model, dynamic=(8, 31))
    plain = MedusaProposer(random_heads(model, own_lm_head=False), model, dynamic=(8, 31))
    hidden = torch.randn(model.config.hidden_size)
    for proposer in (conditioned, plain):
        proposer.observe(StepResult([RequestResult(0, [1], [-1], [0], [5], hidden[None])]))
    for nodes, depth, want in [(8, 8, (4, 8, 3)), (4, 2, (3, 4, 2)), (2, 1, (2, 2, 1)), (31, 6, (8, 31, 3))]:
        conditioned.set_budget(nodes, depth)
        plain.set_budget(nodes, depth)
        assert (*conditioned.dynamic, conditioned.depth) == want
        assert (*plain.dynamic, plain.depth) == (8, nodes, 3)
        for proposer in (conditioned, plain):
            tree = proposer.propose([ProposalRequest(0, [1, 5], 1, SamplingParams(), 10)])
            assert tree.num_nodes == nodes + 1 and int(tree.depth.max()) <= proposer.depth


def test_conditioned_heads_refuse_static_trees_and_the_published_layout(tmp_path):
    model = build("llama")
    heads = conditioned_heads(model)
    with pytest.raises(ValueError, match="conditioned Medusa heads draft level by level"):
        MedusaProposer(heads, model, tree=full_tree(2, 2))
    with pytest.raises(ValueError, match="no place for"):
        heads_module.export_published_medusa(heads, tmp_path / "out", target=model)
    with pytest.raises(TypeError, match="conditioned must be a bool"):
        MedusaConfig(16, 32, conditioned=1)
