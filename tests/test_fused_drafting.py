"""Drafting through the fused path: an EAGLE-1 head's pass as C calls over its own cache, a draft
model's levels through the fused decoder one level at a time, reduced read-outs that never widen
to the whole vocabulary. Each agrees with the path it replaces, keeps the output exact, and every
head, backend or setting it cannot serve falls back with its reason."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from conftest import build
from test_eagle import random_head
from test_fused import needs_kernels, road  # noqa: F401 (the fixture: each instruction road)

import treespec
from treespec.heads.eagle import EagleHead
from treespec.proposers import DraftModelProposer, EagleProposer, HybridProposer, NgramProposer
from treespec.proposers.base import ProposalRequest
from treespec.sampling import SamplingParams
from treespec.tree import NO_PARENT, extend_ancestors

PROMPTS = [list(range(5, 17)), [20, 21, 22, 23, 24], list(range(30, 52))]


def bf16_pair(seed: int = 2, std: float = 0.05, eagle3: bool = False):
    """A tiny bf16 Llama target and a random bf16 EAGLE-1 head for it (or an EAGLE-3 head with
    a 64-token draft vocabulary)."""
    model = build("llama", seed=seed).to(torch.bfloat16)
    head = random_head(model, std=std, seed=seed, eagle3=eagle3, draft_vocab=64 if eagle3 else None)
    return model, head.to(torch.bfloat16)


def requests_of(contexts: list[list[int]]) -> list[ProposalRequest]:
    return [ProposalRequest(i, c, len(c) - 1, SamplingParams(), 8) for i, c in enumerate(contexts)]


@needs_kernels
@pytest.mark.parametrize("eagle3", [False, True])
def test_the_fused_eagle_layer_agrees_with_the_heads_modules(eagle3, road):  # noqa: F811
    """Prefill pairs, a catch-up chain and two tree levels (batch of 2), through the C layer and
    through the head's modules: the head's cache, outputs and read-out log-probs agree to bf16
    rounding (weights large enough that attention moves the outputs: a wrong mask or position
    shows). EAGLE-3: the target's three layers fused by fc, the layer over [embedding; feature]
    with its two norms, the read-out through the head's own norm and draft vocabulary."""
    model, head = bf16_pair(std=0.2, eagle3=eagle3)
    fused = EagleProposer(head, model, top_k=3, depth=3, total_tokens=7, fused=True)
    modules = EagleProposer(head, model, top_k=3, depth=3, total_tokens=7, fused=False)
    assert (fused.path, modules.path) == ("native tree", "modules")
    torch.manual_seed(0)
    hidden_size = model.config.hidden_size
    width = head.config.feature_size
    features = [torch.randn(n, width).to(torch.bfloat16) for n in (9, 6, 2, 3)]
    outs = []
    for p in (fused, modules):
        p.observe_prefill(0, list(range(10, 19)), features[0])
        p.observe_prefill(1, list(range(40, 46)), features[1])
        p._pending[0], p._pending[1] = [([7, 8], features[2])], [([3, 4, 5], features[3])]
        roots = p._catch_up([0, 1])
        slots = [p._slot[0], p._slot[1]]
        drafted = [torch.zeros(2, 0, 0, dtype=torch.bool)]
        level_1 = p._run_level(slots, torch.tensor([[1, 2, 3], [4, 5, 6]]), roots[:, None].expand(-1, 3, -1),
                               drafted, torch.full((2, 3), NO_PARENT), 1)  # fmt: skip
        parents = torch.tensor([[0, 0, 2], [1, 2, 2]])
        level_2 = p._run_level(slots, torch.tensor([[7, 8, 9], [10, 11, 12]]), level_1.gather(1, parents[..., None].expand(-1, -1, hidden_size)),
                               drafted, parents, 2)  # fmt: skip
        log_probs = p._log_probs(level_2.flatten(0, 1), widen=False)
        outs.append(
            (roots, level_1, level_2, p.cache.keys.clone(), p.cache.values.clone(), log_probs, list(p.cache.lengths))
        )  # fmt: skip
    for got, want in zip(outs[0][:6], outs[1][:6], strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert outs[0][5].shape[-1] == (64 if eagle3 else model.config.vocab_size)
    assert outs[0][6] == outs[1][6] == [11, 9] + [0] * (len(outs[0][6]) - 2)
    assert outs[0][1].abs().sum() > 0 and outs[0][3].abs().sum() > 0


@needs_kernels
@pytest.mark.parametrize("readout", [None, range(64)])
def test_fused_drafting_keeps_plain_decodings_tokens(readout, road):  # noqa: F811
    """EAGLE-1, EAGLE-3 and the draft model (each tree in one C call, and level by level) and the
    hybrid, each at batch 1 and 3 with chunked prefill: the tokens of plain decoding on the same
    fused target."""
    model, head = bf16_pair(seed=5)
    eagle3 = bf16_pair(seed=5, eagle3=True)[1]
    draft = build("llama", seed=6, num_hidden_layers=2).to(torch.bfloat16)
    want = treespec.generate(model, PROMPTS, max_new_tokens=14).sequences
    makers = {
        "eagle": lambda: EagleProposer(head, model, top_k=3, depth=4, total_tokens=9, readout_ids=readout),
        "draft": lambda: DraftModelProposer(
            draft, target_model=model, dynamic=(3, 4, 9), readout_ids=readout
        ),
        "eagle levels": lambda: EagleProposer(
            head, model, top_k=3, depth=4, total_tokens=9, readout_ids=readout, native=False
        ),
        "draft levels": lambda: DraftModelProposer(
            draft, target_model=model, dynamic=(3, 4, 9), readout_ids=readout, native=False
        ),
        "eagle3": lambda: EagleProposer(eagle3, model, top_k=3, depth=4, total_tokens=9),
        "eagle3 levels": lambda: EagleProposer(eagle3, model, top_k=3, depth=4, total_tokens=9, native=False),
        "hybrid": lambda: HybridProposer(
            EagleProposer(head, model, top_k=2, depth=3, total_tokens=5),
            NgramProposer(max_depth=3, max_nodes=3),
        ),  # fmt: skip
    }
    if readout is not None:  # an EAGLE-3 head reads out through its own draft vocabulary
        del makers["eagle3"], makers["eagle3 levels"]
    for name, make in makers.items():
        for batch in (1, 3):
            proposer = make()
            paths = set(proposer.drafting_paths().values())
            assert paths == {"fused (native=False)" if "levels" in name else "native tree"}, name
            out = treespec.generate(model, PROMPTS[:batch], max_new_tokens=14, proposer=proposer,
                                    prefill_chunk_size=4)  # fmt: skip
            assert out.sequences == want[:batch], (name, batch)
            assert out.stats.drafted_nodes > 0


@needs_kernels
def test_a_draft_models_newest_level_alone_has_the_bits_of_rerunning_every_level():
    """Through the fused decoder the draft runs only the newest level (the earlier levels' K/V
    are in its cache); its logits are bit for bit those of running every level again."""
    draft = build("llama", seed=7, num_hidden_layers=2).to(torch.bfloat16)
    proposer = DraftModelProposer(draft, dynamic=(3, 4, 12))
    requests = requests_of([list(range(3, 14)), list(range(50, 57))])
    proposer._catch_up(requests)
    slots = [proposer._slot[r.request_id] for r in requests]
    levels = [(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.full((2, 3), NO_PARENT))]
    for tokens, parents in (([[7, 8, 9], [10, 11, 12]], [[0, 0, 2], [1, 1, 1]]), ([[13, 14, 15], [16, 17, 18]], [[2, 1, 0], [0, 2, 2]])):  # fmt: skip
        newest = proposer._score_levels(requests, levels)  # writes this level's K/V
        visible = torch.zeros(2, 0, 0, dtype=torch.bool)
        for level, (_, parent_slots) in enumerate(levels):
            visible = extend_ancestors(
                visible, torch.where(parent_slots >= 0, (level - 1) * 3 + parent_slots, -1)
            )
        again = proposer._score_all_levels(slots, levels, visible, widen=True)
        assert torch.equal(newest, again)
        levels.append((torch.tensor(tokens), torch.tensor(parents)))


@needs_kernels
def test_what_the_fused_drafting_cannot_serve_drafts_through_the_modules_with_its_reason(monkeypatch):
    model = build("llama", seed=3).to(torch.bfloat16)
    gelu = EagleHead(dataclasses.replace(random_head(model).config, hidden_act="gelu"))
    gelu = gelu.to(torch.bfloat16).eval()
    with pytest.warns(
        RuntimeWarning, match="through its modules, not the fused layer: the fused decoder's MLP"
    ):
        proposer = EagleProposer(gelu, model, top_k=2, depth=3, total_tokens=5)
    assert proposer.path == "modules" and "'gelu'" in proposer.path_reason
    assert proposer.drafting_paths() == {"eagle head": f"modules ({proposer.path_reason})"}
    want = treespec.generate(model, PROMPTS[:2], max_new_tokens=10).sequences
    assert treespec.generate(model, PROMPTS[:2], max_new_tokens=10, proposer=proposer).sequences == want
    with pytest.raises(ValueError, match="fused=True: the fused decoder's MLP is SiLU-gated"):
        EagleProposer(gelu, model, top_k=2, depth=3, total_tokens=5, fused=True)
    head = random_head(model).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        off = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5, fused=False)
    assert (off.path, off.path_reason) == ("modules", "fused=False")
    with pytest.warns(RuntimeWarning, match="a backend was chosen"):
        forced = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5, linear_backend="native")
    assert forced.path == "modules" and "a backend was chosen (linear 'native'" in forced.path_reason
    fp32 = build("llama", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fp32 drafts through the modules by nature: nothing to say
        plain = EagleProposer(random_head(fp32), fp32, top_k=2, depth=3, total_tokens=5)
    assert plain.path == "modules" and "bf16 heads on a CPU" in plain.path_reason
    monkeypatch.setenv("TREESPEC_FUSED", "0")
    env_off = EagleProposer(copy.deepcopy(head), model, top_k=2, depth=3, total_tokens=5)
    assert env_off.path_reason == "turned off by TREESPEC_FUSED=0"
    draft = DraftModelProposer(
        build("llama", seed=4, num_hidden_layers=2).to(torch.bfloat16), dynamic=(2, 3, 5)
    )
    assert draft.drafting_paths() == {"draft model": "modules (turned off by TREESPEC_FUSED=0)"}
    assert treespec.generate(model, PROMPTS[:2], max_new_tokens=10, proposer=draft).sequences == want
    assert NgramProposer().drafting_paths() == {}


@needs_kernels
def test_a_fused_level_that_would_write_past_the_drafters_cache_is_refused():
    """The C stack writes K/V where the rows say: a catch-up or a tree level that does not fit
    the head's or the draft's cache is refused before any compute, as the module path refuses it."""
    model, head = bf16_pair()
    eagle = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5, max_len=16, fused=True)
    hidden = torch.randn(10, model.config.hidden_size).to(torch.bfloat16)
    eagle.observe_prefill(0, list(range(10)), hidden)
    slot = eagle._slot[0]
    eagle.cache.lengths[slot] = eagle.cache.max_len - 2
    with pytest.raises(ValueError, match="more exceed the cache length"):
        eagle._run_level([slot], torch.tensor([[1, 2]]), hidden[:2][None], [torch.zeros(1, 0, 0, dtype=torch.bool)],
                         torch.full((1, 2), NO_PARENT), 2)  # fmt: skip
    eagle._pending[0] = [(list(range(3)), hidden[:3])]
    with pytest.raises(ValueError, match="more exceed the cache length"):
        eagle._catch_up([0])
    draft = DraftModelProposer(build("llama", seed=6, num_hidden_layers=2).to(torch.bfloat16), dynamic=(2, 3, 5),
                               max_len=16)  # fmt: skip
    requests = requests_of([list(range(3, 12))])
    draft._catch_up(requests)
    draft.cache.lengths[draft._slot[0]] = draft.cache.max_len - 3
    levels = [
        (torch.tensor([[1, 2]]), torch.full((1, 2), NO_PARENT)),
        (torch.tensor([[3, 4]]), torch.tensor([[0, 1]])),
    ]
    with pytest.raises(ValueError, match="more exceed the cache length"):
        draft._score_levels(requests, levels)


def committed_kv(cache) -> list[torch.Tensor]:
    """Every slot's committed keys and values (what a later step attends to)."""
    return [
        t[:, slot, :, :length]
        for slot, length in enumerate(cache.lengths)
        for t in (cache.keys, cache.values)
    ]


@needs_kernels
@pytest.mark.parametrize("readout", [None, range(64), "eagle3"])
def test_a_native_tree_is_the_tree_the_fused_levels_build(readout, road):  # noqa: F811
    """One C call per tree (the pending pairs' catch-up, levels, top-k, scores, rerank inside)
    against the fused layer's catch-up and levels one call each with the tree built in PyTorch:
    the same tokens, parents, depths and masks for every shape, two requests of different
    lengths, and the same committed K/V in the head's cache. EAGLE-1 with the whole read-out and
    a reduced one; EAGLE-3 with its own read-out over a draft vocabulary."""
    eagle3 = readout == "eagle3"
    model, head = bf16_pair(seed=3, std=0.2, eagle3=eagle3)
    readout = None if eagle3 else readout
    torch.manual_seed(0)
    features = [torch.randn(n, head.config.feature_size).to(torch.bfloat16) for n in (13, 8)]
    for top_k, depth, nodes in [(3, 4, 9), (2, 3, 5), (4, 5, 20), (3, 1, 3), (8, 6, 31)]:
        trees, lengths, caches = [], [], []
        for native in (True, False):
            p = EagleProposer(head, model, top_k=top_k, depth=depth, total_tokens=nodes, readout_ids=readout,
                              native=native)  # fmt: skip
            p.observe_prefill(0, list(range(10, 22)), features[0][:12])
            p.observe_prefill(1, list(range(40, 47)), features[1][:7])
            p._pending[0], p._pending[1] = [([22], features[0][12:])], [([47], features[1][7:])]
            trees.append(p.propose(requests_of([list(range(10, 23)), list(range(40, 48))])))
            lengths.append(list(p.cache.lengths))
            caches.append(committed_kv(p.cache))
        native, levels = trees
        assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))
        assert native.host.sizes == (nodes + 1, nodes + 1)
        for name in ("tokens", "parents", "depth", "cu_nodes", "tree_mask"):
            assert torch.equal(getattr(native, name), getattr(levels, name)), (top_k, depth, nodes, name)
        assert lengths[0] == lengths[1]
        native.validate()


@needs_kernels
def test_a_catch_up_that_does_not_fit_its_requests_is_refused():
    """The one call's catch-up needs a row (at least the root's) per request and a feature per
    row: anything else is refused before the kernel runs, the cache untouched."""
    model, head = bf16_pair()
    p = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5)
    hidden = model.config.hidden_size
    p.observe_prefill(0, [1, 2, 3], torch.zeros(3, hidden, dtype=torch.bfloat16))
    before = list(p.cache.lengths)
    cases = [([], 0, [0], "count >= 1"), ([5], 1, [2], "count >= 1"), ([5, 6], 1, [2], "one row per token")]
    for tokens, rows, counts, message in cases:
        with pytest.raises(ValueError, match=message):
            p.fused.draft_tree(p.embed.weight, p.lm_head.weight, p._column_ids, p.cache, ([p._slot[0]], [3]), None,
                               (2, 3, 5), (tokens, torch.zeros(rows, hidden, dtype=torch.bfloat16), counts))  # fmt: skip
    assert p.cache.lengths == before
    # an EAGLE-3 head fuses the target's three layers: features of one layer's width are refused
    _, head3 = bf16_pair(eagle3=True)
    p3 = EagleProposer(head3, model, top_k=2, depth=3, total_tokens=5)
    one_layer = torch.zeros(1, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"a catch-up's features need width {3 * hidden}, got {hidden}"):
        p3.fused.draft_tree(p3.embed.weight, p3._readout_weight, p3._column_ids, p3.cache, ([0], [3]), None,
                            (2, 3, 5), ([5], one_layer, [1]))  # fmt: skip
    rows = (torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match=f"expected features of width {3 * hidden}, got {hidden}"):
        p3.fused.forward(one_layer, one_layer, torch.tensor([0]), p3.cache, rows, None, from_target=True)
    with pytest.raises(ValueError, match=f"expected features of width {hidden}, got {3 * hidden}"):
        p3.fused.forward(one_layer, torch.zeros(1, 3 * hidden, dtype=torch.bfloat16), torch.tensor([0]), p3.cache,
                         rows, None)  # fmt: skip


@needs_kernels
def test_the_native_tree_falls_back_to_the_fused_levels_and_says_why():
    """native=False, requests with processors and a head off the fused layer: each drafts level by
    level (the same output) and the proposer names its path; native=True refuses what it cannot
    serve."""
    model, head = bf16_pair()
    off = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5, native=False)
    assert (off.path, off.drafting_paths()) == ("fused", {"eagle head": "fused (native=False)"})
    with pytest.raises(ValueError, match="native=True: the head does not run through the fused layer"):
        EagleProposer(head, model, top_k=2, depth=3, total_tokens=5, fused=False, native=True)
    modules = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5, fused=False)
    assert (modules.path, modules.native) == ("modules", False)
    want = treespec.generate(model, PROMPTS[:2], max_new_tokens=10, repetition_penalty=1.3).sequences
    native = EagleProposer(head, model, top_k=2, depth=3, total_tokens=5)
    calls = []
    native._draft_native = lambda *args: calls.append(args)  # processors: never the native tree
    out = treespec.generate(model, PROMPTS[:2], max_new_tokens=10, repetition_penalty=1.3, proposer=native)
    assert out.sequences == want and not calls and out.stats.drafted_nodes > 0


def test_the_rotary_table_gives_the_modules_own_rows():
    """Rows of the table computed once (and grown) are the bits the rotary module gives for the
    same positions in any call; a kind whose table depends on the call is computed per call."""
    from treespec.target.fused import RotaryTable, rotary_tables

    model, head = bf16_pair()
    table = RotaryTable(head.rotary, head.config.head_dim)
    assert table.static
    for positions in (torch.tensor([0, 5, 3]), torch.tensor([700, 2, 1000, 299])):  # 1000: the table grows
        probe = torch.empty(len(positions), 0, dtype=torch.bfloat16)
        want = rotary_tables(head.rotary, probe, positions, head.config.head_dim)
        for got, expected in zip(table(probe, positions), want, strict=True):
            assert torch.equal(got, expected)
    assert len(table.cos) >= 1001


@needs_kernels
def test_a_native_tree_on_per_call_rotary_rows_is_the_same_tree():
    """A rotary kind computed per call (not from the table) lays the tree's rows out itself: the
    native tree is the same as on the table."""
    model, head = bf16_pair(seed=3, std=0.2)
    torch.manual_seed(0)
    features = torch.randn(9, model.config.hidden_size).to(torch.bfloat16)
    trees = []
    for static in (True, False):
        p = EagleProposer(head, model, top_k=3, depth=4, total_tokens=9)
        p.fused.rotary.static = static
        p.observe_prefill(0, list(range(10, 18)), features[:8])
        p._pending[0] = [([18], features[8:])]
        trees.append(p.propose(requests_of([list(range(10, 19))])))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(
        trees[0].tree_mask, trees[1].tree_mask
    )


@needs_kernels
@pytest.mark.parametrize("readout", [None, range(64)])
def test_a_draft_models_native_tree_is_the_tree_its_fused_levels_build(readout, road):  # noqa: F811
    """A draft model's dynamic tree in one C call (its catch-up on the uncached context inside)
    against its fused catch-up and levels one call each with the tree built in PyTorch: the same
    trees for every shape, two requests, a second tree after more tokens, and the same committed
    K/V."""
    draft = build("llama", seed=6, num_hidden_layers=2).to(torch.bfloat16)
    for dynamic in [(3, 4, 9), (2, 3, 5), (4, 5, 20), (3, 1, 3), (4, 6, 31)]:
        trees, lengths, caches = [], [], []
        for native in (True, False):
            p = DraftModelProposer(draft, dynamic=dynamic, readout_ids=readout, native=native)
            assert p.drafting_paths() == {"draft model": "native tree" if native else "fused (native=False)"}
            trees.append(p.propose(requests_of([list(range(10, 23)), list(range(40, 48))])))
            more = requests_of(
                [list(range(10, 26)), list(range(40, 49))]
            )  # 3 and 1 tokens past the first trees
            trees.append(p.propose(more))
            lengths.append(list(p.cache.lengths))
            caches.append(committed_kv(p.cache))
        for first, second in ((trees[0], trees[2]), (trees[1], trees[3])):
            for name in ("tokens", "parents", "depth", "cu_nodes", "tree_mask"):
                assert torch.equal(getattr(first, name), getattr(second, name)), (dynamic, name)
        assert lengths[0] == lengths[1] and lengths[0][:2] == [16, 9]
        assert all(torch.equal(a, b) for a, b in zip(*caches, strict=True))
    with pytest.raises(ValueError, match="native=True: a static tree shape drafts level by level"):
        DraftModelProposer(draft, native=True)


@needs_kernels
@pytest.mark.parametrize("own_lm_head", [False, True])
def test_medusas_native_tree_is_the_tree_the_builder_makes(own_lm_head, road):  # noqa: F811
    """bf16 Medusa heads on the CPU kernels: the dynamic tree built in one C call from the heads'
    fp32 logits against the PyTorch builder on the same logits, for several sizes, two requests
    (with and without a reduced read-out), and the whole engine's output kept."""
    from test_heads import random_heads

    from treespec.proposers import MedusaProposer
    from treespec.proposers.base import RequestResult, StepResult

    model = build("llama", seed=5).to(torch.bfloat16)
    heads = random_heads(model, num_heads=4, own_lm_head=own_lm_head).to(torch.bfloat16)
    hidden = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    for readout in (None,) if own_lm_head else (None, range(64)):
        for dynamic in [(3, 9), (2, 5), (4, 20), (8, 31)]:
            trees = []
            for native in (True, False):
                p = MedusaProposer(heads, model, dynamic=dynamic, readout_ids=readout, native=native)
                assert p.drafting_paths()["medusa heads"] == (
                    "native tree" if native else "one multi-row read-out (native=False)"
                )
                p.observe(
                    StepResult([RequestResult(i, [1], [-1], [0], [5 + i], hidden[i : i + 1]) for i in (0, 1)])
                )
                trees.append(p.propose(requests_of([[1, 5], [1, 6]])))
            for name in ("tokens", "parents", "depth", "cu_nodes", "tree_mask"):
                assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), (dynamic, readout, name)
    want = treespec.generate(model, PROMPTS, max_new_tokens=12).sequences
    out = treespec.generate(
        model, PROMPTS, max_new_tokens=12, proposer=MedusaProposer(heads, model, dynamic=(3, 9))
    )
    assert out.sequences == want and out.stats.drafted_nodes > 0
    with pytest.raises(ValueError, match="native=True: a static tree shape"):
        MedusaProposer(heads, model, native=True)


@needs_kernels
def test_conditioned_medusas_native_tree_is_the_tree_its_levels_build(road):  # noqa: F811
    """Conditioned bf16 Medusa heads on the CPU kernels: each level's heads on the nodes' paths,
    read-outs, top-k and rerank in one C call, against the level-by-level PyTorch tree from the
    same heads: the same tokens, parents, depths and masks for several sizes, two requests, the
    whole and a reduced read-out; the engine's output kept; heads with their own LM heads fall
    back to the levels and say why."""
    from test_heads import conditioned_heads

    from treespec.proposers import MedusaProposer
    from treespec.proposers.base import RequestResult, StepResult

    model = build("llama", seed=5).to(torch.bfloat16)
    heads = conditioned_heads(model, seed=3).to(torch.bfloat16)
    torch.manual_seed(1)
    hidden = torch.randn(2, model.config.hidden_size).to(torch.bfloat16)
    for readout in (None, range(64)):
        for dynamic in [(3, 9), (2, 5), (4, 20), (8, 31), (3, 2)]:
            trees = []
            for native in (True, False):
                p = MedusaProposer(heads, model, dynamic=dynamic, readout_ids=readout, native=native)
                assert p.drafting_paths()["medusa heads"] == (
                    "conditioned heads, native tree" if native
                    else "conditioned heads, level by level (modules) (native=False)"
                )  # fmt: skip
                p.observe(
                    StepResult([RequestResult(i, [1], [-1], [0], [5 + i], hidden[i : i + 1]) for i in (0, 1)])
                )
                trees.append(p.propose(requests_of([[1, 5], [1, 6]])))
            for name in ("tokens", "parents", "depth", "cu_nodes", "tree_mask"):
                assert torch.equal(getattr(trees[0], name), getattr(trees[1], name)), (dynamic, readout, name)
            trees[0].validate()
    want = treespec.generate(model, PROMPTS, max_new_tokens=12).sequences
    native = MedusaProposer(heads, model, dynamic=(3, 9))
    out = treespec.generate(model, PROMPTS, max_new_tokens=12, proposer=native)
    assert out.sequences == want and out.stats.drafted_nodes > 0
    own = MedusaProposer(conditioned_heads(model, own_lm_head=True).to(torch.bfloat16), model, dynamic=(3, 9))
    assert own.drafting_paths()["medusa heads"] == (
        "conditioned heads, level by level (modules) "
        "(conditioned heads with their own LM heads read out through a matrix per head)"
    )
    with pytest.raises(ValueError, match="native=True: conditioned heads with their own LM heads"):
        MedusaProposer(own.heads, model, dynamic=(3, 9), native=True)


def test_bf16_medusa_heads_on_an_fp32_target_run_in_its_dtype():
    """Heads that read the target's LM head (plain or conditioned) follow its dtype, as EAGLE
    heads do: bf16 heads on an fp32 target draft in fp32 (a converted copy; the heads passed in
    are untouched) and keep its output, where their bf16 kernels once read its fp32 weights."""
    from test_heads import conditioned_heads, random_heads

    from treespec.proposers import MedusaProposer

    model = build("llama", seed=5)
    want = treespec.generate(model, PROMPTS[:2], max_new_tokens=10).sequences
    for heads in (random_heads(model, own_lm_head=False), conditioned_heads(model)):
        heads = heads.to(torch.bfloat16)
        proposer = MedusaProposer(heads, model, dynamic=(3, 9))
        assert next(proposer.heads.parameters()).dtype is torch.float32
        assert next(heads.parameters()).dtype is torch.bfloat16
        out = treespec.generate(model, PROMPTS[:2], max_new_tokens=10, proposer=proposer)
        assert out.sequences == want and out.stats.drafted_nodes > 0


@needs_kernels
def test_treespec_native_tree_0_drafts_every_tree_level_by_level_with_the_same_output(monkeypatch):
    """The switch turns the one-call trees off for EAGLE, the draft model and Medusa, each names
    why in its drafting path, and the output is plain decoding's."""
    from test_heads import random_heads

    from treespec.proposers import MedusaProposer

    monkeypatch.setenv("TREESPEC_NATIVE_TREE", "0")
    model, head = bf16_pair(seed=5)
    draft = build("llama", seed=6, num_hidden_layers=2).to(torch.bfloat16)
    medusa = random_heads(model, num_heads=3, own_lm_head=False).to(torch.bfloat16)
    want = treespec.generate(model, PROMPTS[:2], max_new_tokens=10).sequences
    reason = "turned off by TREESPEC_NATIVE_TREE=0"
    for proposer, path in [
        (EagleProposer(head, model, top_k=3, depth=4, total_tokens=9), f"fused ({reason})"),
        (DraftModelProposer(draft, target_model=model, dynamic=(3, 4, 9)), f"fused ({reason})"),
        (MedusaProposer(medusa, model, dynamic=(3, 9)), f"one multi-row read-out ({reason})"),
    ]:
        assert list(proposer.drafting_paths().values()) == [path]
        out = treespec.generate(model, PROMPTS[:2], max_new_tokens=10, proposer=proposer)
        assert out.sequences == want and out.stats.drafted_nodes > 0
