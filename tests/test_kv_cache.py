"""The target's per-slot cache on its own: slots, capacity, K/V rows (and their Triton write, under the interpreter where
Triton is installed), compaction moves, linear-state reset."""
from __future__ import annotations

import pytest
import torch

from target_svc.gated_deltanet import LinearAttnStateShape
from target_svc.kv_cache import KV_WRITE_ENV_VAR, CacheSpec, KVCache, kv_write_kernel_available
from tests.test_quantization_backend import INTERPRETER_PATCH, _run_interpreted, needs_triton

LINEAR = LinearAttnStateShape(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=4, conv_kernel=3)


def cache(max_batch: int = 2, full_layers: int = 2, linear: tuple = (), snapshots: int = 0) -> KVCache:
    return KVCache.allocate(CacheSpec(max_batch=max_batch, max_seq_len=8, max_tree_nodes=4, num_full_layers=full_layers,
                                      num_kv_heads=2, head_dim=3, linear_shapes=linear, device=torch.device("cpu"),
                                      dtype=torch.float32, state_snapshots=snapshots))


def test_capacity_per_slot_is_context_plus_one_verify_block() -> None:
    c = cache()
    assert c.spec.capacity == 12
    assert c.k.shape == c.v.shape == (2, 2 + 1, 12, 2, 3)   # + the scratch slot of padding rows


def test_the_scratch_slot_is_never_handed_out() -> None:
    c = cache(max_batch=2)
    taken = {c.add_sequence("a"), c.add_sequence("b")}
    assert c.spec.scratch_slot == 2 and c.spec.scratch_slot not in taken
    with pytest.raises(RuntimeError, match="capacity"):
        c.add_sequence("c")


def test_slots_are_handed_out_from_zero_and_reused_after_release() -> None:
    c = cache()
    assert c.add_sequence("a") == 0
    assert c.add_sequence("b") == 1
    c.release("a")
    assert c.add_sequence("c") == 0
    assert c.num_sequences == 2 and c.slot("b") == 1


def test_a_full_cache_refuses_with_a_capacity_error() -> None:
    c = cache(max_batch=1)
    c.add_sequence("a")
    with pytest.raises(RuntimeError, match="capacity"):
        c.add_sequence("b")


def test_a_sequence_cannot_take_two_slots() -> None:
    c = cache()
    c.add_sequence("a")
    with pytest.raises(ValueError, match="already"):
        c.add_sequence("a")


def test_unknown_sequences_raise_key_error() -> None:
    c = cache()
    with pytest.raises(KeyError):
        c.slot("nope")
    with pytest.raises(KeyError):
        c.release("nope")


def test_used_tokens_count_live_slots_only() -> None:
    c = cache()
    a, b = c.add_sequence("a"), c.add_sequence("b")
    c.ctx_len[a], c.ctx_len[b] = 5, 3
    assert c.used_tokens() == 8
    c.release("a")
    assert c.used_tokens() == 3


def test_written_rows_read_back_in_their_slot_and_layer() -> None:
    c = cache()
    slots = torch.tensor([1, 0])
    rows = torch.tensor([[0, 1, 2], [4, 5, 6]])
    k = torch.randn(2, 3, 2, 3)
    v = torch.randn(2, 3, 2, 3)
    c.write_kv(1, slots, rows, k, v)
    rk, rv = c.read_kv(1, slots, key_len=7)
    assert torch.equal(rk[0, :3], k[0]) and torch.equal(rv[1, 4:7], v[1])
    assert torch.count_nonzero(c.k[0]) == 0   # the other layer is untouched


def test_move_rows_compacts_overlapping_rows_in_every_layer() -> None:
    c = cache()
    c.k[:, 0, :6] = torch.arange(6, dtype=torch.float32)[None, :, None, None]
    c.v.copy_(c.k)
    # accepted tree rows 2, 4, 5 move to 1, 2, 3 (row 2 is both read and written)
    c.move_rows(torch.tensor([0]), torch.tensor([[2, 4, 5]]), torch.tensor([[1, 2, 3]]))
    for buf in (c.k, c.v):
        for layer in range(2):
            assert buf[layer, 0, :4, 0, 0].tolist() == [0.0, 2.0, 4.0, 5.0]


def test_a_new_sequence_starts_from_zero_linear_state() -> None:
    c = cache(linear=(LINEAR,))
    slot = c.add_sequence("a")
    c.linear[0].conv[slot].fill_(1.0)
    c.linear[0].rec[slot].fill_(1.0)
    c.release("a")
    assert c.add_sequence("b") == slot
    assert torch.count_nonzero(c.linear[0].conv[slot]) == 0 and torch.count_nonzero(c.linear[0].rec[slot]) == 0
    assert c.linear[0].rec.dtype == torch.float32


def test_move_rows_without_full_attention_layers_is_a_no_op() -> None:
    c = cache(full_layers=0, linear=(LINEAR,))
    c.move_rows(torch.tensor([0]), torch.tensor([[1]]), torch.tensor([[0]]))
    assert c.k.numel() == 0


def test_the_write_kernel_is_never_chosen_on_the_cpu_or_when_switched_off(monkeypatch) -> None:
    assert not cache().write_kernel and not kv_write_kernel_available("cpu")
    monkeypatch.setenv(KV_WRITE_ENV_VAR, "off")
    assert not kv_write_kernel_available("cuda")


INTERPRETED_WRITE = """
import torch
from target_svc.kv_cache import write_kv_rows
torch.manual_seed(0)
for n_kv, hd, t in [(2, 6, 3), (8, 128, 5), (4, 512, 2)]:   # one partial block; one; two blocks of 1024
    k_cache, v_cache = torch.zeros(3, 9, n_kv, hd), torch.zeros(3, 9, n_kv, hd)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([2, 0])
    rows = torch.stack([torch.arange(t) + 1, torch.arange(t) + 4])
    qkv = torch.randn(2, t, 3 * n_kv * hd)
    # v as the verify hands it over: a column slice of the fused projection (rows of one node dense, nodes strided)
    k = torch.randn(2, t, n_kv, hd)
    v = qkv[..., n_kv * hd:2 * n_kv * hd].view(2, t, n_kv, hd)
    write_kv_rows(k_cache, v_cache, slots, rows, k, v)
    index = (slots[:, None].expand_as(rows), rows)
    want_k.index_put_(index, k)
    want_v.index_put_(index, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), (n_kv, hd, t)
print("ok")
"""


@needs_triton
def test_the_write_kernel_under_tritons_interpreter_writes_what_index_put_writes() -> None:
    """Rows of two slots, a value tensor sliced out of a fused projection, node widths of one partial block, one
    block and two."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_WRITE)


INTERPRETED_MOVE = """
import torch
from target_svc.kv_cache import move_rows_in_place
from ddtree_serve.decoding.acceptance import compaction_indices_batch
torch.manual_seed(0)
for n_kv, hd in [(2, 6), (8, 128)]:
    k = torch.randn(3, 4, 40, n_kv, hd)
    v = torch.randn(3, 4, 40, n_kv, hd)
    # Paths of three rows: rows past each other (node 2 -> 1 while node 5 -> 2), a lone root, a chain in place.
    path = torch.tensor([[0, 2, 5, 9], [0, -1, -1, -1], [0, 1, 2, 3]])
    n_acc = torch.tensor([4, 1, 4])
    slots = torch.tensor([3, 1, 0])
    src, dst = compaction_indices_batch(path, n_acc, torch.tensor([10, 0, 30]))
    want_k, want_v = k.clone(), v.clone()
    b_idx = slots[:, None].expand_as(src)
    for buf in (want_k, want_v):
        buf[:, b_idx, dst] = buf[:, b_idx, src]
    move_rows_in_place(k, v, slots, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v), (n_kv, hd)
    assert torch.equal(k[:, 3, 11], want_k[:, 3, 11])
print("ok")
"""


@needs_triton
def test_the_move_kernel_under_tritons_interpreter_moves_what_the_gather_and_scatter_move() -> None:
    """A commit's compaction in every layer: rows that are one pair's source and another's destination, a lone
    root, a chain already in place, values of one partial column block and of one whole block."""
    _run_interpreted(INTERPRETER_PATCH + INTERPRETED_MOVE)


def test_a_snapshot_restores_the_states_it_copied_and_the_oldest_makes_room() -> None:
    c = cache(max_batch=3, linear=(LINEAR,), snapshots=2)
    a = c.add_sequence("a")
    for position, value in ((4, 1.0), (6, 2.0), (7, 3.0)):   # three snapshots of "a" in a pool of two
        c.ctx_len[a] = position
        c.linear[0].conv[a].fill_(value)
        c.linear[0].rec[a].fill_(value)
        assert c.take_snapshot(a, position)
    assert sorted(c.snapshot_positions(a)) == [6, 7]
    b = c.add_sequence("b")
    c.restore_snapshot(a, 6, b)
    assert (c.linear[0].conv[b] == 2.0).all() and (c.linear[0].rec[b] == 2.0).all()
    assert not c.take_snapshot(a, 5)   # only where the slot's states stand (its ctx_len)


def test_a_slots_snapshots_go_when_it_is_released_or_starts_over_and_stay_when_parked_and_adopted() -> None:
    c = cache(max_batch=1, linear=(LINEAR,), snapshots=2)
    a = c.add_sequence("a")
    c.ctx_len[a] = 4
    c.take_snapshot(a, 4)
    c.park("a", [1, 2, 3, 4])
    assert c.adopt("b", "a")[0] == a and c.snapshot_positions(a) == [4]
    c.park("b", [1, 2, 3, 4])
    c.add_sequence("c")   # the parked slot taken for a new sequence: its rows and states start over
    assert c.snapshot_positions(a) == []
    c.ctx_len[a] = 3
    c.take_snapshot(a, 3)
    c.release("c")
    assert c.snapshots == {}


def test_without_a_pool_no_snapshot_is_taken() -> None:
    c = cache(linear=(LINEAR,))
    a = c.add_sequence("a")
    assert not c.take_snapshot(a, 0) and c.snapshot_positions(a) == []
