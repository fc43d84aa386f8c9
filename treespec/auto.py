"""``proposer="auto"``: the heads shipped for the target, when there are some.

The target is recognised by the folder it was loaded from (``treespec.models.load`` names it
after the registry entry, e.g. ``smollm2-135m-instruct``). The choice: the shipped EAGLE head on
an EAGLE-2 dynamic tree of at most 31 drafted nodes whose size the adaptive budget picks each
step (``treespec.budget``), the forward-cost curve measured once per target and batch size and,
with it, what the budget learnt (:class:`treespec.budget.BudgetMemory`) kept across calls.
Without shipped heads: the n-gram trie, which needs nothing, under the same budget.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel

from treespec import heads
from treespec.budget import AdaptiveProposer, BudgetChooser, BudgetMemory, CostModel
from treespec.presets import EAGLE_TREE, NGRAM_TREE
from treespec.proposers.base import Proposer
from treespec.proposers.eagle import EagleProposer
from treespec.proposers.ngram import NgramProposer
from treespec.target import Target

_COSTS: dict[tuple[int, int], CostModel] = {}  # (id(model), batch size) -> measured forward costs
_MEMORY: dict[
    tuple[int, int, str], BudgetMemory
] = {}  # (id(model), batch size, proposer) -> what its budget learnt


def model_name(model: PreTrainedModel) -> str:
    return Path(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")).name


def auto_proposer(
    model: PreTrainedModel, *, batch_size: int = 1, target: Target | None = None, max_len: int | None = None
) -> Proposer:
    """The proposer ``proposer="auto"`` picks, for ``batch_size`` requests of at most ``max_len``
    context tokens each (None: the default, ``treespec.target.cache.default_max_len``)."""
    shipped = heads.shipped_for(model_name(model))
    key = (id(model), batch_size)
    if key not in _COSTS:
        _COSTS[key] = CostModel.measure(target or Target(model), batch_size=batch_size, repeats=3)
    if "eagle" in shipped:
        head = heads.load(shipped["eagle"], dtype=model.dtype, device=str(model.device))
        inner: Proposer = EagleProposer(head, model, **EAGLE_TREE, max_batch_size=batch_size, max_len=max_len)
    else:
        inner = NgramProposer(**NGRAM_TREE)
    memory = _MEMORY.setdefault((*key, type(inner).__name__), BudgetMemory())
    return AdaptiveProposer(inner, BudgetChooser(_COSTS[key]), memory=memory)
