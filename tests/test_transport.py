"""Feature transports without a server: the shared-buffer layout, views, and the shm buffer's round trip."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ddtree_serve.proto import drafter_pb2
from ddtree_serve.transport import FeatureRows, OpenedBuffers, decode_rows, encode_rows, payload_bytes, rows_view
from ddtree_serve.transport.shared_buffer import ROW_ALIGN, StagingBuffer, plan_pieces


def covered_rows(pushes) -> dict[int, list[tuple[int, int]]]:
    spans: dict[int, list[tuple[int, int]]] = {}
    for push in pushes:
        for p in push:
            spans.setdefault(p.index, []).append((p.row_begin, p.row_end))
    return spans


def test_small_runs_share_one_push_at_aligned_offsets() -> None:
    [push] = plan_pieces([3, 1, 5], row_bytes=100, capacity=4096)
    assert [(p.index, p.row_begin, p.row_end) for p in push] == [(0, 0, 3), (1, 0, 1), (2, 0, 5)]
    assert [p.offset for p in push] == [0, 2 * ROW_ALIGN, 3 * ROW_ALIGN]


def test_pieces_of_one_push_never_overlap_or_overflow() -> None:
    row_bytes, capacity = 96, 1000
    for push in plan_pieces([7, 2, 11, 1, 4], row_bytes, capacity):
        ends = sorted((p.offset, p.offset + (p.row_end - p.row_begin) * row_bytes) for p in push)
        assert ends[-1][1] <= capacity
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))
        assert all(p.offset % ROW_ALIGN == 0 for p in push)


def test_a_run_longer_than_the_buffer_spans_several_pushes_in_order() -> None:
    pushes = plan_pieces([25], row_bytes=64, capacity=640)
    assert len(pushes) == 3
    assert covered_rows(pushes) == {0: [(0, 10), (10, 20), (20, 25)]}


def test_a_row_larger_than_the_buffer_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        plan_pieces([1], row_bytes=2048, capacity=1024)


def test_rows_view_reads_rows_and_refuses_out_of_bounds() -> None:
    buf = torch.zeros(1024, dtype=torch.uint8)
    rows = torch.randn(3, 8)
    buf[256:256 + rows.numel() * 4] = rows.view(torch.uint8).flatten()
    assert torch.equal(rows_view(buf, 256, 3, 8, "float32"), rows)
    with pytest.raises(ValueError, match="outside"):
        rows_view(buf, 1000, 3, 8, "float32")
    with pytest.raises(ValueError, match="outside"):
        rows_view(buf, -4, 1, 8, "float32")
    with pytest.raises(ValueError, match="dtype"):
        rows_view(buf, 0, 1, 8, "int8")


def test_inline_encoding_round_trips_bfloat16_bits() -> None:
    data = torch.randn(4, 6).to(torch.bfloat16)
    dtype, raw = encode_rows(data)
    assert dtype == "bfloat16" and len(raw) == data.numel() * 2
    assert torch.equal(decode_rows(dtype, raw, 4, 6), data)


def test_payload_bytes_counts_inline_data_and_shared_rows() -> None:
    assert payload_bytes(drafter_pb2.FeatureRows(num_rows=2, dtype="float32", data=bytes(64)), 8) == 64
    assert payload_bytes(drafter_pb2.FeatureRows(num_rows=2, dtype="bfloat16", shared_offset=512), 8) == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_staging_buffer_is_read_back_through_its_descriptor(dtype) -> None:
    staging = StagingBuffer("shm", 8192, torch.device("cpu"))
    opened = OpenedBuffers()
    try:
        rows = [FeatureRows("a", 0, torch.randn(5, 16).to(dtype)), FeatureRows("b", 7, torch.randn(2, 16).to(dtype))]
        [push] = plan_pieces([r.num_rows for r in rows], 16 * rows[0].data.element_size(), staging.size_bytes)
        for piece in push:
            staging.write(piece, rows[piece.index])
        buffer = opened.get(drafter_pb2.SharedBuffer.FromString(staging.descriptor.SerializeToString()))
        name = "float32" if dtype == torch.float32 else "bfloat16"
        for piece in push:
            assert torch.equal(rows_view(buffer, piece.offset, rows[piece.index].num_rows, 16, name),
                               rows[piece.index].data)
        assert opened.get(staging.descriptor) is buffer   # opened once per buffer id
    finally:
        opened.close()
        staging.close()


def test_shm_buffer_is_visible_to_another_process() -> None:
    staging = StagingBuffer("shm", 4096, torch.device("cpu"))
    try:
        [[piece]] = plan_pieces([2], 16, 4096)
        staging.write(piece, FeatureRows("a", 0, torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])))
        script = ("import sys\n"
                  "from ddtree_serve.proto import drafter_pb2\n"
                  "from ddtree_serve.transport import OpenedBuffers, rows_view\n"
                  "desc = drafter_pb2.SharedBuffer.FromString(sys.stdin.buffer.read())\n"
                  "print(rows_view(OpenedBuffers().get(desc), 0, 2, 4, 'float32').sum().item())\n")
        out = subprocess.run([sys.executable, "-c", script], input=staging.descriptor.SerializeToString(),
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()
        assert float(out.stdout) == 36.0
        # the reader exiting must not unlink the target's buffer
        assert OpenedBuffers().get(staging.descriptor).numel() == 4096
    finally:
        staging.close()


def test_opening_a_missing_shm_buffer_is_a_clear_error() -> None:
    desc = drafter_pb2.SharedBuffer(kind="shm", buffer_id="x", size_bytes=4096, shm_name="ddtree-no-such-buffer")
    with pytest.raises(ValueError, match="cannot open shared memory"):
        OpenedBuffers().get(desc)
    with pytest.raises(ValueError, match="unknown shared-buffer kind"):
        OpenedBuffers().get(drafter_pb2.SharedBuffer(kind="rdma", buffer_id="y", size_bytes=8))


def test_opened_buffers_keep_only_the_most_recent() -> None:
    stagings = [StagingBuffer("shm", 1024, torch.device("cpu")) for _ in range(3)]
    opened = OpenedBuffers(capacity=2)
    try:
        for s in stagings:
            opened.get(s.descriptor)
        assert list(opened._open) == [s.descriptor.buffer_id for s in stagings[1:]]
    finally:
        opened.close()
        for s in stagings:
            s.close()


def test_cuda_ipc_staging_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        StagingBuffer("cuda-ipc", 1024, torch.device("cpu"))


def test_a_push_submitted_to_an_idle_sender_is_staged_at_once_and_one_behind_another_waits_its_turn() -> None:
    """Staging at submit time takes the push off the step's critical path, but only while nothing may still be
    reading the buffer: the second push here would land on the first one's rows, so it waits for the sender."""
    import asyncio

    from ddtree_serve.transport.shared import SharedBufferFeatureSender

    async def go():
        # No drafter answers at this address: the pushes fail later, in the sender task, which is not awaited here.
        sender = SharedBufferFeatureSender(drafter_address="unix:/nonexistent/ddtree.sock", name="shm",
                                           staging_bytes=1 << 16, timeout_s=0.2)
        opened = OpenedBuffers()
        first, second = torch.arange(12.0).view(3, 4), torch.full((3, 4), -1.0)
        try:
            sender.submit([FeatureRows("a", 0, first)])          # idle: copied into the buffer now
            staged = opened.rows(sender._staging.descriptor, 0, 3, 4, "float32")   # noqa: SLF001
            sender.submit([FeatureRows("b", 0, second)])         # the first is queued: not copied yet
            kept = opened.rows(sender._staging.descriptor, 0, 3, 4, "float32")     # noqa: SLF001
            return staged, kept
        finally:
            opened.close()
            await sender.close()

    staged, kept = asyncio.run(go())
    assert torch.equal(staged, torch.arange(12.0).view(3, 4))
    assert torch.equal(kept, torch.arange(12.0).view(3, 4))


def test_an_early_push_stages_rows_and_headers_in_its_own_region_and_holds_it_until_answered() -> None:
    """stage_early (the model thread's call) copies each sequence's rows and its (accepted, next token) header into
    a free early region past the plain pushes' part of the buffer; the drafter reads them through the message's
    offsets; with every early region taken the rows go the plain way (None), and an answered push frees its own."""
    from ddtree_serve.transport.base import EarlyRows
    from ddtree_serve.transport.shared import EARLY_REGIONS, SharedBufferFeatureSender

    sender = SharedBufferFeatureSender(drafter_address="unix:/nonexistent/ddtree.sock", name="shm",
                                       staging_bytes=1 << 16)
    opened = OpenedBuffers()
    try:
        rows = [EarlyRows("a", 5, torch.arange(12.0).view(3, 4), torch.tensor([2, 41])),
                EarlyRows("b", 0, torch.full((2, 4), -1.0), torch.tensor([1, 7]))]
        pushes = [sender.stage_early(rows) for _ in range(EARLY_REGIONS)]
        assert sender.stage_early(rows) is None                        # every region holds an unanswered push
        assert len({p.region for p in pushes}) == EARLY_REGIONS
        batch = pushes[0].batch
        assert [(m.seq_id, m.start, m.num_rows) for m in batch.rows] == [("a", 5, 3), ("b", 0, 2)]
        for m, r in zip(batch.rows, rows):
            assert m.shared_offset >= sender._plain_bytes                  # noqa: SLF001 - past the plain part
            assert torch.equal(opened.rows(batch.shared, m.shared_offset, m.num_rows, 4, m.dtype), r.data)
            assert opened.header(batch.shared, m.header_offset).tolist() == r.header.tolist()
        assert batch.ready_event == b""                                 # shm: written before the message goes
        sender._free_region(pushes[1].region)                           # noqa: SLF001 - as its answer does
        assert sender.stage_early(rows).region == pushes[1].region
        cuda_like = [EarlyRows("a", 0, torch.zeros(1, 4), torch.zeros(2, dtype=torch.long))]
        assert SharedBufferFeatureSender(drafter_address="x", name="cuda-ipc").stage_early(cuda_like) is None
    finally:
        opened.close()
        sender._release()                                               # noqa: SLF001


def test_a_header_view_is_refused_off_its_grid_or_past_the_buffer() -> None:
    from ddtree_serve.transport.shared_buffer import header_view

    buffer = torch.zeros(64, dtype=torch.uint8)
    assert header_view(buffer, 48).shape == (2,)
    for offset in (-16, 8, 56, 64):
        with pytest.raises(ValueError, match="header"):
            header_view(buffer, offset)
