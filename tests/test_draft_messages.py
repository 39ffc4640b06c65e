"""A draft on the wire (ddtree_serve/plumbing/messages.py): raw little-endian arrays, read back exactly, and a
malformed one refused with a clear error."""
from __future__ import annotations

import pytest
import torch

from ddtree_serve.plumbing.messages import draft_arrays, draft_result
from ddtree_serve.proto import drafter_pb2


def test_a_draft_round_trips_through_its_serialized_message_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    top = torch.log_softmax(torch.randn(15, 50000, generator=gen) * 5, dim=-1).topk(64, dim=-1)
    wire = drafter_pb2.DraftResponse(results=[draft_result("s", top.values, top.indices)]).SerializeToString()
    (result,) = drafter_pb2.DraftResponse.FromString(wire).results
    logprobs, ids = draft_arrays(result)
    assert (result.depth, result.k) == (15, 64)
    assert logprobs.dtype.name == "float32" and ids.dtype.name == "int64"
    assert torch.equal(torch.from_numpy(logprobs), top.values)
    assert torch.equal(torch.from_numpy(ids), top.indices)


def test_a_ready_drafts_numpy_slices_go_on_the_wire_as_the_same_tensors_would():
    """The drafter keeps ready drafts as numpy arrays and answers narrower asks with slices of them."""
    gen = torch.Generator().manual_seed(1)
    top = torch.log_softmax(torch.randn(15, 5000, generator=gen), dim=-1).topk(64, dim=-1)
    values, ids = top.values, top.indices.to(torch.int32)
    want = draft_result("s", values[:9, :16], ids[:9, :16])
    got = draft_result("s", values.numpy()[:9, :16], ids.numpy()[:9, :16])
    assert got.SerializeToString() == want.SerializeToString() and (got.depth, got.k) == (9, 16)


def test_a_draft_with_no_positions_is_empty_not_an_error():
    logprobs, ids = draft_arrays(draft_result("s", torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.long)))
    assert logprobs.shape == ids.shape == (0, 4)


@pytest.mark.parametrize("depth,k,id_bytes,lp_bytes", [
    (2, 3, 24, 20),     # log-probs a number short
    (2, 3, 20, 24),     # ids a number short
    (3, 3, 24, 24),     # shape claims more than sent
    (-1, 3, 0, 0),      # a negative shape
])
def test_a_draft_whose_sizes_disagree_is_refused(depth, k, id_bytes, lp_bytes):
    bad = drafter_pb2.DraftResult(seq_id="s", depth=depth, k=k, token_ids=bytes(id_bytes), logprobs=bytes(lp_bytes))
    with pytest.raises(ValueError, match="bytes"):
        draft_arrays(bad)
