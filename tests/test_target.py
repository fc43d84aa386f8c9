"""The target's ragged tree forward against HF's own forward on each branch."""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON, build
from transformers import BertConfig, BertModel, Gemma2Config, Gemma2ForCausalLM

from treespec.target import Target


def full_forward_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_chain_logits_and_hidden_match_hf(family):
    model = build(family)
    prompt = list(range(3, 23))
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), output_hidden_states=True)
    target = Target(model)
    cache = target.new_cache(num_slots=2, max_len=32)
    slot = cache.allocate()
    out = target.forward(
        torch.tensor(prompt),
        cache,
        torch.tensor([0, len(prompt)]),
        torch.tensor([slot]),
        hidden_layers=(0, 1),
    )
    torch.testing.assert_close(out.logits, ref.logits[0].float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.hidden, ref.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.layer_hidden[1], ref.hidden_states[1][0], atol=1e-4, rtol=1e-4)


def test_tree_nodes_score_like_their_branches(family):
    """Two requests, each a tree on top of its own cached prefix, in one forward."""
    model = build(family)
    target = Target(model)
    cache = target.new_cache(num_slots=4, max_len=64)
    prompts = [list(range(10, 30)), list(range(40, 47))]
    # Node 0 is the root; parents index within the same request's tree.
    trees = [([5, 6, 7, 8, 9, 11], [-1, 0, 0, 1, 1, 2]), ([50, 51, 52], [-1, 0, 1])]
    slots = [3, 1]  # non-contiguous, out of order
    for _ in range(4):
        cache.allocate()
    for slot, prompt in zip(slots, prompts, strict=False):
        target.forward(torch.tensor(prompt), cache, torch.tensor([0, len(prompt)]), torch.tensor([slot]))
        cache.commit([slot], [range(len(prompt))])
    tokens, _parents, depth, masks, cu = [], [], [], [], [0]
    for toks, par in trees:
        d = []
        for p in par:
            d.append(0 if p < 0 else d[p] + 1)
        bits = []
        for node in range(len(par)):
            word, a = 0, node
            while a >= 0:
                word |= 1 << a
                a = par[a]
            bits.append([word])
        tokens += toks
        depth += d
        masks += bits
        cu.append(len(tokens))
    out = target.forward(
        torch.tensor(tokens),
        cache,
        torch.tensor(cu),
        torch.tensor(slots),
        tree_mask=torch.tensor(masks, dtype=torch.int32),
        depth=torch.tensor(depth),
    )
    for b, (toks, par) in enumerate(trees):
        for node in range(len(par)):
            branch, a = [], node
            while a >= 0:
                branch.append(toks[a])
                a = par[a]
            expect = full_forward_logits(model, prompts[b] + branch[::-1])[-1]
            torch.testing.assert_close(out.logits[cu[b] + node], expect, atol=1e-4, rtol=1e-4)


def test_logit_rows_select_rows():
    model = build("llama")
    target = Target(model)
    cache = target.new_cache(num_slots=1, max_len=16)
    cache.allocate()
    out = target.forward(
        torch.arange(5, 12), cache, torch.tensor([0, 7]), torch.tensor([0]), logit_rows=torch.tensor([6, 2])
    )
    full = full_forward_logits(model, list(range(5, 12)))
    torch.testing.assert_close(out.logits, full[[6, 2]], atol=1e-4, rtol=1e-4)
    assert out.hidden.shape == (7, 64)


def test_wrapped_model_still_generates_like_before():
    model = build("llama")
    prompt = torch.tensor([[1, 2, 3, 4]])
    before = model.generate(prompt, max_new_tokens=6, do_sample=False)
    Target(model)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), before)


def test_not_a_causal_lm():
    encoder = BertModel(
        BertConfig(
            vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
    )
    with pytest.raises(TypeError, match="not a decoder-only causal LM"):
        Target(encoder)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        Target(torch.nn.Linear(2, 2))


def test_cache_overflow_is_refused_before_compute():
    target = Target(build("llama"))
    cache = target.new_cache(num_slots=1, max_len=8)
    cache.allocate()
    with pytest.raises(ValueError, match="exceed the cache length 8"):
        target.forward(torch.arange(9), cache, torch.tensor([0, 9]), torch.tensor([0]))
    assert cache.lengths == [0] and cache.keys.abs().sum() == 0


def test_host_layouts_that_do_not_fit_are_refused_before_compute():
    target = Target(build("llama"))
    cache = target.new_cache(num_slots=2, max_len=8)
    cache.allocate()
    with pytest.raises(ValueError, match=r"one count >= 0 of new tokens per slot, got \[3, -1\]"):
        target.forward(torch.arange(2), cache, [0, 3, 2], [0, 1])
    with pytest.raises(ValueError, match="one count >= 0 of new tokens per slot"):
        target.forward(torch.arange(3), cache, [0, 3], [0, 1])
    assert cache.keys.abs().sum() == 0


def test_bidirectional_gemma_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Target(build("gemma3", use_bidirectional_attention=True))


def test_attention_softcap_matches_hf_eager():
    """Gemma 2 passes its attention logit cap to the attention function; HF's eager path applies it."""
    torch.manual_seed(0)
    config = Gemma2Config(
        **COMMON, num_hidden_layers=2, head_dim=16, sliding_window=8, attn_logit_softcapping=2.0
    )
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # large attention logits, so that the cap bites
            layer.self_attn.q_proj.weight.mul_(100.0)
    prompt = list(range(3, 23))
    model.set_attn_implementation("eager")
    expect = full_forward_logits(model, prompt)
    target = Target(model)
    cache = target.new_cache(num_slots=1, max_len=32)
    cache.allocate()
    out = target.forward(torch.tensor(prompt), cache, torch.tensor([0, len(prompt)]), torch.tensor([0]))
    torch.testing.assert_close(out.logits, expect, atol=1e-4, rtol=1e-4)
    for layer in model.model.layers:  # without the cap the logits differ: the test can tell
        layer.self_attn.attn_logit_softcapping = None
    target = Target(model)  # a Target's view holds the module attributes it was built with
    cache.free(0)
    cache.allocate()
    uncapped = target.forward(torch.tensor(prompt), cache, torch.tensor([0, len(prompt)]), torch.tensor([0]))
    assert not torch.allclose(uncapped.logits, expect, atol=1e-3)


def test_bert_lm_head_is_not_causal_self_attention():
    from transformers import BertLMHeadModel

    config = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    with pytest.raises((TypeError, ValueError), match="causal"):
        Target(BertLMHeadModel(config))
