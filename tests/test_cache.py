from __future__ import annotations

import pytest
import torch

from treespec.target.cache import CacheFullError, KVCache


def make_cache(num_slots=3, max_len=10) -> KVCache:
    return KVCache(num_layers=2, num_slots=num_slots, num_kv_heads=2, max_len=max_len, head_dim=4)


def test_allocate_free_reuse():
    cache = make_cache(num_slots=2)
    a, b = cache.allocate(), cache.allocate()
    assert {a, b} == {0, 1} and cache.num_free == 0
    with pytest.raises(CacheFullError):
        cache.allocate()
    cache.lengths[a] = 5
    cache.free(a)
    assert cache.allocate() == a and cache.lengths[a] == 0
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(7)


def test_write_then_commit_moves_accepted_nodes_for_every_layer():
    cache = make_cache()
    slot = cache.allocate()
    cache.lengths[slot] = 3
    # Six tree nodes written at 3..8; each carries its node index as its value.
    rows = torch.full((6,), slot)
    pos = torch.arange(3, 9)
    k = torch.arange(6.0)[:, None, None].expand(6, 2, 4)
    for layer in range(2):
        cache.write(layer, rows, pos, k, -k)
    cache.commit([slot], [[0, 2, 5]])
    assert cache.lengths[slot] == 6
    for layer in range(2):
        assert cache.keys[layer, slot, :, 3:6, 0].tolist() == [[0.0, 2.0, 5.0]] * 2
        assert cache.values[layer, slot, :, 3:6, 0].tolist() == [[-0.0, -2.0, -5.0]] * 2


def test_commit_several_slots_leaves_others_alone():
    cache = make_cache()
    s0, s1, s2 = cache.allocate(), cache.allocate(), cache.allocate()
    cache.keys.normal_()
    before = cache.keys.clone()
    cache.commit([s2, s0], [[0, 1, 2], [0, 3]])  # a full chain (no move) and a tree path
    assert cache.lengths == [2, 0, 3]
    assert torch.equal(cache.keys[:, s1], before[:, s1]) and torch.equal(cache.keys[:, s2], before[:, s2])
    assert torch.equal(cache.keys[:, s0, :, 1], before[:, s0, :, 3])


def test_room_is_checked_before_anything_moves():
    cache = make_cache(max_len=4)
    slot = cache.allocate()
    cache.lengths[slot] = 3
    with pytest.raises(ValueError, match="exceed the cache length 4"):
        cache.check_room(slot, 2)
    with pytest.raises(ValueError, match="exceed"):
        cache.commit([slot], [[0, 1]])
    assert cache.lengths[slot] == 3


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_slots"):
        KVCache(num_layers=1, num_slots=0, num_kv_heads=1, max_len=4, head_dim=2)
