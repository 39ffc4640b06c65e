"""The gated delta rule through fla-core's Triton kernels (the optional `gpu` extra): decode steps and prefill chains.

The adapters take exactly what target_svc/gated_deltanet.py computes and return what its reference returns:

    q     [B, T, Hk, Dk] fp32, l2-normalised and already scaled by Dk^-0.5
    k     [B, T, Hk, Dk] fp32, l2-normalised, NOT repeated to the value heads
    v     [B, T, Hv, Dv] fp32
    g     [B, T, Hv]     fp32, log decay (natural log, <= 0)
    beta  [B, T, Hv]     fp32, after the sigmoid
    state [B, Hv, Dk, Dv] fp32, the recurrent state before the chain
    ->    (o [B, T, Hv, Dv] fp32, final state [B, Hv, Dk, Dv] fp32)

How that meets fla 0.6.0 (fla/ops/gated_delta_rule/fused_recurrent.py and chunk.py), point by point:
- token layout: fla takes [B, T, H, D] (its head-first layout was removed), as we do: no transposes;
- GQA: fla maps value head h to key head h // (Hv / Hk) in the kernels, the very mapping of our reference's
  repeat_interleave, so q and k go in with their Hk heads (Hv % Hk == 0 is checked by LinearAttnStateShape);
- l2norm: done by us (eps 1e-6 under the square root, as fla's), so use_qk_l2norm_in_kernel=False;
- scale: q already carries Dk^-0.5, so scale=1.0 (fla's default of None would apply Dk^-0.5 a second time);
- g: fla's recurrent kernel multiplies the state by exp(g) and its chunk path converts g to log2 itself, so the
  natural-log decay goes in as is; beta is post-sigmoid (use_beta_sigmoid_in_kernel=False, the default);
- state: fla's default layout (state_v_first=False) is [N, Hv, K, V] with fp32 final states, which is ours.

Nothing here syncs with the host, so a decode step through `recurrent_delta_rule` can be captured in a CUDA graph
(fla's recurrent kernel has fixed launch parameters: no autotuning at replay). `chunk_delta_rule` autotunes on its
first call per shape; it serves prefill, which runs eagerly.
"""
from __future__ import annotations

import importlib
import logging

import torch
from torch import Tensor

from ddtree_serve.switches import switched_off

log = logging.getLogger(__name__)

ENV_VAR = "DDTREE_GDN_KERNELS"
# Chains up to this many tokens go through the recurrent kernel (exact fp32 arithmetic, one launch); longer ones
# through the chunked kernel, which parallelises over 64-token chunks (its fp32 products run as TF32 on the GPU).
RECURRENT_MAX_TOKENS = 64
_FLA_MODULE = "fla.ops.gated_delta_rule"


def disabled_by_env() -> bool:
    """True when DDTREE_GDN_KERNELS says off (off / 0 / false / no)."""
    return switched_off(ENV_VAR)


def available(device: torch.device | str) -> bool:
    """Whether the fla kernels can serve Gated DeltaNet layers on `device`: CUDA, fla importable, not disabled."""
    if disabled_by_env() or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(_FLA_MODULE)
    except Exception as exc:  # ImportError, or a Triton/torch mismatch raised while fla defines its kernels
        log.info("Gated DeltaNet kernels unavailable (%s: %s); using the PyTorch reference", type(exc).__name__, exc)
        return False
    return True


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> None:
    """Shape and dtype checks on metadata only (no device sync)."""
    bsz, seq, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    if q.shape != k.shape or v.shape[:2] != (bsz, seq) or g.shape != (bsz, seq, hv) or beta.shape != g.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} "
                         f"beta {tuple(beta.shape)}")
    if hv % hk != 0:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    if state.shape != (bsz, hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 [{bsz}, {hv}, {dk}, {dv}], got {state.dtype} {tuple(state.shape)}")


def _fla_delta_rule(kernel: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    state: Tensor) -> tuple[Tensor, Tensor]:
    """One of fla's gated delta rule kernels in our layout: q/k already l2-normed and scaled, natural-log g."""
    _check(q, k, v, g, beta, state)
    fn = getattr(importlib.import_module(_FLA_MODULE), kernel)
    o, final = fn(q, k, v, g=g, beta=beta, scale=1.0, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=False)
    return o, final


def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor) -> tuple[Tensor, Tensor]:
    """fla's fused_recurrent_gated_delta_rule in our layout: one token at a time (decode steps, short chains)."""
    return _fla_delta_rule("fused_recurrent_gated_delta_rule", q, k, v, g, beta, state)


def chunk_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state: Tensor) -> tuple[Tensor, Tensor]:
    """fla's chunk_gated_delta_rule in our layout: 64-token chunks in parallel (prefill)."""
    return _fla_delta_rule("chunk_gated_delta_rule", q, k, v, g, beta, state)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """A chain through the kernel that suits its length (recurrent up to RECURRENT_MAX_TOKENS, else chunked)."""
    if q.shape[1] <= RECURRENT_MAX_TOKENS:
        return recurrent_delta_rule(q, k, v, g, beta, state)
    return chunk_delta_rule(q, k, v, g, beta, state)


__all__ = [
    "ENV_VAR",
    "RECURRENT_MAX_TOKENS",
    "available",
    "chunk_delta_rule",
    "delta_rule",
    "disabled_by_env",
    "recurrent_delta_rule",
]
