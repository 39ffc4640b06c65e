"""The fused tree WY core (target_svc/gdn_tree_kernel.py) equals the PyTorch reference core of gdn_tree_wy.py.

The kernel runs here under Triton's interpreter on the CPU, where Triton is installed (scripts/test.sh installs it;
without it those tests are skipped); tests/test_gpu.py runs it compiled at the 27B's head dims. The interpreter must be on before Triton
is imported (triton.language's own helpers, tl.zeros, tl.sum, are jit functions built at import), and in a whole
session something imports Triton first: so the `test_interpreted_*` tests run only in a process started with
TRITON_INTERPRET=1, which test_kernel_cases_under_tritons_interpreter starts for them (this file, -k interpreted).
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.common import random_parents
from ddtree_serve.decoding.tree_mask import ancestor_mask_batch
from target_svc import gdn_tree_kernel
from target_svc.gdn_tree_kernel import TileConfig, choose_config, supports
from target_svc.gdn_tree_wy import _wy_core_reference, gdn_tree_forward_wy

REPO = Path(__file__).resolve().parents[1]
# Stated tolerance, as a fraction of the reference's largest magnitude: kernel and reference do the same float32
# arithmetic in other orders (blocked substitution instead of LAPACK's solve, other summation orders): the
# interpreter showed up to 9e-7 on these cases; a wrong mask, block or index is off by 1e-3 or more.
REL_TOL = 1e-5
# Against the reference computed in float64: the kernel's own float32 rounding (measured up to 1.3e-6).
F64_TOL = 3e-6

HAS_TRITON = importlib.util.find_spec("triton") is not None
IN_INTERPRETER = os.environ.get("TRITON_INTERPRET", "") == "1"
in_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and IN_INTERPRETER),
    reason="runs in test_kernel_cases_under_tritons_interpreter's own process, with the interpreter on")


@pytest.fixture(scope="module")
def interpreted():
    """Triton's interpreter with loop bounds taken from scalar arguments working under numpy >= 2.4."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        # Triton 3.6's interpreter turns a scalar into a loop bound with int() of a one-element array, which
        # numpy >= 2.4 refuses; Triton 3.8 squeezes it first, as here.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch_with_index)
        yield


@pytest.mark.skipif(not HAS_TRITON or IN_INTERPRETER, reason="needs the triton package (scripts/test.sh installs it)")
def test_kernel_cases_under_tritons_interpreter():
    """This file's test_interpreted_* tests in a fresh process with the interpreter on: all run, all pass."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted",
                          str(Path(__file__).resolve())], capture_output=True, text=True, env=env, timeout=600,
                         cwd=REPO)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.fullmatch(r"\d+ passed, \d+ deselected in .*", summary), summary  # nothing skipped, nothing failed




def core_inputs(trees: list[list[int]], heads: int, dk: int, dv: int, seed: int):
    """(qh, kh, vh, g, beta, anc, s0) as gdn_tree_forward_wy hands them over: padded trees (parents [B, T] with
    -1 past each tree), heads-first transposed views, normalised keys, padded nodes with k = g = beta = 0."""
    gen = torch.Generator().manual_seed(seed)
    bsz, t = len(trees), max(len(p) for p in trees)
    parents = torch.full((bsz, t), -1, dtype=torch.long)
    for b, p in enumerate(trees):
        parents[b, : len(p)] = torch.tensor(p)
    sizes = torch.tensor([len(p) for p in trees])
    anc = ancestor_mask_batch(parents, sizes)
    vf = (torch.arange(t)[None, :] < sizes[:, None]).float()
    q = F.normalize(torch.randn(bsz, t, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(bsz, t, heads, dk, generator=gen), dim=-1) * vf[:, :, None, None]
    v = torch.randn(bsz, t, heads, dv, generator=gen)
    # Decays from slow heads to fast ones, as -exp(A_log) * softplus(.) makes them.
    rate = torch.linspace(-3.0, 1.0, heads).exp()
    g = -rate * F.softplus(torch.randn(bsz, t, heads, generator=gen)) * vf[..., None]
    beta = torch.sigmoid(torch.randn(bsz, t, heads, generator=gen)) * vf[..., None]
    s0 = torch.randn(bsz, heads, dk, dv, generator=gen) * 0.3
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), anc,
            s0)


def assert_matches_reference(args, config: TileConfig | None = None) -> None:
    got = gdn_tree_kernel.tree_wy_core(*args, config=config)
    want = _wy_core_reference(*args)
    for name, x, ref in zip(("core", "u", "cum"), got, want):
        assert x.shape == ref.shape and x.dtype == torch.float32, name
        err = ((x - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()
        assert err <= REL_TOL, f"{name}: {err:.2e} of the largest magnitude (config {config})"


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


GEN = torch.Generator().manual_seed(0)
CASES = {
    "one node": ([[-1], [-1]], 16, 16),
    "chains, a depth-16 chain, padded": ([chain(17), chain(9)], 32, 16),
    "65 nodes, depth 16, padded": ([random_parents(65, 16, GEN), random_parents(40, 16, GEN)], 16, 32),
    "65 nodes, any depth": ([random_parents(65, 64, GEN), chain(65)], 32, 32),
    "16-node trees": ([random_parents(16, 15, GEN), random_parents(11, 3, GEN)], 32, 16),
    "a 256-node chain, a 200-node tree": ([chain(256), random_parents(200, 16, GEN)], 16, 16),
    # a hybrid's prompt prefill in the 257-node bucket: a 130-token chain padded to 257 rows, and a whole one
    "257-node prefill chains, one padded": ([chain(130), chain(257)], 16, 16),
}


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_equals_the_reference_core_on_random_trees(interpreted, case):
    trees, dk, dv = CASES[case]
    heads = 1 if max(map(len, trees)) > 128 else 2  # the interpreter's time grows as T^2
    assert_matches_reference(core_inputs(trees, heads=heads, dk=dk, dv=dv, seed=len(case)))


@in_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_three_launch_kernel_equals_the_reference_core_on_random_trees(interpreted, case):
    """TileConfig.phases == 3 (products first, then the substitution, then the outputs) on every tree case; trees
    past THREE_PHASE_MAX_NODES take the one-launch kernel."""
    trees, dk, dv = CASES[case]
    heads = 1 if max(map(len, trees)) > 128 else 2
    assert_matches_reference(core_inputs(trees, heads=heads, dk=dk, dv=dv, seed=len(case)),
                             TileConfig(block_t=16, block_c=32, block_v=16, phases=3))


@in_interpreter
@pytest.mark.parametrize("case", [c for c in CASES if max(map(len, CASES[c][0])) <= gdn_tree_kernel.TWO_PHASE_MAX_NODES])
def test_interpreted_two_launch_kernel_equals_the_reference_core_on_random_trees(interpreted, case):
    """TileConfig.phases == 2 (the whole inverse and QK per head, then every node past the root in one block) on
    every tree case of up to TWO_PHASE_MAX_NODES nodes: 1, 16, 17 and 65 nodes, padded trees, chains and any depth."""
    trees, dk, dv = CASES[case]
    assert_matches_reference(core_inputs(trees, heads=2, dk=dk, dv=dv, seed=len(case)),
                             TileConfig(block_c=32, block_v=16, phases=2))


@in_interpreter
@pytest.mark.parametrize("config", [TileConfig(block_t=16, block_c=16, block_v=16),
                                    TileConfig(block_t=32, block_c=16, block_v=16, phases=3),
                                    TileConfig(block_t=16, block_c=64, block_v=32, phases=3, invert="rows"),
                                    TileConfig(block_t=32, block_c=16, block_v=32),
                                    TileConfig(block_t=16, block_c=64, block_v=32),
                                    TileConfig(block_t=64, block_c=16, block_v=16),
                                    TileConfig(block_t=32, block_c=64, block_v=16, invert="rows")])
def test_interpreted_kernel_equals_the_reference_core_under_other_tilings(interpreted, config):
    """Several ancestor chunks per block, chunks wider than the solved rows, 32- and 64-row diagonal blocks."""
    trees = [random_parents(50, 16, torch.Generator().manual_seed(9)), chain(37)]
    assert_matches_reference(core_inputs(trees, heads=2, dk=32, dv=32, seed=7), config)


BLOCK_CASES = {
    "one node": [[-1]],
    "a 16-deep chain, padded": [chain(17), chain(16), chain(3)],
    "65 nodes, depth 16, padded": [random_parents(65, 16, GEN), random_parents(40, 16, GEN)],
    "a 200-node tree": [random_parents(200, 16, GEN)],
}


@in_interpreter
@pytest.mark.parametrize("block_t", [16, 32, 64])
@pytest.mark.parametrize("invert", ["blocks", "rows"])
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_interpreted_kernel_equals_the_reference_core_for_each_diagonal_block(interpreted, case, block_t, invert):
    """Diagonal blocks of 16, 32 and 64 nodes, inverted either way: one node, blocks cut through a chain and
    past a padded tree's end, trees wider than a block."""
    trees = BLOCK_CASES[case]
    config = TileConfig(block_t=block_t, block_c=32, block_v=16, invert=invert)
    assert_matches_reference(core_inputs(trees, heads=1, dk=16, dv=16, seed=len(case) + block_t), config)


def correlated_chain_inputs(nodes: int, dk: int, dv: int, cosine: float, seed: int):
    """A chain whose keys share one direction (pairwise cosine about `cosine`), beta in (0.9, 1), gates near 0:
    entries of A near 1 all over the lower triangle, the hardest system for the diagonal block's inverse."""
    qh, kh, vh, g, beta, anc, s0 = core_inputs([chain(nodes)], heads=2, dk=dk, dv=dv, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(1, 2, 1, dk, generator=gen)
    kh = F.normalize(shared * cosine**0.5 + torch.randn(kh.shape, generator=gen) * (1 - cosine) ** 0.5, dim=-1)
    beta = 0.9 + 0.1 * torch.rand(beta.shape, generator=gen)
    return qh, kh, vh, g * 0.01, beta, anc, s0


@in_interpreter
@pytest.mark.parametrize("phases", [1, 3])
@pytest.mark.parametrize("block_t", [16, 32, 64])
@pytest.mark.parametrize("invert", ["blocks", "rows"])
def test_interpreted_inversions_round_like_substitution_against_float64(interpreted, block_t, invert, phases):
    """Both inversions' error against the reference in float64, on a random tree and on correlated chains.

    Measured under the interpreter (max over core and u, relative to the largest magnitude, over the three
    inputs): substitution ("rows") 8.7e-7, 9.6e-7, 1.3e-6 and the block doubling ("blocks") 8.7e-7, 8.1e-7,
    1.3e-6 at BT 16, 32, 64; the float32 reference itself 1.3e-6. The power series (I + N)(I + N^2)...
    (I + N^(BT/2)), N = -A, was tried and dropped: exact on the random tree (2.8e-7) but on the chains 2.3e-5 and
    1.3e-4 at BT 16, 1.7e-1 and 2.9e1 at BT 32, 3.9e6 and 9.5e9 at BT 64 (binomially growing terms that cancel)."""
    assert_rounds_like_substitution(TileConfig(block_t=block_t, block_c=32, block_v=16, invert=invert, phases=phases))


def assert_rounds_like_substitution(config: TileConfig) -> None:
    """The core within F64_TOL of the float64 reference on a random 65-node tree and two correlated 64-chains."""
    for args in (core_inputs([random_parents(65, 16, torch.Generator().manual_seed(4))], heads=2, dk=128, dv=16,
                             seed=5),
                 correlated_chain_inputs(64, dk=128, dv=16, cosine=0.8, seed=7),
                 correlated_chain_inputs(64, dk=16, dv=16, cosine=0.98, seed=9)):
        want = _wy_core_reference(*(a.double() if a.is_floating_point() else a for a in args))
        got = gdn_tree_kernel.tree_wy_core(*args, config=config)
        for name, x, ref in zip(("core", "u"), got, want):
            err = ((x.double() - ref).abs().max() / ref.abs().max()).item()
            assert err <= F64_TOL, f"{name}: {err:.2e} against float64 (config {config})"


@in_interpreter
@pytest.mark.parametrize("case", [c for c in CASES if 17 < max(map(len, CASES[c][0])) <= gdn_tree_kernel.TWO_PHASE_MAX_NODES])
def test_interpreted_two_launch_kernel_with_batched_16_blocks_equals_the_reference_core(interpreted, case):
    """invert="blocks16": the two-launch inverse's doubling up to blocks of 16 on the diagonal 16-blocks batched
    ([NP / 16, 16, 16] dots), the levels past 16 whole: the reference core on the tree cases of 18 to 65 nodes
    (up to 17 nodes the block is 16 rows: nothing to batch)."""
    trees, dk, dv = CASES[case]
    assert_matches_reference(core_inputs(trees, heads=2, dk=dk, dv=dv, seed=len(case)),
                             TileConfig(block_c=32, block_v=16, phases=2, invert="blocks16"))


@in_interpreter
def test_interpreted_batched_16_blocks_give_the_whole_dots_inverse(interpreted):
    """The diagonal 16-blocks' doubling batched sums the same nonzero terms as the whole 64 x 64 dots: at IEEE the
    two forms' outputs agree to float32 rounding on a 65-node tree and a 64-deep chain of correlated keys."""
    for args in (core_inputs([random_parents(65, 16, torch.Generator().manual_seed(3))], heads=2, dk=32, dv=16, seed=3),
                 correlated_chain_inputs(65, dk=32, dv=16, cosine=0.9, seed=4)):
        whole = gdn_tree_kernel.tree_wy_core(*args, config=TileConfig(block_c=32, block_v=16, phases=2))
        batched = gdn_tree_kernel.tree_wy_core(*args, config=TileConfig(block_c=32, block_v=16, phases=2,
                                                                        invert="blocks16"))
        for x, y in zip(whole, batched):
            assert ((x - y).abs().max() / y.abs().max()).item() <= 1e-5


@in_interpreter
def test_interpreted_two_launch_batched_16_blocks_round_like_substitution_against_float64(interpreted):
    """invert="blocks16" keeps the two-launch inverse within the float32 rounding bound of the one-launch kernel."""
    assert_rounds_like_substitution(TileConfig(block_c=32, block_v=16, phases=2, invert="blocks16"))


@in_interpreter
def test_interpreted_two_launch_inverse_rounds_like_substitution_against_float64(interpreted):
    """The two-launch form inverts all 64 nodes past the root as one block (doubling up to 64): within the
    float32 rounding bound of the one-launch kernel, on the random tree and the correlated chains above."""
    assert_rounds_like_substitution(TileConfig(block_c=32, block_v=16, phases=2))


@in_interpreter
def test_interpreted_tree_forward_with_the_kernel_equals_it_without(interpreted):
    """gdn_tree_forward_wy on a layer: outputs and the trace the commit reads agree; the trace's layout is kept."""
    layer, x, parents, valid, conv, rec = _small_forward_inputs(seed=5)
    with torch.no_grad():
        want_out, want = gdn_tree_forward_wy(layer, x, parents, valid, conv, rec, kernel=False)
        got_out, got = gdn_tree_forward_wy(layer, x, parents, valid, conv, rec, kernel=True)
    scale = want_out.abs().max()
    torch.testing.assert_close(got_out, want_out, atol=REL_TOL * scale, rtol=0)
    torch.testing.assert_close(got.u, want.u, atol=REL_TOL * want.u.abs().max(), rtol=0)
    torch.testing.assert_close(got.cum_g, want.cum_g, atol=REL_TOL * want.cum_g.abs().max(), rtol=0)
    assert torch.equal(got.key, want.key) and torch.equal(got.anc, want.anc)
    assert torch.equal(got.conv_inputs, want.conv_inputs) and torch.equal(got.window_idx, want.window_idx)


@in_interpreter
def test_interpreted_kernel_reads_each_trees_state_from_a_pool_by_index(interpreted):
    """s0_index: tree b starts from s0[s0_index[b]] of a state pool, the index a strided view (the packed batch's
    slots column) with one slot twice (padding rows share the scratch slot)."""
    args = list(core_inputs([random_parents(40, 16, torch.Generator().manual_seed(2)), chain(17), [-1]], heads=2,
                            dk=16, dv=32, seed=3))
    pool = torch.randn(6, 2, 16, 32, generator=torch.Generator().manual_seed(4)) * 0.3
    packed = torch.tensor([[7, 5], [7, 1], [7, 5]])
    index = packed[:, 1]
    for phases in (1, 2, 3):
        config = TileConfig(block_v=32, phases=phases)
        args[6] = pool
        got = gdn_tree_kernel.tree_wy_core(*args, config=config, s0_index=index)
        args[6] = pool[index]
        want = gdn_tree_kernel.tree_wy_core(*args, config=config)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), phases
    want_ref = _wy_core_reference(*args)
    assert all(((x - y).abs().max() / y.abs().max()).item() <= REL_TOL for x, y in zip(got, want_ref))


@in_interpreter
@pytest.mark.parametrize("phases", [1, 2, 3])
def test_interpreted_kernel_stays_exact_past_the_last_block_under_a_fast_decaying_root(interpreted, phases):
    """Trees whose last 16-node block runs past the tree (16 and 33 nodes: nodes 1 .. T-1 in blocks of 16) with
    a root gate of -100 (e^100 overflows float32): finite and the reference's, as at 17 nodes. Rows past the
    tree once took e^{-g_0} = inf as their scale, 0 * inf = NaN spread through the diagonal block's dot."""
    config = TileConfig(block_v=16, phases=phases)
    for tree in (chain(16), random_parents(33, 16, torch.Generator().manual_seed(6)), chain(17)):
        args = list(core_inputs([tree], heads=2, dk=16, dv=16, seed=len(tree)))
        args[3] = args[3].clone()
        args[3][:, :, 0] = -100.0
        assert all(torch.isfinite(x).all() for x in gdn_tree_kernel.tree_wy_core(*args, config=config)), len(tree)
        assert_matches_reference(args, config)


def _small_forward_inputs(seed: int):
    from target_svc.gated_deltanet import LinearAttnStateShape
    from tests.test_gated_deltanet import HIDDEN, _make_layer

    layer = _make_layer(seed=seed)
    dims = LinearAttnStateShape.from_module(layer)
    gen = torch.Generator().manual_seed(seed)
    trees = [random_parents(20, 16, gen), random_parents(13, 4, gen)]
    parents = torch.full((2, 20), -1, dtype=torch.long)
    for b, p in enumerate(trees):
        parents[b, : len(p)] = torch.tensor(p)
    valid = torch.arange(20)[None, :] < torch.tensor([20, 13])[:, None]
    x = torch.randn(2, 20, HIDDEN, generator=gen)
    conv = torch.randn(dims.conv_shape(2), generator=gen)
    rec = torch.randn(dims.rec_shape(2), generator=gen) * 0.3
    return layer, x, parents, valid, conv, rec


def test_the_forward_takes_the_kernel_where_available_unless_switched_off(monkeypatch):
    """kernel=None: the kernel where available (never on the CPU) and supporting the size, unless
    DDTREE_GDN_KERNELS=off."""
    from target_svc import gdn_kernels

    assert not gdn_tree_kernel.available("cpu")
    calls: list[int] = []
    precisions: list[str] = []

    def spy(*args, s0_index=None, precision=None):
        calls.append(args[0].shape[2])
        precisions.append(precision)
        return _wy_core_reference(*args)

    args = _small_forward_inputs(seed=8)
    monkeypatch.setattr(gdn_tree_kernel, "tree_wy_core", spy)
    monkeypatch.delenv(gdn_kernels.ENV_VAR, raising=False)
    with torch.no_grad():
        gdn_tree_forward_wy(*args)
        assert calls == []  # the CPU: the reference
        monkeypatch.setattr(gdn_tree_kernel, "available", lambda device: True)
        gdn_tree_forward_wy(*args)
        assert calls == [20]
        monkeypatch.setenv(gdn_kernels.ENV_VAR, "off")
        gdn_tree_forward_wy(*args)
        assert calls == [20]
        monkeypatch.delenv(gdn_kernels.ENV_VAR)
        layer, x, parents, valid, conv, rec = args   # 16 nodes: a last block with a row past the tree, served too
        gdn_tree_forward_wy(layer, x[:, :16], parents[:, :16], valid[:, :16], conv, rec)
        assert calls == [20, 16]
        assert precisions == ["ieee", "ieee"]   # a float32 model: the dots in float32
        gdn_tree_forward_wy(layer.to(torch.bfloat16), x.bfloat16(), parents, valid, conv, rec)
        assert calls == [20, 16, 20] and precisions[-1] == "bf16x3"


def test_the_serving_precision_follows_the_model_dtype_unless_the_environment_names_one(monkeypatch):
    """serving_precision: bf16x3 for bf16 / fp16 models, IEEE for float32 ones; DDTREE_TREE_WY_PRECISION (any case,
    spaces trimmed) overrides both; a name the kernels do not take is refused."""
    monkeypatch.delenv(gdn_tree_kernel.PRECISION_ENV, raising=False)
    assert gdn_tree_kernel.precision_from_env() is None
    assert gdn_tree_kernel.serving_precision(torch.bfloat16) == "bf16x3"
    assert gdn_tree_kernel.serving_precision(torch.float16) == "bf16x3"
    assert gdn_tree_kernel.serving_precision(torch.float32) == "ieee"
    monkeypatch.setenv(gdn_tree_kernel.PRECISION_ENV, " IEEE ")
    assert gdn_tree_kernel.serving_precision(torch.bfloat16) == "ieee"
    monkeypatch.setenv(gdn_tree_kernel.PRECISION_ENV, "tf32x3")
    assert gdn_tree_kernel.serving_precision(torch.float32) == "tf32x3"
    monkeypatch.setenv(gdn_tree_kernel.PRECISION_ENV, "fp8")
    with pytest.raises(ValueError, match="fp8"):
        gdn_tree_kernel.serving_precision(torch.bfloat16)


def test_the_launch_form_switch_reads_one_or_three_and_refuses_anything_else(monkeypatch):
    """DDTREE_TREE_WY_PHASES: unset is None (choose_config's form), "1", "2" and "3" name the form, others are
    refused."""
    monkeypatch.delenv(gdn_tree_kernel.PHASES_ENV, raising=False)
    assert gdn_tree_kernel.phases_from_env() is None
    monkeypatch.setenv(gdn_tree_kernel.PHASES_ENV, " 3 ")
    assert gdn_tree_kernel.phases_from_env() == 3
    monkeypatch.setenv(gdn_tree_kernel.PHASES_ENV, "1")
    assert gdn_tree_kernel.phases_from_env() == 1
    monkeypatch.setenv(gdn_tree_kernel.PHASES_ENV, "2")
    assert gdn_tree_kernel.phases_from_env() == 2
    monkeypatch.setenv(gdn_tree_kernel.PHASES_ENV, "4")
    with pytest.raises(ValueError, match="expected 1, 2 or 3"):
        gdn_tree_kernel.phases_from_env()


def test_trees_on_the_tensor_cores_up_to_65_nodes_default_to_two_launches():
    """default_phases: two launches for 2 .. 65 nodes at any tensor-core precision; one at IEEE, for a lone root
    and past 65 nodes."""
    assert gdn_tree_kernel.default_phases(65, "bf16x3") == 2 and gdn_tree_kernel.default_phases(2, "tf32x3") == 2
    assert gdn_tree_kernel.default_phases(17, "bf16x3") == 2
    assert gdn_tree_kernel.default_phases(65, "ieee") == 1 and gdn_tree_kernel.default_phases(1, "bf16x3") == 1
    assert gdn_tree_kernel.default_phases(gdn_tree_kernel.TWO_PHASE_MAX_NODES + 1, "bf16x3") == 1


def test_supported_shapes_and_tiles():
    assert supports(1, 128, 128) and supports(256, 128, 128) and supports(gdn_tree_kernel.MAX_NODES, 16, 256)
    assert not supports(0, 128, 128) and not supports(gdn_tree_kernel.MAX_NODES + 1, 128, 128)
    assert not supports(65, 96, 128) and not supports(65, 128, 8) and not supports(65, 512, 128)
    # 27B heads (48 value heads of 128) on 132 SMs: value blocks of 64; 8 warps for one tree, 4 for eight.
    assert choose_config(48, 128, 132).block_v == 64 and choose_config(8 * 48, 128, 132).block_v == 64
    assert choose_config(2, 16, 132).block_v == 16 and choose_config(1, 64, 1).block_v == 64
    assert choose_config(48, 128, 132).num_warps == 8 and choose_config(8 * 48, 128, 132).num_warps == 4
    assert choose_config(48, 128, 132).block_t == 16 and choose_config(48, 128, 132).invert == "blocks"
    # Two launches: value blocks of 32 (or the whole head below), 4 warps, the inverse batched up to 16, any batch.
    two = choose_config(48, 128, 132, phases=2)
    assert (two.phases, two.block_v, two.num_warps, two.invert) == (2, 32, 4, "blocks16")
    assert choose_config(8 * 48, 128, 132, 2) == two
    assert choose_config(2, 16, 132, phases=2).block_v == 16


def test_bad_inputs_are_refused_before_any_launch():
    args = core_inputs([[-1, 0]], heads=2, dk=16, dv=16, seed=1)
    with pytest.raises(ValueError, match="float32"):
        gdn_tree_kernel.tree_wy_core(*(a.double() if i == 0 else a for i, a in enumerate(args)))
    with pytest.raises(ValueError, match="shapes"):
        gdn_tree_kernel.tree_wy_core(*args[:5], args[5][:, :1], args[6])
    with pytest.raises(ValueError, match="unsupported"):
        wide = core_inputs([[-1, 0]], heads=2, dk=24, dv=16, seed=1)
        gdn_tree_kernel.tree_wy_core(*wide)
    for bad in (TileConfig(block_t=48, block_v=16), TileConfig(block_t=128, block_v=16),
                TileConfig(block_v=16, invert="doubling"), TileConfig(block_v=16, invert="blocks16"),  # phases 2 only
                TileConfig(block_v=16, phases=2, key_warps=3)):  # a warp count Triton does not launch
        with pytest.raises(ValueError, match="bad tiles"):
            gdn_tree_kernel.tree_wy_core(*args, config=bad)
