"""Bad input and faults get a clear gRPC status, and the services keep serving everyone else."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from ddtree_serve.plumbing.messages import draft_arrays
from ddtree_serve.proto import (common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc,
                                target_pb2, target_pb2_grpc)
from launch.local_stack import LocalStack
from tests.conftest import make_request, prompts_for, reference_greedy, run_streams, start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(checkpoints):
    target, drafter = checkpoints("qwen3")
    s = start_stack(target, drafter, metrics=True,
                    extra={"target": ["--max-seq-len", "256"], "drafter": ["--max-seq-len", "256"]})
    yield s, target
    s.stop()


def _generate(address: str, request) -> gateway_pb2.GenerateResponse:
    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            return await gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120)

    return asyncio.run(call())


def _code_of(address: str, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _generate(address, request)
    return info.value.code(), info.value.details()


BAD_REQUESTS = {
    "empty prompt": lambda: make_request([], 8),
    "ids out of vocabulary": lambda: make_request([1, 2, 10**6], 8),
    "negative id": lambda: make_request([1, -3], 8),
    "max_tokens zero": lambda: make_request([1, 2, 3], 0),
    "max_tokens negative": lambda: make_request([1, 2, 3], -5),
    "NaN temperature": lambda: make_request([1, 2, 3], 8, temperature=math.nan),
    "negative temperature": lambda: make_request([1, 2, 3], 8, temperature=-1.0),
    "prompt over the context limit": lambda: make_request([5] * 300, 8),
    "prompt + max_tokens over the limit": lambda: make_request([5] * 200, 100),
    "oversized budget": lambda: make_request([1, 2, 3], 8, mode="ddtree", budget=100_000),
    "empty text": lambda: gateway_pb2.GenerateRequest(text="", max_tokens=8),
    "guide that does not parse": lambda: make_request([1, 2, 3], 8, guide=common_pb2.Guide(kind="json", spec="{")),
    "guide of an unknown kind": lambda: make_request([1, 2, 3], 8, guide=common_pb2.Guide(kind="yaml")),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(stack, name):
    s, _ = stack
    code, details = _code_of(s.gateway, BAD_REQUESTS[name]())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details


def test_services_keep_serving_after_bad_requests(stack):
    s, target = stack
    for make in BAD_REQUESTS.values():
        with pytest.raises(grpc.aio.AioRpcError):
            _generate(s.gateway, make())
    prompt = prompts_for(target, [6], seed=3)[0]
    reply = _generate(s.gateway, make_request(prompt, 24))
    assert list(reply.token_ids) == reference_greedy(target, prompt, 24)
    assert all(s.alive().values())


def test_unknown_sequence_id_is_not_found_on_the_target(stack):
    s, _ = stack

    async def call():
        async with s.internal_channel("target") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            await stub.Verify(target_pb2.VerifyRequest(items=[target_pb2.TreeItem(
                seq_id="no-such-sequence", tokens=[1], parents=[-1])]), timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_malformed_tree_is_invalid_argument_on_the_target(stack):
    s, _ = stack

    async def call():
        async with s.internal_channel("target") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            await stub.Verify(target_pb2.VerifyRequest(items=[target_pb2.TreeItem(
                seq_id="x", tokens=[1, 2], parents=[-1])]), timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_guide_that_does_not_compile_refuses_its_own_prefill_item_and_the_batch_runs_on(stack):
    s, _ = stack

    async def call():
        async with s.internal_channel("target") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            reply = await stub.Prefill(target_pb2.PrefillRequest(items=[
                target_pb2.PrefillItem(seq_id="guided-bad", prompt_ids=[5, 6, 7],
                                       guide=common_pb2.Guide(kind="regex", spec="[0-9")),
                target_pb2.PrefillItem(seq_id="guided-ok", prompt_ids=[5, 6, 7],
                                       guide=common_pb2.Guide(kind="choice", spec='["yes", "no"]'))]), timeout=60)
            await stub.Release(target_pb2.ReleaseRequest(seq_ids=["guided-bad", "guided-ok"]), timeout=30)
            return {r.seq_id: r for r in reply.results}

    results = asyncio.run(call())
    assert "invalid structured output regex" in results["guided-bad"].error
    assert results["guided-ok"].error == "" and results["guided-ok"].context_len == 3
    assert results["guided-ok"].next_token >= 0


def test_a_guide_is_compiled_once_ahead_of_its_prefill_and_a_bad_one_is_invalid_argument(stack):
    s, _ = stack

    async def call(guide):
        async with s.internal_channel("target") as channel:
            return await target_pb2_grpc.TargetServiceStub(channel).PrepareGuide(guide, timeout=60)

    def prepared() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_ports['target']}/metrics", timeout=10).read()
        return {line.split('result="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.decode().splitlines() if line.startswith("ddtree_target_grammars_prepared_total{")}

    before = prepared()
    guide = common_pb2.Guide(kind="regex", spec="[a-f]{5}")
    first, again = asyncio.run(call(guide)), asyncio.run(call(guide))
    assert first.compile_seconds > 0 and again.compile_seconds == 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call(common_pb2.Guide(kind="grammar", spec="root ::= ")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "invalid structured output" in info.value.details()
    after = prepared()
    assert {k: after[k] - before.get(k, 0) for k in after} == {"compiled": 1, "cached": 1, "invalid": 1}


def _received_feature_bytes(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ddtree_transport_bytes_total{") and 'direction="recv"' in line)


def test_features_arriving_after_release_are_dropped_but_counted_as_received(stack):
    """A sequence's last push can land after the gateway released it: the rows are not stored, yet the bytes did
    cross the wire, so the drafter's "recv" counter still meets the target's "send" counter."""
    s, _ = stack
    payload = bytes(2 * 8 * 4)  # 2 rows of 8 float32 features

    async def call():
        async with s.internal_channel("drafter") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            await stub.Release(drafter_pb2.DrafterReleaseRequest(seq_ids=["finished-1"]), timeout=30)
            return await stub.PushFeatures(drafter_pb2.FeatureBatch(feature_dim=8, rows=[drafter_pb2.FeatureRows(
                seq_id="finished-1", start=0, num_rows=2, dtype="float32", data=payload)]), timeout=30)

    before = _received_feature_bytes(s.metrics_ports["drafter"])
    reply = asyncio.run(call())
    assert reply.bytes == 0   # nothing stored for a released sequence
    assert _received_feature_bytes(s.metrics_ports["drafter"]) - before == len(payload)


def test_an_early_push_without_a_shared_buffer_turns_its_sequence_autoregressive(stack):
    """Rows with a header offset (an early push) make sense only in a shared buffer: inline ones are rejected,
    the sequence is marked broken, and its next Draft says so instead of waiting for rows."""
    s, _ = stack

    async def call():
        async with s.internal_channel("drafter") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            await stub.PushFeatures(drafter_pb2.FeatureBatch(feature_dim=8, rows=[drafter_pb2.FeatureRows(
                seq_id="early-inline", start=0, num_rows=1, dtype="float32", data=bytes(32), header_offset=0)]),
                timeout=30)
            return await stub.Draft(drafter_pb2.DraftRequest(items=[drafter_pb2.DraftItem(
                seq_id="early-inline", bonus_token=1, context_len=1)], top_k=2), timeout=30)

    reply = asyncio.run(call())
    assert "must be in a shared buffer" in reply.results[0].error


def test_a_shared_buffer_the_drafter_cannot_open_is_failed_precondition(stack):
    s, _ = stack

    async def call():
        async with s.internal_channel("drafter") as channel:
            await drafter_pb2_grpc.DrafterServiceStub(channel).PushFeatures(drafter_pb2.FeatureBatch(
                feature_dim=8, shared=drafter_pb2.SharedBuffer(kind="shm", buffer_id="b", size_bytes=4096,
                                                               shm_name="ddtree-not-on-this-host"),
                rows=[drafter_pb2.FeatureRows(seq_id="elsewhere-1", start=0, num_rows=1, dtype="float32")]),
                timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cannot open shared memory" in info.value.details()


@pytest.mark.parametrize("transport, code", [("cuda-ipc", grpc.StatusCode.FAILED_PRECONDITION),
                                             ("nccl", grpc.StatusCode.FAILED_PRECONDITION),
                                             ("carrier-pigeon", grpc.StatusCode.INVALID_ARGUMENT)])
def test_a_transport_the_target_cannot_use_is_refused_at_attach(stack, transport, code):
    s, _ = stack

    async def call():
        async with s.internal_channel("target") as channel:
            await target_pb2_grpc.TargetServiceStub(channel).AttachDrafter(target_pb2.AttachDrafterRequest(
                drafter_address=s.address("drafter"), target_layer_ids=[0], transport=transport), timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == code
    assert transport in info.value.details()


def test_a_step_socket_the_drafter_does_not_serve_is_refused_at_attach(stack, tmp_path):
    """The target pushes features to the step socket the drafter itself names in its Info, never to a path taken
    on the caller's word (this stack's drafter serves none)."""
    s, _ = stack

    async def call():
        async with s.internal_channel("target") as channel:
            await target_pb2_grpc.TargetServiceStub(channel).AttachDrafter(target_pb2.AttachDrafterRequest(
                drafter_address=s.link_address("drafter"), transport="inline",
                drafter_step_socket=str(tmp_path / "elsewhere.sock")), timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves no step socket" in info.value.details()


def test_nccl_on_a_cpu_target_is_refused_with_every_reason_and_the_package_to_install(stack):
    s, _ = stack

    async def call():
        async with s.internal_channel("target") as channel:
            await target_pb2_grpc.TargetServiceStub(channel).AttachDrafter(target_pb2.AttachDrafterRequest(
                drafter_address=s.address("drafter"), transport="nccl"), timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "target on a CUDA device" in info.value.details()
    if importlib.util.find_spec("cupy") is None:
        assert "cupy-cuda1" in info.value.details()


def test_a_cpu_drafter_refuses_to_join_an_nccl_communicator(stack):
    s, _ = stack

    async def call():
        async with s.internal_channel("drafter") as channel:
            await drafter_pb2_grpc.DrafterServiceStub(channel).JoinNccl(drafter_pb2.NcclJoinRequest(
                unique_id=bytes(128), comm_id="c", world_size=2, rank=1, buffer_bytes=1 << 20), timeout=30)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "drafter on a CUDA device" in info.value.details()


def test_an_nccl_push_on_no_communicator_turns_its_sequences_autoregressive(stack):
    """A header whose payload can never come (the communicator is gone) fails its sequences at once: their Drafts
    answer with an error (the gateway runs them `ar`) instead of waiting out the feature timeout."""
    s, _ = stack

    async def call():
        async with s.internal_channel("drafter") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.PushFeatures(drafter_pb2.FeatureBatch(
                    feature_dim=8, nccl=drafter_pb2.NcclPayload(comm_id="gone", push_id=0, dtype="float32", count=16),
                    rows=[drafter_pb2.FeatureRows(seq_id="nccl-lost-1", start=0, num_rows=2, dtype="float32")]),
                    timeout=30)
            draft = await stub.Draft(drafter_pb2.DraftRequest(items=[drafter_pb2.DraftItem(
                seq_id="nccl-lost-1", bonus_token=1, context_len=2)], top_k=4), timeout=10)
            await stub.Release(drafter_pb2.DrafterReleaseRequest(seq_ids=["nccl-lost-1"]), timeout=30)
            return info.value, draft

    error, draft = asyncio.run(call())
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "no NCCL communicator" in error.details()
    [result] = draft.results
    assert result.seq_id == "nccl-lost-1" and "context features lost" in result.error


def test_a_gateway_asked_for_nccl_on_cpu_services_stops_at_start_up_with_the_reason(checkpoints):
    """A transport the pair cannot use is a misconfiguration: like a vLLM server given a bad config, the gateway
    exits (code 2) with one line saying why, instead of quietly serving without speculation."""
    target, drafter = checkpoints("qwen3")
    s = LocalStack(model=str(target), drafter=str(drafter), threads=1, transport="nccl")
    try:
        with pytest.raises(RuntimeError, match="gateway exited during start-up"):
            s.start(timeout_s=180)
        assert s.procs["gateway"].returncode == 2
        gateway_log = (Path(s.log_dir) / "gateway.log").read_text()
        [line] = [ln for ln in gateway_log.splitlines() if "refused the drafter" in ln]
        assert "--transport nccl" in line and "FAILED_PRECONDITION" in line and "CUDA device" in line
        assert "Traceback" not in gateway_log
        assert "transport nccl refused" in (Path(s.log_dir) / "target.log").read_text()
    finally:
        s.stop()
        s.cleanup()


def test_text_prompt_stop_string_and_model_info(stack):
    s, _ = stack
    reply = _generate(s.gateway, gateway_pb2.GenerateRequest(text="hello world", max_tokens=16, ignore_eos=True))
    assert reply.finished and len(reply.token_ids) == 16 and reply.finish_reason == "length"
    full_text = reply.text
    if len(full_text) > 4:  # a stop string taken from the middle of the greedy text cuts it there
        stop = full_text[2:4]
        cut = _generate(s.gateway, gateway_pb2.GenerateRequest(text="hello world", max_tokens=16, stop=[stop],
                                                               ignore_eos=True))
        assert cut.finish_reason == "stop"
        assert cut.text == full_text[: full_text.index(stop)]

    async def info():
        async with grpc.aio.insecure_channel(s.gateway) as channel:
            return await gateway_pb2_grpc.GatewayStub(channel).ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=30)

    mi = asyncio.run(info())
    assert mi.vocab_size > 0 and mi.block_size == 16 and mi.max_seq_len == 256
    assert mi.default_mode == "ddtree" and len(mi.pairs) == 1


def test_cli_generate_json_prints_ids_text_and_stats(stack):
    s, target = stack
    prompt = prompts_for(target, [4], seed=5)[0]
    out = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--gateway", s.gateway,
                          "--max-tokens", "12", "--ignore-eos", "--json", "--prompt-ids", ",".join(map(str, prompt))],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["token_ids"] == reference_greedy(target, prompt, 12)
    assert isinstance(result["text"], str)
    assert {"steps", "accepted_tokens", "mean_acceptance_length"} <= set(result["stats"])
    assert result["stats"]["steps"] >= 1


def test_cancelled_stream_frees_its_cache_and_others_finish_unchanged(stack):
    s, target = stack
    prompts = prompts_for(target, [5, 8, 6], seed=9)

    async def scenario():
        async with grpc.aio.insecure_channel(s.gateway) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def full(prompt):
                ids = []
                async for msg in stub.GenerateStream(make_request(prompt, 48), timeout=120):
                    ids.extend(msg.token_ids)
                return ids

            others = [asyncio.create_task(full(p)) for p in prompts[1:]]
            call = stub.GenerateStream(make_request(prompts[0], 200), timeout=120)
            got = 0
            async for msg in call:
                got += len(msg.token_ids)
                if got >= 3:
                    call.cancel()
                    break
            finished = await asyncio.gather(*others)
            for _ in range(100):  # the engine releases at its next step boundary, in both services concurrently
                mi = await stub.ModelInfo(gateway_pb2.ModelInfoRequest(), timeout=30)
                if (mi.running_requests == 0 and mi.pairs[0].target_cache.running_sequences == 0
                        and mi.pairs[0].drafter_cache.running_sequences == 0):
                    break
                await asyncio.sleep(0.1)
            return finished, mi

    finished, mi = asyncio.run(scenario())
    for prompt, ids in zip(prompts[1:], finished):
        assert ids == reference_greedy(target, prompt, 48)
    assert mi.running_requests == 0
    assert mi.pairs[0].target_cache.running_sequences == 0
    assert mi.pairs[0].drafter_cache.running_sequences == 0


@pytest.mark.parametrize("step_sockets, transport", [(False, "inline"), (True, "inline"), (True, "shm")],
                         ids=["streams", "step-sockets", "step-sockets-shm-early-pushes"])
def test_drafter_dying_mid_stream_falls_back_to_autoregressive_losslessly(checkpoints, step_sockets, transport):
    target, drafter = checkpoints("llama")
    s = start_stack(target, drafter, step_sockets=step_sockets, transport=transport)
    try:
        prompt = prompts_for(target, [7], seed=13)[0]

        async def scenario():
            async with grpc.aio.insecure_channel(s.gateway) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                ids, final = [], None
                async for msg in stub.GenerateStream(make_request(prompt, 40), timeout=120):
                    ids.extend(msg.token_ids)
                    final = msg
                    if len(ids) >= 4 and s.alive()["drafter"]:
                        s.kill("drafter")
                return ids, final.stats

        ids, stats = asyncio.run(scenario())
        assert ids == reference_greedy(target, prompt, 40)
        assert s.alive()["gateway"] and s.alive()["target"]
        # the stats say what happened: asked ddtree, ended autoregressive
        assert (stats.mode, stats.requested_mode, stats.drafter_fallback) == ("ar", "ddtree", True)
        # a new request still works (autoregressively) with the drafter gone
        again = run_streams(s.gateway, [make_request(prompt, 10)])[0]
        assert again["token_ids"] == reference_greedy(target, prompt, 10)
        assert again["stats"].mode == "ar" and again["stats"].drafter_fallback
        # one error line for the outage in the target's log, not one per feature push
        target_log = (Path(s.log_dir) / "target.log").read_text()
        assert sum("feature push" in line and "ERROR" in line for line in target_log.splitlines()) <= 1
    finally:
        s.stop()


@pytest.mark.parametrize("step_sockets", [False, True], ids=["streams", "step-sockets"])
def test_target_dying_mid_stream_gives_unavailable_not_a_hang(checkpoints, step_sockets):
    target, drafter = checkpoints("qwen3")
    s = start_stack(target, drafter, step_sockets=step_sockets)
    try:
        prompt = prompts_for(target, [7], seed=17)[0]

        async def scenario():
            async with grpc.aio.insecure_channel(s.gateway) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                async for msg in stub.GenerateStream(make_request(prompt, 500, mode="ar"), timeout=60):
                    if s.alive()["target"]:
                        s.kill("target")

        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(scenario())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert s.alive()["gateway"]
    finally:
        s.stop()


def test_seeded_sampling_is_reproducible_through_the_services(stack):
    s, target = stack
    prompt = prompts_for(target, [6], seed=21)[0]
    runs = run_streams(s.gateway, [make_request(prompt, 32, mode=m, temperature=0.9, seed=seed)
                                   for m, seed in [("ddtree", 42), ("ddtree", 42), ("dflash", 7), ("dflash", 7),
                                                   ("ddtree", 43)]])
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[2]["token_ids"] == runs[3]["token_ids"]
    assert runs[0]["token_ids"] != runs[4]["token_ids"]  # another seed, another sample (32 tokens at T=0.9)
    assert all(len(r["token_ids"]) == 32 for r in runs)


def _prefetch_hits(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ddtree_drafter_prefetched_drafts_total{") and 'outcome="hit"' in line)


def test_a_push_carrying_the_next_token_answers_the_next_draft_with_the_same_draft(stack):
    """Rows pushed with the sequence's next bonus token are drafted on arrival; the Draft that follows is answered
    from that draft (a prefetch hit), and it equals the draft made on request for the same context."""
    import torch

    s, _ = stack

    async def call():
        async with s.internal_channel("drafter") as channel:
            stub = drafter_pb2_grpc.DrafterServiceStub(channel)
            info = await stub.Info(drafter_pb2.DrafterInfoRequest(), timeout=30)
            dim = len(info.target_layer_ids) * info.hidden_size
            first, second = torch.randn(3, dim).numpy().tobytes(), torch.randn(2, dim).numpy().tobytes()

            def push(seq_id, start, n, data, **fields):
                return stub.PushFeatures(drafter_pb2.FeatureBatch(feature_dim=dim, rows=[drafter_pb2.FeatureRows(
                    seq_id=seq_id, start=start, num_rows=n, dtype="float32", data=data, **fields)]), timeout=30)

            def draft(seq_id, bonus, context_len, top_k=4):
                return stub.Draft(drafter_pb2.DraftRequest(items=[drafter_pb2.DraftItem(
                    seq_id=seq_id, bonus_token=bonus, context_len=context_len)], top_k=top_k, max_depth=3), timeout=30)

            for seq_id in ("prefetch-a", "prefetch-b"):
                await push(seq_id, 0, 3, first)
                await draft(seq_id, 5, 3)   # tells the drafter the top-k this sequence drafts with
            await push("prefetch-a", 3, 2, second, next_token=7)
            await push("prefetch-b", 3, 2, second)
            hits = _prefetch_hits(s.metrics_ports["drafter"])
            a, b = await draft("prefetch-a", 7, 5), await draft("prefetch-b", 7, 5)
            hit = _prefetch_hits(s.metrics_ports["drafter"]) - hits
            # A new sequence's first push (a prompt's rows and first token) is drafted with the widest top-k of the
            # recent Drafts, so its first Draft is a hit too, even when the latest Draft asked for fewer.
            await draft("prefetch-b", 7, 5, top_k=1)
            await push("prefetch-c", 0, 3, first, next_token=9)
            hits = _prefetch_hits(s.metrics_ports["drafter"])
            await draft("prefetch-c", 9, 3)
            first_hit = _prefetch_hits(s.metrics_ports["drafter"]) - hits
            # The gateway's word wins over the recent asks: a prompt's push naming K = 6 is drafted that wide.
            await push("prefetch-d", 0, 3, first, next_token=9, draft_top_k=6)
            hits = _prefetch_hits(s.metrics_ports["drafter"])
            await draft("prefetch-d", 9, 3, top_k=6)
            hinted_hit = _prefetch_hits(s.metrics_ports["drafter"]) - hits
            await stub.Release(drafter_pb2.DrafterReleaseRequest(
                seq_ids=["prefetch-a", "prefetch-b", "prefetch-c", "prefetch-d"]), timeout=30)
            return a.results[0], b.results[0], hit, first_hit, hinted_hit

    a, b, hit, first_hit, hinted_hit = asyncio.run(call())
    assert hit == 1   # a was answered from its prefetched draft, b by a forward
    assert first_hit == 1   # drafted at top-k 4 (the widest recent ask), not 1 (the latest)
    assert hinted_hit == 1  # drafted at the hinted 6, wider than any recent ask
    assert (a.depth, a.k) == (b.depth, b.k) == (3, 4)
    (a_logprobs, a_ids), (b_logprobs, b_ids) = draft_arrays(a), draft_arrays(b)
    assert a_ids.tolist() == b_ids.tolist()
    assert a_logprobs.ravel().tolist() == pytest.approx(b_logprobs.ravel().tolist(), abs=1e-5)
