"""The proposer protocol: what the engine asks of every drafter, and what it tells it.

Each step, for the requests that are decoding, the engine calls ``propose`` with one
:class:`ProposalRequest` each and gets back one :class:`TokenTree` holding one tree per request,
in the same order. Node 0 of tree b must be ``requests[b].tokens[-1]`` (the root: the last
committed token, not yet in the target's cache). A tree may be the root alone: no speculation
for that request this step. After verification the engine calls ``observe`` once with a
:class:`StepResult` (per request: its tree, the accepted node indices, the committed tokens and,
for heads, the target's features at the accepted nodes), and ``release`` when a request leaves.

Everything a proposer may need or offer is declared on :class:`Proposer` with a default, so the
engine and the wrappers read attributes and never probe for them:

    sampled_children  True: children are drawn from the tree's ``draft_probs`` without
                      replacement (verified by the sampled-children rule above temperature 0);
                      False: chosen without the verifier's coins, e.g. top-k (deterministic rule).
    max_tree_nodes    the most nodes (root included) of any tree it returns; sizes the KV cache.
    max_batch_size    the most requests it can hold at once (None: no limit); the engine never
                      runs more decoding requests than this.
    vocab_size        the vocabulary it drafts from (None: any); must equal the target's.
    needs_hidden      True: the engine hands over target features (``observe_prefill`` for every
                      prefill chunk, ``StepResult`` rows after every step).
    hidden_layers     with ``needs_hidden``: () for the final normed hidden state, else the HF
                      ``hidden_states`` indices (0 = embeddings) whose rows are concatenated
                      (EAGLE-3's low, middle and high layers).
    has_budget        True: ``set_budget(num_nodes, depth)`` sizes the next trees (the adaptive
                      budget of ``treespec.budget`` drives it).
    max_context       the most context tokens per request (prompt + output) its own cache holds
                      (None: no limit); the engine refuses requests that could need more.

:class:`Capabilities` holds them as one frozen value (``proposer.capabilities``), and a proposer
that wraps another (:class:`WrappingProposer`: the adaptive budget, a benchmark's timer) reads
each one through from the wrapped proposer instead of copying it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn

from treespec.sampling import SamplingParams
from treespec.tree import TokenTree


@dataclass(frozen=True)
class ProposalRequest:
    """One decoding request as a proposer sees it."""

    request_id: int
    tokens: list[int]  # the committed context: prompt, then generated tokens; tokens[-1] is the root
    prompt_len: int  # tokens[:prompt_len] is the prompt
    sampling: SamplingParams
    max_new: int  # the most tokens this request can still commit (a longer proposal is wasted)


@dataclass(frozen=True)
class RequestResult:
    """What one step did for one request: the engine builds one per request from the step's
    read (tuples), cuts ``committed`` and ``hidden`` where the request finished, and hands them
    to ``observe``.

    The tree is the one the proposer returned for it. A request that has just finished its
    prefill reports the prompt's last token as a root-alone tree: its row produced the first
    generated token, exactly as a root's row produces a bonus.

    Fields (N nodes in the request's tree, C committed tokens, F feature width):
        tree_tokens   [N] the tree's tokens, node 0 the root
        tree_parents  [N] parent of each node within the tree, -1 at the root
        accepted      node indices the target kept, the root first, then the accepted path in order
        committed     [C] tokens appended to the output: the accepted drafted tokens, then the bonus,
                      cut after an EOS token or at max_new_tokens (so C <= len(accepted))
        hidden        [C, F] target features at the node whose logits produced each committed
                      token (``hidden[j]`` is the state at node ``accepted[j]``), or None when the
                      proposer does not need them
    """

    request_id: int
    tree_tokens: Sequence[int]
    tree_parents: Sequence[int]
    accepted: Sequence[int]
    committed: Sequence[int]
    hidden: torch.Tensor | None = None

    @property
    def num_accepted(self) -> int:
        """Drafted tokens the target accepted and the output kept (the bonus not counted)."""
        return min(len(self.accepted) - 1, len(self.committed))

    def rejected_at_last(self) -> bool:
        """True when the walk stopped at a node that had children (drafts were rejected there)."""
        return bool(self.accepted) and self.accepted[-1] in self.tree_parents


@dataclass(frozen=True)
class StepResult:
    """Everything one engine step committed, built once from verification, for the proposer."""

    requests: list[RequestResult]


@dataclass(frozen=True)
class Capabilities:
    """What a proposer declares (module docstring), as one value: ``proposer.capabilities``.
    Every field is given; the defaults a proposer starts from are :class:`Proposer`'s."""

    sampled_children: bool
    max_tree_nodes: int
    max_batch_size: int | None
    vocab_size: int | None
    needs_hidden: bool
    hidden_layers: tuple[int, ...]
    has_budget: bool
    max_context: int | None


CAPABILITIES = tuple(f.name for f in fields(Capabilities))


class Proposer(abc.ABC):
    """What the engine calls. Small strategy objects: one file per proposer.

    Subclasses override the capabilities they have (module docstring) and ``propose``; the
    other methods default to doing nothing.
    """

    sampled_children: bool = False
    max_tree_nodes: int = 1
    max_batch_size: int | None = None
    vocab_size: int | None = None
    needs_hidden: bool = False
    hidden_layers: tuple[int, ...] = ()
    has_budget: bool = False
    max_context: int | None = None
    # seconds the last ``propose`` spent catching the proposer's own cache up with the context
    # (not drafting): the adaptive budget leaves it out of the drafting cost it fits, since it
    # grows with the steps since the last tree, not with the tree
    catch_up_s: float = 0.0

    @abc.abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        """One tree per request, in order, rooted at each request's last committed token."""

    def observe(self, result: StepResult) -> None:  # noqa: B027 (a default: nothing to learn)
        """What the last step committed, per request (see :class:`RequestResult`)."""

    def observe_prefill(self, request_id: int, tokens: list[int], hidden: torch.Tensor) -> None:  # noqa: B027
        """One prefill chunk's (feature, next token) pairs, for proposers that ``needs_hidden``.

        ``hidden[j]`` is the feature of the position just before ``tokens[j]`` (pairs
        (h_t, x_{t+1}), carried across chunk boundaries, so that any chunking delivers the same
        pairs; the prompt's last state comes with the first generated token through ``observe``).
        Shape: tokens [n], hidden [n, F].
        """

    def release(self, request_id: int) -> None:  # noqa: B027 (a default: no state to forget)
        """The request left the batch; forget its state."""

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Draft at most ``num_nodes`` nodes (root excluded), ``depth`` deep, from the next step on.
        Only for proposers with ``has_budget``."""
        raise TypeError(f"{type(self).__name__} has no settable budget: its tree size is fixed")

    def drafting_paths(self) -> dict[str, str]:
        """What runs each of its models: {drafter: "fused" or "modules (why)"}; {} for a
        proposer without a model (n-gram lookup). ``treespec bench`` reports it per method."""
        return {}

    @property
    def capabilities(self) -> Capabilities:
        """This proposer's declarations now (a budget may change ``max_tree_nodes``)."""
        return Capabilities(**{name: getattr(self, name) for name in CAPABILITIES})


def _read_through(name: str) -> property:
    return property(lambda self: getattr(self.proposer, name), doc=f"the wrapped proposer's {name}")


class WrappingProposer(Proposer):
    """A proposer around another (``self.proposer``) that declares what the wrapped one declares:
    each capability reads through to it, so nothing is copied and nothing goes stale. A wrapper
    that changes one (the adaptive budget sets the size itself: ``has_budget`` is False) sets
    that one on its class. Every call a wrapper does not override goes to the wrapped proposer."""

    proposer: Proposer

    def __init__(self, proposer: Proposer) -> None:
        if not isinstance(proposer, Proposer):
            raise TypeError(f"expected a Proposer to wrap, got {type(proposer).__name__}")
        self.proposer = proposer

    sampled_children = _read_through("sampled_children")
    max_tree_nodes = _read_through("max_tree_nodes")
    max_batch_size = _read_through("max_batch_size")
    vocab_size = _read_through("vocab_size")
    needs_hidden = _read_through("needs_hidden")
    hidden_layers = _read_through("hidden_layers")
    has_budget = _read_through("has_budget")
    max_context = _read_through("max_context")

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        return self.proposer.propose(requests)

    def observe(self, result: StepResult) -> None:
        self.proposer.observe(result)

    def observe_prefill(self, request_id: int, tokens: list[int], hidden: torch.Tensor) -> None:
        self.proposer.observe_prefill(request_id, tokens, hidden)

    def release(self, request_id: int) -> None:
        self.proposer.release(request_id)

    def set_budget(self, num_nodes: int, depth: int) -> None:
        self.proposer.set_budget(num_nodes, depth)

    def drafting_paths(self) -> dict[str, str]:
        return self.proposer.drafting_paths()


def reduced_rows(
    lm_head: nn.Module, readout_ids: Sequence[int] | torch.Tensor, vocab_size: int, top_k: int
) -> tuple[torch.Tensor, nn.Linear]:
    """A reduced draft vocabulary over an LM head: (the ids on the head's device, a bias-free
    linear layer holding those rows, copied once), after checking the ids are distinct, in
    ``[0, vocab_size)`` and at least ``top_k`` of them."""
    ids = torch.as_tensor(list(readout_ids) if not torch.is_tensor(readout_ids) else readout_ids)
    if ids.dim() != 1 or len(ids) == 0 or ids.dtype.is_floating_point:
        raise ValueError(
            f"readout_ids must be a non-empty 1-D list of token ids, got {tuple(ids.shape)} {ids.dtype}"
        )
    ids = ids.long().cpu()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(ids.unique()) != len(ids):
        raise ValueError(f"readout_ids must be distinct token ids in [0, {vocab_size}), got min {int(ids.min())}, "
                         f"max {int(ids.max())}, {len(ids) - len(ids.unique())} repeated")  # fmt: skip
    if len(ids) < top_k:
        raise ValueError(f"readout_ids holds {len(ids)} tokens, fewer than top_k={top_k}")
    full = lm_head.weight
    rows = nn.Linear(full.shape[1], len(ids), bias=False, dtype=full.dtype, device=full.device)
    with torch.no_grad():
        rows.weight.copy_(full[ids.to(full.device)])
    return ids.to(full.device), rows
