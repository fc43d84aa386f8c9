"""A smaller causal LM as the drafter, proposing a static tree (a chain is the degenerate one).

The draft runs through the same wrapper and cache machinery as the target, with its own KV
cache. Each step, per request:

1. **Catch up**: the context tokens the draft has not cached yet (the tokens committed last
   step, ending with the root) go through the draft as a chain and are committed to its cache.
   The root's row gives the distribution of depth-1 children.
2. **Draft level by level**: the tree grows one depth at a time. All drafted nodes so far go
   through the draft as new tokens on top of the cached context (a forest under the root, with
   its ancestor mask); the rows of the deepest level give their children. Drafted K/V are never
   committed: the next catch-up writes whatever the target accepted. Re-scoring the drafted
   nodes each level costs depth x nodes draft tokens per step instead of nodes, which is what a
   contract with cached tree nodes (EAGLE-style) would save; for small drafts this is cheap.

Children of a node are its ``k`` best tokens (``sample=False``: the deterministic-children rule
verifies them) or ``k`` tokens drawn without replacement from the draft's distribution after the
request's temperature, top-k and top-p (``sample=True``, at temperature > 0: the sampled-children
rule, with ``draft_probs`` on the tree). At temperature 0 children are always the top-k.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from treespec.heads.draft import readout_ids as carried_readout_ids
from treespec.kernels import cpu_kernels
from treespec.processors import process_draft, tree_paths
from treespec.proposers.base import ProposalRequest, Proposer, reduced_rows
from treespec.sampling import logits_to_probs
from treespec.target import Target, linear
from treespec.target.cache import default_max_len
from treespec.target.fused import choose_native, describe_path, draft_tree, level_rows, native_refusal
from treespec.tree import (
    BITS_PER_WORD,
    NO_PARENT,
    TokenTree,
    TreeShape,
    build_dynamic_tree,
    chain,
    check_dynamic_budget,
    dynamic_capacity,
    extend_ancestors,
    fit_dynamic_budget,
    pack_ancestor_mask,
    pack_bits,
)


class DraftModelProposer(Proposer):
    """Proposes a static ``TreeShape`` of draft tokens per request from a smaller causal LM."""

    def __init__(
        self,
        draft_model: PreTrainedModel,
        *,
        shape: TreeShape | None = None,
        sample: bool = False,
        target_model: PreTrainedModel | None = None,
        max_batch_size: int = 8,
        max_len: int | None = None,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        generator: torch.Generator | None = None,
        dynamic: tuple[int, int, int] | None = None,
        readout_ids: Sequence[int] | torch.Tensor | None = None,
        native: bool | None = None,
    ) -> None:
        """``readout_ids``: the draft reads out through these rows of its LM head only (a reduced
        draft vocabulary, as for EAGLE and Medusa heads); a token outside is never drafted, the
        output is the target's either way. None: the ids the draft carries where it was trained
        with its own (``treespec.heads.draft.set_readout_ids``), else every row. ``dynamic=(top_k, depth, num_nodes)`` grows an EAGLE-2 dynamic tree over the draft's
        cumulative log-probabilities (``tree.build_dynamic_tree``) instead of ``shape``; its
        children are top-k, so it cannot be combined with ``sample``. ``max_batch_size``
        requests at once (the engine admits no more). With ``sample=True`` the draws use
        ``generator`` (on the draft's device) or the default generator of that device.

        ``native``: a dynamic tree on the fused decoder is drafted in one C call (every level,
        top-k, scores and the rerank inside; :func:`treespec.target.fused.draft_tree`), skipping
        the frontier nodes no kept node can descend from: the tree the level-by-level path builds.
        None (the default): wherever it can and no request has processors; True: required (refused
        with the reason); False: off. ``path`` and ``path_reason`` say which ran."""
        if dynamic is not None and sample:
            raise ValueError("dynamic trees keep top-k children: they cannot be combined with sample=True")
        self.draft = Target(draft_model, attention_backend=attention_backend, linear_backend=linear_backend)
        self.shape = shape or chain(4)
        self.dynamic = self._max_dynamic = dynamic
        self.has_budget = dynamic is not None
        if dynamic is not None:
            top_k, depth, num_nodes = dynamic
            check_dynamic_budget(top_k, depth, num_nodes, vocab=self.draft.vocab_size,
                                 names=("dynamic top_k", "depth", "num_nodes"))  # fmt: skip
        self.sampled_children = sample
        self.max_tree_nodes = dynamic[2] + 1 if dynamic is not None else self.shape.num_nodes
        self.vocab_size = self.draft.vocab_size
        self.max_batch_size = max_batch_size
        if target_model is not None:
            check_same_vocabulary(target_model, draft_model)
        max_len = max_len or default_max_len(self.draft.max_context)  # context tokens per request
        self.max_context = max_len
        # The draft scores at most all drafted nodes at once (dynamic: every frontier node of
        # every level), written past the cached context.
        self.cache = self.draft.new_cache(max_batch_size, max_len + self._max_forest())
        self.generator = generator
        self._slot: dict[int, int] = {}  # request id -> draft cache slot
        self.native = self._native(native)
        self.readout_ids, self.readout = None, None
        if readout_ids is None:
            readout_ids = carried_readout_ids(draft_model)
        if readout_ids is not None:
            top_k = dynamic[0] if dynamic is not None else self.shape.max_rank + 1
            self.readout_ids, rows = reduced_rows(
                draft_model.get_output_embeddings(), readout_ids, self.vocab_size, top_k
            )
            self.readout = linear.module_view(rows, self.draft.linear_backend).eval()

    def _native(self, native: bool | None) -> bool:
        """Whether dynamic trees are drafted in one C call (``native`` as the constructor takes it)."""
        if self.dynamic is None:
            refusal = "a static tree shape drafts level by level"
        elif self.draft.fused is None:
            refusal = f"the draft does not run through the fused decoder ({self.draft.path_reason})"
        else:
            refusal = native_refusal(self.draft.model.get_input_embeddings().weight)
        chosen, self._native_reason = choose_native(native, refusal)
        return chosen

    def drafting_paths(self) -> dict[str, str]:
        if self.native:
            return {"draft model": "native tree"}
        if self.draft.fused is not None and self.dynamic is not None:
            return {"draft model": describe_path("fused", self._native_reason)}
        return {"draft model": describe_path(self.draft.path, self.draft.path_reason)}

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Dynamic trees only: at most ``num_nodes`` nodes, ``depth`` deep, from the next step on
        (within the sizes given at construction; see :func:`treespec.tree.fit_dynamic_budget`)."""
        if self._max_dynamic is None:
            raise TypeError("set_budget needs a dynamic tree (DraftModelProposer(dynamic=...))")
        top_k, max_depth, max_nodes = self._max_dynamic
        depth, nodes = fit_dynamic_budget(top_k, max_depth, max_nodes, num_nodes, depth)
        self.dynamic = (top_k, depth, nodes)

    def _max_forest(self) -> int:
        if self.dynamic is None:
            return self.shape.num_nodes
        top_k, depth, _ = self.dynamic
        return depth * top_k

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        if self.dynamic is not None:
            return self._propose_dynamic(requests)
        root_logits = self._catch_up(requests)  # [B, V]
        shapes = [self.shape.cut(max(0, r.max_new - 1)) for r in requests]
        device = root_logits.device
        # Per request, its nodes' tokens so far as device tensors (the root first) and their count:
        # the shape is the host's, the picks stay on the device.
        tokens = [[torch.tensor([r.tokens[-1]], device=device)] for r in requests]
        counts = [1] * len(requests)
        probs: list[list[torch.Tensor]] = [[] for _ in requests]  # per node: the dist. its children came from
        level_logits = root_logits[:, None]  # [B, nodes at the current depth, V]
        for depth in range(1, self.shape.max_depth + 1):
            for b, request in enumerate(requests):
                frontier = [n for n in range(counts[b]) if shapes[b].depth[n] == depth - 1]
                paths = None
                if request.sampling.has_processors:  # host sync: processors read the paths' tokens
                    paths = tree_paths(torch.cat(tokens[b]).tolist(), shapes[b].parents[: counts[b]])
                for slot_in_level, node in enumerate(frontier):
                    children = [c for c in range(shapes[b].num_nodes) if shapes[b].parents[c] == node]
                    logits = level_logits[b][slot_in_level]
                    if paths is not None:  # the request's processors, on this node's path
                        logits = process_draft(logits[None], [request], [0], [paths[node]])[0]
                    dist = self._distribution(logits, request)
                    probs[b].append(dist)
                    tokens[b].append(self._pick(dist, len(children), request))
                    counts[b] += len(children)
            if not any(shape.max_depth > depth for shape in shapes):
                break  # no request grows deeper
            level_logits = self._score_level(requests, [torch.cat(t) for t in tokens], shapes, depth)
        return self._tree(requests, [torch.cat(t) for t in tokens], shapes, probs)

    def _propose_dynamic(self, requests: list[ProposalRequest]) -> TokenTree:
        """EAGLE-2 growth driven by the draft: ``expand`` scores every frontier node so far as a
        forest under the cached root and returns the newest level's log-probs."""
        top_k, depth, num_nodes = self.dynamic
        depth = max(1, min(depth, min(r.max_new for r in requests) - 1))
        num_nodes = min(num_nodes, dynamic_capacity(top_k, depth))
        processed = any(r.sampling.has_processors for r in requests)
        if self.native and not processed:  # the catch-up in the tree's own call
            tree, self.catch_up_s = self._native_tree(requests, (top_k, depth, num_nodes))
            return tree
        start = time.perf_counter()
        root_logits = self._catch_up(requests, widen=processed).float()  # [B, V']
        self.catch_up_s = time.perf_counter() - start
        root_logprobs = torch.log_softmax(root_logits, -1)
        roots = torch.tensor([r.tokens[-1] for r in requests], device=root_logprobs.device)
        levels: list[tuple[torch.Tensor, torch.Tensor]] = []  # per expansion: frontier tokens, parent slots
        paths: list[list[list[int]]] = []  # per expansion: per request, per frontier slot
        if processed:  # the requests' processors steer the drafts, each node on its own path
            root_logprobs = process_draft(root_logprobs, requests, range(len(requests)), [[]] * len(requests))

        def expand(step: int, frontier_tokens: torch.Tensor, parent_slots: torch.Tensor) -> torch.Tensor:
            levels.append((frontier_tokens, parent_slots))
            logits = self._score_levels(requests, levels, widen=processed)  # [B, K, V']
            log_probs = torch.log_softmax(logits.float(), -1)
            if processed:
                paths.append(_extend_paths(paths[-1] if step > 1 else None, frontier_tokens, parent_slots))
                log_probs = _process_frontier(log_probs, requests, paths[-1])
            return log_probs

        return build_dynamic_tree(  # expand returns log_softmax outputs: no need to check them
            roots,
            root_logprobs,
            expand,
            top_k=top_k,
            depth=depth,
            num_nodes=num_nodes,
            check=False,
            token_ids=None if processed else self.readout_ids,
        )

    def _native_tree(self, requests, shape: tuple[int, int, int]) -> tuple[TokenTree, float]:
        """The tree :meth:`_propose_dynamic` builds level by level, in one C call over the fused
        decoder (fp32 read-out logits, as :meth:`_read_out` gives them there), the catch-up on
        the uncached context run first in the same call and committed. Returns the tree and the
        catch-up's seconds."""
        fused = self.draft.fused
        readout = (
            (fused.lm_head, None, None)
            if self.readout is None
            else (self.readout.weight, self.readout_ids, None)
        )
        slots, chunks = self._uncached(requests)
        flat, seconds = draft_tree(
            fused.tree_stack(), fused.rotary, readout, self.cache, (slots, [r.tokens[-1] for r in requests]),
            (None, None), shape, ([t for c in chunks for t in c], None, [len(c) for c in chunks]),
        )  # fmt: skip
        top_k, depth, _ = shape
        return TokenTree.equal_sized(flat, len(requests), depth, top_k), seconds

    def _score_levels(self, requests, levels, widen: bool = True) -> torch.Tensor:
        """Draft logits at the newest frontier [B, K, V'] (``widen``: over the whole vocabulary,
        see ``_forward``). The frontier nodes so far are a forest under the cached root, level by
        level (node l * K + i is slot i of level l, its parent slot ``parent_slots[i]`` of level
        l - 1; level 0's parent is the root, which is cached). Through the fused decoder only the
        newest level runs (``_score_newest_level``); through the modules every level runs again."""
        k = levels[0][0].shape[1]
        visible = torch.zeros(len(requests), 0, 0, dtype=torch.bool, device=levels[0][0].device)
        for level, (_, slots) in enumerate(levels):  # the forest's ancestor relation, on the device
            visible = extend_ancestors(visible, torch.where(slots >= 0, (level - 1) * k + slots, NO_PARENT))
        slots = [self._slot[r.request_id] for r in requests]
        if self.draft.fused is not None:
            return self._score_newest_level(slots, levels, visible, widen)
        return self._score_all_levels(slots, levels, visible, widen)

    def _score_newest_level(self, slots, levels, visible, widen: bool) -> torch.Tensor:
        """The newest level's rows alone through the fused decoder: the earlier levels' K/V were
        written past the cached context when they ran, with the bits a rerun would give them (the
        fused stack's rows are batch-invariant), so the logits are ``_score_all_levels``' bits."""
        tokens, k = levels[-1][0], levels[-1][0].shape[1]
        batch, num_run = tokens.shape[0], len(levels) * k
        rows, committed = level_rows(self.cache, slots, k, num_run)
        _, hidden, _ = self.draft.fused.forward(
            tokens.flatten(), committed + len(levels) - 1, self.cache, rows, pack_bits(visible[:, -k:]).flatten(0, 1),
            torch.zeros(0, dtype=torch.long),
        )  # fmt: skip
        return self._read_out(hidden, widen).view(batch, k, -1)

    def _score_all_levels(self, slots, levels, visible, widen: bool) -> torch.Tensor:
        """Every level's rows through the draft's forward, the newest level's logits."""
        k = levels[0][0].shape[1]
        device = levels[0][0].device
        tokens = torch.cat([level_tokens for level_tokens, _ in levels], dim=1)  # [B, L * K]
        batch, num_run = tokens.shape
        logits = self._forward(
            tokens.flatten(), self.cache, [num_run * b for b in range(batch + 1)], slots,
            tree_mask=pack_bits(visible).flatten(0, 1),
            depth=(torch.arange(num_run, device=device) // k).repeat(batch),
            logit_rows=(torch.arange(batch, device=device)[:, None] * num_run + num_run - k + torch.arange(k, device=device)).flatten(),
            widen=widen,
        )  # fmt: skip
        return logits.view(batch, k, -1)

    def _forward(
        self, *args, logit_rows: torch.Tensor | None = None, widen: bool = True, **kwargs
    ) -> torch.Tensor:
        """The draft's forward; logits [R, V] of ``logit_rows`` (None: every row), read out through
        the reduced rows when there are some: [R, V'] in their order, or with ``widen`` [R, V]
        with -inf outside them."""
        if self.readout is None and self.draft.fused is None:
            return self.draft.forward(*args, logit_rows=logit_rows, return_hidden=False, **kwargs).logits
        device = self.draft.device
        out = self.draft.forward(*args, logit_rows=torch.zeros(0, dtype=torch.long, device=device), **kwargs)
        return self._read_out(out.hidden if logit_rows is None else out.hidden[logit_rows], widen)

    def _read_out(self, hidden: torch.Tensor, widen: bool) -> torch.Tensor:
        """Logits of the draft's final normed rows over the reduced rows (``widen``: placed in
        the whole vocabulary, -inf elsewhere), or over its LM head where there are none. On the
        fused decoder in fp32 (the sums unrounded: the bits the one-call tree ranks by)."""
        if self.draft.fused is not None:
            weight = self.draft.fused.lm_head if self.readout is None else self.readout.weight
            logits = cpu_kernels.linear_unchecked(hidden, weight, None, fp32_out=True)
        else:
            logits = self.readout(hidden)
        if not widen or self.readout_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.readout_ids, logits)

    def release(self, request_id: int) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.cache.free(slot)

    # -- steps ---------------------------------------------------------------------------------

    def _uncached(self, requests: list[ProposalRequest]) -> tuple[list[int], list[list[int]]]:
        """Each request's draft-cache slot (allocated on first use) and the context tokens its
        cache does not hold yet (the tokens committed since its last tree, ending with the root;
        the whole prompt at its first)."""
        slots, chunks = [], []
        for request in requests:
            if request.request_id not in self._slot:
                self._slot[request.request_id] = self.cache.allocate()
            slots.append(self._slot[request.request_id])
            chunks.append(request.tokens[self.cache.lengths[slots[-1]] :])
        return slots, chunks

    def _catch_up(self, requests: list[ProposalRequest], widen: bool = True) -> torch.Tensor:
        """Feed each request's uncached context (ending with the root); return the root logits."""
        slots, chunks = self._uncached(requests)
        device = self.draft.device
        cu = list(itertools.accumulate((len(c) for c in chunks), initial=0))
        logits = self._forward(
            torch.tensor([t for c in chunks for t in c], device=device), self.cache, cu, slots,
            logit_rows=torch.tensor(cu[1:], device=device) - 1, widen=widen,
        )  # fmt: skip
        self.cache.commit(slots, [range(len(c)) for c in chunks])
        return logits

    def _score_level(self, requests, tokens, shapes, depth) -> list[torch.Tensor]:
        """Run every drafted node so far (a forest under the cached root); logits of the deepest level."""
        device = self.draft.device
        forests = [tokens[b][1:] for b in range(len(requests))]  # device tensors; structure on the host
        parents = [[p - 1 for p in shapes[b].parents[1 : len(tokens[b])]] for b in range(len(requests))]
        depths = [[d - 1 for d in shapes[b].depth[1 : len(tokens[b])]] for b in range(len(requests))]
        sizes = [len(f) for f in forests]
        cu = list(itertools.accumulate(sizes, initial=0))
        width = max(1, -(-max(sizes) // BITS_PER_WORD))
        mask = torch.cat([pack_ancestor_mask(p, forest=True, num_words=width) for p in parents if p])
        slots = [self._slot[r.request_id] for r in requests]
        rows = [cu[b] + i for b in range(len(requests)) for i, d in enumerate(depths[b]) if d == depth - 1]
        logits = self._forward(
            torch.cat(forests), self.cache, cu, slots, tree_mask=mask.to(device),
            depth=torch.tensor([d for ds in depths for d in ds], device=device),
            logit_rows=torch.tensor(rows, device=device),
        )  # fmt: skip
        counts = [sum(1 for d in depths[b] if d == depth - 1) for b in range(len(requests))]
        return list(logits.split(counts))

    def _distribution(self, logits: torch.Tensor, request: ProposalRequest) -> torch.Tensor:
        """The draft's distribution at a node: after the request's sampling rules when sampling."""
        if self.sampled_children and not request.sampling.greedy:
            return logits_to_probs(logits[None], request.sampling)[0]
        return torch.softmax(logits.float(), -1)

    def _pick(self, dist: torch.Tensor, count: int, request: ProposalRequest) -> torch.Tensor:
        if count == 0:
            return dist.new_zeros(0, dtype=torch.long)
        if self.sampled_children and not request.sampling.greedy:
            # Gumbel top-k: `count` draws without replacement, in draw order.
            uniform = torch.rand(dist.shape, generator=self.generator, device=dist.device)
            gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0)))
            scores = torch.where(dist > 0, dist.log() + gumbel, float("-inf"))
            return scores.topk(count).indices
        return dist.topk(count).indices

    def _tree(self, requests, tokens, shapes, probs) -> TokenTree:
        parents = [list(shapes[b].parents[: len(tokens[b])]) for b in range(len(requests))]
        draft_probs = None
        if self.sampled_children:
            # Shape nodes are ordered by depth, and every node above the deepest level got its
            # distribution in that order; the deepest level's rows are unused.
            rows = []
            for b in range(len(requests)):
                rows += probs[b] + [probs[b][0].new_zeros(self.vocab_size)] * (len(tokens[b]) - len(probs[b]))
            draft_probs = torch.stack(rows)
        return TokenTree.from_parents(torch.cat(tokens), parents, draft_probs=draft_probs)


def check_same_vocabulary(target_model: PreTrainedModel, draft_model: PreTrainedModel) -> None:
    """The draft must speak the target's tokens: same output vocabulary size."""
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}); "
            "a draft model must share the target's tokenizer"
        )


def _extend_paths(
    previous: list[list[list[int]]] | None, frontier_tokens: torch.Tensor, parent_slots: torch.Tensor
) -> list[list[list[int]]]:
    """Per request, per frontier slot: the drafted path to that slot (its parent's path, then its token)."""
    tokens, parents = frontier_tokens.tolist(), parent_slots.tolist()
    return [
        [
            (previous[b][p] if previous is not None else []) + [t]
            for t, p in zip(tokens[b], parents[b], strict=True)
        ]
        for b in range(len(tokens))
    ]


def _process_frontier(
    log_probs: torch.Tensor, requests: list[ProposalRequest], paths: list[list[list[int]]]
) -> torch.Tensor:
    """Each frontier node's log-probs [B, K, V'] through its request's processors, on its own path."""
    k = log_probs.shape[1]
    flat = [path for per_request in paths for path in per_request]
    rows = [b for b in range(len(requests)) for _ in range(k)]
    return process_draft(log_probs.flatten(0, 1), requests, rows, flat).view(log_probs.shape)
