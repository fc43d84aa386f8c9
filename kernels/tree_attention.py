"""Tree-masked multi-query attention over a slotted KV cache: a Triton kernel, its PyTorch twin
and a plain reference.

Every new token of every request in a step is one query row of a single flattened batch
(vLLM's layout). A query sees its request's whole committed prefix in the cache plus those new
tokens of its own request that the ancestor bitmask marks (itself and its ancestors in the token
tree). A prefill chunk is the degenerate case: a chain, i.e. causal (``tree_mask=None``).

Contract, shared by ``tree_attention_triton``, ``tree_attention_ref`` and ``tree_attention_naive``::

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

The file reads top to bottom: the Triton kernel (flash-attention online softmax, one program
per block of query tokens x all query heads of one KV head, optionally one slice of the prefix
for split-KV), its Python wrapper, the PyTorch reference, a plain reference, and
``tree_attention``, which picks the kernel or the PyTorch reference. A fourth backend, ``"cpu"``,
is treespec's batch-invariant C kernel for bf16 on x86-64 CPUs (:mod:`treespec.kernels.cpu_kernels`):
each query row and head computed alone over its visible keys in cache order, so that a tree
node gets the bits an autoregressive step would; it is chosen explicitly (a Target's
``batch_invariant`` mode), never by "auto". The PyTorch reference pads
the ragged batch to [B, n_max] queries and [B, L_max] keys with a dense boolean mask and runs one
scaled-dot-product attention, with fast paths; callers that run many layers per step build an
:class:`AttentionPlan` once and call :func:`attend` per layer. The plain reference,
``tree_attention_naive``, has no fast path: one query row at a time, it gathers the keys the
contract lets the row see and takes a softmax. It is the specification the tests check the other
two against, run in float64.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treespec.kernels import cpu_kernels
from treespec.tree import BITS_PER_WORD

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still runs; backend="triton" raises
    triton = None

BACKENDS = ("auto", "triton", "reference", "cpu")


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------

if triton is not None:
    _WORD_BITS = tl.constexpr(BITS_PER_WORD)  # a jitted kernel reads globals only as constexpr

    @triton.jit
    def _online_softmax_step(s, visible, v, m_i, l_i, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """Fold one key block into the running max m_i, normaliser l_i and output acc (base 2)."""
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _scores(
        q, k, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr
    ):
        """[R, N] logits in base 2: q.k * sm_scale, soft-capped if asked, times 1/ln(2)."""
        if UPCAST:  # the interpreter's tl.dot is wrong on bf16 operands
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s * qk_scale / softcap) - 1.0)
            return s * 1.4426950408889634  # 1/ln(2): exp2 instead of exp
        return s * (qk_scale * 1.4426950408889634)

    @triton.jit
    def _tree_attention_kernel(
        Q, K, V, Out, CuQ, Slots, PrefixLens, TreeMask, QPos, BlockRequest, BlockStart,
        PartialOut, PartialM, PartialL,
        sm_scale, softcap, window, split_len,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl,
        stride_ot, stride_oh, stride_mt,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_TREE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_M query tokens of one request x the GROUP query heads of KV head
        `kv_head`, over one slice of the prefix (split-KV) and, in the last slice, the new tokens.
        Each token takes GROUP_PAD rows (GROUP rounded up to a power of two, as tl.arange needs);
        the padding rows load zeros and are never stored."""
        block, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_splits = tl.num_programs(2)
        request = tl.load(BlockRequest + block)
        first = tl.load(BlockStart + block)  # index of the block's first token within the request
        q_start = tl.load(CuQ + request)
        num_new = tl.load(CuQ + request + 1) - q_start
        prefix = tl.load(PrefixLens + request)
        slot = tl.load(Slots + request).to(tl.int64)

        rows = tl.arange(0, BLOCK_M * GROUP_PAD)  # token-major, then the group's heads (padded)
        token = first + rows // GROUP_PAD
        head_in_group = rows % GROUP_PAD
        head = kv_head * GROUP + head_in_group
        row_ok = (token < num_new) & (head_in_group < GROUP)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        if HAS_WINDOW:
            q_pos = tl.load(QPos + q_rows, mask=row_ok, other=0)

        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
        k_base = K + slot * stride_ks + kv_head * stride_kh
        v_base = V + slot * stride_vs + kv_head * stride_vh
        keys = tl.arange(0, BLOCK_N)

        # (a) the committed prefix: no mask but its length (and the window); this program's slice
        lo = split * split_len
        hi = tl.minimum(prefix, lo + split_len)
        if HAS_WINDOW:  # keys before the block's earliest position minus the window are never seen
            earliest = tl.min(tl.where(row_ok, q_pos, 2147483647))
            lo = tl.maximum(lo, ((earliest - window + 1) // BLOCK_N) * BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            key = start + keys
            key_ok = key < hi
            kv_off = key.to(tl.int64)[:, None] * stride_kl + dims[None, :]
            k = tl.load(k_base + kv_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
            v = tl.load(v_base + kv_off, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
            s = _scores(q, k, sm_scale, softcap, HAS_SOFTCAP, UPCAST, PRECISION)
            visible = key_ok[None, :]
            if HAS_WINDOW:
                visible = visible & ((q_pos[:, None] - key[None, :]) < window)
            m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc, UPCAST, PRECISION)

        # (b) the new tokens, under the ancestor bitmask or causal: only in the last slice. A
        # node's ancestors come before it, so keys past the block's last token are never seen.
        new_hi = tl.where(split == num_splits - 1, tl.minimum(num_new, first + BLOCK_M), 0)
        for start in range(0, new_hi, BLOCK_N):
            j = start + keys
            j_ok = j < num_new
            kv_off = (prefix + j).to(tl.int64)[:, None] * stride_kl + dims[None, :]
            k = tl.load(k_base + kv_off, mask=j_ok[:, None] & dim_ok[None, :], other=0.0)
            v = tl.load(v_base + kv_off, mask=j_ok[:, None] & dim_ok[None, :], other=0.0)
            s = _scores(q, k, sm_scale, softcap, HAS_SOFTCAP, UPCAST, PRECISION)
            if HAS_TREE:
                word = tl.load(
                    TreeMask + q_rows[:, None] * stride_mt + (j // _WORD_BITS)[None, :],
                    mask=row_ok[:, None] & j_ok[None, :],
                    other=0,
                )
                visible = ((word >> (j % _WORD_BITS)[None, :]) & 1) != 0
            else:
                visible = j[None, :] <= token[:, None]
            visible = visible & j_ok[None, :]
            if HAS_WINDOW:
                k_pos = tl.load(QPos + q_start + j, mask=j_ok, other=0)
                visible = visible & ((q_pos[:, None] - k_pos[None, :]) < window)
            m_i, l_i, acc = _online_softmax_step(s, visible, v, m_i, l_i, acc, UPCAST, PRECISION)

        if SPLIT:  # partial results in base 2, combined by _combine_splits
            part = (block * tl.num_programs(1) + kv_head) * num_splits + split
            part_rows = part * (BLOCK_M * GROUP_PAD) + rows
            tl.store(PartialM + part_rows, m_i)
            tl.store(PartialL + part_rows, l_i)
            tl.store(PartialOut + part_rows[:, None] * BLOCK_D + dims[None, :], acc)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0 only on padded rows
            tl.store(
                Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                out.to(Out.dtype.element_ty),
                mask=row_ok[:, None] & dim_ok[None, :],
            )

    # Block sizes are tuned per (head dim, group, query block, tree/causal, split) on the GPU;
    # configurations that do not fit the chip's shared memory are pruned by the autotuner.
    _TUNING_CONFIGS = [
        triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_n in (32, 64, 128)
        for warps in (4, 8)
        for stages in (2, 3)
    ]
    _tree_attention_kernel_tuned = triton.autotune(
        _TUNING_CONFIGS, key=["HEAD_DIM", "GROUP", "BLOCK_M", "HAS_TREE", "SPLIT"]
    )(_tree_attention_kernel)


# --------------------------------------------------------------------------------------------
# Python wrapper
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TritonSchedule:
    """Which program does what: blocks of BLOCK_M query tokens, each within one request.

    Shapes (NB blocks, T new tokens):
        block_request [NB] int32   the request a block belongs to
        block_start   [NB] int32   index of its first token within that request
        token_block   [T] int32    the block that holds each new token (split-KV's combine)
        token_index   [T] int32    its index within that block
    """

    block_request: torch.Tensor
    block_start: torch.Tensor
    token_block: torch.Tensor
    token_index: torch.Tensor
    block_m: int
    num_splits: int
    split_len: int


def group_pad(group: int) -> int:
    """Rows a token takes in a block: the GQA group rounded up to a power of two (tl.arange's rule)."""
    return 1 << (group - 1).bit_length()


def schedule_blocks(
    num_new: Sequence[int],
    longest_prefix: int,
    group: int,
    *,
    device: torch.device | str,
    num_splits: int | None = None,
) -> TritonSchedule:
    """Cut every request's new tokens into blocks and decide the split-KV factor, from host values
    only (``num_new[b]``: new tokens of request b; ``longest_prefix``: max of prefix_lens).

    A block holds BLOCK_M tokens x GROUP_PAD rows = at least 16 rows (tl.dot's minimum), BLOCK_M
    a power of two. Split-KV (flash-decoding): when there are too few blocks to fill the GPU and
    the prefix is long, each block's prefix is cut into ``num_splits`` slices run by separate
    programs.
    """
    rows = 16 if max(num_new, default=1) <= 16 else 64  # decode-sized trees: small blocks
    block_m = max(1, rows // group_pad(group))  # a power of two: both are
    request, start, token_block, token_index = [], [], [], []
    for b, n in enumerate(num_new):
        for first in range(0, n, block_m):
            token_block += [len(request)] * min(block_m, n - first)
            token_index += range(min(block_m, n - first))
            request.append(b)
            start.append(first)
    if num_splits is None:
        # Aim for ~4 waves of 132 SMs (an H100/H200), slices of at least 512 keys.
        num_splits = max(1, min(math.ceil(528 / max(1, len(request))), math.ceil(longest_prefix / 512), 64))
    split_len = max(1, math.ceil(longest_prefix / num_splits))
    packed = torch.tensor(request + start + token_block + token_index, dtype=torch.int32, device=device)
    nb, t = len(request), len(token_block)  # one host-to-device copy, four views
    return TritonSchedule(
        packed[:nb], packed[nb : 2 * nb], packed[2 * nb : 2 * nb + t], packed[2 * nb + t :],
        block_m, num_splits, split_len,
    )  # fmt: skip


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_MAX_GROUP = 16  # query heads per KV head: BLOCK_M >= 1 token of GROUP_PAD <= 16 rows
# tl.dot needs every dimension >= 16 (head dims are padded to a power of two, so 80 is fine); past
# 256 a block's accumulator [rows, BLOCK_D] fp32 no longer fits the registers of one program.
TRITON_HEAD_DIMS = (16, 256)


def triton_layout_refusal(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the Triton kernel cannot serve this head layout, or None if it can (reads no device)."""
    layout = f"{num_heads} query heads over {num_kv_heads} KV heads, head dim {head_dim}, {dtype}"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        reason = "the query heads must be a multiple of the KV heads"
    elif num_heads // num_kv_heads > TRITON_MAX_GROUP:
        reason = f"it serves at most {TRITON_MAX_GROUP} query heads per KV head"
    elif not TRITON_HEAD_DIMS[0] <= head_dim <= TRITON_HEAD_DIMS[1]:
        reason = f"it serves head dims {TRITON_HEAD_DIMS[0]} to {TRITON_HEAD_DIMS[1]}"
    elif dtype not in TRITON_DTYPES:
        reason = f"it serves {', '.join(str(d) for d in TRITON_DTYPES)}"
    else:
        return None
    return (
        f"the Triton tree-attention kernel cannot serve {layout}: {reason}; "
        'attention_backend="reference" (the PyTorch reference) serves it'
    )


def _kernel_and_configs(block_d: int):
    """The autotuned kernel on a GPU; a fixed small BLOCK_N under the interpreter (nothing to tune).
    TREESPEC_TRITON_AUTOTUNE=0 takes one fixed GPU configuration instead: one compile per shape
    rather than twelve plus their timing, for tests on a GPU lent for minutes."""
    if interpreting():
        return _tree_attention_kernel, {"BLOCK_N": 16}
    if os.environ.get("TREESPEC_TRITON_AUTOTUNE", "1") == "0":
        block_n = 64 if block_d <= 128 else 32  # two stages of fp32 K, V [BLOCK_N, 256] fit in SMEM
        return _tree_attention_kernel, {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}
    return _tree_attention_kernel_tuned, {}


def tree_attention_triton(
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
    schedule: TritonSchedule | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel behind the module's contract. ``schedule`` (:func:`schedule_blocks`) may
    be reused across layers; a caller that passes it has checked the step's inputs against the
    contract once, so only the checks that read no device memory run here."""
    if triton is None:
        raise RuntimeError("backend 'triton' needs the triton package (pip install 'treespec[gpu]')")
    if not q.is_cuda and not interpreting():
        raise RuntimeError("the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 on a CPU")
    checks = check_attention_inputs if schedule is None else check_attention_shapes
    checks(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    _check_triton_layout(q, k_cache, v_cache, schedule)
    if schedule is None:
        num_new = (cu_q[1:] - cu_q[:-1]).tolist()  # host sync: the launch grid depends on it
        longest_prefix = int(prefix_lens.max()) if len(prefix_lens) else 0
        schedule = schedule_blocks(num_new, longest_prefix, group, device=q.device)
    out = torch.empty_like(q) if out is None else out
    if num_rows == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    num_blocks = len(schedule.block_request)
    split = schedule.num_splits > 1
    partial_out, partial_m, partial_l = _split_buffers(q, schedule, num_kv_heads, group, block_d)
    mask = tree_mask if tree_mask is not None else cu_q  # any int tensor; unread when causal
    positions = q_positions if q_positions is not None else cu_q
    kernel, configs = _kernel_and_configs(block_d)
    kernel[(num_blocks, num_kv_heads, schedule.num_splits)](
        q, k_cache, v_cache, out, cu_q, slots, prefix_lens, mask, positions,
        schedule.block_request, schedule.block_start, partial_out, partial_m, partial_l,
        sm_scale, softcap or 1.0, window or 0, schedule.split_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        mask.stride(0) if tree_mask is not None else 0,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, GROUP_PAD=group_pad(group), BLOCK_M=schedule.block_m,
        HAS_TREE=tree_mask is not None, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None,
        SPLIT=split, UPCAST=interpreting(), **configs,
        # fp32 stays fp32 (no TF32) so that fp32 results match the reference closely.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if split:
        _combine_splits(out, schedule, partial_out, partial_m, partial_l, group, head_dim)
    return out


def _split_buffers(q: torch.Tensor, schedule: TritonSchedule, num_kv_heads: int, group: int, block_d: int):
    """(partial outputs, running maxima, running sums) in fp32 for a split-KV launch: one row per
    block, KV head, split and query row of the block; one unread element each without splits."""
    if schedule.num_splits == 1:
        unused = q.new_empty((1,), dtype=torch.float32)
        return unused, torch.empty_like(unused), torch.empty_like(unused)
    rows = (
        len(schedule.block_request) * num_kv_heads * schedule.num_splits * schedule.block_m * group_pad(group)
    )
    partial_m = q.new_empty((rows,), dtype=torch.float32)
    return q.new_empty((rows, block_d), dtype=torch.float32), partial_m, torch.empty_like(partial_m)


def _check_triton_layout(q, k_cache, v_cache, schedule):
    """Refuse, before launch and with no device read, what the kernel cannot serve."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[1]
    refusal = triton_layout_refusal(num_heads, num_kv_heads, head_dim, q.dtype)
    if refusal is not None:
        raise ValueError(refusal)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        dtypes = f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        raise ValueError(f"q, k_cache and v_cache need one dtype, got {dtypes}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if schedule is not None and schedule.block_m * group_pad(num_heads // num_kv_heads) < 16:
        raise ValueError(f"the schedule's blocks of {schedule.block_m} tokens were built for a larger group")


def _combine_splits(out, schedule, partial_out, partial_m, partial_l, group, head_dim):
    """Merge split-KV partials: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    num_blocks, num_kv_heads = len(schedule.block_request), out.shape[1] // group
    pad = group_pad(group)
    shape = (num_blocks, num_kv_heads, schedule.num_splits, schedule.block_m * pad)
    m = partial_m.view(shape)
    weight = torch.exp2(m - m.amax(2, keepdim=True)).nan_to_num(0.0)  # slices that saw no key: 0
    num = (weight[..., None] * partial_out.view(*shape, -1)).sum(2)  # [NB, Hkv, R, BLOCK_D]
    den = (weight * partial_l.view(shape)).sum(2)  # [NB, Hkv, R]
    merged = num / den[..., None]  # padded rows may be NaN (0/0): never gathered
    # Gather rows back (no boolean mask, so no host sync): token t, head h sits in block
    # token_block[t], KV head h // group, row token_index[t] * GROUP_PAD + h % group.
    heads = torch.arange(out.shape[1], device=out.device)
    block = schedule.token_block.long()[:, None]  # [T, 1]
    row = schedule.token_index.long()[:, None] * pad + (heads % group)[None, :]  # [T, Hq]
    out.copy_(merged[block, (heads // group)[None, :], row, :head_dim])


# --------------------------------------------------------------------------------------------
# PyTorch reference (the twin), also the path that runs without a GPU
# --------------------------------------------------------------------------------------------


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
    host: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None,
) -> AttentionPlan:
    """Expand the ragged step metadata into padded indices and a dense mask (see the contract).

    ``host``: (new tokens, committed lengths, slots) per request as host lists, which size the
    padded tensors and pick the fast paths; a step's metadata has them, so the plan reads nothing
    from the device. Without them they are read (one host sync)."""
    device = cu_q.device
    cu_q = cu_q.long()
    prefix = prefix_lens.long()
    num_new = cu_q[1:] - cu_q[:-1]  # [B]
    kv_len = prefix + num_new
    if host is None:
        host = (num_new.tolist(), prefix.tolist(), slots.tolist())
    num_new_list, slot_list = list(host[0]), list(host[2])
    kv_len_list = [p + n for p, n in zip(host[1], num_new_list, strict=True)]
    num_rows, n_max, l_max = sum(num_new_list), max(num_new_list, default=0), max(kv_len_list, default=0)

    row_request = torch.repeat_interleave(
        torch.arange(len(num_new), device=device), num_new, output_size=num_rows
    )  # [T]
    row_index = torch.arange(num_rows, device=device) - cu_q[row_request]  # [T]

    rel, is_new_key, visible = _visible_keys(prefix, num_new, tree_mask, row_request, row_index, n_max, l_max)
    if window is not None:
        visible &= _window_mask(cu_q, q_positions, rel, is_new_key, row_request, row_index, window, n_max)

    is_padded_row = torch.arange(n_max, device=device)[None, :] >= num_new[:, None]  # [B, n_max]
    visible &= ~is_padded_row[:, :, None]
    visible[..., 0] |= is_padded_row  # a fully masked row would give NaN
    consecutive = (
        slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list))) if slot_list else False
    )
    slot_index = slice(slot_list[0], slot_list[0] + len(slot_list)) if consecutive else slots.long()
    uniform = len(set(num_new_list)) <= 1
    # No key is masked exactly when each request has one new token (it sees its whole prefix and
    # itself) and all requests see as many keys (no padded key), with no window to cut the prefix.
    all_visible = window is None and set(num_new_list) <= {1} and len(set(kv_len_list)) <= 1
    return AttentionPlan(row_request, row_index, kv_len, visible, slot_index, uniform, all_visible)


def _visible_keys(prefix, num_new, tree_mask, row_request, row_index, n_max: int, l_max: int):
    """(rel, is_new_key, visible): each key's index among its request's new tokens [B, L_max], whether
    it is one, and which keys each padded query row sees [B, n_max, L_max] before any window: the
    whole prefix, then the causal chain or the tree's ancestors among the new tokens."""
    device = prefix.device
    key = torch.arange(l_max, device=device)
    rel = key[None, :] - prefix[:, None]
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
    return rel, is_new_key, (rel < 0)[:, None, :] | (is_new_key[:, None, :] & new_visible)


def _window_mask(cu_q, q_positions, rel, is_new_key, row_request, row_index, window, n_max):
    """[B, n_max, L_max] bool: key position p is visible from query position P iff P - p < window."""
    batch, l_max = rel.shape
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
    """Raise ValueError naming the first input that breaks the contract (reads the device)."""
    check_attention_shapes(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions)
    _check_attention_values(q, k_cache, cu_q, slots, prefix_lens, tree_mask)


def check_attention_shapes(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions):
    """The contract's checks that read no device memory: ranks, head layout, batch sizes."""
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
    if tree_mask is not None and (tree_mask.dim() != 2 or tree_mask.shape[0] != q.shape[0]):
        raise ValueError(f"tree_mask must be [T={q.shape[0]}, W], got {tuple(tree_mask.shape)}")
    if window is not None and (q_positions is None or q_positions.shape != (q.shape[0],)):
        raise ValueError("window needs q_positions of shape [T] (each new token's sequence position)")


def _check_attention_values(q, k_cache, cu_q, slots, prefix_lens, tree_mask):
    """The contract's checks on the metadata's values: host syncs, once per step at most."""
    if int(cu_q[-1]) != q.shape[0]:
        raise ValueError(f"cu_q[-1] = {int(cu_q[-1])} but q has {q.shape[0]} rows")
    num_new = cu_q[1:] - cu_q[:-1]
    max_new = int(num_new.max()) if len(slots) else 0
    if len(slots) and int((prefix_lens + num_new).max()) > k_cache.shape[2]:
        raise ValueError(f"prefix + new tokens exceed the cache length {k_cache.shape[2]}")
    if tree_mask is not None and BITS_PER_WORD * tree_mask.shape[1] < max_new:
        raise ValueError(
            f"tree_mask must be [T={q.shape[0]}, W >= {-(-max_new // BITS_PER_WORD)}], got {tuple(tree_mask.shape)}"
        )


# --------------------------------------------------------------------------------------------
# Plain reference: the contract spelled out, one query at a time (the specification in tests)
# --------------------------------------------------------------------------------------------


def tree_attention_naive(
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
    """Tree attention as the module contract states it, with no fast path: for each query row,
    gather the keys it may see and take a softmax over them. Slow (a Python loop over rows); it
    computes in the inputs' dtype, so tests hand it float64 copies and use it as the oracle
    that ``tree_attention_ref`` and the Triton kernel are checked against.

    Shape:
        q [T, Hq, D]; k_cache, v_cache [S, Hkv, L, D]; cu_q [B+1]; slots [B]; prefix_lens [B];
        tree_mask [T, W] or None; q_positions [T] or None -> out [T, Hq, D]
    """
    check_attention_inputs(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions)
    group = q.shape[1] // k_cache.shape[1]
    cu, words = cu_q.tolist(), None if tree_mask is None else tree_mask.tolist()
    positions = None if q_positions is None else q_positions.tolist()
    out = torch.empty_like(q)
    for b, (slot, prefix) in enumerate(zip(slots.tolist(), prefix_lens.tolist(), strict=True)):
        start, num_new = cu[b], cu[b + 1] - cu[b]
        for i in range(num_new):
            t = start + i
            # New token j sits at cache position prefix + j. Row t sees it if bit j of its mask
            # words is set (an ancestor, or itself), or, in a causal chain, if j <= i.
            new = [j for j in range(num_new) if (j <= i if words is None else _bit(words[t], j))]
            keys = list(range(prefix)) + [prefix + j for j in new]
            if window is not None:  # committed key p sits at position p; new key j at its q_position
                key_positions = list(range(prefix)) + [positions[start + j] for j in new]
                keys = [k for k, p in zip(keys, key_positions, strict=True) if positions[t] - p < window]
            k = k_cache[slot, :, keys].repeat_interleave(group, 0)  # [Hq, n, D]
            v = v_cache[slot, :, keys].repeat_interleave(group, 0)
            scores = torch.einsum("hd,hnd->hn", q[t], k) * sm_scale  # [Hq, n]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[t] = torch.einsum("hn,hnd->hd", scores.softmax(-1), v)
    return out


def _bit(words: list[int], j: int) -> bool:
    """Bit j of a row of int32 mask words (Python's >> on a negative int keeps bit 31 right)."""
    return bool(words[j // BITS_PER_WORD] >> (j % BITS_PER_WORD) & 1)


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "auto" -> "triton" on CUDA when triton is installed, else "reference"; forced ones are checked."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "reference"
    if backend == "triton" and (triton is None or (device.type != "cuda" and not interpreting())):
        raise RuntimeError(
            "backend='triton' cannot run here: it needs the triton package and CUDA tensors "
            "(or TRITON_INTERPRET=1 on a CPU)"
        )
    if backend == "cpu" and (device.type != "cpu" or not cpu_kernels.available()):
        reason = f"the model is on {device}" if device.type != "cpu" else cpu_kernels.unavailable_reason()
        raise RuntimeError(f"backend='cpu' (treespec's CPU attention kernel) cannot run here: {reason}")
    return backend


def cpu_rows(
    cu_q: torch.Tensor, slots: torch.Tensor, prefix_lens: torch.Tensor, num_rows: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Per query row: (cache slot, committed length, index among its request's new tokens, that
    request's count of new tokens), [T] int64 each: what the CPU kernel reads. ``num_rows`` (T,
    known to a step's metadata) spares reading ``cu_q[-1]``."""
    cu_q = cu_q.long()
    num_new = cu_q[1:] - cu_q[:-1]
    num_rows = int(cu_q[-1]) if num_rows is None else num_rows
    row_request = torch.repeat_interleave(
        torch.arange(len(num_new), device=cu_q.device), num_new, output_size=num_rows
    )
    row_index = torch.arange(num_rows, device=cu_q.device) - cu_q[row_request]
    return slots.long()[row_request], prefix_lens.long()[row_request], row_index, num_new[row_request]


def tree_attention_cpu(
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
    rows: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """The contract on treespec's batch-invariant CPU kernel. It serves bf16 q and caches with no
    window and no soft-cap; anything else takes :func:`tree_attention_ref` (same values up to
    summation order). ``rows``: :func:`cpu_rows`, when the caller (a Target's step, whose
    metadata the engine built) has made it once for the step; without it the inputs are checked
    against the contract first, since the kernel reads them through raw pointers."""
    if (
        window is not None
        or softcap is not None
        or q.dtype != torch.bfloat16
        or k_cache.dtype != torch.bfloat16
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        return tree_attention_ref(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, sm_scale=sm_scale,
                                  window=window, softcap=softcap, q_positions=q_positions)  # fmt: skip
    if rows is None:
        check_attention_inputs(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, window, q_positions)
        if len(slots) and not 0 <= int(slots.min()) <= int(slots.max()) < k_cache.shape[0]:
            raise ValueError(f"slots must lie in [0, {k_cache.shape[0]}), got {slots.tolist()}")
        rows = cpu_rows(cu_q, slots, prefix_lens)
    mask = None if tree_mask is None else tree_mask.to(torch.int32)
    return cpu_kernels.tree_attention_bf16(q, k_cache, v_cache, *rows, mask, sm_scale)


def tree_attention(
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
    backend: str = "auto",
) -> torch.Tensor:
    """Tree attention (see the module contract) on the chosen backend. Nothing falls back silently
    but the "cpu" backend, which hands what its kernel does not serve (a window, a soft-cap, other
    dtypes) to the PyTorch reference, as its docstring says."""
    kwargs = dict(sm_scale=sm_scale, window=window, softcap=softcap, q_positions=q_positions)
    resolved = resolve_backend(backend, q.device)
    if resolved == "triton":
        return tree_attention_triton(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, **kwargs)
    if resolved == "cpu":
        return tree_attention_cpu(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, **kwargs)
    return tree_attention_ref(q, k_cache, v_cache, cu_q, slots, prefix_lens, tree_mask, **kwargs)
