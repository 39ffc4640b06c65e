"""bench.step_cost's kernel families: which part of a step each kernel is, and where a larger tree's time goes."""
from __future__ import annotations

import pytest

from bench.step_cost import kernel_family, tree_extra_rows


@pytest.mark.parametrize("name, family", [
    ("nvjet_sm90_tst_384x72_64x3_4x1_v_bz_coopA_TNT", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "GEMM"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nt_n_tilesize32x32x8", "GEMM"),
    ("tree_wy_core_kernel", "tree WY core"),
    ("tree_wy_keys_kernel", "tree WY core"),
    ("fused_recurrent_gated_delta_rule_fwd_kernel", "GDN recurrence (fla)"),
    ("tree_attention_split_kernel", "attention"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, at::native::ArgMaxOps<float>>>",
     "sampling (argmax, top-k)"),
    ("void at::native::mbtopk::gatherTopK<c10::BFloat16, unsigned int, 2>", "sampling (argmax, top-k)"),
    ("triton_poi_fused_cat_index_transpose_1", "glue"),
    ("Memcpy DtoD (Device -> Device)", "glue"),
])
def test_each_kernel_lands_in_its_family(name, family):
    assert kernel_family(name) == family


def _call(nodes: int, families: dict[str, float], batch: int = 1) -> dict:
    return {"batch": batch, "nodes": nodes, "what": "one captured verify call", "families": families,
            "kernel_ms_total": round(sum(families.values()), 4)}


def test_the_extra_time_is_the_largest_tree_against_the_smallest_per_family_largest_first():
    profiles = [_call(1, {"GEMM": 3.7}), _call(17, {"GEMM": 3.9, "tree WY core": 0.2, "glue": 0.9}),
                _call(65, {"GEMM": 4.1, "tree WY core": 0.7, "glue": 1.2}), _call(65, {"GEMM": 9.0}, batch=8),
                {"batch": 1, "nodes": 65, "top": []}]   # an eager forward's profile: not a captured call
    rows = tree_extra_rows(profiles)
    assert [r[0] for r in rows] == ["tree WY core", "glue", "GEMM", "all"]
    assert rows[0][1:] == [0.2, 0.7, 0.5]
    assert rows[-1] == ["all", 5.0, 6.0, 1.0]


def test_no_table_without_two_tree_sizes():
    assert tree_extra_rows([_call(1, {"GEMM": 3.7}), _call(65, {"GEMM": 4.1})]) == []


def test_without_graphs_the_eager_forwards_are_compared():
    """A CPU run profiles eager forwards only (no "what"): the table compares those."""
    eager = [{"batch": 1, "nodes": n, "families": {"GEMM": g}, "kernel_ms_total": g} for n, g in ((17, 2.0), (65, 3.0))]
    assert tree_extra_rows(eager)[-1] == ["all", 2.0, 3.0, 1.0]
