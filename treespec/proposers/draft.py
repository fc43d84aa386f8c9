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

import torch
from transformers import PreTrainedModel

from treespec.proposers.base import ProposalRequest
from treespec.sampling import logits_to_probs
from treespec.target import Target
from treespec.tree import TokenTree, TreeShape, build_dynamic_tree, chain, words_to_tensor


class DraftModelProposer:
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
        generator: torch.Generator | None = None,
        dynamic: tuple[int, int, int] | None = None,
    ) -> None:
        """``dynamic=(top_k, depth, num_nodes)`` grows an EAGLE-2 dynamic tree over the draft's
        cumulative log-probabilities (``tree.build_dynamic_tree``) instead of ``shape``; its
        children are top-k, so it cannot be combined with ``sample``."""
        if dynamic is not None and sample:
            raise ValueError("dynamic trees keep top-k children: they cannot be combined with sample=True")
        self.draft = Target(draft_model, attention_backend=attention_backend)
        self.shape = shape or chain(4)
        self.dynamic = self._max_dynamic = dynamic
        if dynamic is not None:
            top_k, depth, num_nodes = dynamic
            if not (top_k >= 1 and depth >= 1 and 1 <= num_nodes <= top_k + (depth - 1) * top_k * top_k):
                raise ValueError(
                    f"dynamic=(top_k, depth, num_nodes) needs num_nodes <= top_k + (depth-1) top_k^2, got {dynamic}"
                )
        self.sampled_children = sample
        self.max_tree_nodes = dynamic[2] + 1 if dynamic is not None else self.shape.num_nodes
        self.vocab_size = self.draft.vocab_size
        if target_model is not None:
            check_same_vocabulary(target_model, draft_model)
        max_len = max_len or min(4096, self.draft.max_context or 4096)  # context tokens per request
        # The draft scores at most all drafted nodes at once (dynamic: every node of the pool's
        # ancestor forest), written past the cached context.
        self.cache = self.draft.new_cache(max_batch_size, max_len + self._max_forest())
        self.generator = generator
        self._slot: dict[int, int] = {}  # request id -> draft cache slot

    def set_budget(self, num_nodes: int, depth: int) -> None:
        """Dynamic trees only: at most ``num_nodes`` nodes, ``depth`` deep (never deeper than
        ``num_nodes``), from the next step on (clamped to the sizes given at construction)."""
        if self._max_dynamic is None:
            raise ValueError("set_budget needs a dynamic tree (DraftModelProposer(dynamic=...))")
        top_k, max_depth, max_nodes = self._max_dynamic
        nodes = max(1, min(num_nodes, max_nodes))
        depth = max(1, min(depth, max_depth, nodes))  # n nodes reach depth n at most: no idle levels
        while depth < max_depth and top_k + (depth - 1) * top_k * top_k < nodes:
            depth += 1
        self.dynamic = (top_k, depth, min(nodes, top_k + (depth - 1) * top_k * top_k))

    def _max_forest(self) -> int:
        if self.dynamic is None:
            return self.shape.num_nodes
        top_k, depth, _ = self.dynamic
        return 1 + top_k + (depth - 1) * top_k * top_k

    def propose(self, requests: list[ProposalRequest]) -> TokenTree:
        if self.dynamic is not None:
            return self._propose_dynamic(requests)
        root_logits = self._catch_up(requests)  # [B, V]
        shapes = [_truncate(self.shape, max(0, r.max_new - 1)) for r in requests]
        tokens = [[r.tokens[-1]] for r in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]  # per node: the dist. its children came from
        level_logits = root_logits[:, None]  # [B, nodes at the current depth, V]
        for depth in range(1, self.shape.max_depth + 1):
            frontier = [
                [n for n in range(len(tokens[b])) if shapes[b].depth[n] == depth - 1]
                for b in range(len(requests))
            ]
            for b, request in enumerate(requests):
                for slot_in_level, node in enumerate(frontier[b]):
                    children = [c for c in range(shapes[b].num_nodes) if shapes[b].parents[c] == node]
                    dist = self._distribution(level_logits[b][slot_in_level], request)
                    probs[b].append(dist)
                    picks = self._pick(dist, len(children), request)
                    tokens[b] += picks.tolist()
            if not any(shape.max_depth > depth for shape in shapes):
                break  # no request grows deeper
            level_logits = self._score_level(requests, tokens, shapes, depth)
        return self._tree(requests, tokens, shapes, probs)

    def _propose_dynamic(self, requests: list[ProposalRequest]) -> TokenTree:
        """EAGLE-2 growth driven by the draft: ``expand`` scores the frontier's ancestor forest."""
        top_k, depth, num_nodes = self.dynamic
        depth = max(1, min(depth, min(r.max_new for r in requests) - 1))
        num_nodes = min(num_nodes, top_k + (depth - 1) * top_k * top_k)
        root_logprobs = torch.log_softmax(self._catch_up(requests).float(), -1)  # [B, V]
        roots = torch.tensor([r.tokens[-1] for r in requests])
        # The drafted pool per request, in the builder's id order: id 0 the root, then children.
        pool_tokens = [
            [r.tokens[-1]] + root_logprobs[b].topk(top_k).indices.tolist() for b, r in enumerate(requests)
        ]
        pool_parents = [[-1] + [0] * top_k for _ in requests]

        def expand(step: int, frontier_tokens: torch.Tensor, frontier_ids: torch.Tensor) -> torch.Tensor:
            logits = self._score_forest(requests, pool_tokens, pool_parents, frontier_ids.tolist())
            logprobs = torch.log_softmax(logits.float(), -1)  # [B, K, V]
            children = logprobs.topk(top_k, dim=-1).indices.tolist()  # what the builder will pick
            for b in range(len(requests)):
                for i, node in enumerate(frontier_ids[b].tolist()):
                    pool_tokens[b] += children[b][i]
                    pool_parents[b] += [node] * top_k
            return logprobs

        return build_dynamic_tree(roots, root_logprobs, expand, top_k=top_k, depth=depth, num_nodes=num_nodes)

    def _score_forest(self, requests, pool_tokens, pool_parents, frontier_ids) -> torch.Tensor:
        """Draft logits at each frontier node [B, K, V]: its ancestors (below the cached root)
        and itself go through the draft as a forest, in id order (parents before children)."""
        forests, parents, depths, cu = [], [], [], [0]
        for b in range(len(requests)):
            keep: set[int] = set()
            for node in frontier_ids[b]:
                while node > 0 and node not in keep:
                    keep.add(node)
                    node = pool_parents[b][node]
            order = sorted(keep)
            position = {node: i for i, node in enumerate(order)}
            forests.append(order)
            parents.append([position.get(pool_parents[b][n], -1) for n in order])
            depth_of: dict[int, int] = {}
            for n in order:
                depth_of[n] = 0 if pool_parents[b][n] == 0 else depth_of[pool_parents[b][n]] + 1
            depths.append([depth_of[n] for n in order])
            cu.append(cu[-1] + len(order))
        width = max(1, -(-max(len(f) for f in forests) // 32))
        slots = [self._slot[r.request_id] for r in requests]
        out = self.draft.forward(
            torch.tensor([pool_tokens[b][n] for b, f in enumerate(forests) for n in f], dtype=torch.long),
            self.cache, torch.tensor(cu), torch.tensor(slots),
            tree_mask=torch.cat([_forest_mask(p, width) for p in parents]),
            depth=torch.tensor([d for ds in depths for d in ds], dtype=torch.long), return_hidden=False,
        )  # fmt: skip
        rows = [[cu[b] + forests[b].index(node) for node in frontier_ids[b]] for b in range(len(requests))]
        return out.logits[torch.tensor(rows)]  # [B, K, V]

    def observe(self, request_id: int, committed: list[int]) -> None:
        """Nothing to do: the next catch-up feeds the committed tokens."""

    def release(self, request_id: int) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self.cache.free(slot)

    # -- steps ---------------------------------------------------------------------------------

    def _catch_up(self, requests: list[ProposalRequest]) -> torch.Tensor:
        """Feed each request's uncached context (ending with the root); return the root logits."""
        chunks = []
        for request in requests:
            if request.request_id not in self._slot:
                self._slot[request.request_id] = self.cache.allocate()
            cached = self.cache.lengths[self._slot[request.request_id]]
            chunks.append(request.tokens[cached:])
        cu = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0)
        slots = [self._slot[r.request_id] for r in requests]
        out = self.draft.forward(
            torch.tensor([t for c in chunks for t in c]), self.cache, cu, torch.tensor(slots),
            logit_rows=cu[1:] - 1, return_hidden=False,
        )  # fmt: skip
        self.cache.commit(slots, [range(len(c)) for c in chunks])
        return out.logits

    def _score_level(self, requests, tokens, shapes, depth) -> list[torch.Tensor]:
        """Run every drafted node so far (a forest under the cached root); logits of the deepest level."""
        forests = [tokens[b][1:] for b in range(len(requests))]
        parents = [[p - 1 for p in shapes[b].parents[1 : len(tokens[b])]] for b in range(len(requests))]
        depths = [[d - 1 for d in shapes[b].depth[1 : len(tokens[b])]] for b in range(len(requests))]
        sizes = [len(f) for f in forests]
        cu = torch.tensor([0] + sizes).cumsum(0)
        width = max(1, -(-max(sizes) // 32))
        mask = torch.cat(
            [_forest_mask(p, width) for p in parents if p] or [torch.zeros(0, width, dtype=torch.int32)]
        )
        slots = [self._slot[r.request_id] for r in requests]
        out = self.draft.forward(
            torch.tensor([t for f in forests for t in f], dtype=torch.long), self.cache, cu, torch.tensor(slots),
            tree_mask=mask, depth=torch.tensor([d for ds in depths for d in ds], dtype=torch.long), return_hidden=False,
        )  # fmt: skip
        starts = cu[:-1].tolist()
        return [
            out.logits[[starts[b] + i for i, d in enumerate(depths[b]) if d == depth - 1]]
            for b in range(len(requests))
        ]

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
            gumbel = -torch.log(
                -torch.log(torch.rand(dist.shape, generator=self.generator).clamp(1e-20, 1.0))
            )
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
                rows += probs[b] + [torch.zeros(self.vocab_size)] * (len(tokens[b]) - len(probs[b]))
            draft_probs = torch.stack(rows)
        return TokenTree.from_lists(tokens, parents, draft_probs=draft_probs)


def _forest_mask(parents: list[int], width: int) -> torch.Tensor:
    """Ancestor-and-self bits of a forest (parents -1 at its roots, before their children)."""
    bits: list[int] = []
    for node, parent in enumerate(parents):
        bits.append((bits[parent] if parent >= 0 else 0) | (1 << node))
    return words_to_tensor(bits, width)


def _truncate(shape: TreeShape, max_depth: int) -> TreeShape:
    """The shape cut at ``max_depth`` (a request close to max_new_tokens needs no deeper guesses)."""
    if max_depth >= shape.max_depth:
        return shape
    return TreeShape.from_paths([p for p in shape.paths if len(p) <= max_depth])


def check_same_vocabulary(target_model: PreTrainedModel, draft_model: PreTrainedModel) -> None:
    """The draft must speak the target's tokens: same output vocabulary size."""
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}); "
            "a draft model must share the target's tokenizer"
        )
