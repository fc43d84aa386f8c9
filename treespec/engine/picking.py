"""How a step picks its tokens from the target's logits: the processors, the first token of a
finished prompt, and the verification table of the decoding requests' trees (the tree rejection
sampler, or plain decoding's pick when nothing was drafted)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from treespec.engine.requests import Request
from treespec.processors import RowContexts, process, tree_paths
from treespec.proposers.base import Proposer
from treespec.sampling import SamplingParams, argmax, logits_to_probs, next_tokens, sample_from_uniforms
from treespec.tree import TokenTree, host_structure
from treespec.verify import MEDUSA_TYPICAL, verify


@dataclass
class TokenPicker:
    """The engine's token choices. ``proposer`` None: plain decoding (its children rule is read
    for the verification mode); ``generator`` the engine's stream for requests without a seed;
    ``sampler`` "multinomial" (HF's draws) or "inverse-cdf"; ``debug`` checks each verification."""

    proposer: Proposer | None
    generator: torch.Generator | None
    sampler: str
    debug: bool

    def verify_table(
        self, decoding: list[Request], trees: TokenTree | None, logits: torch.Tensor
    ) -> torch.Tensor | None:
        """The verification table of the decoding requests ([B, 2 (D+1)] on the device, see
        :meth:`VerifyOutput.readback_table`), None without decoding requests."""
        if trees is None:
            return None
        roots_only = trees.num_nodes == len(decoding) and all(r.sampling.greedy for r in decoding)
        if self.proposer is None or roots_only:  # plain decoding: the next token the way HF picks it
            tokens = self.first_tokens(decoding, logits)  # (greedy roots only: what the tree sampler picks)
            return torch.stack([torch.zeros_like(tokens), tokens], 1)
        table = None
        for params, members in _group_by_sampling(decoding).items():
            sub_tree = trees.select(members)
            sub_logits = (
                logits
                if sub_tree is trees
                else logits[torch.tensor(trees.node_rows(members)).to(logits.device)]
            )
            eps, delta = params.typical_acceptance or MEDUSA_TYPICAL  # read only in typical mode
            uniforms = None
            if not params.greedy and params.seed is not None:  # each request draws from its own stream
                uniforms = torch.cat([
                    torch.rand(n, 2, generator=decoding[m].generator, device=logits.device)
                    for m, n in zip(members, sub_tree.sizes(), strict=True)
                ])  # fmt: skip
            result = verify(
                sub_tree, sub_logits, params, mode=self.mode(params), generator=self.generator,
                uniforms=uniforms, check=self.debug, typical_eps=eps, typical_delta=delta,
            )  # fmt: skip
            rows = result.readback_table(sub_tree)
            if table is None:
                if len(members) == len(decoding):
                    return rows
                table = rows.new_full((len(decoding), rows.shape[1]), -1)
            table[torch.tensor(members, device=table.device)] = rows
        return table

    @staticmethod
    def process(
        logits: torch.Tensor, finishing: list[Request], decoding: list[Request], trees: TokenTree | None
    ) -> torch.Tensor:
        """The logits rows after each request's processors (``treespec.processors``): a prompt's
        last row sees the prompt, a tree node the committed sequence and its own path (read from
        the device first when drafted there: one more host sync, in steps with processors only)."""
        requests = finishing + decoding
        if not any(r.sampling.has_processors for r in requests):
            return logits
        row_request, paths = [], []
        for b in range(len(finishing)):
            row_request.append(b)
            paths.append([])
        structure = host_structure([trees])[0] if trees is not None else ([0], [], [])
        cu, flat_tokens, flat_parents = structure
        tree_lists = [(flat_tokens[i:j], flat_parents[i:j]) for i, j in itertools.pairwise(cu)]
        for k, (tokens, parents) in enumerate(tree_lists):
            for path in tree_paths(tokens, parents):
                row_request.append(len(finishing) + k)
                paths.append(path)
        rows = RowContexts(
            [r.prompt + r.output for r in requests], [len(r.prompt) for r in requests],
            [r.sampling for r in requests], [r.eos_token_ids for r in requests], row_request, paths,
        )  # fmt: skip
        return process(logits, rows)

    def mode(self, params: SamplingParams) -> str:
        """The verification rule: greedy at temperature 0; above it typical acceptance when the
        request asks for it (lossy), else the lossless rule for how the proposer drew children."""
        if params.greedy:
            return "greedy"
        if params.typical_acceptance is not None:
            return "typical"
        return "sampled" if self.proposer.sampled_children else "deterministic"

    def first_tokens(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """One token per request from its logits row, [N] on the device: greedy, or sampled by
        the engine's sampler."""
        if all(r.sampling.greedy for r in requests):
            return argmax(logits)
        if self.sampler == "inverse-cdf":
            return self._inverse_cdf(requests, logits)
        return torch.cat([
            next_tokens(logits[i : i + 1], r.sampling, r.generator or self.generator).view(1)
            for i, r in enumerate(requests)
        ])  # fmt: skip

    def _inverse_cdf(self, requests: list[Request], logits: torch.Tensor) -> torch.Tensor:
        """Every row's distribution at once per sampling group, then one uniform per row from its
        request's stream (or the engine's, in row order) and the inverse CDF."""
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        for params, members in _group_by_sampling(requests).items():
            rows = logits[members]
            if params.greedy:
                picked = argmax(rows)
            else:
                uniforms = torch.cat([
                    torch.rand(1, generator=requests[m].generator or self.generator, device=logits.device)
                    for m in members
                ])  # fmt: skip
                picked = sample_from_uniforms(logits_to_probs(rows, params), uniforms)
            tokens[members] = picked
        return tokens


def _group_by_sampling(requests: list[Request]) -> dict[SamplingParams, list[int]]:
    groups: dict[SamplingParams, list[int]] = {}
    for i, request in enumerate(requests):
        groups.setdefault(request.sampling, []).append(i)
    return groups
