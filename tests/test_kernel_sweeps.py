"""The kernel sweeps' grids (bench/tree_attention_kernel.py, bench/gdn_tree_kernel.py) only hold launches the kernels
take: every key split covers the key bucket in whole tiles, every tree WY tiling passes tree_wy_core's checks."""
from __future__ import annotations

import pytest

from bench import gdn_tree_kernel, tree_attention_kernel
from target_svc.gdn_tree_kernel import _BLOCK_T


@pytest.mark.parametrize("rows, head_dim", [(4, 128), (68, 128), (260, 128), (6, 256), (390, 256)])
def test_every_attention_split_covers_the_key_bucket_in_whole_tiles(rows, head_dim):
    configs = list(tree_attention_kernel.sweep_grid(rows, head_dim))
    assert configs
    bucket = tree_attention_kernel.KEY_BUCKET
    for cfg in configs:
        assert cfg.split_len % cfg.block_n == 0
        assert cfg.splits * cfg.split_len >= bucket and (cfg.splits - 1) * cfg.split_len < bucket
        assert cfg.block_m == 16 or cfg.block_m < 2 * rows   # no tile that is mostly padding
        assert head_dim <= 128 or cfg.block_n == 32
    assert all(cfg.context_loop for cfg in configs)   # the masked main loop only where asked for
    both = list(tree_attention_kernel.sweep_grid(rows, head_dim, context_loops=(0, 1)))
    assert len(both) == 2 * len(configs) and sum(cfg.context_loop for cfg in both) == len(configs)
    assert not any(cfg.balanced for cfg in configs)
    fair = list(tree_attention_kernel.sweep_grid(rows, head_dim, balanced=(0, 1)))
    assert [c for c in fair if not c.balanced] == configs and all(c.splits > 1 for c in fair if c.balanced)


def test_the_tree_wy_sweep_holds_every_form_and_only_tilings_the_kernel_takes():
    configs = list(gdn_tree_kernel.sweep_grid((16, 32)))
    assert {c.phases for c in configs} == {1, 2, 3}
    for cfg in configs:
        assert cfg.block_t in _BLOCK_T and cfg.block_c >= 16 and 128 % cfg.block_v == 0
        assert cfg.invert in ("blocks", "rows", "blocks16") and (cfg.invert != "rows" or cfg.block_t == 16)
        assert cfg.invert != "blocks16" or cfg.phases == 2   # the two-launch form's 64-row inverse only
        assert cfg.key_warps == 0 or cfg.phases == 2   # the two-launch form's key kernel only
