"""Our Triton kernels compiled for a Hopper GPU on a machine without one: registers, spills, shared memory and the
SASS instructions of each loop, per warp and per iteration (a static profile).

The device is lent by the half hour; this runs anywhere Triton is installed (its wheel bundles ptxas and cuobjdump).
Each case runs the real launcher (tree_attention, tree_layout, tree_wy_core, ...) on CPU tensors of the real shapes
with Triton's launch replaced by a recorder, then compiles every recorded launch exactly as Triton's runtime
would (its own argument specialisation: ints divisible by 16, the value 1 as a constant, aligned pointers) for
sm_90, and reads the cubin. What it measures is instructions, not time: on the H100, Nsight Compute found the
tree-attention split kernel instruction-bound (issue slots 34 % busy at 1.6 instructions a cycle, ~340
instructions a warp per key tile: the count this reports for that kernel), so fewer instructions per key tile is
the lever, and the device's sweep (bench.tree_attention_kernel) has the last word.

    python -m bench.kernel_sass [--cases attention,layout,tree_wy] [--arch 90] [--out-dir bench/results]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from bench import common

CASES = ("attention", "layout", "tree_wy", "kv_write", "int8", "w8a8")


@dataclass
class Launch:
    """One recorded kernel launch: the JIT function, its grid and the arguments it was given."""

    fn: object
    grid: tuple
    args: tuple
    kwargs: dict


@dataclass
class SassLoop:
    """One loop of the SASS (a backward branch): instructions a warp runs per iteration, by opcode."""

    instructions: int
    mix: dict[str, int]
    mma: dict[str, int] = field(default_factory=dict)


@dataclass
class SassReport:
    """What the cubin says of one compiled launch."""

    kernel: str
    registers: int
    stack_bytes: int
    shared_bytes: int
    instructions: int
    loops: list[SassLoop] = field(default_factory=list)


@contextlib.contextmanager
def recorded_launches():
    """Within it, launching any Triton kernel records the launch (list yielded) instead of running it."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    real_getitem = JITFunction.__getitem__

    def record(self, grid):
        return lambda *args, **kwargs: launches.append(Launch(self, tuple(grid), args, dict(kwargs)))

    JITFunction.__getitem__ = record
    try:
        yield launches
    finally:
        JITFunction.__getitem__ = real_getitem


def compile_launch(launch: Launch, arch: int = 90):
    """The launch compiled for CUDA sm_<arch> as Triton's runtime would compile it -> triton CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _tool(name: str) -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(compiled) -> tuple[str, str]:
    """(resource usage, SASS) of a compiled kernel's cubin, as cuobjdump prints them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    return usage, sass


def sass_report(compiled) -> SassReport:
    """Registers, spills, shared memory, instruction count and the loops of a compiled kernel's SASS."""
    usage, sass = disassemble(compiled)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)   # a stack frame: registers spilled (or local arrays)
    instructions = parse_sass(sass)
    return SassReport(compiled.metadata.name, int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else 0,
                      int(compiled.metadata.shared), len(instructions), sass_loops(instructions))


def parse_sass(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction in cuobjdump -sass output."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(instruction: str) -> str:
    """The opcode without its predicate and modifiers: '@!P2 FMUL.FTZ R1, ...' -> 'FMUL'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def mma_form(instruction: str) -> str | None:
    """A tensor-core instruction's shape and types, and where a warpgroup MMA reads A from ('HGMMA.64x64x16.F32.BF16
    A:regs'; shared memory: 'A:smem'); None for any other instruction. Integer MMAs are IMMA (warp) and IGMMA
    (warpgroup)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", instruction)
    name = text.split()[0]
    if name.split(".")[0] not in ("HMMA", "HGMMA", "IMMA", "IGMMA"):
        return None
    form = ".".join(p for p in name.split(".") if p not in ("SP",))
    if name.startswith(("HGMMA", "IGMMA")):
        operands = [o.strip() for o in text[len(name):].split(",")]
        form += " A:regs" if len(operands) > 1 and operands[1].startswith("R") else " A:smem"
    return form


def sass_loops(instructions: list[tuple[int, str]]) -> list[SassLoop]:
    """Every backward branch's body [target, branch], in address order: the instructions of one iteration."""
    loops = []
    for addr, text in instructions:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [t for a, t in instructions if lo <= a <= addr]
            mma = collections.Counter(f for f in map(mma_form, body) if f)
            loops.append(SassLoop(len(body), dict(collections.Counter(map(opcode, body)).most_common()), dict(mma)))
    return loops


# ---- cases: the real launchers on CPU tensors of the real shapes ----

# (query heads, KV heads, head dim) of the attention cases: the target 8B's, and the 27B's full-attention layers
ATTENTION_HEADS = {"8b": (32, 8, 128), "27b": (24, 4, 256)}


def attention_launches(nodes: int, variants: dict[str, dict], batch: int = 1, shape: str = "8b"
                       ) -> list[tuple[str, Launch]]:
    """The tree-attention split and merge launches of one block (bf16, a 512-token context in the 1024-key bucket)
    at the heads of `shape`, at the tiling choose_config gives it and each variant of that tiling."""
    from ddtree_serve.kernels import tree_attention as ta

    heads, kv_heads, head_dim = ATTENTION_HEADS[shape]
    key_len = 1024
    q = torch.zeros(batch, nodes, heads, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(batch + 1, key_len + 128, kv_heads, head_dim, dtype=torch.bfloat16)
    keys = ta.TreeKeys(torch.full((batch,), 512), torch.ones(batch, nodes, nodes, dtype=torch.bool))
    chosen = ta.choose_config(batch, kv_heads, heads // kv_heads * nodes, key_len, head_dim)
    return variant_launches(
        chosen, variants,
        lambda cfg: ta.tree_attention(q, cache, cache, torch.arange(batch), keys, key_len, head_dim ** -0.5, cfg),
        lambda name, cfg: (f"{shape} b{batch} {nodes} nodes, {name}: BM {cfg.block_m} BN {cfg.block_n} splits "
                           f"{cfg.splits} warps {cfg.num_warps}{' context loop' if cfg.context_loop else ''}"
                           f"{' balanced' if cfg.balanced else ''}{' fused merge' if cfg.fused_merge else ''}"))


def variant_launches(chosen, variants: dict[str, dict], launch, label) -> list[tuple[str, Launch]]:
    """The launches launch(config) records at the chosen config and at each variant of it (fields replaced),
    labelled label(name, config)."""
    out = []
    for name, change in {"chosen": {}, **variants}.items():
        cfg = dataclasses.replace(chosen, **change)
        with recorded_launches() as launches:
            launch(cfg)
        out += [(label(name, cfg), recorded) for recorded in launches]
    return out


def layout_launches(nodes: int) -> list[tuple[str, Launch]]:
    """The tree-layout launch of one 65-node tree with the GDN conv windows (kernel 4)."""
    from target_svc.tree_layout import tree_layout

    with recorded_launches() as launches:
        tree_layout(torch.full((1, nodes), -1, dtype=torch.long), torch.full((1,), nodes), 4)
    return [(f"{nodes} nodes", launch) for launch in launches]


def tree_wy_launches(nodes: int, variants: dict[str, dict]) -> list[tuple[str, Launch]]:
    """The tree WY core of one Qwen3.6-27B GDN layer (48 value heads of 128 x 128; float32, as the layer calls it)
    on a `nodes` tree, at the tiling choose_config gives it and each variant of that tiling."""
    from target_svc.gdn_tree_kernel import choose_config, tree_wy_core

    heads, dk, dv = 48, 128, 128
    qh = torch.zeros(1, heads, nodes, dk)
    vh = torch.zeros(1, heads, nodes, dv)
    g = torch.zeros(1, heads, nodes)
    anc = torch.ones(1, nodes, nodes, dtype=torch.bool)
    s0 = torch.zeros(1, heads, dk, dv, dtype=torch.float32)
    return variant_launches(
        choose_config(heads, dv), variants, lambda cfg: tree_wy_core(qh, qh, vh, g, g, anc, s0, cfg),
        lambda name, cfg: (f"{nodes} nodes, {name}: BT {cfg.block_t} BC {cfg.block_c} BV {cfg.block_v} warps "
                           f"{cfg.num_warps} {cfg.phases} phase{'s' if cfg.phases > 1 else ''}"
                           f"{'' if cfg.precision == 'ieee' else ' ' + cfg.precision}"))


def kv_write_launches(nodes: int) -> list[tuple[str, Launch]]:
    """One layer's K/V rows of a `nodes` block written into the 8B's slot cache (8 KV heads of 128, bf16), and a
    commit's compaction of a 17-row path in all 36 layers."""
    from target_svc.kv_cache import move_rows_in_place, write_kv_rows

    cache = torch.zeros(2, 1024, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, nodes, 8, 128, dtype=torch.bfloat16)
    rows = torch.zeros(1, 17, dtype=torch.long)
    layers = torch.zeros(36, 2, 64, 8, 128, dtype=torch.bfloat16)   # the 8B's 36 layers (a short capacity)
    with recorded_launches() as launches:
        write_kv_rows(cache, cache, torch.zeros(1, dtype=torch.long), torch.zeros(1, nodes, dtype=torch.long), k, k)
        move_rows_in_place(layers, layers, torch.zeros(1, dtype=torch.long), rows, rows)
    return [(f"{nodes} nodes" if launch.fn.__name__ == "write_kv_kernel" else "17-row path, 36 layers", launch)
            for launch in launches]


def int8_launches() -> list[tuple[str, Launch]]:
    """The weight-only int8 kernels at the 8B's gate/up projection (4096 -> 2 x 12288) at the tilings
    kernel_config picks for a decode token and 64- and 65-node verifies, the 64-row dot swapped, the GEMV kernel
    (with its split-K reduction) for a decode token, and the down projection's split decode launch with its
    reduction fused."""
    from target_svc.int8_matmul import SPLIT_COUNTERS, choose_config, choose_gemv_config, matmul

    n, k = 2 * 12288, 4096
    qweight = torch.zeros(n, k, dtype=torch.int8)
    scales = torch.ones(n, dtype=torch.bfloat16)
    out = []
    for rows in (1, 64, 65):
        with recorded_launches() as launches:
            matmul(torch.zeros(rows, k, dtype=torch.bfloat16), qweight, scales)
        out += [(f"{rows} rows x {k} -> {n}", launch) for launch in launches]
    # The swapped dot (W x^T) at a 64-node verify: the widened weight tile becomes the MMA's register operand
    # instead of going back to shared memory (the sweep's next axis, docs/MEMORY.md).
    swapped = dataclasses.replace(choose_config(64, n, k), swap_ab=True)
    with recorded_launches() as launches:
        matmul(torch.zeros(64, k, dtype=torch.bfloat16), qweight, scales, config=swapped)
    out += [(f"64 rows x {k} -> {n}, swapped", launch) for launch in launches]
    gemv = dataclasses.replace(choose_gemv_config(1, n, k), split_k=2)
    with recorded_launches() as launches:
        matmul(torch.zeros(1, k, dtype=torch.bfloat16), qweight, scales, config=gemv)
    out += [(f"1 row x {k} -> {n}, GEMV split 2", launch) for launch in launches]
    down_k, down_n = 12288, 4096
    with recorded_launches() as launches:
        matmul(torch.zeros(1, down_k, dtype=torch.bfloat16), torch.zeros(down_n, down_k, dtype=torch.int8),
               torch.ones(down_n, dtype=torch.bfloat16), counters=torch.zeros(SPLIT_COUNTERS, dtype=torch.int32))
    return out + [(f"1 row x {down_k} -> {down_n}, fused split-K reduction", launch) for launch in launches]


def w8a8_launches() -> list[tuple[str, Launch]]:
    """The w8a8 kernels (row quantizer, int8 x int8 product, split-K reduction) at the 8B's gate/up projection for
    a decode token and 64- and 65-node verifies, and its down projection's split decode launch."""
    from target_svc.w8a8_matmul import matmul

    out = []
    for rows, n, k in ((1, 2 * 12288, 4096), (64, 2 * 12288, 4096), (65, 2 * 12288, 4096), (1, 4096, 12288)):
        with recorded_launches() as launches:
            matmul(torch.zeros(rows, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.int8),
                   torch.ones(n, dtype=torch.bfloat16))
        out += [(f"{rows} row{'s' if rows > 1 else ''} x {k} -> {n}", launch) for launch in launches]
    return out


def case_launches(case: str) -> list[tuple[str, Launch]]:
    """The labelled launches of one case."""
    if case == "attention":
        variants = {"masked loop": {"context_loop": False}, "unbalanced": {"balanced": False},
                    "16 x 32 at 96 registers": {"block_m": 16, "block_n": 32, "splits": 4, "split_len": 256,
                                                "balanced": False, "max_registers": 96}}
        fused = {"fused merge": {"fused_merge": True}}
        return ([x for nodes in (1, 17, 65) for x in attention_launches(nodes, {**variants, **fused} if nodes == 65
                                                                         else fused)]
                + attention_launches(65, {}, batch=8)                       # the wide-batch tiling
                + [x for nodes in (1, 65) for x in attention_launches(nodes, {}, shape="27b")])
    if case == "layout":
        return layout_launches(65)
    if case == "kv_write":
        return kv_write_launches(65)
    if case == "int8":
        return int8_launches()
    if case == "w8a8":
        return w8a8_launches()
    if case == "tree_wy":
        return tree_wy_launches(65, {"three phases": {"phases": 3}, "4 warps": {"num_warps": 4},
                                     "tf32x3": {"precision": "tf32x3"}, "tf32": {"precision": "tf32"},
                                     "bf16x3": {"precision": "bf16x3"}, "bf16x6": {"precision": "bf16x6"},
                                     "two phases": {"phases": 2},
                                     "two phases bf16x3": {"phases": 2, "precision": "bf16x3"},
                                     "two phases bf16x3, its tiles": {"phases": 2, "precision": "bf16x3",
                                                                      "block_v": 32, "num_warps": 4},
                                     "two phases bf16x3, its tiles, batched 16-blocks": {
                                         "phases": 2, "precision": "bf16x3", "block_v": 32, "num_warps": 4,
                                         "invert": "blocks16"}})
    raise ValueError(f"unknown case {case!r} (of {', '.join(CASES)})")


def report_rows(case: str, arch: int) -> list[dict]:
    """One row per compiled launch of the case."""
    rows = []
    for label, launch in case_launches(case):
        rep = sass_report(compile_launch(launch, arch))
        loops = [lp.instructions for lp in rep.loops]
        main = max(rep.loops, key=lambda lp: lp.instructions) if rep.loops else None
        rows.append({"case": case, "launch": label, "kernel": launch.fn.__name__,
                     "warps": launch.kwargs.get("num_warps", 4), "registers": rep.registers,
                     "stack_bytes": rep.stack_bytes, "shared_bytes": rep.shared_bytes,
                     "instructions": rep.instructions, "loop_instructions": loops,
                     "main_loop_mix": dict(list(main.mix.items())[:12]) if main else {},
                     "main_loop_mma": main.mma if main else {}})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.kernel_sass", description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100 / H200)")
    p.add_argument("--out-dir", default=str(common.RESULTS_DIR))
    args = p.parse_args(argv)
    try:
        import triton
    except ImportError:
        print("needs triton (pip install triton==3.6.0)", file=sys.stderr)
        return 2
    rows = [r for case in args.cases.split(",") for r in report_rows(case, args.arch)]
    table = common.md_table(
        ["case", "launch", "kernel", "warps", "registers", "stack B", "shared B", "instructions",
         "per loop iteration (a warp)", "main loop: top opcodes", "main loop: MMAs"],
        [[r["case"], r["launch"], r["kernel"], r["warps"], r["registers"], r["stack_bytes"], r["shared_bytes"],
          r["instructions"], " / ".join(map(str, r["loop_instructions"])) or "-",
          ", ".join(f"{k} {v}" for k, v in list(r["main_loop_mix"].items())[:8]),
          ", ".join(f"{k} x{v}" for k, v in r["main_loop_mma"].items()) or "-"] for r in rows])
    md = (f"# Triton kernels compiled for sm_{args.arch} (static: no GPU)\n\n"
          f"Command: `{common.command_line('bench.kernel_sass')}`  \nDate: {common.now_utc()}  \n"
          f"Triton {triton.__version__}, torch {torch.__version__}, compiled on {common.cpu_model()}\n\n"
          "Each launch as the real launcher makes it (CPU tensors of the real shapes, the launch recorded and "
          "compiled as Triton's runtime would). Instructions per loop iteration are a warp's, one SASS loop each "
          "(the tree-attention split kernel with the context loop has two: committed keys, then the block's). "
          "MMAs: the main loop's tensor-core instructions (HMMA: sm_80 warp MMA; HGMMA: sm_90 warpgroup MMA, its "
          "A operand from registers or shared memory).\n\n"
          + table + "\n")
    print(md)
    common.write_outputs(args.out_dir, f"kernel-sass-sm{args.arch}", {"arch": args.arch, "rows": rows,
                                                                       "triton": triton.__version__,
                                                                       "date": common.now_utc(),
                                                                       "command": common.command_line(
                                                                           "bench.kernel_sass")}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
