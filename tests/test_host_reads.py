"""The engine reads the device once per step (docs/architecture.md, "One read per step").

On a GPU every device-to-host read stalls the host until the queued kernels finish, and a step
that reads the device more than once cannot be captured as one graph. On this CPU nothing
stalls, so the test counts the calls that would: a ``TorchFunctionMode`` sees every tensor
method and function the engine calls and counts the ones that read values back (``item``,
``tolist``, ``int()``, ``bool()``, ``nonzero``, ``.cpu()``...), and the ones that read
implicitly on a GPU (boolean-mask indexing, ``repeat_interleave`` without ``output_size``).
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from conftest import tiny_llama
from test_eagle import random_head
from test_heads import random_heads
from torch.overrides import TorchFunctionMode

from treespec import sampling
from treespec.budget import AdaptiveProposer, BudgetChooser, CostModel
from treespec.engine import Engine
from treespec.proposers import (
    DraftModelProposer,
    EagleProposer,
    HybridProposer,
    MedusaProposer,
    NgramProposer,
)
from treespec.sampling import SamplingParams, _top_p_filter
from treespec.target import Target
from treespec.tree import TokenTree, full_tree
from treespec.verify import verify

READS = {
    "item",
    "tolist",
    "__int__",
    "__float__",
    "__bool__",
    "__index__",
    "nonzero",
    "numpy",
    "cpu",
    "unique",
}
READS |= {"masked_select", "argwhere"}


class DeviceReads(TorchFunctionMode):
    """Counts device-to-host reads, with where each came from (file:line function)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads(func, args, kwargs):
            frame = traceback.extract_stack()[-2]
            self.sites[
                f"{getattr(func, '__name__', func)} {frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}"
            ] += 1
        return func(*args, **kwargs)


def _reads(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in READS:
        return True
    if name in ("__getitem__", "__setitem__") and len(args) > 1:  # x[bool mask]: a nonzero
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "repeat_interleave":  # tensor repeats: the output size is read unless given
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "to" and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
        return any(
            a == "cpu" or (isinstance(a, torch.device) and a.type == "cpu")
            for a in [*args[1:], *kwargs.values()]
        )
    return False


def test_the_counter_sees_each_kind_of_read():
    x = torch.arange(6)
    with DeviceReads() as reads:
        x.tolist(), int(x[0]), bool(x.any()), x[x > 2], x.nonzero()
        torch.repeat_interleave(x, x)
        torch.repeat_interleave(x, x, output_size=15)  # sized: no read
        x + 1, x[1:3], x[torch.tensor([0, 2])]  # arithmetic and integer indexing: no read
    assert reads.count == 6, reads.sites


MODEL = tiny_llama().eval()


@pytest.fixture(autouse=True)
def fixed_shapes(monkeypatch):
    """Count what a GPU would run: where reads are free (a CPU) verification and top-p may stop
    early or widen on what they read; with FIXED_SHAPES they take the GPU's fixed shapes."""
    monkeypatch.setattr(sampling, "FIXED_SHAPES", True)


def _proposer(kind: str):
    model = MODEL
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramProposer()
    if kind == "draft":
        return DraftModelProposer(tiny_llama(num_hidden_layers=1).eval(), shape=full_tree(2, 2))
    if kind == "draft-dynamic":
        return DraftModelProposer(tiny_llama(num_hidden_layers=1).eval(), dynamic=(2, 3, 6))
    if kind == "medusa":
        return MedusaProposer(random_heads(model), model)
    if kind == "medusa-dynamic":
        return MedusaProposer(random_heads(model), model, dynamic=(2, 5))
    if kind == "eagle":
        return EagleProposer(random_head(model), model, top_k=3, depth=4, total_tokens=10)
    if kind == "eagle3":
        return EagleProposer(random_head(model, eagle3=True), model, top_k=3, depth=3, total_tokens=8)
    if kind == "adaptive-eagle":
        eagle = EagleProposer(random_head(model), model, top_k=3, depth=4, total_tokens=10)
        ticks = iter(range(10**6))  # a flat measured cost: the budget follows acceptance only
        chooser = BudgetChooser(CostModel([1, 8, 64], [1.0, 1.1, 1.5]))
        return AdaptiveProposer(eagle, chooser, clock=lambda: float(next(ticks)))
    if kind == "hybrid":
        eagle = EagleProposer(random_head(model), model, top_k=2, depth=3, total_tokens=5)
        return HybridProposer(NgramProposer(), eagle)
    raise AssertionError(kind)


# Reads per decode step: one, the step's read-back; a hybrid also reads its device-drafted
# member's tree once to merge it with the host-drafted one.
KINDS = {"none": 1, "ngram": 1, "draft": 1, "draft-dynamic": 1, "medusa": 1, "medusa-dynamic": 1,
         "eagle": 1, "eagle3": 1, "adaptive-eagle": 1, "hybrid": 2}  # fmt: skip


def _engine(kind: str, batch: int, **sampling) -> Engine:
    engine = Engine(Target(MODEL), proposer=_proposer(kind), debug=False, max_batch_size=8)
    generator = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(0, MODEL.config.vocab_size, (9,), generator=generator).tolist()
        engine.add_request(prompt * 2, max_new_tokens=40, sampling=SamplingParams(**sampling))
    return engine


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_decode_step_reads_the_device_once(kind, batch, temperature):
    sampling = {} if temperature == 0 else {"temperature": temperature, "top_p": 0.9}
    if kind == "draft" and temperature:  # children drawn from the draft: the sampled-children rule
        sampling["seed"] = 3
    engine = _engine(kind, batch, **sampling)
    for _ in range(3):  # prefill, the first token, then decode steps with drafts
        engine.step()
    for _ in range(2):
        with DeviceReads() as reads:
            engine.step()
        assert reads.count <= KINDS[kind], reads.sites


def test_a_step_that_prefills_one_request_while_others_decode_reads_once():
    engine = _engine("eagle", 2)
    engine.step()
    engine.step()
    engine.add_request(list(range(5, 30)), max_new_tokens=8)  # joins mid-run: prefill beside decoding
    with DeviceReads() as reads:
        engine.step()
    assert reads.count == 1, reads.sites
    assert not engine._running[-1].prefilling


def test_a_bad_proposal_found_by_the_one_read_still_raises_and_names_the_request():
    class OutOfVocabulary(NgramProposer):
        def propose(self, requests):
            tree = super().propose(requests)
            return type(tree)(tree.tokens + 1000, *list(vars(tree).values())[1:])

    engine = Engine(Target(MODEL), proposer=OutOfVocabulary(), debug=False)
    engine.add_request([1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=10)
    engine.step()
    with pytest.raises(ValueError, match="root must be the last committed token|outside the vocabulary"):
        engine.step()


def test_top_p_on_a_gpu_reads_nothing_and_keeps_what_the_cpu_path_keeps():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(0)) * 3
    logits[0] *= 0.01  # a nearly flat row: the CPU path widens to the whole vocabulary
    with DeviceReads() as reads:
        sorted_way = _top_p_filter(logits, 0.9, adaptive=False)  # what a GPU runs
    assert reads.count == 0, reads.sites
    assert torch.equal(sorted_way.isinf(), _top_p_filter(logits, 0.9, adaptive=True).isinf())


@pytest.mark.parametrize("mode", ["deterministic", "sampled"])
def test_stopping_early_where_reads_are_free_changes_no_result(mode, monkeypatch):
    generator = torch.Generator().manual_seed(5)
    trees = [random_tree(generator) for _ in range(3)]
    tree = TokenTree.concat(trees)
    logits = torch.randn(tree.num_nodes, 64, generator=generator) * 2
    probs = torch.softmax(torch.randn(tree.num_nodes, 64, generator=generator), -1)
    tree = TokenTree(*list(vars(tree).values())[:5], probs, tree.host)
    uniforms = torch.rand(tree.num_nodes, 2, generator=generator)
    params = SamplingParams(temperature=1.0)
    fixed = verify(tree, logits, params, mode=mode, uniforms=uniforms)
    monkeypatch.setattr(sampling, "FIXED_SHAPES", False)
    early = verify(tree, logits, params, mode=mode, uniforms=uniforms)
    assert torch.equal(fixed.paths, early.paths) and torch.equal(fixed.bonus_tokens, early.bonus_tokens)


def random_tree(generator: torch.Generator) -> TokenTree:
    """A random tree of 12 nodes (node i under a random earlier one), distinct sibling tokens."""
    parents, tokens = [-1], [int(torch.randint(0, 64, (1,), generator=generator))]
    for i in range(1, 12):
        parents.append(int(torch.randint(0, i, (1,), generator=generator)))
        taken = {t for t, p in zip(tokens, parents, strict=False) if p == parents[-1]}
        tokens.append(next(t for t in torch.randperm(64, generator=generator).tolist() if t not in taken))
    return TokenTree.from_lists([tokens], [parents])
