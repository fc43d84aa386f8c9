"""EAGLE heads and their proposer: drafting against a cache-free re-run, chunk invariance,
exact output with random heads, folder I/O, bad input."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import build, oracle_table, record_drafted

import treespec
from treespec import heads as heads_module
from treespec.heads import EagleConfig, EagleHead
from treespec.proposers import EagleProposer, Proposer
from treespec.tree import build_dynamic_tree

PROMPTS = [list(range(5, 12)), [20, 21, 22], list(range(30, 60)), [7]]
NEW = 17


def random_head(model, *, eagle3=False, draft_vocab=None, seed=0, std=0.2) -> EagleHead:
    torch.manual_seed(seed)
    config = EagleConfig.from_target(model.config, eagle3=eagle3, draft_vocab_size=draft_vocab)
    head = EagleHead(config)
    for name, p in head.named_parameters():
        torch.nn.init.normal_(p, std=std) if "norm" not in name else torch.nn.init.uniform_(p, 0.5, 1.5)
    if draft_vocab is not None:  # draft id i -> target id 2i (+1 for odd i): a real remapping
        ids = torch.randperm(model.config.vocab_size)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head.eval()


def predictable_llama():
    """A tiny Llama whose greedy output is easy to guess: every embedding shares a large common
    direction that the LM head reads as token 5, nudged by the token itself, so runs of 5 alternate
    with other tokens. EAGLE heads then get long accepted paths (the cache commit is exercised)."""
    model = build("llama")
    with torch.no_grad():
        common = torch.randn(model.config.hidden_size)
        model.model.embed_tokens.weight.mul_(20).add_(common)
        model.lm_head.weight[5] += 0.4 * common / common.norm()
    return model


def target_features(model, head: EagleHead, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([context]), output_hidden_states=True)
    if head.config.eagle3:
        return torch.cat([out.hidden_states[i][0] for i in head.config.feature_layers], -1)
    return out.hidden_states[-1][0]


def naive_tree(model, head: EagleHead, context: list[int], *, top_k, depth, num_nodes):
    """EAGLE-2 drafting without any cache: every node's output comes from a causal re-run of the
    whole pair sequence (context pairs with the target's features, then the node's path with the
    head's own outputs as features)."""
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()

    def run(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        def attention(q, k, v):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            )
            return out.transpose(0, 1)

        return head(embed(torch.tensor(tokens)), features, torch.arange(len(tokens)), attention)

    with torch.no_grad():
        fused = head.fuse(target_features(model, head, context)[:-1])  # pairs (f_t, x_{t+1})
        root_out = run(context[1:], fused)[-1]
        previous_paths: list[list[int]] = []  # the previous frontier's paths, by slot

        def node_output(path: list[int]) -> torch.Tensor:
            tokens, features, last = list(context[1:]), fused, root_out
            for token in path:
                tokens, features = tokens + [token], torch.cat([features, last[None]])
                last = run(tokens, features)[-1]
            return last

        def expand(step, frontier_tokens, parent_slots):
            paths = [
                (previous_paths[slot] if slot >= 0 else []) + [token]
                for token, slot in zip(frontier_tokens[0].tolist(), parent_slots[0].tolist(), strict=True)
            ]
            previous_paths[:] = paths
            return head.log_probs(torch.stack([node_output(p) for p in paths]), lm_head)[None]

        root_logprobs = head.log_probs(root_out[None], lm_head)
        return build_dynamic_tree(
            torch.tensor([context[-1]]), root_logprobs, expand, top_k=top_k, depth=depth, num_nodes=num_nodes
        )


def tree_lists(tree) -> list[tuple[list[int], list[int]]]:
    cu = tree.cu_nodes.tolist()
    return [
        (tree.tokens[a:b].tolist(), tree.parents[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:], strict=True)
    ]


class Recorder(Proposer):
    """Wraps a proposer: keeps, per request, every context, tree and the head's cache rows then."""

    def __init__(self, proposer: EagleProposer):
        self.proposer, self.calls = proposer, {}
        self.needs_hidden, self.hidden_layers = proposer.needs_hidden, proposer.hidden_layers
        self.max_tree_nodes, self.max_batch_size = proposer.max_tree_nodes, proposer.max_batch_size

    def observe(self, result):
        self.proposer.observe(result)

    def observe_prefill(self, request_id, tokens, hidden):
        self.proposer.observe_prefill(request_id, tokens, hidden)

    def release(self, request_id):
        self.proposer.release(request_id)

    def propose(self, requests):
        tree = self.proposer.propose(requests)
        cache = self.proposer.cache
        for r, drafted in zip(requests, tree_lists(tree), strict=True):
            slot = self.proposer._slot[r.request_id]
            n = cache.lengths[slot]
            rows = (cache.keys[0, slot, :, :n].clone(), cache.values[0, slot, :, :n].clone())
            self.calls.setdefault(r.request_id, []).append((list(r.tokens), drafted, rows, r.max_new))
        return tree


def recorded_run(model, head, prompts, chunk, new=NEW, **kwargs):
    """Generate; return the output and, per request, a list of (context, tree, cache rows, max_new)."""
    proposer = Recorder(EagleProposer(head, model, **kwargs))
    out = treespec.generate(model, prompts, max_new_tokens=new, proposer=proposer, prefill_chunk_size=chunk)
    return out, [proposer.calls[i] for i in sorted(proposer.calls)]


@pytest.mark.parametrize("eagle3", [False, True])
@pytest.mark.parametrize("predictable", [False, True])
def test_drafts_equal_a_cache_free_rerun(eagle3, predictable):
    """Every tree the proposer drafts (batch of 2, chunked prefill, through many steps) equals the
    one a cache-free EAGLE-2 re-run builds from the same context."""
    model = predictable_llama() if predictable else build("llama")
    head = random_head(
        model, eagle3=eagle3, draft_vocab=48 if eagle3 else None, std=0.05 if predictable else 0.2
    )
    if predictable and not eagle3:  # fc passes the embedding through: the head reads token 5 too
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, : model.config.hidden_size] = torch.eye(model.config.hidden_size)
    kwargs = dict(top_k=3, depth=3, total_tokens=7)
    out, calls = recorded_run(model, head, [PROMPTS[0], PROMPTS[2]], chunk=4, new=12, **kwargs)
    for per_request in calls:
        assert len(per_request) >= 3
        for context, got, _, max_new in per_request:
            depth = min(3, max_new - 1)  # the proposer never drafts past what a request can still take
            if depth < 1:
                assert got == ([context[-1]], [-1])
                continue
            want = naive_tree(
                model, head, context, top_k=3, depth=depth, num_nodes=min(7, 3 + (depth - 1) * 9)
            )
            assert got == tree_lists(want)[0]
    if predictable and not eagle3:
        assert out.stats.tau > 2.0  # long accepted paths went through the head's cache commit


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("eagle3", [False, True])
def test_chunk_size_changes_neither_cache_nor_proposals(family, eagle3):
    """Chunk sizes 1, 3, 16 and whole on a 17-token prompt (16: a boundary right before the
    prompt's last token) beside a 5-token one: the head's cache and every tree are identical."""
    model = build(family)
    head = random_head(model, eagle3=eagle3, draft_vocab=64 if eagle3 else None)
    prompts = [list(range(40, 57)), [3, 9, 27, 81, 115]]
    _, reference = recorded_run(model, head, prompts, chunk=None, new=9, top_k=2, depth=3, total_tokens=5)
    for chunk in (1, 3, 16):
        _, calls = recorded_run(model, head, prompts, chunk=chunk, new=9, top_k=2, depth=3, total_tokens=5)
        for per_request, want_per_request in zip(calls, reference, strict=True):
            assert [c[:2] for c in per_request] == [c[:2] for c in want_per_request]  # contexts, trees
            for (_, _, (k, v), _), (_, _, (k_want, v_want), _) in zip(
                per_request, want_per_request, strict=True
            ):
                # The target's own hidden states differ in the last bits between chunkings (other
                # matmul shapes); the head's cache follows them, nothing more.
                torch.testing.assert_close(k, k_want, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, v_want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("eagle3", [False, True])
def test_random_eagle_heads_keep_the_output_exact(family, eagle3):
    model, want = oracle_table(PROMPTS, NEW)(family)
    head = random_head(model, eagle3=eagle3, draft_vocab=64 if eagle3 else None)
    for batch in (1, 4):
        for chunk in (None, 3):
            proposer = EagleProposer(head, model, top_k=3, depth=4, total_tokens=10)
            out = treespec.generate(
                model, PROMPTS[:batch], max_new_tokens=NEW, proposer=proposer, prefill_chunk_size=chunk
            )
            assert out.sequences == want[:batch]


def test_a_head_follows_the_targets_dtype_and_the_callers_head_is_left_as_it_was():
    model = build("llama", seed=0).to(torch.bfloat16)
    head = random_head(model)  # float32, as a head folder loads by default
    converted = EagleProposer(copy.deepcopy(head).to(torch.bfloat16), model, top_k=2, depth=3, total_tokens=5)
    want = treespec.generate(model, PROMPTS[:2], max_new_tokens=NEW, proposer=converted).sequences
    proposer = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5)
    assert treespec.generate(model, PROMPTS[:2], max_new_tokens=NEW, proposer=proposer).sequences == want
    assert head.fc.weight.dtype == torch.float32  # converted in a copy


def test_sampling_with_an_eagle_head_runs_seeded():
    model = build("llama")
    head = random_head(model)
    runs = []
    for _ in range(2):
        proposer = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5)
        out = treespec.generate(model, PROMPTS[:2], max_new_tokens=8, proposer=proposer, temperature=0.9,
                                generator=torch.Generator().manual_seed(3))  # fmt: skip
        runs.append(out.sequences)
    assert runs[0] == runs[1] and all(len(s) == 8 for s in runs[0])


@pytest.mark.parametrize("eagle3", [False, True])
def test_folder_round_trip(tmp_path, eagle3):
    model = build("llama")
    head = random_head(model, eagle3=eagle3, draft_vocab=48 if eagle3 else None)
    head.save(tmp_path / "eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["head_type"] == "eagle" and config["eagle3"] is eagle3
    loaded = heads_module.load(tmp_path / "eagle")
    assert isinstance(loaded, EagleHead) and loaded.config == head.config
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    bf16 = heads_module.load(tmp_path / "eagle", dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16
    if eagle3:
        assert bf16.d2t.dtype == torch.long and torch.equal(bf16.d2t, head.d2t)


def test_heads_load_by_registered_name(tmp_path):
    model = build("llama")
    random_head(model).save(tmp_path / "h")
    heads_module.register("tiny-llama-eagle", tmp_path / "h")
    try:
        assert isinstance(heads_module.load("tiny-llama-eagle"), EagleHead)
    finally:
        heads_module.unregister("tiny-llama-eagle")
    with pytest.raises(ValueError, match="no head folder or registered name"):
        heads_module.load("tiny-llama-eagle")


def test_eagle3_feature_layers_default_low_middle_high():
    config = EagleConfig.from_target(build("gemma3").config, eagle3=True)
    assert config.feature_layers == (2, 2, 1)  # 4 layers: (2, 4 // 2, 4 - 3)
    assert heads_module.eagle.default_feature_layers(30) == (2, 15, 27)


def test_bad_heads(tmp_path):
    model = build("llama")
    config = EagleConfig.from_target(model.config)
    with pytest.raises(ValueError, match="hidden size 32, the target 64"):
        EagleProposer(EagleHead(dataclasses.replace(config, hidden_size=32)), model)
    with pytest.raises(ValueError, match="vocabulary of 256, the target 128"):
        EagleProposer(EagleHead(dataclasses.replace(config, vocab_size=256)), model)
    with pytest.raises(ValueError, match=r"target layers \(0, 1, 5\).*the target has 2 layers"):
        EagleProposer(
            EagleHead(EagleConfig.from_target(model.config, eagle3=True, feature_layers=(0, 1, 5))), model
        )
    with pytest.raises(ValueError, match="total_tokens"):
        EagleProposer(random_head(model), model, top_k=2, depth=2, total_tokens=7)
    with pytest.raises(ValueError, match="three target layers"):
        EagleConfig.from_target(model.config, eagle3=True, feature_layers=(1, 2))
    with pytest.raises(ValueError, match="set eagle3=True"):
        EagleConfig.from_target(model.config, feature_layers=(0, 1, 1))
    with pytest.raises(ValueError, match="draft_vocab_size must be in"):
        EagleConfig.from_target(model.config, draft_vocab_size=1000)
    # a folder missing tensors, one with a wrong shape, an unknown head type
    head = random_head(model)
    head.save(tmp_path / "h")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    del state["fc.weight"], state["layer.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: fc.weight, layer.mlp.up_proj.weight"):
        heads_module.load(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**config, "head_type": "hydra"}))
    with pytest.raises(ValueError, match="unknown head layout 'hydra'"):
        heads_module.load(tmp_path / "h")


# ------------------------------------------------------------------------------------------
# Published layouts
# ------------------------------------------------------------------------------------------

H, HEADS, KV, D, FFN, VOCAB_T = 16, 4, 2, 4, 24, 40


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layer_tensors(prefix: str, width: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    r = lambda *shape: torch.randn(*shape, generator=gen) * 0.3  # noqa: E731
    return {
        f"{prefix}.self_attn.q_proj.weight": r(HEADS * D, width),
        f"{prefix}.self_attn.k_proj.weight": r(KV * D, width),
        f"{prefix}.self_attn.v_proj.weight": r(KV * D, width),
        f"{prefix}.self_attn.o_proj.weight": r(H, HEADS * D),
        f"{prefix}.mlp.gate_proj.weight": r(FFN, H),
        f"{prefix}.mlp.up_proj.weight": r(FFN, H),
        f"{prefix}.mlp.down_proj.weight": r(H, FFN),
        f"{prefix}.post_attention_layernorm.weight": 1 + r(H),
    }


def llama_json(**extra) -> dict:
    return dict(hidden_size=H, intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV,
                vocab_size=VOCAB_T, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                hidden_act="silu", num_hidden_layers=1, **extra)  # fmt: skip


def attend_one(t, x, prefix):
    """Attention of a single token at position 0 (RoPE is the identity there): o(v(x)), GQA."""
    v = (x @ t[f"{prefix}.self_attn.v_proj.weight"].T).view(KV, D)
    return v.repeat_interleave(HEADS // KV, 0).reshape(-1) @ t[f"{prefix}.self_attn.o_proj.weight"].T


def mlp(t, h, prefix):
    n = rms(h, t[f"{prefix}.post_attention_layernorm.weight"])
    g, u = n @ t[f"{prefix}.mlp.gate_proj.weight"].T, n @ t[f"{prefix}.mlp.up_proj.weight"].T
    return (F.silu(g) * u) @ t[f"{prefix}.mlp.down_proj.weight"].T


def single_pair(head, embed, feature):
    return head(
        embed[None],
        head.fuse(feature[None]),
        torch.zeros(1, dtype=torch.long),
        lambda q, k, v: v.repeat_interleave(HEADS // KV, 1),
    )[0]


@pytest.mark.parametrize("file_format", ["safetensors", "bin"])
def test_published_eagle1_layout_loads_with_known_weights(tmp_path, file_format):
    gen = torch.Generator().manual_seed(0)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=gen) * 0.3, "fc.bias": torch.randn(H, generator=gen),
         "embed_tokens.weight": torch.randn(VOCAB_T, H, generator=gen), **layer_tensors("layers.0", H, gen)}  # fmt: skip
    (tmp_path / "config.json").write_text(
        json.dumps(llama_json(architectures=["LlamaForCausalLM"], bias=True))
    )
    if file_format == "bin":
        torch.save(t, tmp_path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(t, str(tmp_path / "model.safetensors"))
    head = heads_module.load(tmp_path)
    assert isinstance(head, EagleHead) and not head.config.eagle3 and head.config.fc_bias
    e, f = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    x = torch.cat([e, f]) @ t["fc.weight"].T + t["fc.bias"]
    h = x + attend_one(t, x, "layers.0")
    want = h + mlp(t, h, "layers.0")
    with torch.no_grad():
        torch.testing.assert_close(single_pair(head, e, f), want, atol=1e-5, rtol=1e-5)


def eagle3_tensors(gen, draft_vocab=12):
    return {"fc.weight": torch.randn(H, 3 * H, generator=gen) * 0.3, **layer_tensors("midlayer", 2 * H, gen),
            "midlayer.input_layernorm.weight": 1 + torch.randn(H, generator=gen) * 0.1,
            "midlayer.hidden_norm.weight": 1 + torch.randn(H, generator=gen) * 0.1,
            "norm.weight": 1 + torch.randn(H, generator=gen) * 0.1,
            "lm_head.weight": torch.randn(draft_vocab, H, generator=gen),
            "d2t": torch.arange(draft_vocab) * 2, "t2d": (torch.arange(VOCAB_T) % 3 == 0)}  # fmt: skip


def test_published_eagle3_layout_loads_with_known_weights(tmp_path):
    gen = torch.Generator().manual_seed(1)
    t = eagle3_tensors(gen)
    (tmp_path / "config.json").write_text(
        json.dumps(
            llama_json(
                architectures=["LlamaForCausalLMEagle3"],
                draft_vocab_size=12,
                eagle_aux_hidden_state_layer_ids=[1, 3, 5],
            )
        )  # fmt: skip
    )
    torch.save(t, tmp_path / "pytorch_model.bin")
    head = heads_module.load(tmp_path)
    assert (
        head.config.eagle3 and head.config.feature_layers == (1, 3, 5) and head.config.draft_vocab_size == 12
    )
    e, f3 = torch.randn(H, generator=gen), torch.randn(3 * H, generator=gen)
    x = f3 @ t["fc.weight"].T
    a_in = torch.cat([rms(e, t["midlayer.input_layernorm.weight"]), rms(x, t["midlayer.hidden_norm.weight"])])
    h = x + attend_one(t, a_in, "midlayer")
    want = h + mlp(t, h, "midlayer")
    with torch.no_grad():
        got = single_pair(head, e, f3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        logits = rms(want, t["norm.weight"]) @ t["lm_head.weight"].T  # draft id i is target id 3i
        logprobs = head.log_probs(got[None], None)[0]
        torch.testing.assert_close(logprobs[0:36:3], torch.log_softmax(logits, -1), atol=1e-5, rtol=1e-5)
        outside = torch.ones(VOCAB_T, dtype=torch.bool)
        outside[0:36:3] = False
        assert torch.isinf(logprobs[outside]).all()


@pytest.mark.parametrize("eagle3", [False, True])
def test_export_then_import_round_trip(tmp_path, eagle3):
    model = build("llama")
    head = random_head(model, eagle3=eagle3, draft_vocab=48 if eagle3 else None)
    heads_module.export_published_eagle(head, tmp_path / "pub", target=model)
    config = json.loads((tmp_path / "pub" / "config.json").read_text())
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "pub" / "model.safetensors")))
    if eagle3:  # what vLLM's and SGLang's EAGLE-3 loaders read
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
        assert {"midlayer.hidden_norm.weight", "d2t", "t2d", "lm_head.weight", "norm.weight"} <= names
    else:
        assert config["architectures"] == ["LlamaForCausalLM"] and "layers.0.self_attn.q_proj.weight" in names
        assert not any(n.startswith("layers.0.input_layernorm") for n in names)
    loaded = heads_module.load(tmp_path / "pub")
    assert loaded.config.eagle3 == eagle3
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    proposer = EagleProposer(loaded, model, top_k=2, depth=2, total_tokens=3)
    out = treespec.generate(model, [PROMPTS[0]], max_new_tokens=5, proposer=proposer)
    assert len(out.sequences[0]) == 5


def test_published_eagle_missing_tensors_and_unknown_layouts(tmp_path):
    gen = torch.Generator().manual_seed(2)
    t = eagle3_tensors(gen)
    del t["midlayer.hidden_norm.weight"], t["d2t"]
    (tmp_path / "config.json").write_text(
        json.dumps(llama_json(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=12))
    )
    torch.save(t, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="missing tensors: d2t, midlayer.hidden_norm.weight"):
        heads_module.load(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no EAGLE weights"):
        heads_module.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"something": 1}))
    with pytest.raises(ValueError, match="unknown head layout None"):
        heads_module.load(tmp_path)


def test_auto_proposer_uses_the_shipped_head_of_the_model(tmp_path, monkeypatch):
    """proposer="auto": the EAGLE head shipped for the model (recognised by its folder's name),
    adaptive budget; the n-gram trie for a model without heads, under the same budget. The output
    stays exact."""
    from treespec.auto import auto_proposer
    from treespec.budget import AdaptiveProposer
    from treespec.proposers import NgramProposer

    model, want = oracle_table(PROMPTS[:2], 8)("llama")
    without = auto_proposer(model)  # no shipped heads: n-gram lookup under the same budget
    assert isinstance(without, AdaptiveProposer) and isinstance(without.proposer, NgramProposer)
    random_head(model).save(tmp_path / "head")
    model.name_or_path = str(tmp_path / "tiny-llama")
    monkeypatch.setitem(heads_module.SHIPPED_FOR, "tiny-llama", {"eagle": "tiny-llama-eagle"})
    monkeypatch.setitem(heads_module._REGISTRY, "tiny-llama-eagle", tmp_path / "head")
    proposer = auto_proposer(model, batch_size=2)
    assert isinstance(proposer, AdaptiveProposer) and isinstance(proposer.proposer, EagleProposer)
    out = treespec.generate(model, PROMPTS[:2], max_new_tokens=8, proposer="auto")
    assert out.sequences == want
    with pytest.raises(ValueError, match='"auto"'):
        treespec.generate(model, PROMPTS[:1], proposer="eagle")


def test_a_reduced_readout_drafts_only_its_tokens_and_keeps_the_output():
    """An EAGLE-1 head reading out through 40 of the 128 rows of the target's LM head drafts only
    those tokens, the output stays the target's, and bad id lists are refused."""
    from conftest import hf_greedy

    import treespec

    model = build("llama")
    ids = list(range(0, 80, 2))
    proposer = EagleProposer(random_head(model), model, depth=3, top_k=4, total_tokens=12, readout_ids=ids)
    drafted = record_drafted(proposer)
    prompt = [5, 9, 2, 7, 7, 3]
    out = treespec.generate(model, [prompt], max_new_tokens=16, proposer=proposer)
    assert out.sequences[0] == hf_greedy(model, prompt, 16)
    assert drafted and drafted <= set(ids)
    for bad, message in (
        ([], "non-empty"),
        ([3, 3, 4, 5], "distinct"),
        ([1, 2, 500], r"\[0, 128\)"),
        ([1, 2], "top_k"),
    ):
        with pytest.raises(ValueError, match=message):
            EagleProposer(random_head(model), model, depth=3, top_k=4, total_tokens=12, readout_ids=bad)
    with pytest.raises(ValueError, match="EAGLE-1"):
        EagleProposer(
            random_head(model, eagle3=True), model, depth=3, top_k=4, total_tokens=12, readout_ids=ids
        )


@pytest.mark.parametrize("eagle3", [False, True])
def test_a_head_cut_to_fewer_readout_rows(tmp_path, eagle3):
    """``with_readout`` keeps the named rows of a head's read-out (EAGLE-3: its own LM head's
    rows), nothing else changes, the cut head drafts only those tokens and keeps the target's
    output, it survives a folder round trip, and a list that is not a proper subset is refused."""
    from conftest import hf_greedy

    model = build("llama")
    head = random_head(model, eagle3=eagle3, draft_vocab=64 if eagle3 else None)
    own = head.target_ids()
    keep = own[torch.randperm(len(own), generator=torch.Generator().manual_seed(1))[:24]]  # unsorted
    cut = head.with_readout(keep)
    assert cut.config.readout_size == 24 and torch.equal(cut.target_ids(), keep.sort().values)
    rows = (own[:, None] == cut.target_ids()[None]).nonzero()[:, 0]  # their rows in the full read-out
    with torch.no_grad():
        h = torch.randn(5, model.config.hidden_size)
        assert torch.equal(cut.logits(h, model.lm_head), head.logits(h, model.lm_head)[:, rows])
        embeds, features = torch.randn(4, 64), torch.randn(4, head.config.feature_size)
        attention = lambda q, k, v: v.repeat_interleave(q.shape[1] // v.shape[1], 1)  # noqa: E731
        fused, fused_cut = head.fuse(features), cut.fuse(features)
        assert torch.equal(cut(embeds, fused_cut, torch.arange(4), attention),
                           head(embeds, fused, torch.arange(4), attention))  # fmt: skip
    proposer = EagleProposer(cut, model, depth=3, top_k=4, total_tokens=12)
    drafted = record_drafted(proposer)
    prompt = [5, 9, 2, 7, 7, 3]
    out = treespec.generate(model, [prompt], max_new_tokens=16, proposer=proposer)
    assert out.sequences[0] == hf_greedy(model, prompt, 16)
    assert drafted and drafted <= set(keep.tolist())
    cut.save(tmp_path / "cut")
    loaded = heads_module.load(tmp_path / "cut")
    assert loaded.config == cut.config and torch.equal(loaded.target_ids(), cut.target_ids())
    outside = int(torch.isin(torch.arange(128), own, invert=True).nonzero()[0]) if eagle3 else 200
    for bad, error, message in (
        (keep[:, None], TypeError, "1-D integer tensor"),
        (keep.float(), TypeError, "1-D integer tensor"),
        (torch.tensor([], dtype=torch.long), ValueError, "got 0 ids"),
        (torch.cat([keep[:3], keep[:1]]), ValueError, "distinct"),
        (torch.cat([keep[:3], torch.tensor([outside])]), ValueError, "1 of them outside it"),
        (own, ValueError, f"1 to {len(own) - 1} distinct ids"),
    ):
        with pytest.raises(error, match=message):
            head.with_readout(bad)


def test_an_eagle1_head_with_its_own_draft_vocabulary(tmp_path):
    """An EAGLE-1 head trained with a draft vocabulary keeps it through save and load, its
    proposer reads out through those rows by default (the same drafts as passing them), the output
    stays the target's, and the published layout drops it (a full read-out there)."""
    from conftest import hf_greedy

    import treespec
    from treespec.heads.layouts import export_published_eagle

    model = build("llama")
    head = random_head(model, draft_vocab=40)
    assert (
        head.log_probs(torch.randn(3, 64), model.lm_head)[
            :, ~torch.isin(torch.arange(128), head.target_ids())
        ]
        .isinf()
        .all()
    )
    head.save(tmp_path / "head")
    loaded = EagleHead.from_folder(tmp_path / "head")
    assert torch.equal(loaded.d2t, head.d2t) and loaded.config.draft_vocab_size == 40
    own = EagleProposer(loaded, model, depth=3, top_k=4, total_tokens=12)
    assert torch.equal(own.readout_ids, head.target_ids())
    prompt = [5, 9, 2, 7, 7, 3]
    out = treespec.generate(model, [prompt], max_new_tokens=16, proposer=own)
    assert out.sequences[0] == hf_greedy(model, prompt, 16)
    export_published_eagle(loaded, tmp_path / "published", target=model.config)
    from safetensors.torch import load_file

    assert "d2t" not in load_file(str(next((tmp_path / "published").glob("*.safetensors"))))


def test_export_refuses_a_head_for_another_target(tmp_path):
    """A head exported for a target it does not fit is refused, both sides named, and nothing is
    written: another hidden size, another vocabulary, EAGLE-3 layers the target lacks."""
    model = build("llama")  # hidden 64, vocabulary 128, 2 layers
    config = EagleConfig.from_target(model.config)
    cases = [
        (EagleHead(dataclasses.replace(config, hidden_size=32)), "hidden size 32, the target 64"),
        (EagleHead(dataclasses.replace(config, vocab_size=256)), "vocabulary of 256, the target 128"),
        (
            EagleHead(EagleConfig.from_target(model.config, eagle3=True, feature_layers=(0, 1, 5))),
            r"target layers \(0, 1, 5\).*the target has 2 layers",
        ),
    ]
    for head, message in cases:
        for target in (model, model.config):
            with pytest.raises(ValueError, match=message):
                heads_module.export_published_eagle(head, tmp_path / "out", target=target)
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="Hugging Face model or its config, got str"):
        heads_module.export_published_eagle(random_head(model), tmp_path / "out", target="llama")
