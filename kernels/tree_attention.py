"""Tree-masked multi-query attention over a slotted KV cache: the PyTorch reference.

Every new token of every request in a step is one query row of a single flattened batch
(vLLM's layout). A query sees its request's whole committed prefix in the cache plus those new
tokens of its own request that the ancestor bitmask marks (itself and its ancestors in the token
tree). A prefill chunk is the degenerate case: a chain, i.e. causal (``tree_mask=None``).

Contract (the Triton kernel in its own issue has the same signature)::

    tree_attention(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask=None, *,
                   sm_scale, window=None, softcap=None, q_positions=None) -> out

      q               [T, Hq, D]       new tokens of all requests, back to back
      k_cache/v_cache [S, Hkv, L, D]   cache rows; the new tokens' K/V are already written at
                                       positions prefix_lens[b] + i (i = index within request b)
      cu_q            [B+1] int32      request b owns q rows cu_q[b]:cu_q[b+1]
      slots           [B] int32        cache row of request b (any subset of rows, any order)
      prefix_lens     [B] int32        committed tokens of request b, all visible to its new tokens
      tree_mask       [T, W] int32     bit j of word w in row t: new token 32*w+j of the same
                      or None          request is visible to row t (ancestors and self); None = causal
      q_positions     [T] int32        each new token's position in its sequence (prefix_lens[b] +
                      or None          depth); required with `window`: a key at position p is
                                       visible to a query at position P only if P - p < window
      out             [T, Hq, D]       q's dtype; Hq a multiple of Hkv (grouped-query attention)

The reference pads the ragged batch to [B, n_max] queries and [B, L_max] keys with a dense
boolean mask, then runs one scaled-dot-product attention. The mask depends only on the step's
metadata, so callers that run many layers per step build an :class:`AttentionPlan` once and call
:func:`attend` per layer; :func:`tree_attention_ref` does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BITS_PER_WORD = 32


@dataclass(frozen=True)
class AttentionPlan:
    """Step metadata expanded into padded gather indices and a dense visibility mask.

    Shapes (B requests, T query rows, n_max = longest request, L_max = longest key range):
        row_request [T]               request b of each query row
        row_index   [T]               index i of each row within its request
        kv_len      [B]               prefix_lens + new tokens: keys each request attends to
        visible     [B, n_max, L_max] bool; padded query rows see key 0 only (never NaN)
    """

    row_request: torch.Tensor
    row_index: torch.Tensor
    kv_len: torch.Tensor
    visible: torch.Tensor
    slot_index: torch.Tensor | slice  # cache rows of the requests; a slice when they are consecutive
    uniform: bool  # every request has n_max new tokens: padding q is a reshape
    all_visible: bool  # no key is masked (e.g. one request decoding one token): attention needs no mask

    @property
    def num_requests(self) -> int:
        return self.visible.shape[0]

    @property
    def max_queries(self) -> int:
        return self.visible.shape[1]

    @property
    def max_keys(self) -> int:
        return self.visible.shape[2]


def unpack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """[T, W] int32 bit words -> [T, 32*W] bool; column j is new token j of the same request."""
    shifts = torch.arange(BITS_PER_WORD, device=tree_mask.device, dtype=torch.int32)
    bits = (tree_mask.to(torch.int32)[:, :, None] >> shifts) & 1  # [T, W, 32]
    return bits.reshape(tree_mask.shape[0], -1).bool()


def build_plan(
    cu_q: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    *,
    window: int | None = None,
    q_positions: torch.Tensor | None = None,
) -> AttentionPlan:
    """Expand the ragged step metadata into padded indices and a dense mask (see the contract)."""
    device = cu_q.device
    cu_q = cu_q.long()
    prefix = prefix_lens.long()
    num_new = cu_q[1:] - cu_q[:-1]  # [B]
    kv_len = prefix + num_new
    # One host sync sizes the padded tensors and picks the fast paths.
    num_new_list, kv_len_list, slot_list = num_new.tolist(), kv_len.tolist(), slots.tolist()
    num_rows, n_max, l_max = sum(num_new_list), max(num_new_list, default=0), max(kv_len_list, default=0)

    row_request = torch.repeat_interleave(torch.arange(len(num_new), device=device), num_new)  # [T]
    row_index = torch.arange(num_rows, device=device) - cu_q[row_request]  # [T]

    key = torch.arange(l_max, device=device)
    rel = key[None, :] - prefix[:, None]  # [B, L_max]: index of the key among the new tokens
    is_new_key = (rel >= 0) & (rel < num_new[:, None])
    query = torch.arange(n_max, device=device)
    if tree_mask is None:
        new_visible = rel[:, None, :] <= query[None, :, None]  # causal chain
    else:
        bits = unpack_tree_mask(tree_mask)  # [T, 32W]
        bits_pad = bits.new_zeros(len(num_new), n_max, bits.shape[1])
        bits_pad[row_request, row_index] = bits
        column = rel.clamp(0, bits.shape[1] - 1)[:, None, :].expand(-1, n_max, -1)
        new_visible = torch.gather(bits_pad, 2, column)  # [B, n_max, L_max]
    visible = (rel < 0)[:, None, :] | (is_new_key[:, None, :] & new_visible)

    if window is not None:
        visible &= _window_mask(prefix, cu_q, q_positions, rel, is_new_key, row_request, row_index, window)

    is_padded_row = query[None, :] >= num_new[:, None]  # [B, n_max]
    visible[is_padded_row] = False
    visible[..., 0] |= is_padded_row  # a fully masked row would give NaN
    consecutive = (
        slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list))) if slot_list else False
    )
    slot_index = slice(slot_list[0], slot_list[0] + len(slot_list)) if consecutive else slots.long()
    uniform = len(set(num_new_list)) <= 1
    return AttentionPlan(row_request, row_index, kv_len, visible, slot_index, uniform, bool(visible.all()))


def _window_mask(prefix, cu_q, q_positions, rel, is_new_key, row_request, row_index, window):
    """[B, n_max, L_max] bool: key position p is visible from query position P iff P - p < window."""
    batch, l_max = rel.shape
    n_max = int((cu_q[1:] - cu_q[:-1]).max())
    q_pos = q_positions.long()
    q_pos_pad = q_pos.new_zeros(batch, n_max)
    q_pos_pad[row_request, row_index] = q_pos
    # Committed keys sit at their own sequence positions; a new key's position is its q_position.
    key_pos = torch.arange(l_max, device=rel.device).expand(batch, -1).clone()
    new_row = (cu_q[:-1, None] + rel.clamp(min=0)).clamp(max=max(len(q_pos) - 1, 0))
    key_pos = torch.where(is_new_key, q_pos[new_row], key_pos)
    return (q_pos_pad[:, :, None] - key_pos[:, None, :]) < window


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    *,
    sm_scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Run attention for one layer with a prebuilt plan. Shapes as in the module contract."""
    num_rows, num_heads, head_dim = q.shape
    batch, n_max, l_max = plan.visible.shape
    # PyTorch's CPU attention is several times slower in bf16/fp16 than in fp32, and the copy
    # out of the cache is needed anyway: compute in fp32 there, return q's dtype.
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    if plan.uniform:  # rows are request-major with n_max rows each: padding is a reshape
        q_pad = q.view(batch, n_max, num_heads, head_dim)
    else:
        q_pad = q.new_zeros(batch, n_max, num_heads, head_dim)
        q_pad[plan.row_request, plan.row_index] = q
    q_pad = q_pad.transpose(1, 2).to(compute)  # [B, Hq, n_max, D]
    k = k_cache[plan.slot_index, :, :l_max].to(compute)  # [B, Hkv, L_max, D]
    v = v_cache[plan.slot_index, :, :l_max].to(compute)
    mask = None if plan.all_visible else plan.visible[:, None]  # [B, 1, n_max, L_max]
    if softcap is None:
        out = F.scaled_dot_product_attention(q_pad, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)
    else:
        out = _attend_softcap(q_pad, k, v, plan.visible[:, None], sm_scale, softcap)
    out = out.transpose(1, 2).to(q.dtype)  # [B, n_max, Hq, D]
    if plan.uniform:
        return out.reshape(num_rows, num_heads, head_dim)
    return out[plan.row_request, plan.row_index]  # [T, Hq, D]


def _attend_softcap(q, k, v, mask, sm_scale, softcap):
    """Attention with tanh logit soft-capping (Gemma 2 style): s <- softcap * tanh(s / softcap)."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * sm_scale  # [B, Hq, n_max, L_max]
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor | None = None,
    *,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    q_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference tree attention; see the module docstring for the contract.

    Shape:
        q [T, Hq, D]; k_cache, v_cache [S, Hkv, L, D]; cu_q [B+1]; slots [B]; prefix_lens [B];
        tree_mask [T, W] or None; q_positions [T] or None -> out [T, Hq, D]
    """
    check_attention_inputs(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions)
    plan = build_plan(cu_q, slots, prefix_lens, tree_mask, window=window, q_positions=q_positions)
    return attend(q, k_cache, v_cache, plan, sm_scale=sm_scale, softcap=softcap)


def check_attention_inputs(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions):
    """Raise ValueError naming the first input that breaks the contract."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and k_cache == v_cache [S, Hkv, L, D], got q {tuple(q.shape)}, "
            f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(
            f"q heads/dim {tuple(q.shape[1:])} do not fit cache heads/dim "
            f"({k_cache.shape[1]}, {k_cache.shape[3]}): Hq must be a multiple of Hkv and D equal"
        )
    if cu_q.dim() != 1 or len(cu_q) != len(slots) + 1 or len(prefix_lens) != len(slots):
        raise ValueError(
            f"expected cu_q [B+1], slots [B], prefix_lens [B], got {len(cu_q)}, {len(slots)}, {len(prefix_lens)}"
        )
    if int(cu_q[-1]) != q.shape[0]:
        raise ValueError(f"cu_q[-1] = {int(cu_q[-1])} but q has {q.shape[0]} rows")
    num_new = cu_q[1:] - cu_q[:-1]
    max_new = int(num_new.max()) if len(slots) else 0
    if len(slots) and int((prefix_lens + num_new).max()) > k_cache.shape[2]:
        raise ValueError(f"prefix + new tokens exceed the cache length {k_cache.shape[2]}")
    if tree_mask is not None and (
        tree_mask.shape[0] != q.shape[0] or BITS_PER_WORD * tree_mask.shape[1] < max_new
    ):
        raise ValueError(
            f"tree_mask must be [T={q.shape[0]}, W >= {-(-max_new // BITS_PER_WORD)}], got {tuple(tree_mask.shape)}"
        )
    if window is not None and (q_positions is None or q_positions.shape != (q.shape[0],)):
        raise ValueError("window needs q_positions of shape [T] (each new token's sequence position)")
