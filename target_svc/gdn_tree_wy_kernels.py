"""Triton kernel of the tree WY core of target_svc/gdn_tree_wy.py: G, U and the outputs of all nodes in one launch.

Imported only where Triton is installed (target_svc/gdn_tree_kernel.py imports it lazily and picks the tiles).
For one (tree b, value head h, block of BV value columns) a program computes, with the notation of
gdn_tree_wy.py (anc(i): ancestors-or-self of node i, parents before children):

    G_i = sum_{j in anc(i)} g_j
    (I + A) U = beta V - (beta e^G K) S_0,   A[i, r] = beta_i (k_i . k_r) e^{G_i - G_r}   (r a strict ancestor)
    o_i = e^{G_i} S_0^T q_i + sum_{r in anc(i)} e^{G_i - G_r} (q_i . k_r) u_r

I + A is unit lower triangular, so U comes out by block forward substitution over blocks of BT nodes: block R's
right-hand side loses the terms of the ancestors in earlier blocks (already solved, in chunks of BC columns),
then the BT x BT diagonal block (I + A_RR) is inverted in registers (BT row steps) and applied with one dot. The
same column chunks feed the outputs. Every tile is BT, BC or BV by Dk or Dv: the node count T only sets the
trip counts, so one compile serves every T.

Solved rows of U and G are written to the outputs u and cum and read back by later blocks of the same program,
after a barrier (a CTA barrier orders a program's global stores before its later loads). Programs of one head
that differ in their value block all write the same G, computed by the same instructions from the same inputs:
the same bits, so which write lands last does not matter, and each program reads only rows it wrote itself
before its barrier.

Products are float32 dots with IEEE precision (not TF32): the results match the PyTorch reference to float32
rounding, as the tree's acceptance decisions need.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _exp_where(mask, x):
    """exp(x) where mask, else exactly 0 (exp(-inf)): the reference's masked_fill(-inf).exp()."""
    return tl.exp(tl.where(mask, x, float("-inf")))


# T changes with every tree size: not specialised on it, so one compile serves all T.
@triton.jit(do_not_specialize=["T"])
def tree_wy_core_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, s0_ptr, core_ptr, u_ptr, cum_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, stride_bb, stride_bh, stride_bt, stride_ab, stride_ai, stride_aj,
    stride_sb, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
):
    """core, u [B, H, T, DV] and cum [B, H, T] (contiguous float32) of one (b, h, value block); q, k [B, H, T, DK],
    v [B, H, T, DV] and s0 [B, H, DK, DV] have unit stride along their last dim, anc [B, T, T] is uint8 (0/1)."""
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_ptr += b * stride_qb + h * stride_qh
    k_ptr += b * stride_kb + h * stride_kh
    v_ptr += b * stride_vb + h * stride_vh
    g_ptr += b * stride_gb + h * stride_gh
    beta_ptr += b * stride_bb + h * stride_bh
    anc_ptr += b * stride_ab
    core_ptr += bh * T * DV
    u_ptr += bh * T * DV
    cum_ptr += bh * T

    offs_k = tl.arange(0, DK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    loc = tl.arange(0, BT)
    # S_0's value block stays in registers: every block of nodes reads it twice.
    s0 = tl.load(s0_ptr + b * stride_sb + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :])
    strict = loc[:, None] > loc[None, :]
    eye = tl.where(loc[:, None] == loc[None, :], 1.0, 0.0)

    for r0 in range(0, T, BT):
        rows = r0 + loc
        rmask = rows < T

        # G of the block's nodes: their ancestors all precede them, so columns past the block are not needed.
        cum_r = tl.zeros([BT], dtype=tl.float32)
        for c0 in range(0, r0 + BT, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < T
            a = tl.load(anc_ptr + rows[:, None] * stride_ai + cols[None, :] * stride_aj,
                        mask=rmask[:, None] & cmask[None, :], other=0)
            g_c = tl.load(g_ptr + cols * stride_gt, mask=cmask, other=0.0)
            cum_r += tl.sum(tl.where(a != 0, g_c[None, :], 0.0), axis=1)

        # Padded rows (past T) load as zeros: k = v = beta = G = 0, so they solve to u = 0 and are never stored.
        beta_r = tl.load(beta_ptr + rows * stride_bt, mask=rmask, other=0.0)
        q_r = tl.load(q_ptr + rows[:, None] * stride_qt + offs_k[None, :], mask=rmask[:, None], other=0.0)
        k_r = tl.load(k_ptr + rows[:, None] * stride_kt + offs_k[None, :], mask=rmask[:, None], other=0.0)
        v_r = tl.load(v_ptr + rows[:, None] * stride_vt + offs_v[None, :], mask=rmask[:, None], other=0.0)
        e_r = tl.exp(cum_r)
        kb_r = k_r * beta_r[:, None]  # the reference's k_beta
        rhs = v_r * beta_r[:, None] - tl.dot(kb_r * e_r[:, None], s0, input_precision="ieee")
        o = tl.dot(q_r * e_r[:, None], s0, input_precision="ieee")

        # Ancestors in earlier blocks: solved already (rows < r0 of u and cum hold this program's results).
        for c0 in range(0, r0, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < r0
            k_c = tl.load(k_ptr + cols[:, None] * stride_kt + offs_k[None, :], mask=cmask[:, None], other=0.0)
            u_c = tl.load(u_ptr + cols[:, None] * DV + offs_v[None, :], mask=cmask[:, None], other=0.0)
            cum_c = tl.load(cum_ptr + cols, mask=cmask, other=0.0)
            a = tl.load(anc_ptr + rows[:, None] * stride_ai + cols[None, :] * stride_aj,
                        mask=rmask[:, None] & cmask[None, :], other=0)
            decay = _exp_where(a != 0, cum_r[:, None] - cum_c[None, :])
            kk = tl.dot(kb_r, tl.trans(k_c), input_precision="ieee") * decay
            qk = tl.dot(q_r, tl.trans(k_c), input_precision="ieee") * decay
            rhs -= tl.dot(kk, u_c, input_precision="ieee")
            o += tl.dot(qk, u_c, input_precision="ieee")

        # The diagonal block: (I + A_RR)^-1 row by row. Row i of the inverse is e_i - sum_{r < i} A[i, r] inv[r, :],
        # rows r < i being final by then (A_RR is strictly lower triangular).
        a = tl.load(anc_ptr + rows[:, None] * stride_ai + rows[None, :] * stride_aj,
                    mask=rmask[:, None] & rmask[None, :], other=0)
        decay = _exp_where(a != 0, cum_r[:, None] - cum_r[None, :])
        sys_a = tl.where(strict, tl.dot(kb_r, tl.trans(k_r), input_precision="ieee") * decay, 0.0)
        inv = eye
        for i in tl.static_range(1, BT):
            sel = loc[:, None] == i
            a_i = tl.sum(tl.where(sel, sys_a, 0.0), axis=0)  # A[i, :], indexed by column
            inv = tl.where(sel, inv - tl.sum(a_i[:, None] * inv, axis=0)[None, :], inv)
        u_r = tl.dot(inv, rhs, input_precision="ieee")
        o += tl.dot(tl.dot(q_r, tl.trans(k_r), input_precision="ieee") * decay, u_r, input_precision="ieee")

        out_mask = rmask[:, None]
        tl.store(u_ptr + rows[:, None] * DV + offs_v[None, :], u_r, mask=out_mask)
        tl.store(core_ptr + rows[:, None] * DV + offs_v[None, :], o, mask=out_mask)
        tl.store(cum_ptr + rows, cum_r, mask=rmask)
        # The next blocks read these rows back (other threads of this program): order the stores before them.
        tl.debug_barrier()
