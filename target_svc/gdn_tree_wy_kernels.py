"""Triton kernel of the tree WY core of target_svc/gdn_tree_wy.py: G, U and the outputs of all nodes in one launch.

Imported only where Triton is installed (target_svc/gdn_tree_kernel.py imports it lazily and picks the tiles).
For one (tree b, value head h, block of BV value columns) a program computes, with the notation of
gdn_tree_wy.py (anc(i): ancestors-or-self of node i, parents before children):

    G_i = sum_{j in anc(i)} g_j
    (I + A) U = beta V - (beta e^G K) S_0,   A[i, r] = beta_i (k_i . k_r) e^{G_i - G_r}   (r a strict ancestor)
    o_i = e^{G_i} S_0^T q_i + sum_{r in anc(i)} e^{G_i - G_r} (q_i . k_r) u_r

Node 0, the root of every real node, is solved first as one recurrent step, and its state S_r stands in for S_0
for its descendants (with G less the root's gate); the rest, nodes 1 .. T-1, in blocks of BT nodes: a verify tree
of 4^k + 1 nodes then fills 4^k / BT blocks exactly (a 65-node tree: 4 blocks of 16, not 5, the last for one node).
I + A is unit lower triangular, so U comes out by block forward substitution over blocks of BT nodes: block R's
right-hand side loses the terms of the ancestors in earlier blocks (already solved, in chunks of BC columns),
then the BT x BT diagonal block (I + A_RR) is inverted in registers and applied with one dot. The same column
chunks feed the outputs. Every tile is BT, BC or BV by Dk or Dv: the node count T only sets the trip counts, so
one compile serves every T. BT is 16, 32 or 64; at Dk = 128 the BT x Dk tiles of q, k and beta k make BT = 64
spill heavily (ptxas, sm_90), so it is for sweeps, not a default.

The diagonal block's inverse is on every block's critical path. INVERT="rows" is forward substitution, BT - 1
dependent row steps of two cross-thread reductions each. INVERT="blocks" (the default) builds it from inverses
of diagonal blocks of size 1, 2, 4, ..., BT: each doubling is two BT x BT dots, X <- X - X M X, 2 (log2(BT) - 1)
dots in all, so the latency no longer grows linearly with BT and larger blocks (fewer sequential blocks per
tree) become affordable. Its entries are formed as substitution forms them (inverse entries times entries of A)
and round alike; the Neumann product (I + N)(I + N^2)..., as many dots, loses accuracy to cancellation on
chains of similar keys (see _invert_unit_lower).

Solved rows of U and G are written to the outputs u and cum and read back by later blocks of the same program,
after a barrier (a CTA barrier orders a program's global stores before its later loads). Programs of one head
that differ in their value block all write the same G, computed by the same instructions from the same inputs:
the same bits, so which write lands last does not matter, and each program reads only rows it wrote itself
before its barrier.

Products are float32 dots with IEEE precision by default (PRECISION "ieee", not TF32): the results match the
PyTorch reference to float32 rounding, as the tree's acceptance decisions need. PRECISION "tf32x3" runs them on
the tensor cores as three TF32 products each (the operands split into a high and a low TF32 part; the low x low
product dropped), about float32's accuracy for the issue slots of a few MMAs instead of a dot's FFMAs; "tf32"
(one product, ~1e-3 relative) is for the sweep only. The diagonal block's inverse stays IEEE: its doubling
products compound their rounding.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _exp_where(mask, x):
    """exp(x) where mask, else exactly 0 (exp(-inf)): the reference's masked_fill(-inf).exp()."""
    return tl.exp(tl.where(mask, x, float("-inf")))


@triton.jit
def _invert_unit_lower(sys_a, loc, BT: tl.constexpr, INVERT: tl.constexpr, PRECISION: tl.constexpr):
    """(I + sys_a)^-1 of a strictly lower triangular BT x BT sys_a (BT a power of two >= 16); the doubling's dots
    at PRECISION (IEEE but for the two-launch form's 64-row inverse, see tree_wy_keys_kernel)."""
    eye = tl.where(loc[:, None] == loc[None, :], 1.0, 0.0)
    if INVERT == "rows":
        # Forward substitution: row i of the inverse is e_i - sum_{r < i} A[i, r] inv[r, :], rows r < i final by
        # then. BT - 1 dependent steps, each two cross-thread reductions: the kernel's latency at BT = 16.
        inv = eye
        for i in tl.static_range(1, BT):
            sel = loc[:, None] == i
            a_i = tl.sum(tl.where(sel, sys_a, 0.0), axis=0)  # A[i, :], indexed by column
            inv = tl.where(sel, inv - tl.sum(a_i[:, None] * inv, axis=0)[None, :], inv)
    else:
        tl.static_assert((INVERT == "blocks") | (INVERT == "blocks16"))
        tl.static_assert(BT <= 128)
        # Diagonal blocks of doubling size: with X the inverse of I + A's diagonal blocks of size b, those of size
        # 2b are X - X M X, M = A's lower-left b x b quarter of each 2b block (the 2 x 2 block inverse
        # [[X1, 0], [-X2 A21 X1, X2]]). Blocks of 1 are 1, of 2 are I - M: 2 (log2(BT) - 1) dots in place of
        # BT - 1 steps of two reductions each. Each entry is still a sum of final inverse entries times A, as in
        # substitution, so it rounds as substitution does. The power series (I + N)(I + N^2)(I + N^4)...
        # (N = -A), as many dots, sums binomially growing terms that cancel: on a chain of keys of cosine 0.8
        # it was off by 2e-5 at BT = 16 and 2e-1 at BT = 32 (tests/test_gdn_tree_kernel.py).
        row = loc[:, None]
        col = loc[None, :]
        inv = eye - tl.where((row % 2 == 1) & (col == row - 1), sys_a, 0.0)
        if (INVERT == "blocks16") & (BT > 16):
            # Up to blocks of 16 every product is block-diagonal: a BT^3 dot of them is (BT / 16)^2 times the work
            # of the BT / 16 diagonal blocks' own 16^3 dots, batched here ([BT / 16, 16, 16]), the same nonzero
            # terms in the same order; the levels past 16 stay whole dots.
            inv = _doubling(_doubled_diagonal_16_blocks(inv, sys_a, BT, PRECISION), sys_a, row, col, BT, 4,
                            PRECISION)
        else:
            inv = _doubling(inv, sys_a, row, col, BT, 1, PRECISION)
    return inv


@triton.jit
def _doubling(inv, sys_a, row, col, BT: tl.constexpr, FIRST: tl.constexpr, PRECISION: tl.constexpr):
    """_invert_unit_lower's block doubling from blocks of 2^FIRST (inv: their inverse) to BT, in BT^3 dots (of a
    batch of BT x BT blocks where inv and sys_a are [N, BT, BT]: row and col index one block)."""
    for s in tl.static_range(FIRST, 7):
        if 2**s < BT:  # b = 2^s: blocks of b -> 2b
            quarter = ((row // 2**s) % 2 == 1) & (col // 2**s == row // 2**s - 1)
            m = tl.where(quarter, sys_a, 0.0)
            inv -= tl.dot(inv, tl.dot(m, inv, input_precision=PRECISION), input_precision=PRECISION)
    return inv


@triton.jit
def _doubled_diagonal_16_blocks(inv, sys_a, BT: tl.constexpr, PRECISION: tl.constexpr):
    """The block doubling of _invert_unit_lower from blocks of 2 (inv: I less the 2-blocks' entries) to blocks of 16,
    on the BT / 16 diagonal 16 x 16 blocks of inv and sys_a batched [BT / 16, 16, 16]; returns the BT x BT tile."""
    NB: tl.constexpr = BT // 16
    nb = tl.arange(0, NB)
    # [NB, 16, NB, 16]: element (i, r, j, c) is (16 i + r, 16 j + c); the diagonal blocks are those with j == i.
    on_diag = nb[:, None, None, None] == nb[None, None, :, None]
    blk_inv = tl.sum(tl.where(on_diag, tl.reshape(inv, [NB, 16, NB, 16]), 0.0), axis=2)
    blk_a = tl.sum(tl.where(on_diag, tl.reshape(sys_a, [NB, 16, NB, 16]), 0.0), axis=2)
    r = tl.arange(0, 16)
    blk_inv = _doubling(blk_inv, blk_a, r[:, None], r[None, :], 16, 1, PRECISION)   # each block's [16, 16] masks
    return tl.reshape(tl.where(on_diag, blk_inv[:, :, None, :], 0.0), [BT, BT])


@triton.jit
def _tree_head(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, bh, H, stride_qb, stride_qh, stride_kb, stride_kh,
               stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh, stride_ab):
    """Tree b = bh // H, head h = bh % H, and the inputs' pointers moved to them (the ancestor mask's to tree b)."""
    b = bh // H
    h = bh % H
    return (b, h, q_ptr + b * stride_qb + h * stride_qh, k_ptr + b * stride_kb + h * stride_kh,
            v_ptr + b * stride_vb + h * stride_vh, g_ptr + b * stride_gb + h * stride_gh,
            beta_ptr + b * stride_bb + h * stride_bh, anc_ptr + b * stride_ab)


@triton.jit
def _value_program(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, core_ptr, u_ptr, cum_ptr, T, H, stride_qb,
                   stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh,
                   stride_ab, DV: tl.constexpr):
    """A (value block, tree x head) program's value block, tree b and head h, its inputs' pointers (_tree_head)
    and its outputs' rows: core, u [B, H, T, DV] and cum [B, H, T], contiguous."""
    bh = tl.program_id(1)
    b, h, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr = _tree_head(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, bh, H, stride_qb, stride_qh, stride_kb, stride_kh,
        stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh, stride_ab)
    return (tl.program_id(0), b, h, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, core_ptr + bh * T * DV,
            u_ptr + bh * T * DV, cum_ptr + bh * T)


@triton.jit
def _s0_base(s0_ptr, s0_index_ptr, b, h, stride_sb, stride_sh, stride_si, INDEXED: tl.constexpr):
    """Tree b's initial state of head h: s0[s0_index[b], h] of a pool (INDEXED) or s0[b, h]."""
    if INDEXED:
        row = tl.load(s0_index_ptr + b * stride_si).to(tl.int64)
    else:
        row = b.to(tl.int64)
    return s0_ptr + row * stride_sb + h * stride_sh


@triton.jit
def _load_s0(s0_base, offs_k, offs_v, stride_sk):
    """Value block offs_v of the state at s0_base (rows offs_k)."""
    return tl.load(s0_base + offs_k[:, None] * stride_sk + offs_v[None, :])


@triton.jit
def _root_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0, offs_k, offs_v):
    """(u_0, o_0, S_r, g_0, e_0) of node 0 from S_0's value block (see tree_wy_core_kernel)."""
    g0 = tl.load(g_ptr)
    beta0 = tl.load(beta_ptr)
    q0 = tl.load(q_ptr + offs_k)
    k0 = tl.load(k_ptr + offs_k)
    v0 = tl.load(v_ptr + offs_v)
    e0 = tl.exp(g0)
    u0 = v0 * beta0 - tl.sum((k0 * (beta0 * e0))[:, None] * s0, axis=0)
    o0 = tl.sum((q0 * e0)[:, None] * s0, axis=0) + tl.sum(q0 * k0) * u0
    return u0, o0, s0 * e0 + k0[:, None] * u0[None, :], g0


@triton.jit
def _rows_cum(anc_ptr, g_ptr, rows, rmask, end, T, stride_gt, stride_ai, stride_aj, BT: tl.constexpr,
              BC: tl.constexpr):
    """G of the rows (the root's gate included), over ancestor columns 0 .. end - 1: the rows' ancestors all precede
    them, so no column past their block is needed."""
    cum_r = tl.zeros([BT], dtype=tl.float32)
    for c0 in range(0, end, BC):
        cols = c0 + tl.arange(0, BC)
        cmask = cols < T
        a = tl.load(anc_ptr + rows[:, None] * stride_ai + cols[None, :] * stride_aj,
                    mask=rmask[:, None] & cmask[None, :], other=0)
        g_c = tl.load(g_ptr + cols * stride_gt, mask=cmask, other=0.0)
        cum_r += tl.sum(tl.where(a != 0, g_c[None, :], 0.0), axis=1)
    return cum_r


@triton.jit
def _block_terms(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, rows, rmask, r0, T, offs_k, offs_v, s0_base, s_root,
                 g0, stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_ai, stride_aj, stride_sk,
                 BT: tl.constexpr, BC: tl.constexpr, PRECISION: tl.constexpr):
    """What a block of nodes needs before any earlier block's u: (G of its rows, q, k and beta k rows, its right-hand
    side less the root state's term, its outputs' root-state term). Rows past T load as zeros (k = v = beta = 0:
    they solve to u = 0 and are never stored); rows outside the root's subtree (padding) use S_0 and G."""
    cum_r = _rows_cum(anc_ptr, g_ptr, rows, rmask, r0 + BT, T, stride_gt, stride_ai, stride_aj, BT, BC)
    in_root = tl.load(anc_ptr + rows * stride_ai, mask=rmask, other=0) != 0
    beta_r = tl.load(beta_ptr + rows * stride_bt, mask=rmask, other=0.0)
    q_r = tl.load(q_ptr + rows[:, None] * stride_qt + offs_k[None, :], mask=rmask[:, None], other=0.0)
    k_r = tl.load(k_ptr + rows[:, None] * stride_kt + offs_k[None, :], mask=rmask[:, None], other=0.0)
    v_r = tl.load(v_ptr + rows[:, None] * stride_vt + offs_v[None, :], mask=rmask[:, None], other=0.0)
    # e^{G_i - g_0} against S_r; e^{G_i} against S_0; exactly 0 past T. Rows past T have k = 0, and a scale of
    # e^{-g_0} there (inf for a root gate below -88) made 0 * inf = NaN rows that the diagonal block's dot then
    # spread to every row of the block (a 64-node tree of the random 27B on an H100, 2026-12-06).
    e_r = _exp_where(rmask, cum_r - tl.where(in_root, g0, 0.0))
    kb_r = k_r * beta_r[:, None]  # the reference's k_beta
    # A node outside the root's subtree is padding: k = beta = 0, so its right-hand side has no state term.
    rhs = v_r * beta_r[:, None] - tl.dot(kb_r * e_r[:, None], s_root, input_precision=PRECISION)
    o = tl.dot(q_r * e_r[:, None], s_root, input_precision=PRECISION)
    if tl.min((in_root | ~rmask).to(tl.int32), axis=0) == 0:  # padding in this block: its outputs start from S_0
        # Read again here, not kept from the root step: a value block of S_0 held through the whole walk was 32
        # registers a thread of a kernel that spilled (sm_90, bench.kernel_sass).
        s0 = _load_s0(s0_base, offs_k, offs_v, stride_sk)
        o = tl.where(in_root[:, None], o, tl.dot(q_r * e_r[:, None], s0, input_precision=PRECISION))
    return cum_r, q_r, k_r, kb_r, rhs, o


# T changes with every tree size: not specialised on it, so one compile serves all T.
@triton.jit(do_not_specialize=["T"])
def tree_wy_core_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, s0_ptr, s0_index_ptr, core_ptr, u_ptr, cum_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, stride_bb, stride_bh, stride_bt, stride_ab, stride_ai, stride_aj,
    stride_sb, stride_sh, stride_sk, stride_si,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    INVERT: tl.constexpr, INDEXED: tl.constexpr, PRECISION: tl.constexpr = "ieee",
):
    """core, u [B, H, T, DV] and cum [B, H, T] (contiguous float32) of one (b, h, value block); q, k [B, H, T, DK],
    v [B, H, T, DV] and s0 [B or pool, H, DK, DV] have unit stride along their last dim, anc [B, T, T] is uint8
    (0/1). INDEXED: tree b starts from s0[s0_index[b]] (a state pool read in place), else from s0[b]."""
    pid_v, b, h, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, core_ptr, u_ptr, cum_ptr = _value_program(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, core_ptr, u_ptr, cum_ptr, T, H, stride_qb, stride_qh,
        stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh, stride_ab, DV)

    offs_k = tl.arange(0, DK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    loc = tl.arange(0, BT)
    s0_base = _s0_base(s0_ptr, s0_index_ptr, b, h, stride_sb, stride_sh, stride_si, INDEXED)
    s0 = _load_s0(s0_base, offs_k, offs_v, stride_sk)   # the root step's; blocks with padding read it again
    strict = loc[:, None] > loc[None, :]

    # Node 0, the root of every real node, as one recurrent step: u_0 = beta_0 v_0 - S_0^T (beta_0 e^{g_0} k_0),
    # o_0 = e^{g_0} S_0^T q_0 + (q_0 . k_0) u_0, and its state S_r = e^{g_0} S_0 + k_0 u_0^T. Then for a descendant i,
    # e^{G_i} S_0 plus the root's term is e^{G_i - g_0} S_r: the blocks start at node 1 from S_r, so a tree of
    # 4^k + 1 nodes (a budget-4^k tree, a 16-token chain plus its root) takes 4^k / BT blocks, not one more for its
    # last node. Nodes outside the root's subtree (padding) keep S_0 and G.
    u0, o0, s_root, g0 = _root_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0, offs_k, offs_v)
    tl.store(u_ptr + offs_v, u0)
    tl.store(core_ptr + offs_v, o0)
    tl.store(cum_ptr, g0)

    for r0 in range(1, T, BT):
        rows = r0 + loc
        rmask = rows < T
        cum_r, q_r, k_r, kb_r, rhs, o = _block_terms(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, rows, rmask, r0, T, offs_k, offs_v, s0_base, s_root, g0,
            stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_ai, stride_aj, stride_sk, BT, BC,
            PRECISION)

        # Ancestors in earlier blocks, the root aside: solved already (rows 1 .. r0 - 1 of u and cum).
        for c0 in range(1, r0, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < r0
            k_c = tl.load(k_ptr + cols[:, None] * stride_kt + offs_k[None, :], mask=cmask[:, None], other=0.0)
            u_c = tl.load(u_ptr + cols[:, None] * DV + offs_v[None, :], mask=cmask[:, None], other=0.0)
            cum_c = tl.load(cum_ptr + cols, mask=cmask, other=0.0)
            a = tl.load(anc_ptr + rows[:, None] * stride_ai + cols[None, :] * stride_aj,
                        mask=rmask[:, None] & cmask[None, :], other=0)
            decay = _exp_where(a != 0, cum_r[:, None] - cum_c[None, :])
            kk = tl.dot(kb_r, tl.trans(k_c), input_precision=PRECISION) * decay
            qk = tl.dot(q_r, tl.trans(k_c), input_precision=PRECISION) * decay
            rhs -= tl.dot(kk, u_c, input_precision=PRECISION)
            o += tl.dot(qk, u_c, input_precision=PRECISION)

        # The diagonal block: A_RR, then (I + A_RR)^-1 in registers.
        a = tl.load(anc_ptr + rows[:, None] * stride_ai + rows[None, :] * stride_aj,
                    mask=rmask[:, None] & rmask[None, :], other=0)
        decay = _exp_where(a != 0, cum_r[:, None] - cum_r[None, :])
        sys_a = tl.where(strict, tl.dot(kb_r, tl.trans(k_r), input_precision=PRECISION) * decay, 0.0)
        inv = _invert_unit_lower(sys_a, loc, BT, INVERT, "ieee")
        u_r = tl.dot(inv, rhs, input_precision=PRECISION)
        o += tl.dot(tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION) * decay, u_r, input_precision=PRECISION)

        out_mask = rmask[:, None]
        tl.store(u_ptr + rows[:, None] * DV + offs_v[None, :], u_r, mask=out_mask)
        tl.store(core_ptr + rows[:, None] * DV + offs_v[None, :], o, mask=out_mask)
        tl.store(cum_ptr + rows, cum_r, mask=rmask)
        # The next blocks read these rows back (other threads of this program): order the stores before them.
        tl.debug_barrier()


# ---- the same core in three launches (TileConfig.phases == 3) --------------------------------------------------
# Everything of block R that does not depend on earlier blocks' u (its G, its diagonal block's inverse, the
# products with earlier nodes' keys, its terms of the root state) is made by one program per (tree, head, block)
# in parallel; one program per (tree, head, value block) then runs the substitution, whose chain per block is a
# dot per chunk of earlier columns and one with the inverse; a third launch adds the outputs' terms of every
# ancestor once all of U is known. Scratch: the inverses [BH, NB, BT, BT] and the decayed products A and QK
# [BH, T, T] (float32: 34 KB a head at 65 nodes).


@triton.jit(do_not_specialize=["T"])
def tree_wy_prepare_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, s0_ptr, s0_index_ptr, core_ptr, cum_ptr,
    rhs_ptr, inv_ptr, akk_ptr, aqk_ptr,
    T, H, NB,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, stride_bb, stride_bh, stride_bt, stride_ab, stride_ai, stride_aj,
    stride_sb, stride_sh, stride_sk, stride_si,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    INVERT: tl.constexpr, INDEXED: tl.constexpr, PRECISION: tl.constexpr = "ieee",
):
    """Block blk = program_id(1) of nodes 1 + blk*BT ..: rhs (beta V less the root state's term) and the outputs'
    root-state term (into core) for value block program_id(0); the first value block's program also G (cum), the
    diagonal block's inverse, and the rows of A and QK (decayed, ancestor-masked) over nodes 1 .. block end."""
    pid_v = tl.program_id(0)
    blk = tl.program_id(1)
    bh = tl.program_id(2)
    b, h, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr = _tree_head(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, bh, H, stride_qb, stride_qh, stride_kb, stride_kh,
        stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh, stride_ab)
    offs_k = tl.arange(0, DK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    loc = tl.arange(0, BT)
    s0_base = _s0_base(s0_ptr, s0_index_ptr, b, h, stride_sb, stride_sh, stride_si, INDEXED)
    s0 = _load_s0(s0_base, offs_k, offs_v, stride_sk)
    _, _, s_root, g0 = _root_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0, offs_k, offs_v)

    r0 = 1 + blk * BT
    rows = r0 + loc
    rmask = rows < T
    cum_r, q_r, k_r, kb_r, rhs, o = _block_terms(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, rows, rmask, r0, T, offs_k, offs_v, s0_base, s_root, g0,
        stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_ai, stride_aj, stride_sk, BT, BC,
            PRECISION)
    out_mask = rmask[:, None]
    tl.store(rhs_ptr + bh * T * DV + rows[:, None] * DV + offs_v[None, :], rhs, mask=out_mask)
    tl.store(core_ptr + bh * T * DV + rows[:, None] * DV + offs_v[None, :], o, mask=out_mask)

    if pid_v == 0:
        tl.store(cum_ptr + bh * T + rows, cum_r, mask=rmask)
        square = rmask[:, None] & rmask[None, :]
        a = tl.load(anc_ptr + rows[:, None] * stride_ai + rows[None, :] * stride_aj, mask=square, other=0)
        decay = _exp_where(a != 0, cum_r[:, None] - cum_r[None, :])
        strict = loc[:, None] > loc[None, :]
        sys_a = tl.where(strict, tl.dot(kb_r, tl.trans(k_r), input_precision=PRECISION) * decay, 0.0)
        inv = _invert_unit_lower(sys_a, loc, BT, INVERT, "ieee")
        tl.store(inv_ptr + (bh * NB + blk) * BT * BT + loc[:, None] * BT + loc[None, :], inv)
        qk = tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION) * decay
        tl.store(aqk_ptr + bh * T * T + rows[:, None] * T + rows[None, :], qk, mask=square)
        for c0 in range(1, r0, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < r0
            # G of these earlier nodes, summed here from the inputs (their own block's program sums it too).
            cum_c = tl.zeros([BC], dtype=tl.float32)
            for j0 in range(0, c0 + BC, BC):
                js = j0 + tl.arange(0, BC)
                jmask = js < r0
                a_cj = tl.load(anc_ptr + cols[:, None] * stride_ai + js[None, :] * stride_aj,
                               mask=cmask[:, None] & jmask[None, :], other=0)
                g_j = tl.load(g_ptr + js * stride_gt, mask=jmask, other=0.0)
                cum_c += tl.sum(tl.where(a_cj != 0, g_j[None, :], 0.0), axis=1)
            k_c = tl.load(k_ptr + cols[:, None] * stride_kt + offs_k[None, :], mask=cmask[:, None], other=0.0)
            # Names of their own: Triton types a name once per loop, and these are BT x BC, not BT x BT.
            a_rc = tl.load(anc_ptr + rows[:, None] * stride_ai + cols[None, :] * stride_aj,
                           mask=rmask[:, None] & cmask[None, :], other=0)
            decay_rc = _exp_where(a_rc != 0, cum_r[:, None] - cum_c[None, :])
            kk = tl.dot(kb_r, tl.trans(k_c), input_precision=PRECISION) * decay_rc
            qk_rc = tl.dot(q_r, tl.trans(k_c), input_precision=PRECISION) * decay_rc
            box = rmask[:, None] & cmask[None, :]
            tl.store(akk_ptr + bh * T * T + rows[:, None] * T + cols[None, :], kk, mask=box)
            tl.store(aqk_ptr + bh * T * T + rows[:, None] * T + cols[None, :], qk_rc, mask=box)


@triton.jit(do_not_specialize=["T"])
def tree_wy_solve_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s0_ptr, s0_index_ptr, core_ptr, u_ptr, cum_ptr,
    rhs_ptr, inv_ptr, akk_ptr,
    T, H, NB,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh,
    stride_sb, stride_sh, stride_sk, stride_si,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr,
    INDEXED: tl.constexpr, PRECISION: tl.constexpr = "ieee",
):
    """The root step, then U block by block: rhs less A's earlier columns times their u, times the inverse."""
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, DK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    loc = tl.arange(0, BT)
    s0 = _load_s0(_s0_base(s0_ptr, s0_index_ptr, b, h, stride_sb, stride_sh, stride_si, INDEXED), offs_k, offs_v,
                  stride_sk)
    u0, o0, _, g0 = _root_step(q_ptr + b * stride_qb + h * stride_qh, k_ptr + b * stride_kb + h * stride_kh,
                               v_ptr + b * stride_vb + h * stride_vh, g_ptr + b * stride_gb + h * stride_gh,
                               beta_ptr + b * stride_bb + h * stride_bh, s0, offs_k, offs_v)
    u_ptr += bh * T * DV
    tl.store(u_ptr + offs_v, u0)
    tl.store(core_ptr + bh * T * DV + offs_v, o0)
    tl.store(cum_ptr + bh * T, g0)
    rhs_ptr += bh * T * DV
    akk_ptr += bh * T * T
    for blk in range(0, NB):
        r0 = 1 + blk * BT
        rows = r0 + loc
        rmask = rows < T
        rhs = tl.load(rhs_ptr + rows[:, None] * DV + offs_v[None, :], mask=rmask[:, None], other=0.0)
        for c0 in range(1, r0, BC):
            cols = c0 + tl.arange(0, BC)
            cmask = cols < r0
            a = tl.load(akk_ptr + rows[:, None] * T + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            u_c = tl.load(u_ptr + cols[:, None] * DV + offs_v[None, :], mask=cmask[:, None], other=0.0)
            rhs -= tl.dot(a, u_c, input_precision=PRECISION)
        inv = tl.load(inv_ptr + (bh * NB + blk) * BT * BT + loc[:, None] * BT + loc[None, :])
        u_r = tl.dot(inv, rhs, input_precision=PRECISION)
        tl.store(u_ptr + rows[:, None] * DV + offs_v[None, :], u_r, mask=rmask[:, None])
        tl.debug_barrier()  # the next blocks read these rows back


@triton.jit(do_not_specialize=["T"])
def tree_wy_output_kernel(
    core_ptr, u_ptr, aqk_ptr, T,
    DV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr = "ieee",
):
    """Block blk's outputs: the root-state term (in core) plus QK's row times U over nodes 1 .. block end."""
    pid_v = tl.program_id(0)
    blk = tl.program_id(1)
    bh = tl.program_id(2)
    offs_v = pid_v * BV + tl.arange(0, BV)
    r0 = 1 + blk * BT
    rows = r0 + tl.arange(0, BT)
    rmask = rows < T
    end = tl.minimum(r0 + BT, T)
    o = tl.load(core_ptr + bh * T * DV + rows[:, None] * DV + offs_v[None, :], mask=rmask[:, None], other=0.0)
    for c0 in range(1, r0 + BT, BC):
        cols = c0 + tl.arange(0, BC)
        cmask = cols < end
        a = tl.load(aqk_ptr + bh * T * T + rows[:, None] * T + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0)
        u_c = tl.load(u_ptr + bh * T * DV + cols[:, None] * DV + offs_v[None, :], mask=cmask[:, None], other=0.0)
        o += tl.dot(a, u_c, input_precision=PRECISION)
    tl.store(core_ptr + bh * T * DV + rows[:, None] * DV + offs_v[None, :], o, mask=rmask[:, None])


# ---- the same core in two launches (TileConfig.phases == 2), trees of up to 1 + 64 nodes ----------------------
# The nodes past the root fit one block of NP (16, 32 or 64) rows, so nothing is sequential over blocks: one
# program per (tree, head) makes the key side, G, the whole (I + A)^-1 (block doubling up to NP) and the decayed
# QK, once for all value blocks; then one program per (tree, head, value block) makes the right-hand sides,
# U = (I + A)^-1 rhs and the outputs. Both walk the key dim in chunks of KC, so no [NP, DK] tile and no state is
# held whole (the one-launch kernel at 64-row blocks and Dk 128 spilled tens of KB a thread). Scratch: the
# inverse and QK [BH, NP, NP] (float32).


@triton.jit(do_not_specialize=["T"])
def tree_wy_keys_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, anc_ptr, inv_ptr, qkd_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_gb, stride_gh, stride_gt, stride_bb, stride_bh, stride_bt, stride_ab, stride_ai, stride_aj,
    DK: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr, PRECISION: tl.constexpr = "ieee",
    INVERT: tl.constexpr = "blocks",
):
    """Tree b, head h = program_id(0): (I + A)^-1 and QK * decay over nodes 1 .. T-1 (rows and columns 0 .. NP-1
    of inv and qkd [BH, NP, NP]; rows past T: identity and zeros). INVERT: "blocks" or "blocks16" (the doubling's
    levels up to 16 on the diagonal 16-blocks batched; see _invert_unit_lower)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    q_ptr += b * stride_qb + h * stride_qh
    k_ptr += b * stride_kb + h * stride_kh
    g_ptr += b * stride_gb + h * stride_gh
    beta_ptr += b * stride_bb + h * stride_bh
    anc_ptr += b * stride_ab
    loc = tl.arange(0, NP)
    rows = 1 + loc
    rmask = rows < T
    beta_r = tl.load(beta_ptr + rows * stride_bt, mask=rmask, other=0.0)
    kk = tl.zeros([NP, NP], dtype=tl.float32)
    qk = tl.zeros([NP, NP], dtype=tl.float32)
    for c in tl.static_range(0, DK, KC):
        offs_c = c + tl.arange(0, KC)
        k_c = tl.load(k_ptr + rows[:, None] * stride_kt + offs_c[None, :], mask=rmask[:, None], other=0.0)
        q_c = tl.load(q_ptr + rows[:, None] * stride_qt + offs_c[None, :], mask=rmask[:, None], other=0.0)
        kk += tl.dot(k_c * beta_r[:, None], tl.trans(k_c), input_precision=PRECISION)
        qk += tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
    cum_r = _rows_cum(anc_ptr, g_ptr, rows, rmask, 1 + NP, T, stride_gt, stride_ai, stride_aj, NP, BC)
    a = tl.load(anc_ptr + rows[:, None] * stride_ai + rows[None, :] * stride_aj,
                mask=rmask[:, None] & rmask[None, :], other=0)
    decay = _exp_where(a != 0, cum_r[:, None] - cum_r[None, :])
    # The whole block's inverse is 2 (log2(NP) - 1) dots of NP^3 (one-launch blocks: of 16^3): in IEEE float32 that
    # is ~1000 FFMAs a thread a dot at NP 64, so tensor-core precisions take it to TF32 x 3 (float32's accuracy).
    inv = _invert_unit_lower(tl.where(loc[:, None] > loc[None, :], kk * decay, 0.0), loc, NP, INVERT,
                             "ieee" if PRECISION == "ieee" else "tf32x3")
    square = bh * NP * NP + loc[:, None] * NP + loc[None, :]
    tl.store(inv_ptr + square, inv)
    tl.store(qkd_ptr + square, qk * decay)


@triton.jit(do_not_specialize=["T"])
def tree_wy_values_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, s0_ptr, s0_index_ptr, core_ptr, u_ptr, cum_ptr, inv_ptr, qkd_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, stride_bb, stride_bh, stride_bt, stride_ab, stride_ai, stride_aj,
    stride_sb, stride_sh, stride_sk, stride_si,
    DK: tl.constexpr, DV: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr,
    BV: tl.constexpr, INDEXED: tl.constexpr, PRECISION: tl.constexpr = "ieee",
):
    """Value block program_id(0) of tree b, head h = program_id(1): the root step (as _root_step), then nodes
    1 .. T-1 at once: their right-hand sides and root-state terms (as _block_terms) with S_r made chunk by chunk
    of the key dim, U = inv rhs, o += qkd U."""
    pid_v, b, h, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, core_ptr, u_ptr, cum_ptr = _value_program(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, anc_ptr, core_ptr, u_ptr, cum_ptr, T, H, stride_qb, stride_qh,
        stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_gh, stride_bb, stride_bh, stride_ab, DV)
    offs_v = pid_v * BV + tl.arange(0, BV)
    s0_base = _s0_base(s0_ptr, s0_index_ptr, b, h, stride_sb, stride_sh, stride_si, INDEXED)

    # Node 0: u_0 = beta_0 v_0 - S_0^T (beta_0 e^{g_0} k_0), o_0 = e^{g_0} S_0^T q_0 + (q_0 . k_0) u_0.
    g0 = tl.load(g_ptr)
    beta0 = tl.load(beta_ptr)
    e0 = tl.exp(g0)
    v0 = tl.load(v_ptr + offs_v)
    sk0 = tl.zeros([BV], dtype=tl.float32)
    sq0 = tl.zeros([BV], dtype=tl.float32)
    qk0 = tl.zeros([KC], dtype=tl.float32)
    for c in tl.static_range(0, DK, KC):
        offs_c = c + tl.arange(0, KC)
        s0_c = _load_s0(s0_base, offs_c, offs_v, stride_sk)
        k0_c = tl.load(k_ptr + offs_c)
        q0_c = tl.load(q_ptr + offs_c)
        sk0 += tl.sum((k0_c * (beta0 * e0))[:, None] * s0_c, axis=0)
        sq0 += tl.sum((q0_c * e0)[:, None] * s0_c, axis=0)
        qk0 += q0_c * k0_c
    u0 = v0 * beta0 - sk0
    tl.store(u_ptr + offs_v, u0)
    tl.store(core_ptr + offs_v, sq0 + tl.sum(qk0) * u0)
    tl.store(cum_ptr, g0)

    # Nodes 1 .. T-1 against S_r = e^{g_0} S_0 + k_0 u_0^T, one chunk of its rows at a time.
    loc = tl.arange(0, NP)
    rows = 1 + loc
    rmask = rows < T
    cum_r = _rows_cum(anc_ptr, g_ptr, rows, rmask, 1 + NP, T, stride_gt, stride_ai, stride_aj, NP, BC)
    in_root = tl.load(anc_ptr + rows * stride_ai, mask=rmask, other=0) != 0
    beta_r = tl.load(beta_ptr + rows * stride_bt, mask=rmask, other=0.0)
    e_r = _exp_where(rmask, cum_r - tl.where(in_root, g0, 0.0))   # see _block_terms: exactly 0 past T
    rhs = tl.load(v_ptr + rows[:, None] * stride_vt + offs_v[None, :], mask=rmask[:, None], other=0.0) \
        * beta_r[:, None]
    o = tl.zeros([NP, BV], dtype=tl.float32)
    for c in tl.static_range(0, DK, KC):
        offs_c = c + tl.arange(0, KC)
        s_root = _load_s0(s0_base, offs_c, offs_v, stride_sk) * e0 + tl.load(k_ptr + offs_c)[:, None] * u0[None, :]
        k_c = tl.load(k_ptr + rows[:, None] * stride_kt + offs_c[None, :], mask=rmask[:, None], other=0.0)
        q_c = tl.load(q_ptr + rows[:, None] * stride_qt + offs_c[None, :], mask=rmask[:, None], other=0.0)
        rhs -= tl.dot(k_c * (beta_r * e_r)[:, None], s_root, input_precision=PRECISION)
        o += tl.dot(q_c * e_r[:, None], s_root, input_precision=PRECISION)
    if tl.min((in_root | ~rmask).to(tl.int32), axis=0) == 0:  # padding: its outputs start from S_0 (as above)
        o_s0 = tl.zeros([NP, BV], dtype=tl.float32)
        for c in tl.static_range(0, DK, KC):
            offs_c = c + tl.arange(0, KC)
            q_c = tl.load(q_ptr + rows[:, None] * stride_qt + offs_c[None, :], mask=rmask[:, None], other=0.0)
            o_s0 += tl.dot(q_c * e_r[:, None], _load_s0(s0_base, offs_c, offs_v, stride_sk), input_precision=PRECISION)
        o = tl.where(in_root[:, None], o, o_s0)

    square = (b * H + h) * NP * NP + loc[:, None] * NP + loc[None, :]
    u_r = tl.dot(tl.load(inv_ptr + square), rhs, input_precision=PRECISION)
    o += tl.dot(tl.load(qkd_ptr + square), u_r, input_precision=PRECISION)
    out_mask = rmask[:, None]
    tl.store(u_ptr + rows[:, None] * DV + offs_v[None, :], u_r, mask=out_mask)
    tl.store(core_ptr + rows[:, None] * DV + offs_v[None, :], o, mask=out_mask)
    tl.store(cum_ptr + rows, cum_r, mask=rmask)
