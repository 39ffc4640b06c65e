"""ddtree_serve.fused_rows: projections of one input concatenated by rows, each re-pointed at its rows."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ddtree_serve.fused_rows import fuse_rows


def test_the_fused_gemm_gives_each_projection_and_the_modules_become_views_of_it():
    torch.manual_seed(0)
    projs = (nn.Linear(8, 6), nn.Linear(8, 2), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    want = [p(x) for p in projs]
    weight, bias = fuse_rows(projs)
    assert weight.shape == (10, 8) and bias.shape == (10,)
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, bias), torch.cat(want, dim=-1))
    assert projs[1].weight.data_ptr() == weight[6:].data_ptr() and projs[2].bias.data_ptr() == bias[8:].data_ptr()
    assert all(torch.equal(p(x), w) for p, w in zip(projs, want))


def test_projections_with_and_without_bias_are_refused():
    with pytest.raises(ValueError, match="bias"):
        fuse_rows((nn.Linear(4, 4), nn.Linear(4, 4, bias=False)))
