"""The proposer protocol: what the engine asks of every drafter, and what it tells it.

Each step, for the requests that are decoding, the engine calls ``propose`` with one
:class:`ProposalRequest` each and gets back one :class:`TokenTree` holding one tree per request,
in the same order. Node 0 of tree b must be ``requests[b].tokens[-1]`` (the root: the last
committed token, not yet in the target's cache). A tree may be the root alone: no speculation
for that request this step. After verification the engine calls ``observe`` with the tokens
that were committed for each request (accepted drafted tokens, then the bonus), and ``release``
when a request leaves.

A proposer's trees are verified by the engine with the greedy rule at temperature 0, and above
it with the sampled-children rule when ``sampled_children`` is True (each child drawn from the
tree's ``draft_probs`` row of its parent, without replacement), else the deterministic-children
rule (children chosen without looking at the verifier's coins, e.g. top-k). Both are lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class Proposer(Protocol):
    """What the engine calls. Small strategy objects: one file per proposer."""

    sampled_children: bool  # True: children are drawn from draft_probs without replacement
    max_tree_nodes: int  # the most nodes (root included) of any tree it returns; sizes the KV cache

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        """One tree per request, in order, rooted at each request's last committed token."""
        ...

    def observe(self, request_id: int, committed: list[int]) -> None:
        """The tokens committed for a request this step (accepted drafted tokens, then the bonus).

        A proposer with a true ``needs_hidden`` attribute (heads) is called as
        ``observe(request_id, committed, hidden)`` instead, ``hidden [len(committed), H]`` being the
        target's final hidden state at the node whose logits produced each committed token.
        Such a proposer also gets ``observe_prefill(request_id, tokens, hidden)`` for every
        prefill chunk: ``hidden[j]`` is the hidden state of the position just before
        ``tokens[j]`` (pairs (h_t, x_{t+1}), carried across chunk boundaries, so that any
        chunking delivers the same pairs; the prompt's last state comes with the first
        generated token through ``observe``). A proposer that names ``hidden_layers`` (EAGLE-3)
        gets, instead of the final state, the concatenated inputs of those target layers (HF
        ``hidden_states`` indices, 0 = the embeddings): rows of width ``len(hidden_layers) * H``.
        """
        ...

    def release(self, request_id: int) -> None:
        """The request left the batch; forget its state."""
        ...
