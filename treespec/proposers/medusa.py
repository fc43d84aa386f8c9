"""Medusa: K heads on the target's hidden state at the last committed token's predecessor.

After each step the engine hands over the target's final hidden state at the node whose logits
produced the newest committed token (the root of the next tree). Head i's top-k from that state
are the candidates for depth i + 1; a static ``TreeShape`` picks which combinations to verify
(``tree.build_static_tree``, Medusa's way), or ``dynamic=(top_k, num_nodes)`` grows an
EAGLE-2 dynamic tree (``tree.build_dynamic_tree``) whose depth-(i+1) children are head i's top-k
under every frontier node, ranked by the product of the heads' probabilities along the path.
Children are top-k: the deterministic rule verifies them losslessly.

Conditioned heads (``MedusaConfig.conditioned``, Hydra's kind) read the tokens on the path
before their guess, so they draft a dynamic tree level by level: head i runs once per frontier
node, on the target's state and the embeddings of the root and the node's path. On treespec's
CPU kernels the levels, read-outs, top-k and rerank run in one C call, as an EAGLE head's do.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from treespec.heads.fit import TargetShape
from treespec.heads.medusa import MedusaHeads
from treespec.kernels import cpu_kernels
from treespec.proposers.base import ProposalRequest, Proposer, StepResult, reduced_rows
from treespec.target import linear
from treespec.target.fused import choose_native, describe_path, native_refusal
from treespec.tree import (
    TokenTree,
    TreeShape,
    budget_top_k,
    build_dynamic_tree,
    build_static_tree,
    chain,
    check_dynamic_budget,
    dynamic_capacity,
    fit_dynamic_budget,
)


class MedusaProposer(Proposer):
    needs_hidden = True

    def __init__(
        self,
        heads: MedusaHeads,
        target_model: PreTrainedModel,
        *,
        tree: TreeShape | None = None,
        dynamic: tuple[int, int] | None = None,
        linear_backend: str = "auto",
        readout_ids: Sequence[int] | torch.Tensor | None = None,
        native: bool | None = None,
    ) -> None:
        """A static ``tree`` (default: a chain over all heads), or ``dynamic=(top_k, num_nodes)``
        for an EAGLE-2 dynamic tree whose size ``set_budget`` can change. ``linear_backend`` as
        for the Target: the heads and the target's LM head run as views with it (the modules
        passed in are left untouched). ``readout_ids``: heads that read out through the target's
        LM head use only these rows of it (a reduced draft vocabulary, as for EAGLE heads): a
        token outside is never drafted, the output is the target's either way.

        Heads that read the target's LM head or embeddings run in the target's dtype and on its
        device (a converted copy where they differ; the heads passed in are left as they were).

        ``native``: on treespec's CPU kernels (linear backend "bf16-kernel"), a dynamic tree is
        built in one C call from the heads' fp32 logits (:func:`treespec.kernels.cpu_kernels.draft_tree_bf16`):
        the tree the PyTorch builder makes from the same logits. None (the default): wherever it
        can; True: required (refused with the reason); False: off."""
        config = heads.config
        target = TargetShape.of(target_model)
        target.check("the Medusa heads", hidden_size=config.hidden_size, vocab_size=config.vocab_size)
        target_vocab = target.vocab_size
        first = next(heads.parameters())
        if (not config.own_lm_head or config.conditioned) and (first.dtype, first.device) != (
            target_model.dtype,
            target_model.device,
        ):  # they read the target's LM head or embeddings: in its precision, as EAGLE heads do
            heads = copy.deepcopy(heads).to(device=target_model.device, dtype=target_model.dtype)
            first = next(heads.parameters())
        backend = linear.resolve_linear_backend(linear_backend, first.device, first.dtype)
        self.heads = linear.module_view(heads, backend).eval()
        self.heads_backend = backend
        self.shape = tree or chain(config.num_heads)
        if self.shape.max_depth > config.num_heads:
            raise ValueError(
                f"the tree is {self.shape.max_depth} deep but there are only {config.num_heads} heads"
            )
        if dynamic is not None:
            top_k, num_nodes = dynamic
            depth = config.num_heads
            if tree is not None:
                raise ValueError(f"dynamic={dynamic} grows its own tree: pass it or a static tree, not both")
            check_dynamic_budget(top_k, depth, num_nodes, vocab=config.vocab_size,
                                 names=("dynamic top_k", "heads", "num_nodes"))  # fmt: skip
        if config.conditioned and dynamic is None:
            raise ValueError(
                "conditioned Medusa heads draft level by level, each node's children from its own path: "
                "pass dynamic=(top_k, num_nodes), not a static tree"
            )
        self.dynamic = self._max_dynamic = dynamic
        self.has_budget = dynamic is not None
        self.embed = target_model.get_input_embeddings().weight if config.conditioned else None
        lm_head = target_model.get_output_embeddings()
        self.lm_head = None if config.own_lm_head else linear.module_view(lm_head, backend)
        self.readout_ids = None
        if readout_ids is not None:
            if config.own_lm_head:
                raise ValueError("readout_ids is for Medusa heads that read out through the target's LM head")
            top_k = dynamic[0] if dynamic is not None else self.shape.max_rank + 1
            self.readout_ids, rows = reduced_rows(lm_head, readout_ids, target_vocab, top_k)
            self.lm_head = linear.module_view(rows, backend).eval()
        self.max_tree_nodes = self.shape.num_nodes if dynamic is None else dynamic[1] + 1
        self.depth = self.shape.max_depth  # the deepest level drafted (set_budget: conditioned heads)
        self.vocab_size = target_vocab
        self._hidden: dict[int, torch.Tensor] = {}  # request id -> [H] hidden state behind its root
        self.native = self._native(native)
        if self.native and self.readout_ids is not None:
            self.readout_ids = self.readout_ids.long().contiguous()  # what the C tree reads
        self._table = cpu_kernels.medusa_table(self.heads) if self.native and config.conditioned else None

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        depth = min(self.depth, min(r.max_new for r in requests) - 1)
        weight = next(self.heads.parameters())
        roots = torch.tensor([r.tokens[-1] for r in requests], device=weight.device)
        if depth < 1:
            return TokenTree.roots([r.tokens[-1] for r in requests]).to(weight.device)
        shape = self.shape.cut(depth)
        hidden = torch.stack([self._hidden[r.request_id] for r in requests])  # [B, H]
        if self.embed is not None and self.native:
            return self._native_tree(roots, depth, hidden=hidden.to(weight.dtype).contiguous())
        if self.embed is not None:
            return self._conditioned(roots, hidden.to(weight.dtype), depth)
        logits = self._logits(hidden.to(weight.dtype))  # [B, K, V] (or the read-out's rows)
        if self.dynamic is not None and self.native:
            return self._native_tree(roots, depth, logits=logits[:, :depth].contiguous())
        if self.dynamic is not None:
            return self._dynamic(roots, logits[:, :depth], depth)
        candidates = logits.topk(shape.max_rank + 1, dim=-1).indices  # [B, K, k] distinct per row
        if self.readout_ids is not None:  # read-out columns -> token ids
            candidates = self.readout_ids[candidates]
        return build_static_tree(shape, roots, candidates, distinct=True)

    def _native(self, native: bool | None) -> bool:
        """Whether dynamic trees are built in one C call (``native`` as the constructor takes it)."""
        if self.dynamic is None:
            refusal = "a static tree shape takes each head's top-k as it is"
        elif self.heads.config.conditioned and self.heads.config.own_lm_head:
            refusal = "conditioned heads with their own LM heads read out through a matrix per head"
        elif self.heads_backend != "bf16-kernel":
            refusal = (
                f"the heads run on the linear backend {self.heads_backend!r}, not treespec's CPU kernels"
            )
        else:
            refusal = native_refusal()
        chosen, self._native_reason = choose_native(native, refusal)
        return chosen

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' logits [B, K, V']: on treespec's CPU kernels every read-out in fp32 (the
        sums unrounded: what the C tree ranks, on both paths)."""
        if self.heads_backend != "bf16-kernel":
            return self.heads(hidden, self.lm_head)
        features = [blocks(hidden) for blocks in self.heads.blocks]  # K x [B, H]
        if self.heads.lm_heads is None:
            rows = torch.stack(features, 1).flatten(0, 1)  # one read-out for every head
            return cpu_kernels.linear_unchecked(rows, self.lm_head.weight, None, fp32_out=True).unflatten(
                0, (len(hidden), len(features))
            )
        return torch.stack([cpu_kernels.linear_unchecked(f, head.weight, None, fp32_out=True)
                            for f, head in zip(features, self.heads.lm_heads, strict=True)], 1)  # fmt: skip

    def _native_tree(
        self,
        roots: torch.Tensor,
        depth: int,
        logits: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> TokenTree:
        """In one C call, the tree :meth:`_dynamic` builds from plain heads' ``logits`` [B, depth, V']
        (nothing runs per level), or the tree :meth:`_conditioned` builds from conditioned heads
        run on the target's states ``hidden`` [B, H] and each node's path (the heads, read-outs,
        top-k, scores and rerank inside)."""
        top_k, num_nodes = self.dynamic
        num_nodes = min(num_nodes, dynamic_capacity(top_k, depth))
        zeros = torch.zeros(len(roots), dtype=torch.long)
        config = self.heads.config
        if hidden is None:
            stack = (None, None, None, None, 0, None, (0, 0, 0, 0, 0), 0.0, 0.0)
            readout, rows, heads = (None, self.readout_ids, None), (None, logits.float()), 0
        else:
            stack = (self.embed, None, None, self._table[0], config.num_layers, None,
                     (config.hidden_size, 0, 0, 0, 0), 0.0, 0.0)  # fmt: skip
            readout, rows, heads = (
                (self.lm_head.weight, self.readout_ids, None),
                (hidden, None),
                config.num_heads,
            )
        flat, _ = cpu_kernels.draft_tree_bf16(
            stack, readout, None, None, None, None, (zeros, zeros, zeros, roots.long(), *rows),
            (top_k, depth, num_nodes), conditioned_heads=heads,
        )  # fmt: skip
        return TokenTree.equal_sized(flat, len(roots), depth, top_k)

    def _conditioned(self, roots: torch.Tensor, hidden: torch.Tensor, depth: int) -> TokenTree:
        """A dynamic tree from conditioned heads: level 0 from the root, then head ``step`` under
        each frontier node, reading the embeddings of that node's path (kept per frontier slot)."""
        top_k, num_nodes = self.dynamic
        batch, width = hidden.shape
        dtype = hidden.dtype

        def logprobs(step: int, rows: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
            features = self.heads.head_features(step, rows, paths)
            if self.heads_backend == "bf16-kernel" and self.lm_head is not None:  # fp32 sums, as the C tree's
                logits = cpu_kernels.linear_unchecked(features, self.lm_head.weight, None, fp32_out=True)
            else:
                logits = self.heads.readout(step, features, self.lm_head).float()
            return torch.log_softmax(logits, dim=-1)

        root = self.embed[roots].to(dtype)[:, None]  # [B, 1, H]: the root's embedding
        root_logprobs = logprobs(0, hidden, root)
        paths = root[:, None].expand(batch, top_k, 1, width)  # per frontier slot [B, K, step, H]
        rows = hidden[:, None].expand(batch, top_k, width).reshape(batch * top_k, width)

        def expand(step: int, frontier_tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
            nonlocal paths
            if step > 1:  # each frontier node's parent path, by the slot its parent had
                paths = paths.gather(1, parent_slots[:, :, None, None].expand(-1, -1, *paths.shape[2:]))
            paths = torch.cat([paths, self.embed[frontier_tokens].to(dtype)[:, :, None]], dim=2)
            return logprobs(step, rows, paths.flatten(0, 1)).unflatten(0, (batch, top_k))

        num_nodes = min(num_nodes, dynamic_capacity(top_k, depth))
        return build_dynamic_tree(roots, root_logprobs, expand, top_k=top_k, depth=depth, num_nodes=num_nodes,
                                  check=False, token_ids=self.readout_ids)  # fmt: skip

    def drafting_paths(self) -> dict[str, str]:
        if self.heads.config.conditioned:
            if self.native:
                return {"medusa heads": "conditioned heads, native tree"}
            return {
                "medusa heads": describe_path(
                    "conditioned heads, level by level (modules)", self._native_reason
                )
            }
        if self.heads_backend != "bf16-kernel":
            return {"medusa heads": f"modules (linear backend {self.heads_backend!r})"}
        if self.native:
            return {"medusa heads": "native tree"}
        return {"medusa heads": describe_path("one multi-row read-out", self._native_reason)}

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Dynamic trees only: at most ``num_nodes`` drafted nodes from the next step on (at most
        the number given at construction). Plain heads score every depth in one read-out, so their
        trees keep the constructed width and every head's depth. Conditioned heads run each
        level's frontier: ``depth`` deep at most and :func:`treespec.tree.budget_top_k` wide, as
        an EAGLE head's levels (see :func:`treespec.tree.fit_dynamic_budget`)."""
        if self._max_dynamic is None:
            raise TypeError("set_budget needs a dynamic tree (MedusaProposer(dynamic=...))")
        top_k, max_nodes = self._max_dynamic
        if self.heads.config.conditioned:
            top_k = budget_top_k(top_k, num_nodes)
            self.depth, num_nodes = fit_dynamic_budget(
                top_k, self.heads.config.num_heads, max_nodes, num_nodes, depth
            )
        self.dynamic = (top_k, max(1, min(num_nodes, max_nodes)))

    def _dynamic(self, roots: torch.Tensor, logits: torch.Tensor, depth: int) -> TokenTree:
        top_k, num_nodes = self.dynamic
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [B, depth, V]

        def expand(step: int, frontier_tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
            return logprobs[:, step, None].expand(-1, top_k, -1)  # head `step` under every frontier node

        num_nodes = min(num_nodes, dynamic_capacity(top_k, depth))
        return build_dynamic_tree(  # log_softmax outputs: no need to check them
            roots,
            logprobs[:, 0],
            expand,
            top_k=top_k,
            depth=depth,
            num_nodes=num_nodes,
            check=False,
            token_ids=self.readout_ids,
        )

    def observe(self, result: StepResult) -> None:
        """Keep, per request, the target's state behind its newest committed token."""
        for request in result.requests:
            if request.hidden is not None and len(request.hidden):
                self._hidden[request.request_id] = request.hidden[-1]

    def release(self, request_id: int) -> None:
        self._hidden.pop(request_id, None)
