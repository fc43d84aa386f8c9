"""The KV cache: preallocated, one row ("slot") per live request, per-slot committed lengths.

Layout: ``keys`` and ``values`` are each one tensor ``[num_layers, num_slots, Hkv, max_len, D]``
so that a layer's view ``keys[l]`` is exactly the ``[S, Hkv, L, D]`` cache of the attention
contract (kernels/tree_attention.py), and a commit moves every layer in one indexing op.

A step writes its new tokens' K/V at ``length[slot] + i`` (i = the token's index within its
request's tree). Verification then picks the accepted nodes; :meth:`KVCache.commit` moves their
K/V to the contiguous positions right after the prefix and advances the length. Everything else
written past the new length is garbage that the next step overwrites.

Slot ids index cache rows; request ids are the engine's. They are different names on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treespec.presets import DEFAULT_MAX_LEN


class CacheFullError(RuntimeError):
    """No free slot is left."""


def default_max_len(model_context: int | None) -> int:
    """The context a cache holds per request when the caller gives none: ``DEFAULT_MAX_LEN``,
    or the model's own context when shorter. The engine and the proposers with a cache of their
    own (EAGLE heads, draft models) all size by it."""
    return min(DEFAULT_MAX_LEN, model_context or DEFAULT_MAX_LEN)


class KVCache:
    """Preallocated per-layer K/V storage with slot allocation and per-slot committed lengths."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        for name, value in [("num_layers", num_layers), ("num_slots", num_slots), ("max_len", max_len)]:
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * num_slots  # committed tokens per slot, on the host
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_slots(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (length 0)."""
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; its contents become garbage."""
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    def check_room(self, slot: int, num_new: int) -> None:
        """Raise before any compute if ``num_new`` more tokens do not fit in ``slot``."""
        if self.lengths[slot] + num_new > self.max_len:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} tokens; {num_new} more exceed the cache "
                f"length {self.max_len}"
            )

    def write(
        self, layer: int, row_slots: torch.Tensor, row_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new K/V rows.

        Shape:
            row_slots, row_pos [T] long: cache row and position of each new token
            k, v [T, Hkv, D]
        """
        self.keys[layer, row_slots, :, row_pos] = k.to(self.keys.dtype)
        self.values[layer, row_slots, :, row_pos] = v.to(self.values.dtype)

    def write_run(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new K/V rows of one slot at positions start, start+1, ... (a slice, no gather).

        Shape:
            k, v [T, Hkv, D]
        """
        stop = start + k.shape[0]
        self.keys[layer, slot, :, start:stop] = k.transpose(0, 1).to(self.keys.dtype)
        self.values[layer, slot, :, start:stop] = v.transpose(0, 1).to(self.values.dtype)

    def commit(self, slots: Sequence[int], accepted: Sequence[Sequence[int]]) -> None:
        """Keep the accepted new tokens of each slot, contiguously after its prefix.

        ``accepted[b]`` lists indices (increasing) of the step's new tokens of ``slots[b]``, as
        they were written at ``length + index``; node k of the list moves to ``length + k``.
        """
        rows, src, dst = [], [], []
        for slot, nodes in zip(slots, accepted, strict=True):
            base = self.lengths[slot]
            self.check_room(slot, len(nodes))
            for k, node in enumerate(nodes):
                if node != k:
                    rows.append(slot)
                    src.append(base + node)
                    dst.append(base + k)
            self.lengths[slot] = base + len(nodes)
        if rows:  # a chain that was fully accepted moves nothing
            rows_t, src_t, dst_t = torch.tensor([rows, src, dst]).to(self.keys.device)  # one copy
            # Advanced indexing on the right copies first, so overlapping src/dst are safe.
            self.keys[:, rows_t, :, dst_t] = self.keys[:, rows_t, :, src_t]
            self.values[:, rows_t, :, dst_t] = self.values[:, rows_t, :, src_t]
