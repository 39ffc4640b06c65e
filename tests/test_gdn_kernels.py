"""The fla kernel switch on the CPU: it stays off without CUDA or fla, and the reference paths it swaps agree.

The kernels themselves are checked against the reference on the GPU (tests/test_gpu.py).
"""
from __future__ import annotations

import sys

import pytest
import torch

from target_svc import gdn_kernels
from target_svc.gated_deltanet import (
    LinearAttnStateShape,
    _l2norm,
    allocate_linear_attn_state,
    chunked_delta_rule,
    gdn_chain_forward,
    gdn_commit_path,
    gdn_step_forward_lean,
    gdn_tree_forward_lean,
    stepwise_delta_rule,
)
from target_svc.model import TargetModel
from target_svc.runner import TargetConfig, TargetRunner
from tests.fixtures import make_tiny_qwen3_5
from tests.test_gated_deltanet import HIDDEN, _committed_states, _make_layer


def _delta_inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, seed: int):
    """q, k, v, g, beta, state as the chain path hands them over (normalised, q scaled, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q = _l2norm(torch.randn(b, t, hk, dk, generator=gen)) * dk**-0.5
    k = _l2norm(torch.randn(b, t, hk, dk, generator=gen))
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * torch.rand(hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


def test_module_imports_and_is_off_on_the_cpu():
    assert gdn_kernels.available("cpu") is False
    assert gdn_kernels.available(torch.device("cpu")) is False
    if not torch.cuda.is_available():
        assert gdn_kernels.available("cuda") is False


@pytest.mark.parametrize("value,off", [("off", True), ("OFF", True), ("0", True), ("false", True), ("no", True),
                                       ("on", False), ("", False), ("auto", False)])
def test_env_switch(monkeypatch, value, off):
    monkeypatch.setenv(gdn_kernels.ENV_VAR, value)
    assert gdn_kernels.disabled_by_env() is off
    if off:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert gdn_kernels.available("cuda") is False


def test_unimportable_fla_means_unavailable_even_with_cuda(monkeypatch):
    monkeypatch.delenv(gdn_kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A None entry in sys.modules makes `import fla...` raise ImportError, as on a machine without fla-core.
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, None)
    assert gdn_kernels.available("cuda") is False


def test_adapters_refuse_wrong_shapes_and_state_dtype_before_touching_fla():
    q, k, v, g, beta, state = _delta_inputs(1, 3, 2, 4, 8, 8, seed=0)
    with pytest.raises(ValueError, match="state must be fp32"):
        gdn_kernels.recurrent_delta_rule(q, k, v, g, beta, state.half())
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn_kernels.chunk_delta_rule(q[:, :, :1].expand(1, 3, 3, 8), k[:, :, :1].expand(1, 3, 3, 8), v, g, beta,
                                     state)
    with pytest.raises(ValueError, match="bad shapes"):
        gdn_kernels.delta_rule(q, k, v, g[:, :2], beta, state)


@pytest.mark.parametrize("t", [1, 7, 70])
def test_stepwise_and_chunked_references_agree_with_gqa(t):
    """The two references with the adapters' contract (3 value heads per key head, Dk != Dv)."""
    args = _delta_inputs(2, t, 2, 6, 16, 8, seed=t)
    o_step, s_step = stepwise_delta_rule(*args)
    o_chunk, s_chunk = chunked_delta_rule(*args, chunk_size=16)
    assert o_step.shape == (2, t, 6, 8) and s_step.shape == (2, 6, 16, 8)
    torch.testing.assert_close(o_chunk, o_step, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s_chunk, s_step, atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_step_forward_lean_is_the_one_node_tree_pass_and_commits_alike():
    layer = _make_layer(seed=4)
    gen = torch.Generator().manual_seed(5)
    conv0, rec0 = _committed_states(layer, 3, 6, gen)
    x = torch.randn(3, 1, HIDDEN, generator=gen)
    valid = torch.tensor([[True], [True], [False]])
    want, want_trace = gdn_tree_forward_lean(layer, x, torch.full((3, 1), -1), valid, conv0, rec0)
    got, trace = gdn_step_forward_lean(layer, x, valid, conv0, rec0)
    assert torch.equal(got, want)
    assert torch.equal(trace.node_conv, want_trace.node_conv) and torch.equal(trace.key, want_trace.key)
    path, path_len = torch.tensor([[0], [0], [-1]]), torch.tensor([1, 1, 0])
    conv, rec = gdn_commit_path(trace, path, path_len, conv0, rec0)
    want_conv, want_rec = gdn_commit_path(want_trace, path, path_len, conv0, rec0)
    assert torch.equal(conv, want_conv) and torch.equal(rec, want_rec)
    assert torch.equal(rec[2], rec0[2]) and torch.equal(conv[2], conv0[2])


@torch.no_grad()
def test_chain_forward_reference_path_is_unchanged_by_the_switch_default():
    layer = _make_layer(seed=6)
    dims = LinearAttnStateShape.from_module(layer)
    st = allocate_linear_attn_state(dims, 2, "cpu", torch.float32)
    x = torch.randn(2, 20, HIDDEN, generator=torch.Generator().manual_seed(7))
    lengths = torch.tensor([20, 9])
    a = gdn_chain_forward(layer, x, lengths, st.conv, st.rec)
    b = gdn_chain_forward(layer, x, lengths, st.conv, st.rec, kernels=False)
    assert all(torch.equal(u, w) for u, w in zip(a, b))


def test_target_model_keeps_the_reference_on_the_cpu_and_refuses_forced_kernels(tmp_path):
    runner = TargetRunner(TargetConfig(model_dir=str(make_tiny_qwen3_5(tmp_path, seed=8)), max_batch=2,
                                       max_seq_len=64, max_tree_nodes=8))
    assert runner.model.gdn_kernels_on is False
    with pytest.raises(RuntimeError, match="kernels requested but unavailable"):
        TargetModel(runner.target, 2, 64, 8, gdn_kernels_on=True)
    assert TargetModel(runner.target, 2, 64, 8, gdn_kernels_on=False).gdn_kernels_on is False
