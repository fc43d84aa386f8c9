"""The target's features on their way to a proposer that reads them (``needs_hidden``).

During prefill the proposer gets (hidden state, next token) pairs chunk by chunk; after every
step it gets, per request, the features of the rows whose logits produced a committed token.
"""

from __future__ import annotations

import torch

from treespec.engine.requests import Request
from treespec.engine.step_batch import StepBatch
from treespec.proposers.base import Proposer


class HiddenHandover:
    """Hands each prefill chunk's pairs to ``proposer`` as they come.

    h_t pairs with x_{t+1}. A chunk's last hidden state waits for the next chunk's first token
    (carried over the boundary); the prompt's last one pairs with the first generated token,
    which ``observe`` delivers. So every chunking yields the same pairs in order."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.carry: dict[int, torch.Tensor] = {}  # request id -> last hidden state of its latest chunk

    def prefill(self, hidden: torch.Tensor, batch: StepBatch, running: list[Request]) -> None:
        """The step's prefill chunks (``running``'s requests still prefilling, before their
        progress is counted), rows ``batch.cu[i]:batch.cu[i + 1]`` of ``hidden``."""
        for i, request in enumerate(running):
            if not request.prefilling or not request.speculate:
                continue
            rows = hidden[batch.cu[i] : batch.cu[i + 1]]
            tokens = request.prompt[request.num_prefilled : request.num_prefilled + len(rows)]
            carried = self.carry.pop(request.request_id, None)
            if carried is None:  # the prompt's first token follows no hidden state
                pair_tokens, pair_hidden = tokens[1:], rows[:-1]
            else:
                pair_tokens, pair_hidden = tokens, torch.cat([carried[None], rows[:-1]])
            if pair_tokens:
                self.proposer.observe_prefill(request.request_id, pair_tokens, pair_hidden)
            if request.request_id not in batch.final_chunk:
                self.carry[request.request_id] = rows[-1]


def committed_features(
    hidden: torch.Tensor,
    batch: StepBatch,
    running: list[Request],
    finishing: list[Request],
    decoding: list[Request],
    accepted: list[list[int]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per request, the target's features at each row whose logits produced a committed token:
    the prompt's last row for the first token; the root and accepted nodes after a tree."""
    rows = {r.request_id: (batch.cu[i], batch.cu[i + 1]) for i, r in enumerate(running)}
    prefill = [hidden[rows[r.request_id][1] - 1 : rows[r.request_id][1]] for r in finishing]
    decode = [
        hidden[[rows[r.request_id][0] + n for n in nodes]]
        for r, nodes in zip(decoding, accepted, strict=True)
    ]
    return prefill, decode
