"""bench.drafter_topk: the two-stage top-k it times gives torch.topk's values and ids holding them."""
from __future__ import annotations

import torch

from bench.drafter_topk import chunked_topk


def test_the_two_stage_top_k_equals_torch_topk_over_a_vocabulary_that_no_chunk_count_divides():
    x = torch.randn(2, 3, 1001, generator=torch.Generator().manual_seed(0))
    want, _ = torch.topk(x, 8, dim=-1, sorted=True)
    for chunks in (4, 7, 16):
        values, ids = chunked_topk(x, 8, chunks)
        assert torch.equal(values, want) and torch.equal(torch.gather(x, -1, ids), want)
