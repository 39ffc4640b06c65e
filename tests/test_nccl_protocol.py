"""The nccl transport without a GPU: handshake checks, the header and payload layout of a push, the order in which
pushes pair up, when the send buffer may be reused, and that CPU paths never import cupy.

The communicator itself (NcclComm) is exercised only on two GPUs, in tests/test_gpu.py."""
from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import threading

import pytest
import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport import FeatureRows, make_sender, rows_view
from ddtree_serve.transport.nccl import in_daemon_thread, wait_event
from ddtree_serve.transport.nccl_protocol import (NcclLinkLost, ReceiveOrder, SendLedger, decode_header,
                                                  encode_header, lost_header, missing_nccl_package, nccl_refusal,
                                                  plan_nccl_pushes, uid_from_bytes, uid_to_bytes)
from ddtree_serve.transport.shared_buffer import ROW_ALIGN, copy_piece


def rows_of(*counts: int, dim: int = 16, dtype=torch.float32) -> list[FeatureRows]:
    return [FeatureRows(f"s{i}", 10 * i, torch.randn(n, dim).to(dtype)) for i, n in enumerate(counts)]


# ---- the unique id travels as 128 bytes -------------------------------------------------------------------------
def test_unique_id_round_trips_through_bytes_as_signed_or_unsigned_chars() -> None:
    signed = tuple(range(-128, 0))
    raw = uid_to_bytes(signed)
    assert len(raw) == 128 and raw[0] == 128 and raw[-1] == 255
    assert uid_from_bytes(raw, signed_char=True) == signed
    unsigned = tuple(range(128, 256))
    assert uid_from_bytes(uid_to_bytes(unsigned), signed_char=False) == unsigned


def test_a_unique_id_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        uid_from_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="128 bytes"):
        uid_to_bytes((1, 2, 3))


# ---- one push: layout, header, and what the drafter reads back ---------------------------------------------------
def test_a_push_lays_sequences_at_aligned_offsets_and_counts_elements_of_the_rows_dtype() -> None:
    rows = rows_of(3, 1, 5, dim=16, dtype=torch.bfloat16)   # 32-byte rows
    [push] = plan_nccl_pushes(rows, buffer_bytes=1 << 20)
    assert push.dtype == "bfloat16" and push.itemsize == 2
    assert [(p.index, p.row_begin, p.row_end, p.offset) for p in push.pieces] == [
        (0, 0, 3, 0), (1, 0, 1, ROW_ALIGN), (2, 0, 5, 2 * ROW_ALIGN)]
    # the payload ends with the last row: alignment padding between runs is sent, nothing after them
    assert push.count == (2 * ROW_ALIGN + 5 * 32) // 2 and push.nbytes == 2 * ROW_ALIGN + 5 * 32


def test_a_submission_larger_than_the_buffer_becomes_several_pushes_covering_every_row_once() -> None:
    rows = rows_of(40, 7, dim=8)   # 32-byte rows, 10 per 320-byte buffer
    pushes = plan_nccl_pushes(rows, buffer_bytes=320)
    assert all(push.nbytes <= 320 for push in pushes)
    covered = {0: [], 1: []}
    for push in pushes:
        for p in push.pieces:
            covered[p.index] += range(p.row_begin, p.row_end)
    assert covered == {0: list(range(40)), 1: list(range(7))}


def test_rows_of_mixed_width_or_dtype_are_not_one_push() -> None:
    with pytest.raises(ValueError, match="share"):
        plan_nccl_pushes([FeatureRows("a", 0, torch.zeros(1, 8)), FeatureRows("b", 0, torch.zeros(1, 4))], 4096)
    with pytest.raises(ValueError, match="share"):
        plan_nccl_pushes([FeatureRows("a", 0, torch.zeros(1, 8)),
                          FeatureRows("b", 0, torch.zeros(1, 8, dtype=torch.float16))], 4096)


def test_header_round_trips_and_the_payload_it_describes_reads_back_every_sequence() -> None:
    rows = rows_of(2, 4, 1, dim=12)
    [push] = plan_nccl_pushes(rows, buffer_bytes=8192)
    batch = drafter_pb2.FeatureBatch.FromString(encode_header(push, rows, "comm-1", 7).SerializeToString())
    header = decode_header(batch, buffer_bytes=8192)
    assert (header.comm_id, header.push_id, header.dtype, header.count) == ("comm-1", 7, "float32", push.count)
    assert [(r.seq_id, r.start, r.num_rows) for r in batch.rows] == [("s0", 0, 2), ("s1", 10, 4), ("s2", 20, 1)]
    # what the sender stages is what NCCL moves; the drafter reads each sequence's rows at its header offset
    payload = torch.zeros(8192, dtype=torch.uint8)
    for p in push.pieces:
        copy_piece(payload, p, rows[p.index])
    received = payload[:header.nbytes].clone()
    for r, want in zip(batch.rows, rows):
        assert torch.equal(rows_view(received, r.shared_offset, r.num_rows, batch.feature_dim, r.dtype), want.data)


def test_a_header_is_refused_before_anything_is_received_when_it_does_not_fit() -> None:
    rows = rows_of(4, dim=16)
    [push] = plan_nccl_pushes(rows, buffer_bytes=4096)
    batch = encode_header(push, rows, "c", 0)
    with pytest.raises(ValueError, match="does not fit"):
        decode_header(batch, buffer_bytes=push.nbytes - 4)      # larger than the receive buffer
    batch.rows[0].num_rows = 5
    with pytest.raises(ValueError, match="fall outside"):
        decode_header(batch, buffer_bytes=4096)                 # rows past the payload
    batch.rows[0].num_rows, batch.rows[0].dtype = 4, "float16"
    with pytest.raises(ValueError, match="fall outside"):
        decode_header(batch, buffer_bytes=4096)                 # a row's dtype is not the payload's
    batch.rows[0].dtype, batch.nccl.dtype = "float32", "int8"
    with pytest.raises(ValueError, match="dtype"):
        decode_header(batch, buffer_bytes=4096)


def test_a_lost_header_names_every_sequence_and_makes_the_drafter_give_up_on_them() -> None:
    rows = rows_of(2, 3)
    batch = lost_header(rows, "c", "peer died")
    assert [(r.seq_id, r.start, r.num_rows) for r in batch.rows] == [("s0", 0, 2), ("s1", 10, 3)]
    with pytest.raises(NcclLinkLost, match="peer died"):
        decode_header(batch, buffer_bytes=4096)


# ---- acknowledgement and order -----------------------------------------------------------------------------------
def test_the_send_buffer_is_reused_only_after_the_drafter_acknowledged_the_push_holding_it() -> None:
    ledger = SendLedger()
    first = ledger.begin()
    assert not ledger.reusable
    with pytest.raises(RuntimeError, match="still holds the send buffer"):
        ledger.begin()
    ledger.acknowledged(first)
    assert ledger.reusable
    assert ledger.begin() == first + 1


def test_an_acknowledgement_for_another_push_is_refused() -> None:
    ledger = SendLedger()
    ledger.begin()
    with pytest.raises(RuntimeError, match="in flight"):
        ledger.acknowledged(5)


def test_after_an_abort_no_push_may_use_the_buffer_again() -> None:
    ledger = SendLedger()
    ledger.begin()
    ledger.abort("drafter gone")
    assert not ledger.reusable
    with pytest.raises(NcclLinkLost, match="drafter gone"):
        ledger.begin()


def test_the_drafter_takes_pushes_only_in_the_order_their_sends_were_posted() -> None:
    order = ReceiveOrder()
    order.accept(0)
    order.accept(1)
    with pytest.raises(ValueError, match="push 3 arrived where push 2"):
        order.accept(3)


# ---- the handshake's refusals --------------------------------------------------------------------------------------
def test_target_and_drafter_on_one_gpu_are_refused_with_the_way_out() -> None:
    reason = nccl_refusal("cuda:0", "GPU-1234", "cuda:0", "GPU-1234", None)
    assert "different GPUs" in reason and "cuda-ipc" in reason


def test_two_gpus_that_both_call_themselves_cuda0_are_fine() -> None:
    # containers: each service sees only its own GPU, as cuda:0; the UUIDs tell them apart
    assert nccl_refusal("cuda:0", "GPU-aaaa", "cuda:0", "GPU-bbbb", None) is None


def test_a_cpu_target_or_drafter_is_refused_naming_the_side() -> None:
    assert "target on a CUDA device" in nccl_refusal("cpu", "", "cuda:1", "GPU-b", None)
    assert "drafter on a CUDA device" in nccl_refusal("cuda:0", "GPU-a", "cpu", "", None)


def test_missing_cupy_is_refused_naming_the_package_to_install(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))
    missing = missing_nccl_package()
    assert "cupy-cuda1" in missing and "ddtree-serve[gpu]" in missing
    reason = nccl_refusal("cpu", "", "", "", missing)
    assert "cupy-cuda1" in reason and "target on a CUDA device" in reason   # every reason at once


def test_cpu_paths_never_import_cupy() -> None:
    script = ("import sys\n"
              "import target_svc.server, drafter_svc.server\n"
              "from ddtree_serve.transport import make_sender\n"
              "from ddtree_serve.transport.nccl_protocol import missing_nccl_package, nccl_refusal\n"
              "s = make_sender('nccl', '127.0.0.1:1')\n"
              "nccl_refusal('cpu', '', 'cpu', '', missing_nccl_package())\n"
              "print(s.name, any(m == 'cupy' or m.startswith('cupy.') for m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nccl", "False"]


# ---- blocking NCCL calls stay off the event loop ------------------------------------------------------------------
def test_a_blocking_init_runs_off_the_event_loop_and_its_result_arrives() -> None:
    release = threading.Event()

    async def scenario():
        fut = in_daemon_thread(lambda: (release.wait(5), threading.current_thread().daemon))
        await asyncio.sleep(0.05)   # the loop runs while the "init" blocks
        assert not fut.done()
        release.set()
        return await fut

    assert asyncio.run(scenario()) == (True, True)


def test_an_init_that_completes_after_the_timeout_is_handed_to_on_late() -> None:
    release, late = threading.Event(), []
    done = threading.Event()

    def on_late(value):
        late.append(value)
        done.set()

    async def scenario():
        fut = in_daemon_thread(lambda: release.wait(5) and "communicator", on_late=on_late)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 0.05)
        release.set()
        await asyncio.get_running_loop().run_in_executor(None, done.wait, 5)

    asyncio.run(scenario())
    assert late == ["communicator"]   # the late communicator is aborted, not leaked


def test_an_init_error_reaches_the_awaiting_side() -> None:
    async def scenario():
        return await in_daemon_thread(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        asyncio.run(scenario())


class Never:
    """A transfer whose peer never posts the matching operation."""

    def query(self) -> bool:
        return False


def test_a_transfer_the_peer_never_matches_times_out_instead_of_hanging() -> None:
    with pytest.raises(TimeoutError, match="did not complete"):
        asyncio.run(wait_event(Never(), timeout_s=0.05))


def test_make_sender_builds_an_nccl_sender_that_waits_for_its_handshake() -> None:
    sender = make_sender("nccl", "127.0.0.1:1")
    assert sender.name == "nccl" and sender.ledger.reusable and sender.comm_id == ""


def test_up_with_nccl_and_one_device_is_a_one_line_usage_error() -> None:
    out = subprocess.run([sys.executable, "-m", "launch.cli", "up", "--transport", "nccl", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--drafter-device cuda:1" in out.stderr and "cuda-ipc" in out.stderr
