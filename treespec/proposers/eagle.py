"""EAGLE: feature-level autoregressive drafting with an EAGLE-2 dynamic tree.

The head keeps its own one-layer KV cache over the whole context. Cache position t holds the
pair (f_t, x_{t+1}): the target's feature at position t and the token after it. Pairs arrive
from the engine (``observe_prefill`` for every prefill chunk, with the one-token carry across
chunk boundaries; ``observe`` after every step, one pair per committed token) and are run
through the head as chains and committed:

- a prefill chunk's pairs run at once, so the head's prefill proceeds chunk by chunk;
- the pairs of the tokens committed last step wait for the next ``propose`` and run as one
  batched catch-up chain. They carry the target's features, not the head's guesses: the
  accepted path is committed to the head's cache as the target saw it (as EAGLE does). The last
  pair (f_{n-1}, root) gives h_{n-1}, the feature the root's children are drafted from.

Drafting (``tree.build_dynamic_tree``): the root's top-k children start the frontier; each
expansion runs the frontier's k nodes through the head as pairs (parent's output, node token),
their K/V written past the committed context, attending to the context and to their ancestors
among the nodes drafted so far (one tree mask, same attention backends as the target). Nothing
drafted is committed: the next catch-up writes what the target accepted. Children are top-k,
so the deterministic-children rule verifies them losslessly at any temperature.
"""

from __future__ import annotations

import copy
import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from treespec.heads.eagle import EagleHead
from treespec.heads.fit import TargetShape
from treespec.kernels.tree_attention import cpu_rows, resolve_backend
from treespec.presets import EAGLE_TREE
from treespec.processors import process_draft
from treespec.proposers.base import ProposalRequest, Proposer, StepResult, reduced_rows
from treespec.target import StepMetadata, linear
from treespec.target.cache import KVCache, default_max_len
from treespec.target.fused import (
    FusedEagleLayer,
    choose_native,
    describe_path,
    eagle_refusal,
    env_refusal,
    level_rows,
    native_refusal,
    say_once,
)
from treespec.tree import (
    NO_PARENT,
    TokenTree,
    budget_top_k,
    build_dynamic_tree,
    check_dynamic_budget,
    dynamic_capacity,
    extend_ancestors,
    fit_dynamic_budget,
    pack_bits,
)


class EagleProposer(Proposer):
    needs_hidden = True
    has_budget = True

    def __init__(
        self,
        head: EagleHead,
        target_model: PreTrainedModel,
        *,
        depth: int = EAGLE_TREE["depth"],
        top_k: int = EAGLE_TREE["top_k"],
        total_tokens: int = EAGLE_TREE["total_tokens"],
        max_batch_size: int = 8,
        max_len: int | None = None,
        attention_backend: str = "auto",
        linear_backend: str = "auto",
        readout_ids: Sequence[int] | torch.Tensor | None = None,
        fused: bool | None = None,
        native: bool | None = None,
    ) -> None:
        """``total_tokens`` drafted nodes at most (the root not counted), ``depth`` levels, each
        expansion keeping the ``top_k`` best children of the ``top_k`` best frontier nodes.
        ``max_batch_size`` requests at once (the engine admits no more). ``linear_backend`` as
        for the Target (:mod:`treespec.target.linear`): the head and the target's LM head it reads out
        through run as views with that backend; the modules passed in are left untouched.

        ``readout_ids``: an EAGLE-1 head reads out through these rows of the target's LM head
        only (a reduced draft vocabulary, as EAGLE-3 heads have their own; default: the head's
        own, ``d2t``, when it was trained with one): every level's
        read-out costs that fraction of the full one, and a token outside it is never drafted
        (the output is the target's either way). ``range(n)`` takes the first n ids, which a BPE
        tokenizer numbers roughly by frequency (docs/results/ measures what they cover). The
        rows are copied once (n x hidden values).

        ``fused``: run the head's pass as two C calls (:class:`treespec.target.fused.FusedEagleLayer`:
        ``fc``, then the decoder layer over the head's cache) instead of its modules. None (the
        default): where the head, the CPU and the backends allow (an EAGLE-1 head in bf16 on a
        CPU with treespec's kernels, linear and attention backends "auto" or treespec's),
        saying once why not elsewhere; True: required (refused with the reason); False: off.
        ``path`` and ``path_reason`` say which ran. Trees differ from the modules' only where
        the last bits (RMSNorm's and the attention's summation orders) tip a near tie; the output
        is the target's either way.

        ``native``: on the fused layer, draft each tree in one C call (levels, top-k, scores and
        the rerank inside: :meth:`FusedEagleLayer.draft_tree`) instead of one call per pass with
        the tree built by PyTorch operators. None (the default): wherever the fused layer runs
        and no request has processors; True: required; False: off. The same tree but for near
        ties (log-softmax's last bit)."""
        config = head.config
        target_config = target_model.config.get_text_config()
        target = TargetShape.of(target_model)
        target_vocab = target.vocab_size
        layers = target.feature_layers(config)
        target.check("the EAGLE head", hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                     feature_layers=layers)  # fmt: skip
        check_dynamic_budget(top_k, depth, total_tokens, vocab=config.readout_size,
                             names=("top_k", "depth", "total_tokens"))  # fmt: skip
        head = _follow_target(head, target_model)
        weight = head.fc.weight
        backend = linear.resolve_linear_backend(linear_backend, weight.device, target_model.dtype)
        self.head = linear.module_view(head, backend).eval()
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self._max = (depth, total_tokens)  # set_budget never exceeds what the cache was sized for
        self._max_top_k = top_k
        self.max_tree_nodes = total_tokens + 1
        self.max_batch_size = max_batch_size
        self.vocab_size = target_vocab
        self.hidden_layers = layers  # the engine hands these layers' inputs over (EAGLE-3)
        self.embed = target_model.get_input_embeddings()
        self._set_readout(head, target_model, readout_ids, backend)
        self.backend = resolve_backend(attention_backend, weight.device)
        self.fused, self.path_reason = _fused_layer(
            head, self._readout_weight, fused, backend, attention_backend
        )
        refusal = "the head does not run through the fused layer" if self.fused is None else None
        self.native, native_reason = choose_native(native, refusal or native_refusal(self.embed.weight))
        if self.native and self._column_ids is not None:
            self._column_ids = self._column_ids.long().contiguous()  # what the C tree reads
        self.path = "native tree" if self.native else "fused" if self.fused is not None else "modules"
        if self.fused is not None and not self.native:
            self.path_reason = native_reason
        self.max_context = max_len or default_max_len(getattr(target_config, "max_position_embeddings", None))
        drafted = 1 + (depth - 1) * top_k  # nodes run through the head per step, root pair included
        self.cache = KVCache(
            1, max_batch_size, config.num_key_value_heads, self.max_context + drafted, config.head_dim,
            dtype=weight.dtype, device=weight.device,
        )  # fmt: skip
        self.sm_scale = config.head_dim**-0.5
        self._slot: dict[int, int] = {}  # request id -> head cache slot
        self._pending: dict[int, list[tuple[list[int], torch.Tensor]]] = {}  # pairs not yet run

    def _set_readout(self, head: EagleHead, target_model: PreTrainedModel, readout_ids, backend: str) -> None:
        """The LM head the head reads out through (a view with ``backend``), reduced to
        ``readout_ids`` or the head's own trained read-out where it has one, and the token id of
        each of its columns (``_column_ids``; None: column c is token c)."""
        config = head.config
        self.lm_head = linear.module_view(target_model.get_output_embeddings(), backend)
        self.readout_ids = None
        if readout_ids is None and not config.eagle3 and config.draft_vocab_size is not None:
            readout_ids = head.target_ids()  # the head's own reduced read-out (trained with it)
        if readout_ids is not None:
            self.readout_ids, self.lm_head = self._reduced_readout(
                readout_ids, config, self.vocab_size, backend
            )
        own = config.eagle3 or config.draft_vocab_size is not None
        self._column_ids = (
            self.readout_ids if self.readout_ids is not None else (head.target_ids() if own else None)
        )
        # what the fused path reads out through (EAGLE-3: the head's own, after its norm)
        self._readout_weight = head.lm_head.weight if config.eagle3 else self.lm_head.weight

    def drafting_paths(self) -> dict[str, str]:
        return {"eagle head": describe_path(self.path, self.path_reason)}

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Draft at most ``num_nodes`` nodes, ``depth`` deep, from the next step on (within the
        sizes given at construction; see :func:`treespec.tree.fit_dynamic_budget`), each level
        expanding :func:`treespec.tree.budget_top_k` frontier nodes."""
        self.top_k = budget_top_k(self._max_top_k, num_nodes)
        self.depth, self.total_tokens = fit_dynamic_budget(self.top_k, *self._max, num_nodes, depth)

    # ---------------------------------------------------------------------------------------
    # What the engine tells the head
    # ---------------------------------------------------------------------------------------

    def observe_prefill(self, request_id: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """Run one prefill chunk's pairs (hidden[j], tokens[j]) through the head now."""
        self._pending.setdefault(request_id, []).append((list(tokens), hidden))
        self._catch_up([request_id])

    def observe(self, result: StepResult) -> None:
        """Queue each request's committed pairs (target feature, token) for the next catch-up."""
        for request in result.requests:
            if request.hidden is None:
                raise ValueError("EagleProposer needs the target's hidden states (needs_hidden = True)")
            if request.committed:
                self._pending.setdefault(request.request_id, []).append(
                    (list(request.committed), request.hidden)
                )

    def release(self, request_id: int) -> None:
        self._pending.pop(request_id, None)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.cache.free(slot)

    # ---------------------------------------------------------------------------------------
    # Drafting
    # ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        ids = [r.request_id for r in requests]
        if any(not self._pending.get(i) for i in ids):
            raise RuntimeError("propose() before observe(): the head has no pair ending at the root")
        # A request never gets a tree deeper than it can still commit; grouping by that depth
        # makes each request's tree independent of the batch it is proposed in.
        depths = [min(self.depth, r.max_new - 1) for r in requests]
        processed = any(r.sampling.has_processors for r in requests)
        if self.native and not processed and len(set(depths)) == 1 and depths[0] >= 1:
            # the catch-up in the tree's own call: the roots' features never leave it
            _, tokens, features, counts = self._take_pending(ids)
            tree, self.catch_up_s = self._draft_native(
                requests, None, depths[0], (tokens, torch.cat(features).to(self.embed.weight.dtype), counts)
            )
            return tree
        start = time.perf_counter()
        root_features = self._catch_up(ids)  # [B, H]: h_{n-1}, the feature after the root
        self.catch_up_s = time.perf_counter() - start
        if len(set(depths)) == 1:
            return self._draft(requests, root_features, depths[0])
        groups = [[b for b, d in enumerate(depths) if d == depth] for depth in sorted(set(depths))]
        trees = [self._draft([requests[b] for b in members], root_features[members], depths[members[0]])
                 for members in groups]  # fmt: skip
        order = [b for members in groups for b in members]  # request order -> its place in `trees`
        return TokenTree.concat(trees).select(sorted(range(len(order)), key=order.__getitem__))

    def _reduced_readout(
        self, readout_ids: Sequence[int] | torch.Tensor, config, target_vocab: int, backend: str
    ) -> tuple[torch.Tensor, nn.Module]:
        """(the ids, a linear layer over those rows of the target's LM head), checked."""
        if config.eagle3:
            raise ValueError(
                "readout_ids is for EAGLE-1 heads: an EAGLE-3 head reads out through its own layer"
            )
        ids, rows = reduced_rows(self.lm_head, readout_ids, target_vocab, self.top_k)
        return ids, linear.module_view(rows, backend).eval()

    def _log_probs(self, h: torch.Tensor, widen: bool) -> torch.Tensor:
        """Log-probabilities over the read-out's columns [T, V'] (their ids: ``_column_ids``),
        or with ``widen`` over the target's vocabulary [T, V] (-inf outside a reduced read-out),
        what the requests' processors read."""
        if self.fused is not None:  # the kernel, fp32 sums as the native tree reads them
            logits = self.fused.read_out(h, self._readout_weight)
        elif self.readout_ids is not None:
            logits = self.lm_head(h)
        else:
            logits = self.head.logits(h, self.lm_head)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if not widen or self._column_ids is None:
            return logprobs
        full = logprobs.new_full((logprobs.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self._column_ids, logprobs)

    def _draft(self, requests: list[ProposalRequest], root_features: torch.Tensor, depth: int) -> TokenTree:
        """One EAGLE-2 tree of ``depth`` levels per request, all of them the same depth."""
        if depth < 1:  # on the features' device: concat joins it to the drafted groups' trees
            return TokenTree.roots([r.tokens[-1] for r in requests]).to(root_features.device)
        processed = any(r.sampling.has_processors for r in requests)
        if self.native and not processed:
            return self._draft_native(requests, root_features, depth)[0]
        root_logprobs = self._log_probs(root_features, widen=processed)  # [B, V']
        if processed:  # the requests' processors steer the drafts too, each node on its own path
            root_logprobs = process_draft(root_logprobs, requests, range(len(requests)), [[]] * len(requests))
        level = _Levels(requests, [self._slot[r.request_id] for r in requests], root_features, processed)
        roots = torch.tensor([r.tokens[-1] for r in requests], device=root_features.device)
        return build_dynamic_tree(  # expand returns log_softmax outputs: no need to check them
            roots,
            root_logprobs,
            functools.partial(self._expand, level),
            top_k=self.top_k,
            depth=depth,
            num_nodes=min(self.total_tokens, dynamic_capacity(self.top_k, depth)),
            check=False,
            token_ids=None if processed else self._column_ids,
        )

    def _draft_native(
        self,
        requests: list[ProposalRequest],
        root_features: torch.Tensor | None,
        depth: int,
        catch_up: tuple[list[int], torch.Tensor, list[int]] | None = None,
    ) -> tuple[TokenTree, float]:
        """The same tree as :meth:`_draft` in one C call (``FusedEagleLayer.draft_tree``): every
        level, the top-k, the scores and the rerank inside, the head's weights hot in cache. With
        ``catch_up`` (the pending pairs' tokens, features and counts; ``root_features`` None) the
        catch-up runs first in the same call and is committed. Returns the tree and the
        catch-up's seconds."""
        num_nodes = min(self.total_tokens, dynamic_capacity(self.top_k, depth))
        flat, seconds = self.fused.draft_tree(
            self.embed.weight, self._readout_weight, self._column_ids, self.cache,
            ([self._slot[r.request_id] for r in requests], [r.tokens[-1] for r in requests]),
            root_features, (self.top_k, depth, num_nodes), catch_up,
        )  # fmt: skip
        return TokenTree.equal_sized(flat, len(requests), depth, self.top_k), seconds

    def _expand(
        self, level: _Levels, step: int, frontier_tokens: torch.Tensor, parent_slots: torch.Tensor
    ) -> torch.Tensor:
        """The tree builder's expansion ``step``: run the frontier [B, K] through the head, each
        node from its parent's output in the previous expansion (the root's feature at step 1);
        the log-probs of their children [B, K, V'], after the processors where requests have them."""
        k, batch = self.top_k, len(level.requests)
        if step == 1:
            features = level.root_features[:, None].expand(-1, k, -1)
        else:
            previous = level.outputs[-1]
            features = previous.gather(1, parent_slots[..., None].expand(-1, -1, previous.shape[-1]))
        # Frontier nodes keep the same slot layout in every request, but their parents differ.
        run_parents = torch.where(parent_slots >= 0, (step - 2) * k + parent_slots, NO_PARENT)  # [B, K]
        h = self._run_level(level.slots, frontier_tokens, features, level.drafted, run_parents, step)
        level.outputs.append(h)
        log_probs = self._log_probs(h.flatten(0, 1), widen=level.processed)
        if level.processed:
            flat = level.extend_paths(frontier_tokens.tolist(), parent_slots.tolist(), step)
            log_probs = process_draft(
                log_probs, level.requests, [b for b in range(batch) for _ in range(k)], flat
            )
        return log_probs.view(batch, k, -1)

    def _run_level(
        self,
        slots: list[int],
        tokens: torch.Tensor,
        features: torch.Tensor,
        drafted: list[torch.Tensor],
        run_parents: torch.Tensor,
        step: int,
    ) -> torch.Tensor:
        """Run one expansion's frontier [B, K] through the head, on top of the committed context
        and the frontier nodes of the earlier expansions (their K/V already written past it).

        ``drafted[-1] [B, N, N]`` is, per request, the ancestor-and-self relation among the N
        nodes run so far (the context is every node's ancestor and not in it); ``run_parents
        [B, K]`` (each new node's parent's run index, -1: the root) extends it by this level, on
        the device. Run node j sits at depth j // K + 1: sequence position L + j // K. Returns
        the head's outputs [B, K, H]."""
        batch, k = tokens.shape
        device = tokens.device
        num_drafted = step * k  # all nodes run this step so far, this level's the last k
        drafted.append(extend_ancestors(drafted[-1], run_parents))
        if self.fused is not None:  # this level's rows only: the earlier ones' K/V are in the cache
            rows, committed = level_rows(self.cache, slots, k, num_drafted)
            h = self.fused.forward(self.embed.weight[tokens.flatten()], features.flatten(0, 1), committed + step - 1,
                                   self.cache, rows, pack_bits(drafted[-1][:, -k:]).flatten(0, 1))  # fmt: skip
            return h.view(batch, k, -1)
        mask = pack_bits(drafted[-1]).flatten(0, 1)  # [B * N, W]
        depth = torch.arange(num_drafted, device=device) // k
        meta = StepMetadata.build(
            self.cache, [num_drafted] * batch, slots, mask, depth.repeat(batch), backend=self.backend
        )
        new_rows = (
            torch.arange(batch, device=device)[:, None] * num_drafted
            + (num_drafted - k)
            + torch.arange(k, device=device)
        ).flatten()

        def attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            self.cache.write(0, meta.row_slots[new_rows], meta.row_pos[new_rows], key, value)
            q_all = q.new_zeros(batch * num_drafted, *q.shape[1:])  # earlier nodes' rows are unused
            q_all[new_rows] = q
            return meta.attend(0, q_all, sm_scale=self.sm_scale)[new_rows]

        weight = self.head.fc.weight
        h = self.head(
            self.embed(tokens.flatten()).to(weight.dtype),
            features.flatten(0, 1).to(weight.dtype),
            meta.q_positions.long()[new_rows],
            attention,
        )
        return h.view(batch, k, -1)

    @torch.inference_mode()
    def _catch_up(self, request_ids: list[int]) -> torch.Tensor:
        """Run every pending pair of these requests as chains and commit them to the head's cache.

        Returns the head's output at each request's last pair [B, H]."""
        slots, tokens, features, counts = self._take_pending(request_ids)
        device = self.head.fc.weight.device
        last = torch.tensor(list(itertools.accumulate(counts)), device=device) - 1
        if self.fused is not None:
            h = self._catch_up_fused(tokens, torch.cat(features), slots, counts)
            self.cache.commit(slots, [list(range(n)) for n in counts])
            return h[last]
        meta = StepMetadata.build(self.cache, counts, slots, backend=self.backend)

        def attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
            meta.write(0, key, value)
            return meta.attend(0, q, sm_scale=self.sm_scale)

        weight = self.head.fc.weight
        fused = self.head.fuse(torch.cat(features).to(weight.dtype))
        h = self.head(
            self.embed(torch.tensor(tokens, device=device)).to(weight.dtype),
            fused,
            meta.q_positions.long(),
            attention,
        )
        self.cache.commit(slots, [list(range(n)) for n in counts])
        return h[last]

    def _take_pending(
        self, request_ids: list[int]
    ) -> tuple[list[int], list[int], list[torch.Tensor], list[int]]:
        """Each request's head-cache slot (allocated on first use) and its pending pairs, taken
        from the queue: (slots, tokens, their target features as queued, per request the count)."""
        for rid in request_ids:
            if rid not in self._slot:
                self._slot[rid] = self.cache.allocate()
        tokens, features, counts = [], [], []
        for rid in request_ids:
            pairs = self._pending.pop(rid, [])
            tokens += [t for chunk, _ in pairs for t in chunk]
            features += [hidden for _, hidden in pairs]
            counts.append(sum(len(chunk) for chunk, _ in pairs))
        return [self._slot[rid] for rid in request_ids], tokens, features, counts

    def _catch_up_fused(
        self, tokens: list[int], features: torch.Tensor, slots: list[int], counts: list[int]
    ) -> torch.Tensor:
        """The catch-up chains through the fused layer: each request's pairs are new rows past
        its committed length, causal among themselves. Returns the head's outputs [T, H]."""
        for slot, count in zip(slots, counts, strict=True):
            self.cache.check_room(slot, count)
        cu = torch.tensor([0, *itertools.accumulate(counts)])
        prefix = torch.tensor([self.cache.lengths[s] for s in slots])
        rows = cpu_rows(cu, torch.tensor(slots), prefix, len(tokens))
        embeds = self.embed.weight[torch.tensor(tokens)]
        return self.fused.forward(
            embeds, features.to(embeds.dtype), rows[1] + rows[2], self.cache, rows, None, from_target=True
        )


def _fused_layer(
    head: EagleHead, readout: torch.Tensor, fused: bool | None, linear_backend: str, attention_backend: str
) -> tuple[FusedEagleLayer | None, str]:
    """(the head's fused layer or None, why not): ``fused`` as EagleProposer takes it; ``readout``
    the weight its read-out goes through (the kernel reads it unchecked). A bf16 head on a CPU
    that still runs through its modules says why, once."""
    if fused is False:
        return None, "fused=False"
    refusal = eagle_refusal(head)
    if refusal is None and not (readout.dtype is torch.bfloat16 and readout.is_contiguous()):
        refusal = f"the read-out weight is not contiguous bf16 ({readout.dtype})"
    if refusal is None and (linear_backend != "bf16-kernel" or attention_backend not in ("auto", "cpu")):
        refusal = (f"a backend was chosen (linear {linear_backend!r}, attention {attention_backend!r}); the fused "
                   "layer runs treespec's own kernels")  # fmt: skip
    if refusal is None:
        return FusedEagleLayer(head), ""
    if fused:
        raise ValueError(f"fused=True: {refusal}")
    weight = head.fc.weight
    if env_refusal() is None and weight.dtype is torch.bfloat16 and weight.device.type == "cpu":
        say_once(f"treespec drafts with the EAGLE head through its modules, not the fused layer: {refusal}")
    return None, refusal


def _follow_target(head: EagleHead, target_model: PreTrainedModel) -> EagleHead:
    """The head in the target's dtype and on its device: it reads the target's embeddings and LM
    head, so it runs in their precision (as a serving engine runs a draft in the model's dtype).
    A head that differs is copied and converted; the one passed in is left as it was."""
    weight = head.fc.weight
    if weight.dtype == target_model.dtype and weight.device == target_model.device:
        return head
    return copy.deepcopy(head).to(device=target_model.device, dtype=target_model.dtype)


@dataclass
class _Levels:
    """What one tree's expansions share: the requests, their head-cache slots, the root features,
    per request the ancestor-and-self relation among the nodes run so far (``drafted``, [B, N, N]
    per expansion), the head's outputs per expansion [B, K, H], and with processors each frontier
    node's path from the root."""

    requests: list[ProposalRequest]
    slots: list[int]
    root_features: torch.Tensor
    processed: bool
    drafted: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    paths: list[list[list[list[int]]]] = field(default_factory=list)  # per expansion, request, slot

    def __post_init__(self) -> None:
        device = self.root_features.device
        self.drafted.append(torch.zeros(len(self.requests), 0, 0, dtype=torch.bool, device=device))

    def extend_paths(self, tokens: list[list[int]], parents: list[list[int]], step: int) -> list[list[int]]:
        """This expansion's paths (each parent's path, then the node's token), flattened."""
        self.paths.append([
            [(self.paths[-1][b][p] if step > 1 else []) + [t] for t, p in zip(tokens[b], parents[b], strict=True)]
            for b in range(len(tokens))
        ])  # fmt: skip
        return [path for per_request in self.paths[-1] for path in per_request]
