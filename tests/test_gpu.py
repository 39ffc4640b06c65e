"""CUDA paths (run on the GPU machine; skipped where there is no GPU): the same lossless guarantees on the device."""
from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import grpc
import pytest
import torch

from ddtree_serve.decoding.config import SamplingParams
from ddtree_serve.decoding.ddtree import build_ddtree_batch
from ddtree_serve.proto import gateway_pb2_grpc
from drafter_svc.runner import DraftItem, DrafterConfig, DrafterRunner
from target_svc.runner import PrefillItem, TargetConfig, TargetRunner, VerifyItem
from tests.conftest import make_request, prompts_for, reference_model, run_streams, start_stack

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def hf_greedy_on(device: str, model_dir, prompt: list[int], n: int, dtype=torch.float32) -> list[int]:
    """transformers' greedy generate() on `device`, from a fresh copy (the cached CPU oracle stays untouched)."""
    model = copy.deepcopy(reference_model(str(model_dir))).to(device=device, dtype=dtype)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def speculative_greedy(target_dir, drafter_dir, prompt: list[int], n: int, dtype: torch.dtype,
                       enforce_eager: bool = False, runners: list | None = None) -> tuple[list[int], int]:
    """Runners on cuda: prefill, then DDTree steps (budget 32) until n tokens; returns tokens and accepted drafts.
    The runners are appended to `runners` when given (to inspect their graphs)."""
    target = TargetRunner(TargetConfig(model_dir=str(target_dir), device="cuda", dtype=dtype, max_batch=2,
                                       max_seq_len=256, max_tree_nodes=65, enforce_eager=enforce_eager))
    drafter = DrafterRunner(DrafterConfig(drafter_dir=str(drafter_dir), target_model_dir=str(target_dir),
                                          device="cuda", dtype=dtype, max_batch=2, max_seq_len=256,
                                          enforce_eager=enforce_eager))
    if runners is not None:
        runners += [target, drafter]
    target.set_feature_layers(drafter.target_layer_ids)
    (out,) = target.prefill([PrefillItem("a", prompt, SamplingParams(), True)])
    drafter.add_context("a", 0, out.features)
    tokens, ctx, accepted = [out.next_token], out.context_len, 0
    while len(tokens) < n:
        depth = min(15, n - len(tokens) - 1)
        if depth > 0:
            lp, ids = drafter.draft([DraftItem("a", tokens[-1], ctx)], top_k=32, max_depth=depth)
            tree = build_ddtree_batch(lp, ids, [tokens[-1]], [32], [depth]).tree(0)
            tree_tokens, parents = tree.tokens, tree.parents
        else:
            tree_tokens, parents = torch.tensor([tokens[-1]]), torch.tensor([-1])
        (r,) = target.verify([VerifyItem("a", tree_tokens, parents)])
        drafter.add_context("a", ctx, r.features)
        tokens += r.accepted_tokens + [r.next_token]
        accepted += len(r.accepted_tokens)
        ctx = r.context_len
    return tokens[:n], accepted


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_float32_runners_equal_transformers_greedy(checkpoints, kind):
    target, drafter = checkpoints(kind)
    prompt = prompts_for(target, [9], seed=4)[0]
    tokens, _ = speculative_greedy(target, drafter, prompt, 48, torch.float32)
    assert tokens == hf_greedy_on("cuda", target, prompt, 48)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_cuda_bfloat16_runners_generate_valid_tokens(checkpoints, kind):
    target, drafter = checkpoints(kind)
    prompt = prompts_for(target, [9], seed=4)[0]
    tokens, _ = speculative_greedy(target, drafter, prompt, 32, torch.bfloat16)
    vocab = reference_model(str(target)).config.get_text_config().vocab_size
    assert len(tokens) == 32 and all(0 <= t < vocab for t in tokens)
    # bf16 kernels differ from transformers' own, so exact equality is not expected; the first tokens agree
    assert tokens[:4] == hf_greedy_on("cuda", target, prompt, 4, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_equal_eager_steps(checkpoints, dtype):
    """Graph-captured verify and draft (padded to buckets) give the eager path's greedy tokens exactly."""
    target, drafter = checkpoints("qwen3")
    for prompt in prompts_for(target, [9, 30], seed=8):
        runners = []
        graphed, accepted_g = speculative_greedy(target, drafter, prompt, 48, dtype, runners=runners)
        eager, accepted_e = speculative_greedy(target, drafter, prompt, 48, dtype, enforce_eager=True)
        assert graphed == eager and accepted_g == accepted_e
        target_runner, drafter_runner = runners
        assert target_runner.graphs.forwards.graphs and target_runner.graphs.commits.graphs
        assert drafter_runner.graphs.cache.graphs


def test_cuda_graph_verify_matches_eager_logits_in_a_padded_batch(checkpoints):
    """Three sequences (bucket 4) through the captured forward: logits within bf16 rounding of eager."""
    from target_svc.verify import VerifyBatch, VerifyShape, verify_forward

    target, _ = checkpoints("qwen3")
    runner = TargetRunner(TargetConfig(model_dir=str(target), device="cuda", dtype=torch.bfloat16, max_batch=4,
                                       max_seq_len=256, max_tree_nodes=65))
    prompts = prompts_for(target, [5, 17, 40], seed=9)
    outs = runner.prefill([PrefillItem(f"s{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 3])
    trees = [(torch.tensor([o.next_token, 11, 12, 13, 14, 15, 16]), parents) for o in outs]
    ctx = [o.context_len for o in outs]
    slots = [runner.seqs[f"s{i}"].slot for i in range(3)]
    scratch = runner.model.cache.spec.scratch_slot
    exact = VerifyBatch.pack(trees, ctx, slots, VerifyShape(3, 7, max(ctx) + 7), scratch)
    want = verify_forward(runner.model, exact.packed.cuda(), 7, max(ctx) + 7, ())[0]
    shape = runner.graphs.shape_for(3, 7, max(ctx) + 7)
    assert (shape.batch, shape.nodes) == (4, 8)
    bucketed = VerifyBatch.pack(trees, ctx, slots, shape, scratch)
    got = runner.graphs.forward(bucketed, bucketed.packed.cuda(), ())[0][:3, :7]
    # bf16: padded shapes may pick other GEMM tilings; stated tolerance 2% of the largest logit
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.95


@pytest.mark.parametrize("transport", ["inline", "cuda-ipc"])
def test_cuda_services_equal_transformers_greedy(checkpoints, transport):
    target, drafter = checkpoints("qwen3")
    prompts = prompts_for(target, [5, 13, 8], seed=6)
    stack = start_stack(target, drafter, device="cuda", transport=transport)
    try:
        results = run_streams(stack.gateway, [make_request(p, 40, mode) for p, mode in
                                              zip(prompts, ["ddtree", "dflash", "ar"])])
    finally:
        stack.stop()
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy_on("cuda", target, prompt, 40)
        assert result["stats"].steps > 0


def test_cuda_ipc_buffer_opened_in_another_process_reads_what_was_staged(tmp_path):
    """The drafter side of cuda-ipc, in a second process: it sees the rows the target staged on the GPU."""
    import subprocess
    import sys

    from ddtree_serve.transport import FeatureRows
    from ddtree_serve.transport.shared_buffer import StagingBuffer, plan_pieces

    rows = FeatureRows("s", 0, torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4))
    staging = StagingBuffer("cuda-ipc", 4096, torch.device("cuda"))
    [[piece]] = plan_pieces([3], 8, 4096)
    staging.write(piece, rows)
    torch.cuda.synchronize()
    (tmp_path / "desc.bin").write_bytes(staging.descriptor.SerializeToString())
    script = (
        "import sys, torch\n"
        "from ddtree_serve.proto import drafter_pb2\n"
        "from ddtree_serve.transport import OpenedBuffers, rows_view\n"
        "desc = drafter_pb2.SharedBuffer.FromString(open(sys.argv[1], 'rb').read())\n"
        "buf = OpenedBuffers().get(desc)\n"
        "print(rows_view(buf, 0, 3, 4, 'bfloat16').float().sum().item())\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "desc.bin")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == sum(range(12))
    staging.close()


# ---- the nccl transport: target on cuda:0, drafter on cuda:1 ------------------------------------------------------
def _has_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


needs_two_gpus_and_cupy = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not _has_cupy(),
    reason="needs 2 CUDA devices and cupy (pip install 'ddtree-serve[gpu]' or cupy-cuda13x)")


@needs_two_gpus_and_cupy
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_comm_moves_a_payload_from_one_gpu_to_another_process_on_the_other(dtype):
    """NcclComm itself, no services: rank 1 in a second process on cuda:1 receives what rank 0 sends from cuda:0."""
    import subprocess
    import sys
    import threading

    from ddtree_serve.transport.nccl import NcclComm, new_unique_id

    uid = new_unique_id()
    script = (
        "import sys, torch\n"
        "from ddtree_serve.transport.nccl import NcclComm\n"
        f"comm = NcclComm(bytes.fromhex(sys.argv[1]), 1, torch.device('cuda:1'))\n"
        f"buf = torch.zeros(1000, dtype=torch.{dtype}, device='cuda:1')\n"
        f"comm.recv(buf, 1000, '{dtype}', 0).synchronize()\n"
        "print(buf.float().sum().item())\n")
    peer = subprocess.Popen([sys.executable, "-c", script, uid.hex()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    comms = []
    joiner = threading.Thread(target=lambda: comms.append(NcclComm(uid, 0, torch.device("cuda:0"))))
    joiner.start()
    joiner.join(120)
    assert comms, "rank 0 did not join within 120 s"
    payload = torch.arange(1000, device="cuda:0").to(getattr(torch, dtype)) % 7
    comms[0].send(payload, 1000, dtype, 1).synchronize()
    out, err = peer.communicate(timeout=120)
    assert peer.returncode == 0, err
    assert float(out.strip()) == payload.float().sum().item()
    comms[0].abort()


@needs_two_gpus_and_cupy
def test_nccl_services_on_two_gpus_equal_transformers_greedy(checkpoints):
    target, drafter = checkpoints("qwen3")
    prompts = prompts_for(target, [5, 13, 8], seed=6)
    stack = start_stack(target, drafter, device="cuda:0", drafter_device="cuda:1", transport="nccl")
    try:
        results = run_streams(stack.gateway, [make_request(p, 40, mode) for p, mode in
                                              zip(prompts, ["ddtree", "dflash", "ar"])])
        target_log = (Path(stack.log_dir) / "target.log").read_text()
    finally:
        stack.stop()
    assert "NCCL communicator" in target_log and "formed" in target_log
    for prompt, result in zip(prompts, results):
        assert result["token_ids"] == hf_greedy_on("cuda", target, prompt, 40)
    # the features really came over NCCL: the speculative requests kept speculating
    assert [r["stats"].drafter_fallback for r in results[:2]] == [False, False]
    assert results[0]["stats"].mode == "ddtree" and results[0]["stats"].accepted_tokens > 0


@needs_two_gpus_and_cupy
def test_killing_the_drafter_mid_stream_over_nccl_leaves_the_target_serving_losslessly(checkpoints):
    target, drafter = checkpoints("llama")
    stack = start_stack(target, drafter, device="cuda:0", drafter_device="cuda:1", transport="nccl")
    try:
        prompt = prompts_for(target, [7], seed=13)[0]

        async def scenario():
            async with grpc.aio.insecure_channel(stack.gateway) as channel:
                ids, final = [], None
                async for msg in gateway_pb2_grpc.GatewayStub(channel).GenerateStream(make_request(prompt, 40),
                                                                                      timeout=120):
                    ids.extend(msg.token_ids)
                    final = msg
                    if len(ids) >= 4 and stack.alive()["drafter"]:
                        stack.kill("drafter")
                return ids, final.stats

        ids, stats = asyncio.run(scenario())
        assert ids == hf_greedy_on("cuda", target, prompt, 40)
        assert stack.alive()["target"] and stack.alive()["gateway"]
        assert (stats.requested_mode, stats.mode, stats.drafter_fallback) == ("ddtree", "ar", True)
        again = run_streams(stack.gateway, [make_request(prompt, 10)])[0]
        assert again["token_ids"] == hf_greedy_on("cuda", target, prompt, 10)
    finally:
        stack.stop()


@pytest.mark.skipif(not _has_cupy(), reason="needs cupy (pip install 'ddtree-serve[gpu]' or cupy-cuda13x)")
def test_nccl_with_target_and_drafter_on_one_gpu_stops_the_gateway_at_start_up(checkpoints):
    """NCCL refuses two ranks on one GPU: the target says so at attach time, and the gateway stops with that line."""
    from launch.local_stack import LocalStack

    target, drafter = checkpoints("qwen3")
    stack = LocalStack(model=str(target), drafter=str(drafter), threads=1, device="cuda:0", transport="nccl")
    try:
        with pytest.raises(RuntimeError, match="gateway exited during start-up"):
            stack.start(timeout_s=300)
        assert stack.procs["gateway"].returncode == 2
        assert "different GPUs" in (Path(stack.log_dir) / "gateway.log").read_text()
        assert "transport nccl refused" in (Path(stack.log_dir) / "target.log").read_text()
    finally:
        stack.stop()
        stack.cleanup()


# ---- the Triton weight-only matmul (target_svc/int8_matmul.py) -----------------------------------------------------
def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


needs_triton = pytest.mark.skipif(not _has_triton(), reason="needs the triton package")
KERNEL_SHAPES = [(17408, 5120), (4096, 12288), (6144, 4096)]  # 27B MLP up, 8B down, 8B fused qkv


def _quantized(n: int, k: int, bits: int):
    from target_svc.quantization import quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(n + k + bits)
    return quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02, bits)


def _assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor, what) -> None:
    """Stated tolerance: max |got - ref| <= 2e-2 * max |ref|. Kernel and reference add the same float32 products in
    different orders, the reference rounds each q * s to bf16 before its GEMM, and both round the output to bf16
    (half an ulp is 2^-9 of a value): the H200 showed <= 4e-3 of the largest output, while a wrong tile, mask,
    scale or split is off by O(1)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= 2e-2 * ref.float().abs().max().item(), (what, err)


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, k", KERNEL_SHAPES)
def test_cuda_triton_weight_only_matmul_equals_the_dequantized_reference(n, k, bits):
    """The tiles chosen for each row count (decode: batch; verify: batch x tree nodes), with and without bias."""
    import torch.nn.functional as F

    from target_svc import int8_matmul

    q = _quantized(n, k, bits)
    w = q.dequantize(torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 3, 16, 65, 130, 520):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for b in (None, bias):
            got = int8_matmul.matmul(x, q.qweight, q.scales, b, bits)
            _assert_close_to_reference(got, F.linear(x, w, b), (m, b is not None))


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_triton_weight_only_matmul_every_kernel_path(bits):
    """Split K, the swapped dot, tiles wider and narrower than M, ragged N and K, a 3-D input, fp16."""
    import torch.nn.functional as F

    from target_svc import int8_matmul
    from target_svc.int8_matmul import TileConfig

    configs = [TileConfig(16, 64, 128, 4), TileConfig(16, 32, 128, 1, True), TileConfig(64, 128, 64, 2, False, 8, 3),
               TileConfig(128, 64, 64, 1, True, 4, 3), TileConfig(32, 64, 128, 1, False, 4, 3)]
    n, k = (4100, 1000) if bits == 8 else (4100, 1024)  # N not a multiple of any tile; int8 K not of BLOCK_K
    q = _quantized(n, k, bits)
    for dtype in (torch.bfloat16, torch.float16):
        w = q.dequantize(dtype)
        for m in (1, 20, 65):
            x = torch.randn(2, m, k, device="cuda", dtype=dtype)
            ref = F.linear(x, w)
            for cfg in configs:
                got = int8_matmul.matmul(x, q.qweight, q.scales.to(dtype), None, bits, cfg)
                _assert_close_to_reference(got, ref, (dtype, m, cfg))


@needs_triton
@pytest.mark.parametrize("bits", [8, 4])
def test_cuda_triton_weight_only_matmul_replays_inside_a_captured_graph(bits):
    """Captured as the engine captures (warm-up runs on a side stream, then recorded; split-K workspace allocated
    during the capture), the replay equals an eager call bit for bit: no host syncs, no atomics."""
    from ddtree_serve.plumbing.cuda_graphs import CapturedFunction
    from target_svc import int8_matmul

    q = _quantized(4096, 12288, bits)
    pool = torch.cuda.graph_pool_handle()
    for m in (1, 16, 65, 520):
        captured = CapturedFunction.capture(lambda x: int8_matmul.matmul(x, q.qweight, q.scales, None, bits),
                                            [torch.randn(m, 12288, device="cuda", dtype=torch.bfloat16)], pool)
        for _ in range(3):
            x = torch.randn(m, 12288, device="cuda", dtype=torch.bfloat16)
            want = int8_matmul.matmul(x, q.qweight, q.scales, None, bits)
            assert torch.equal(captured(x), want), m


@needs_triton
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_cuda_quantized_target_runs_the_triton_kernels_and_greedy_is_the_same_graphed_and_eager(checkpoints,
                                                                                                quantize):
    target_dir, _ = checkpoints("qwen3")
    prompt = prompts_for(target_dir, [13], seed=3)[0]
    outputs = []
    for eager in (False, True):
        runner = TargetRunner(TargetConfig(model_dir=str(target_dir), device="cuda", dtype=torch.bfloat16,
                                           max_batch=2, max_seq_len=128, max_tree_nodes=16, quantize=quantize,
                                           enforce_eager=eager, kv_cache_memory_bytes=2**26))
        assert runner.model.int8_backend == "triton"
        generated = [runner.prefill([PrefillItem("s", prompt, SamplingParams())])[0].next_token]
        while len(generated) < 24:
            generated.append(runner.verify([VerifyItem("s", torch.tensor([generated[-1]]), torch.tensor([-1]))])[0]
                             .next_token)
        outputs.append(generated)
    assert outputs[0] == outputs[1]
