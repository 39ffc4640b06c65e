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
    assert (shape.batch, shape.nodes) == (4, 9)
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
