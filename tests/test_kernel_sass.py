"""bench.kernel_sass: the real launchers' Triton launches, recorded on the CPU and compiled for sm_90 without a GPU.

Compiling for the GPU is also a check no interpreter test makes: a kernel that Triton or ptxas rejects for
Hopper fails here, in CI, rather than on the lent device."""
from __future__ import annotations

import pytest

from bench import kernel_sass
from tests.test_quantization_backend import needs_triton

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   FFMA R2, R0, R0, R1 ;
        /*0030*/              @!P2 FMUL.FTZ R2, R2, 0.5 ;
        /*0040*/               @P0 BRA 0x10 ;
        /*0050*/                   EXIT ;
        /*0060*/                   BRA 0x60;
"""


def test_the_sass_parser_finds_each_backward_branch_as_a_loop_with_its_opcodes():
    instructions = kernel_sass.parse_sass(SASS)
    assert len(instructions) == 7
    loops = kernel_sass.sass_loops(instructions)
    # 0x10..0x40 is the loop; the trailing self-branch (0x60 -> 0x60) is not backward.
    assert [lp.instructions for lp in loops] == [4]
    assert loops[0].mix == {"S2R": 1, "FFMA": 1, "FMUL": 1, "BRA": 1}


def test_a_tensor_core_instruction_names_its_shape_and_where_a_warpgroup_mma_reads_a():
    assert kernel_sass.mma_form("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24") == "HGMMA.64x128x16.F32.BF16 A:smem"
    assert kernel_sass.mma_form("HGMMA.64x64x16.F32.BF16 R56, R112, gdesc[UR16], R56") == (
        "HGMMA.64x64x16.F32.BF16 A:regs")
    assert kernel_sass.mma_form("@P1 HMMA.16816.F32.BF16 R4, R8, R12, R4") == "HMMA.16816.F32.BF16"
    assert kernel_sass.mma_form("IGMMA.64x128x32.S8.S8 R24, gdesc[UR12], R24") == "IGMMA.64x128x32.S8.S8 A:smem"
    assert kernel_sass.mma_form("IMMA.16832.S8.S8.SAT R4, R8, R12, R4") == "IMMA.16832.S8.S8.SAT"
    assert kernel_sass.mma_form("FFMA R2, R0, R0, R1") is None


@needs_triton
def test_the_swapped_int8_dot_feeds_the_widened_weight_to_the_warpgroup_mma_from_registers():
    """At a 64-node verify both int8 dots run Hopper's warpgroup MMA; the plain one (x W^T) reads both operands
    from shared memory, so the widened weight goes back there first; the swapped one (W x^T) reads it from
    registers."""
    launches = dict(x for x in kernel_sass.int8_launches() if x[1].fn.__name__ == "weight_only_matmul_kernel")
    plain, swapped = (max(kernel_sass.sass_report(kernel_sass.compile_launch(launches[label])).loops,
                          key=lambda lp: lp.instructions)
                      for label in ("64 rows x 4096 -> 24576", "64 rows x 4096 -> 24576, swapped"))
    assert plain.mma and all(f.startswith("HGMMA") and f.endswith("A:smem") for f in plain.mma)
    assert swapped.mma and all(f.startswith("HGMMA") and f.endswith("A:regs") for f in swapped.mma)
    assert plain.mix.get("STS", 0) > 0 and swapped.mix.get("STS", 0) == 0


@needs_triton
def test_the_w8a8_product_runs_integer_mmas_on_the_int8_tiles_with_no_widening():
    """At a 64-node verify the w8a8 product is Hopper's integer warpgroup MMA on int8 operands from shared memory,
    and its main loop widens nothing: no conversion, no byte permutes, no stores back to shared memory (the
    weight-only dot's costs, test above); a decode row takes the warp-level integer MMA."""
    launches = dict(x for x in kernel_sass.w8a8_launches() if x[1].fn.__name__ == "w8a8_matmul_kernel")
    verify, decode = (max(kernel_sass.sass_report(kernel_sass.compile_launch(launches[label])).loops,
                          key=lambda lp: lp.instructions)
                      for label in ("64 rows x 4096 -> 24576", "1 row x 4096 -> 24576"))
    assert verify.mma and all(f.startswith("IGMMA") and ".S8.S8" in f for f in verify.mma)
    assert decode.mma and all(f.startswith("IMMA") and ".S8.S8" in f for f in decode.mma)
    for loop in (verify, decode):
        assert not any(op.startswith(("F2F", "I2F", "F2I", "PRMT", "STS")) for op in loop.mix), loop.mix


@needs_triton
def test_a_pdl_launch_prefetches_weights_then_waits_before_any_other_memory_access():
    """DDTREE_INT8_PDL lets an int8 launch start while the kernel before it finishes: compiled for sm_90, every
    program's memory instructions before its wait (griddepcontrol.wait, ACQBULK) are L2 prefetches of weight lines
    (CCTL.E.PF2) only -- no load of x, no store, no atomic -- in the dot kernel (1 and 64 rows), the GEMV and the
    split-K reduction; without PDL none waits."""
    import torch

    from target_svc.int8_matmul import GemvConfig, matmul

    n, k = 4096, 4096
    qweight, scales = torch.zeros(n, k, dtype=torch.int8), torch.ones(n, dtype=torch.bfloat16)
    memory = ("LDG", "LDGSTS", "STG", "ATOM", "ATOMG", "RED", "REDG", "UTMALDG", "UBLKCP", "LDS", "STS")
    for rows, cfg in ((1, None), (64, None), (2, GemvConfig(64, 1024, 2, 8))):
        for pdl in (True, False):
            with kernel_sass.recorded_launches() as launches:
                matmul(torch.zeros(rows, k, dtype=torch.bfloat16), qweight, scales, config=cfg, pdl=pdl)
            assert len(launches) == 2   # these tilings split K: the product, then the reduction
            for launch in launches:
                ops = [kernel_sass.opcode(i) for _, i in kernel_sass.parse_sass(
                    kernel_sass.disassemble(kernel_sass.compile_launch(launch))[1])]
                name = launch.fn.__name__
                if not pdl:
                    assert "ACQBULK" not in ops and "CCTL" not in ops, name
                    continue
                wait = ops.index("ACQBULK")
                before = ops[:wait]
                assert not [op for op in before if op in memory], (rows, name, before)
                assert ("CCTL" in before) == (name != "splitk_reduce_kernel"), (rows, name)


def test_a_recorded_launch_keeps_its_kernel_grid_and_constants():
    pytest.importorskip("triton")
    launches = kernel_sass.layout_launches(17)
    assert len(launches) == 1
    label, launch = launches[0]
    assert launch.fn.__name__ == "tree_layout_kernel" and launch.grid == (1,)
    assert launch.kwargs["BT"] == 32 and launch.kwargs["KERN"] == 4


@needs_triton
@pytest.mark.parametrize("case", kernel_sass.CASES)
def test_every_case_compiles_for_hopper_with_a_register_count_and_its_loops(case):
    rows = kernel_sass.report_rows(case, arch=90)
    assert rows
    for row in rows:
        assert 0 < row["registers"] <= 255 and row["instructions"] > 0, row
        # One row, one output tile, one tile of rows a program (the split reductions: static loops, unrolled): the
        # only kernels without a loop.
        no_loop = ("write_kv_kernel", "splitk_reduce_kernel", "move_rows_kernel", "w8a8_reduce_kernel")
        assert bool(row["loop_instructions"]) == (row["kernel"] not in no_loop), row


@needs_triton
def test_the_attention_context_loop_compiles_to_three_loops_the_first_without_any_mask():
    """With the committed keys in loops of their own the split kernel has three SASS loops (whole tiles of them,
    the partial tile, the block's keys), and the first (no ancestor mask, no bounds) is the shortest; the masked
    loop alone is the kernel's one loop without the context loop."""
    (_, chosen), = [x for x in kernel_sass.attention_launches(65, {}) if x[1].fn.__name__.endswith("split_kernel")]
    masked = [x for x in kernel_sass.attention_launches(65, {"masked": {"context_loop": False}})
              if "masked" in x[0] and x[1].fn.__name__.endswith("split_kernel")]
    report = kernel_sass.sass_report(kernel_sass.compile_launch(chosen))
    assert report.stack_bytes == 0   # no spill
    both = report.loops
    one = kernel_sass.sass_report(kernel_sass.compile_launch(masked[0][1])).loops
    assert len(both) == 3 and len(one) == 1
    assert both[0].instructions < min(both[1].instructions, both[2].instructions, one[0].instructions)
