"""The OpenAI-compatible HTTP front, driven by the official openai client and by curl, against the gRPC API."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from ddtree_serve.client import Client
from tests.conftest import start_stack

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
README = Path(__file__).resolve().parent.parent / "README.md"
CHAT = [{"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module")
def stack(checkpoints):
    """One tiny Llama stack with the HTTP front, an API key and the qwen3 reasoning parser (which leaves an answer
    outside any <think> block as it is), shared by every test here."""
    target, drafter = checkpoints("llama")
    s = start_stack(target, drafter, http=True, api_key=API_KEY, extra={"gateway": ["--reasoning-parser", "qwen3"]})
    yield s
    s.stop()
    s.cleanup()


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack.http_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def grpc_client(stack):
    with Client(stack.gateway) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(oai):
    return oai.models.list().data[0].id


def test_version_answers_the_package_version_without_a_key(stack):
    from ddtree_serve import __version__

    body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{stack.ports['http']}/version", timeout=10).read())
    assert body == {"version": __version__}


def test_models_lists_the_served_target(oai, stack):
    models = oai.models.list().data
    assert [m.id for m in models] == [Path(stack.model).name]


def test_chat_completion_greedy_text_equals_the_grpc_api(oai, grpc_client, model_id):
    http = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0)
    grpc_result = grpc_client.generate(messages=CHAT, max_tokens=24, temperature=0.0)
    assert http.choices[0].message.content == grpc_result.text
    assert http.choices[0].message.role == "assistant"
    assert http.choices[0].finish_reason == grpc_result.finish_reason
    assert http.usage.prompt_tokens == grpc_result.stats["prompt_tokens"]
    assert http.usage.completion_tokens == grpc_result.stats["generated_tokens"]
    assert http.usage.total_tokens == http.usage.prompt_tokens + http.usage.completion_tokens


def test_streamed_chat_completion_equals_the_grpc_api_and_ends_with_usage(oai, grpc_client, model_id):
    stream = oai.chat.completions.create(model=model_id, messages=CHAT, max_completion_tokens=24, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    grpc_result = grpc_client.generate(messages=CHAT, max_tokens=24, temperature=0.0)
    assert text == grpc_result.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [grpc_result.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == grpc_result.stats["generated_tokens"]


def test_a_follow_up_turn_reports_the_prompt_tokens_it_took_from_the_cache_within_its_salt(oai, model_id):
    system = [{"role": "system", "content": "You answer briefly and plainly. " * 6}]

    def ask(messages, salt):
        return oai.chat.completions.create(model=model_id, messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"cache_salt": salt})

    first = ask(system + CHAT, "follow-up-a")   # a salt of its own: no other test's turns are parked under it
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow_up = system + CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "And another one?"}]
    again, elsewhere = ask(follow_up, "follow-up-a"), ask(follow_up, "follow-up-b")
    assert 16 <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert elsewhere.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == elsewhere.choices[0].message.content


def test_a_batch_of_prompts_under_one_prefix_runs_it_once_and_each_answer_equals_the_prompt_alone(oai, model_id):
    shared = list(range(5, 45))
    prompts = [shared + [50, 51], shared + [60], shared + [70, 71, 72]]

    def complete(prompt, salt):
        return oai.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"cache_salt": salt, "ignore_eos": True})

    # One request: its three sequences are admitted in one step. The first runs the shared 40 tokens; the others
    # wait a step and copy its rows instead of running them beside it.
    batch = complete(prompts, "in-batch")
    assert batch.usage.prompt_tokens_details.cached_tokens >= 2 * 16
    for i, prompt in enumerate(prompts):
        alone = complete(prompt, f"alone-{i}")   # a salt of its own: nothing cached
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
        assert batch.choices[i].text == alone.choices[0].text


def test_a_priority_under_the_default_fcfs_policy_is_a_400_that_names_the_policy(oai, grpc_client, model_id):
    import grpc

    with pytest.raises(grpc.RpcError) as refused:
        grpc_client.generate(prompt_ids=[5, 6, 7], max_tokens=2, priority=3)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "fcfs" in refused.value.details()
    with pytest.raises(openai.BadRequestError, match="priority scheduling is off"):
        oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=2, extra_body={"priority": 3})
    with pytest.raises(openai.BadRequestError, match="priority"):
        oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=2, extra_body={"priority": 2**40})
    plain = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=2, extra_body={"priority": 0})
    assert plain.usage.completion_tokens >= 1


def test_completion_of_raw_text_and_of_token_ids_equal_the_grpc_api(oai, grpc_client, model_id):
    by_text = oai.completions.create(model=model_id, prompt="hello world", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    expected = grpc_client.generate("hello world", chat=False, max_tokens=12, ignore_eos=True)
    assert by_text.choices[0].text == expected.text and by_text.choices[0].finish_reason == "length"
    by_ids = oai.completions.create(model=model_id, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == grpc_client.generate(prompt_ids=[5, 6, 7, 8], max_tokens=12,
                                                          ignore_eos=True).text


def test_completion_logprobs_are_the_targets_own_at_every_generated_token(oai, grpc_client, stack, model_id):
    """logprobs=3 on a speculative (ddtree) greedy completion: each generated token's log-prob is the target's
    log-softmax at that position (transformers' forward over the same ids, float32), the top 3 are its largest,
    and the greedy token heads them."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 6, 7, 8]
    out = oai.completions.create(model=model_id, prompt=prompt, max_tokens=24, temperature=0, logprobs=3,
                                 extra_body={"ignore_eos": True, "budget": 64})
    by_grpc = grpc_client.generate(prompt_ids=prompt, max_tokens=24, ignore_eos=True, budget=64, logprobs=True,
                                   top_logprobs=3)
    ids = by_grpc.token_ids
    assert out.model_extra["ddtree"]["accepted_tokens"] > 0   # drafted tokens' log-probs are among those checked
    lp = out.choices[0].logprobs
    assert [x["logprob"] for x in by_grpc.logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)   # one source
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == len(ids)
    model = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert lp.token_logprobs == pytest.approx(ref[torch.arange(len(ids)), ids].tolist(), abs=1e-4)
    for row, top, chosen in zip(ref, lp.top_logprobs, lp.token_logprobs):
        best = row.topk(3).values.tolist()
        # keyed by token text, as OpenAI's completions shape has it: tokens of one text share a key
        assert top and all(min(abs(v - b) for b in best) < 1e-4 for v in top.values())
        assert chosen == pytest.approx(best[0], abs=1e-4)   # greedy: the chosen token is the likeliest
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


ECHO_PROMPT = [9, 14, 3, 27, 8, 11, 40]


def _prompt_log_softmax(stack):
    """transformers' float32 log-softmax over ECHO_PROMPT: row i predicts token i + 1."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(stack.model, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ECHO_PROMPT])).logits[0, :-1].float(), dim=-1)


def test_prompt_logprobs_over_grpc_are_the_targets_own_with_their_alternatives(grpc_client, stack):
    import torch

    result = grpc_client.generate(prompt_ids=ECHO_PROMPT, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    ref = _prompt_log_softmax(stack)
    assert len(result.prompt_logprobs) == len(ECHO_PROMPT) - 1
    assert [x["logprob"] for x in result.prompt_logprobs] == \
        pytest.approx(ref[torch.arange(len(ECHO_PROMPT) - 1), ECHO_PROMPT[1:]].tolist(), abs=1e-4)
    for entry, row in zip(result.prompt_logprobs, ref):
        values, ids = row.topk(2)
        assert [i for i, _ in entry["top"]] == ids.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(values.tolist(), abs=1e-4)
    assert result.token_ids == grpc_client.generate(prompt_ids=ECHO_PROMPT, max_tokens=3, ignore_eos=True).token_ids


def test_completion_echo_scores_the_prompt_as_lm_eval_asks_it(oai, grpc_client, stack, model_id):
    """echo=True, logprobs=1, max_tokens=1 (lm-evaluation-harness's loglikelihood request): the text is the prompt
    then the answer; the prompt's first token has a null log-prob, the others the target's own."""
    import torch

    out = oai.completions.create(model=model_id, prompt=ECHO_PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                 echo=True, extra_body={"ignore_eos": True})
    answer = grpc_client.generate(prompt_ids=ECHO_PROMPT, max_tokens=1, ignore_eos=True)
    status, detokenized = _post(stack, "/detokenize", {"tokens": ECHO_PROMPT})
    prompt_text = detokenized["prompt"]
    lp = out.choices[0].logprobs
    assert status == 200 and out.choices[0].text == prompt_text + answer.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ECHO_PROMPT) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _prompt_log_softmax(stack)
    assert lp.token_logprobs[1:len(ECHO_PROMPT)] == \
        pytest.approx(ref[torch.arange(len(ECHO_PROMPT) - 1), ECHO_PROMPT[1:]].tolist(), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = oai.completions.create(model=model_id, prompt=ECHO_PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                      echo=True, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-6)


def test_vllms_prompt_logprobs_rank_each_prompt_token_and_its_alternatives(oai, stack, model_id):
    """prompt_logprobs=2: per completion choice (once per chat answer), null for the first prompt token, then
    {id: {logprob, rank, decoded_token}} for the token (its rank among all tokens) and its 2 likeliest."""
    out = oai.completions.create(model=model_id, prompt=ECHO_PROMPT, max_tokens=2, temperature=0,
                                 extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    scores = out.choices[0].model_extra["prompt_logprobs"]
    ref = _prompt_log_softmax(stack)
    assert len(scores) == len(ECHO_PROMPT) and scores[0] is None
    for token, entry, row in zip(ECHO_PROMPT[1:], scores[1:], ref):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        best = row.topk(2).indices.tolist()
        assert all(str(i) in entry for i in best)
        assert {entry[str(i)]["rank"] for i in best} <= {1, 2} and len(entry) == len(set(best) | {token})
    chat = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat.model_extra["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="stream"):
        oai.completions.create(model=model_id, prompt=ECHO_PROMPT, max_tokens=2, stream=True,
                               extra_body={"prompt_logprobs": 1})


def test_completion_echo_without_logprobs_puts_the_text_prompt_first_as_given(oai, model_id):
    plain = oai.completions.create(model=model_id, prompt="hello world", max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    echoed = oai.completions.create(model=model_id, prompt="hello world", max_tokens=6, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "hello world" + plain.choices[0].text and echoed.choices[0].logprobs is None


def test_chat_logprobs_streamed_equal_the_whole_answers(oai, model_id):
    """logprobs with top_logprobs=2 on a chat: one entry per completion token, each with its two likeliest
    alternatives (likeliest first, the greedy token first of all); the streamed entries are the same ones."""
    args = dict(model=model_id, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = oai.chat.completions.create(**args)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for chunk in oai.chat.completions.create(**args, stream=True)
                for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    plain = oai.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == whole.choices[0].message.content   # asking changes no token


def test_extension_fields_pick_the_mode_and_report_it(oai, model_id):
    reply = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0,
                                        extra_body={"mode": "ar"})
    ddtree = reply.model_extra["ddtree"]
    assert ddtree["mode"] == "ar" and ddtree["steps"] >= 1 and ddtree["draft_tokens"] == 0
    tree = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0,
                                       extra_body={"mode": "ddtree", "budget": 8})
    assert tree.model_extra["ddtree"]["budget"] == 8
    assert tree.choices[0].message.content == reply.choices[0].message.content  # lossless: same greedy text


def test_seeded_sampling_is_reproducible_and_stop_strings_cut_the_text(oai, model_id):
    def sample():
        return oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=20, temperature=1.0,
                                           top_p=0.9, seed=1234).choices[0].message.content

    assert sample() == sample()
    full = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    cut = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=20, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string_and_stop_reason_names_it(oai, grpc_client, model_id):
    args = dict(model=model_id, prompt=[5, 6, 7], max_tokens=20, temperature=0)
    full = oai.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    kept = oai.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True,
                                                                  "include_stop_str_in_output": True}).choices[0]
    assert kept.text == full[:full.index(stop) + len(stop)] and kept.to_dict()["stop_reason"] == stop
    over_grpc = grpc_client.generate(prompt_ids=[5, 6, 7], max_tokens=20, stop=[stop], ignore_eos=True,
                                     include_stop_str_in_output=True)
    assert over_grpc.text == kept.text and over_grpc.stop_reason == stop
    streamed = oai.completions.create(**args, stop=[stop], stream=True,
                                      extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == kept.text and chunks[-1].to_dict()["stop_reason"] == stop


def test_stop_reason_is_the_stop_token_asked_for_and_none_at_the_length_limit(oai, grpc_client, model_id):
    stop = grpc_client.generate(prompt_ids=[5, 6, 7], max_tokens=4, ignore_eos=True).token_ids[2]
    args = dict(model=model_id, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    by_token = oai.completions.create(**args, extra_body={"ignore_eos": True, "stop_token_ids": [stop]}).choices[0]
    assert by_token.finish_reason == "stop" and by_token.to_dict()["stop_reason"] == stop
    at_length = oai.completions.create(**args, extra_body={"ignore_eos": True}).choices[0]
    assert at_length.finish_reason == "length" and at_length.to_dict()["stop_reason"] is None


def test_min_tokens_passes_over_a_stop_string_the_answer_would_end_on_early(oai, model_id):
    args = dict(model=model_id, prompt=[5, 6, 7], max_tokens=20, temperature=0)
    full = oai.completions.create(**args, extra_body={"ignore_eos": True})
    stop = full.choices[0].text[:2]   # ends within the first two tokens
    early = oai.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    held = oai.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 20}).choices[0]
    assert early.text == "" and early.finish_reason == "stop"
    assert held.text == full.choices[0].text and held.finish_reason == "length"


def test_special_tokens_show_in_the_text_unless_skipped(oai, stack, model_id):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    args = dict(model=model_id, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    body = {"ignore_eos": True, "allowed_token_ids": [tok.eos_token_id]}
    shown = oai.completions.create(**args, extra_body={**body, "skip_special_tokens": False}).choices[0].text
    assert shown == tok.eos_token * 3
    assert oai.completions.create(**args, extra_body=body).choices[0].text == ""


def test_n_seeded_samples_are_n_choices_each_the_single_request_of_its_seed(oai, model_id):
    """n samples of one request: choice i is what the request alone gives with seed + i (so they differ and each
    is reproducible); usage counts the prompt once and every sample's tokens."""
    args = dict(model=model_id, messages=CHAT, max_tokens=16, temperature=1.0, seed=77)
    both = oai.chat.completions.create(n=3, **args)
    alone = [oai.chat.completions.create(**{**args, "seed": 77 + i}).choices[0].message.content for i in range(3)]
    assert [c.index for c in both.choices] == [0, 1, 2]
    assert [c.message.content for c in both.choices] == alone
    assert len(set(alone)) > 1
    single = oai.chat.completions.create(**args)
    assert both.usage.prompt_tokens == single.usage.prompt_tokens
    assert both.usage.completion_tokens == sum(
        oai.chat.completions.create(**{**args, "seed": 77 + i}).usage.completion_tokens for i in range(3))


def test_a_batch_of_prompts_answers_each_as_alone_numbered_prompt_by_sample(oai, model_id):
    """/v1/completions with a list of prompts (texts or token-id lists), n samples each: choice p * n + i is prompt
    p's sample i, equal to that prompt sent alone with seed + i; usage counts each prompt once."""
    prompts = ["The capital of France is", "One, two, three,"]
    args = dict(model=model_id, max_tokens=6, temperature=1.0, seed=5)
    batch = oai.completions.create(prompt=prompts, n=2, **args)
    alone = [oai.completions.create(prompt=p, **{**args, "seed": 5 + i}) for p in prompts for i in range(2)]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = oai.completions.create(prompt=[[5, 6, 7], [8, 9]], max_tokens=4, temperature=0, model=model_id)
    assert [c.text for c in ids.choices] == [oai.completions.create(prompt=p, max_tokens=4, temperature=0,
                                                                     model=model_id).choices[0].text
                                             for p in ([5, 6, 7], [8, 9])]
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(prompt=["hi"] * 65, max_tokens=2, model=model_id)
    assert "1 to 64 per request" in info.value.body["message"]


def test_n_streamed_samples_interleave_by_index_and_each_ends_with_its_finish_reason(oai, model_id):
    stream = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=12, temperature=0, n=2,
                                    stream=True, stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True})
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    greedy = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert texts == {0: greedy, 1: greedy}   # greedy: both samples are the one answer
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 24 and usage.prompt_tokens == 3


def _post(stack, path: str, body: dict, key: str = API_KEY) -> tuple[int, dict]:
    """POST a JSON body to the gateway's HTTP root (outside /v1, as vLLM serves /tokenize); (status, JSON)."""
    request = urllib.request.Request(stack.http_url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_continuous_usage_stats_count_each_chunks_tokens_so_far(oai, model_id):
    stream = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=12, temperature=0, stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True},
                                    extra_body={"ignore_eos": True})
    counts = [c.usage.completion_tokens for c in stream if c.choices]
    assert counts == sorted(counts) and counts[-1] == 12 and all(c > 0 for c in counts)


def test_tokenize_counts_what_the_completions_endpoints_see_and_detokenize_inverts_it(oai, stack, model_id):
    text = "the quick brown fox"
    status, tok = _post(stack, "/tokenize", {"model": model_id, "prompt": text})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    reply = oai.completions.create(model=model_id, prompt=text, max_tokens=1)
    assert tok["count"] == reply.usage.prompt_tokens
    status, chat = _post(stack, "/tokenize", {"model": model_id, "messages": CHAT})
    assert status == 200 and chat["count"] == oai.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=1).usage.prompt_tokens
    bare = _post(stack, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"]
    assert _post(stack, "/detokenize", {"model": model_id, "tokens": bare}) == (200, {"prompt": text})


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "either prompt or messages"),
    ("/tokenize", {}, 400, "either prompt or messages"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "token ids must lie in"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "does not exist"),
])
def test_bad_tokenize_requests_get_openai_shaped_errors(stack, path, body, status, fragment):
    got, reply = _post(stack, path, body)
    assert got == status and fragment in reply["error"]["message"]


def test_tokenize_needs_the_api_key(stack):
    assert _post(stack, "/tokenize", {"prompt": "a"}, key="wrong")[0] == 401


def _running_requests(stack) -> float:
    root = stack.http_url.removesuffix("/v1")
    text = urllib.request.urlopen(f"{root}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def test_a_client_leaving_an_n_sample_stream_frees_every_sample(oai, stack, model_id):
    """Closing a stream of n = 3 long samples mid-way cancels all three: the running batch empties within 2 s
    (finishing them takes ~5 s on a 2-core box; cancelled, ~0.1 s), and the next request is answered as before."""
    import time

    stream = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=480, temperature=0, n=3,
                                    stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()
    left = time.monotonic()
    while _running_requests(stack) and time.monotonic() < left + 2:
        time.sleep(0.05)
    assert _running_requests(stack) == 0
    again = oai.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert again.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"max_tokens": 10**6}, openai.BadRequestError, "context limit"),
    ({"n": 17}, openai.BadRequestError, "n must be in [1, 16]"),
    ({"n": 0}, openai.BadRequestError, "n must be in [1, 16]"),
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"model": "gpt-4o"}, openai.NotFoundError, "does not exist"),
    ({"presence_penalty": 2.5}, openai.BadRequestError, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3}, openai.BadRequestError, "frequency_penalty must be in [-2, 2]"),
    ({"extra_body": {"repetition_penalty": 0}}, openai.BadRequestError, "repetition_penalty must be > 0"),
    ({"extra_body": {"min_p": 1.5}}, openai.BadRequestError, "min_p must be in [0, 1]"),
    ({"logit_bias": {"x": 1}}, openai.BadRequestError, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 101}}, openai.BadRequestError, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"99999999": 1}}, openai.BadRequestError, "logit_bias token ids must lie in"),
    ({"extra_body": {"min_tokens": 9}}, openai.BadRequestError, "min_tokens (9) must be <= max_tokens (8)"),
    ({"extra_body": {"bad_words": ["  "]}}, openai.BadRequestError, "bad_words must be non-blank"),
    ({"extra_body": {"bad_words": ["a"] * 129}}, openai.BadRequestError, "at most 128 bad_words"),
    ({"extra_body": {"allowed_token_ids": []}}, openai.BadRequestError, "allowed_token_ids must be a non-empty"),
    ({"extra_body": {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2}}, openai.BadRequestError,
     "allowed_token_ids are all stop tokens"),
    ({"extra_body": {"allowed_token_ids": [5, 10**7]}}, openai.BadRequestError, "allowed_token_ids must lie in"),
    ({"extra_body": {"cache_salt": "s" * 257}}, openai.BadRequestError, "cache_salt is over the 256-character"),
])
def test_bad_requests_get_openai_shaped_errors(oai, model_id, kwargs, error, fragment):
    args = {"model": model_id, "messages": CHAT, "max_tokens": 8, **kwargs}
    with pytest.raises(error) as info:
        oai.chat.completions.create(**args)
    body = info.value.body
    assert fragment in body["message"] and body["type"]


@pytest.mark.parametrize("kwargs, field", [
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
])
def test_a_field_that_would_change_the_answer_and_is_not_implemented_is_refused_by_name(oai, model_id, kwargs, field):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, **kwargs)
    assert info.value.body["param"] == field and "not supported" in info.value.body["message"]


def test_neutral_values_of_those_fields_and_vllms_top_k_of_minus_one_change_nothing(oai, model_id):
    sampled = {"model": model_id, "messages": CHAT, "max_tokens": 8, "temperature": 0.8, "seed": 3}
    plain = oai.chat.completions.create(**sampled)
    neutral = oai.chat.completions.create(**sampled, response_format={"type": "text"}, logit_bias={},
                                          presence_penalty=0, frequency_penalty=0,
                                          extra_body={"repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0,
                                                      "top_k": -1})
    assert neutral.choices[0].message.content == plain.choices[0].message.content


ADJUSTED_PROMPT = [5, 6, 7, 8]


def test_penalties_min_p_and_logit_bias_answer_as_the_grpc_api_with_the_same_fields(oai, grpc_client, model_id):
    http = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=16, temperature=0,
                                  presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"9": 2.0},
                                  extra_body={"repetition_penalty": 1.5, "min_p": 0.05, "ignore_eos": True})
    adjusted = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=16, ignore_eos=True, presence_penalty=0.5,
                                    frequency_penalty=0.25, logit_bias={9: 2.0}, repetition_penalty=1.5, min_p=0.05)
    plain = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=16, ignore_eos=True)
    assert http.choices[0].text == adjusted.text
    assert adjusted.token_ids != plain.token_ids


def test_min_tokens_holds_back_the_stop_token_the_answer_would_end_on(oai, grpc_client, model_id):
    stop = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=4, ignore_eos=True).token_ids[1]
    args = dict(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=16, temperature=0)
    ended = oai.completions.create(**args, extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    held = oai.completions.create(**args, extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 6})
    assert ended.usage.completion_tokens == 2 and ended.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens > 6


def test_allowed_token_ids_confine_a_sampled_answer_to_them(oai, grpc_client, model_id):
    out = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=24, ignore_eos=True, temperature=1.0, seed=5,
                               allowed_token_ids=[30, 31, 32])
    assert len(out.token_ids) == 24 and set(out.token_ids) <= {30, 31, 32} and len(set(out.token_ids)) > 1
    http = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=24, temperature=1.0, seed=5,
                                  extra_body={"ignore_eos": True, "allowed_token_ids": [30, 31, 32]})
    assert http.choices[0].text == out.text


def test_bad_words_never_appear_and_answer_as_the_grpc_api_with_the_same_words(oai, grpc_client, stack, model_id):
    from transformers import AutoTokenizer

    from gateway.bad_words import bad_word_token_ids

    tok = AutoTokenizer.from_pretrained(stack.model)
    plain = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=16, ignore_eos=True).token_ids
    # a word of the plain answer that is one of its tokens as vLLM tokenizes it
    words = (tok.decode([t]).strip() for t in plain[1:])
    word = next(w for w in words if w and len(ids := tok.encode(w, add_special_tokens=False)) == 1 and ids[0] in plain)
    banned = {ids[0] for ids in bad_word_token_ids(tok, [word]) if len(ids) == 1}
    steered = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=16, ignore_eos=True, bad_words=[word])
    assert steered.token_ids != plain and not banned & set(steered.token_ids)
    http = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": [word]})
    assert http.choices[0].text == steered.text


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                                   {"guided_choice": ["yes", "no", "maybe"]}])
def test_a_choice_answers_exactly_one_of_its_strings(oai, model_id, extra):
    reply = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, temperature=0, extra_body=extra)
    assert reply.choices[0].message.content in ("yes", "no", "maybe") and reply.choices[0].finish_reason == "stop"


def test_a_regex_answer_matches_it_and_sampling_keeps_to_it_too(oai, model_id):
    for seed in (1, 2, 3):
        reply = oai.completions.create(model=model_id, prompt="Three digits:", max_tokens=16, temperature=1.0,
                                       seed=seed, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
        assert re.fullmatch("[0-9]{3}", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"


def test_a_json_schema_answer_keeps_to_the_schema_as_the_grpc_api_does(oai, grpc_client, stack, model_id):
    import xgrammar as xgr

    from tests.conftest import compile_guide

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    over_grpc = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=48,
                                     structured_output=("json", json.dumps(schema)))
    matcher = xgr.GrammarMatcher(compile_guide(stack.model, "json", json.dumps(schema)))
    assert all(matcher.accept_token(t) for t in over_grpc.token_ids)   # every token stays inside the grammar
    if over_grpc.finish_reason == "stop":
        assert set(json.loads(over_grpc.text)) == {"ok", "n"}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    http = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=48, temperature=0,
                                  extra_body={"response_format": fmt})
    assert http.choices[0].text == over_grpc.text
    chat = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=48, temperature=0, response_format=fmt)
    chat_grpc = grpc_client.generate(messages=CHAT, max_tokens=48, structured_output=("json", json.dumps(schema)))
    assert chat.choices[0].message.content == chat_grpc.text
    free = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=48)
    assert free.text != over_grpc.text


def test_a_structural_tag_answer_keeps_to_its_tag_as_the_grpc_api_does(oai, grpc_client, stack, model_id):
    import xgrammar as xgr

    from tests.conftest import compile_guide

    # a whole answer that is one tag: <n>, an integer, </n> (the tiny random model cannot write anything else)
    tag = {"format": {"type": "tag", "begin": "<n>", "end": "</n>",
                      "content": {"type": "json_schema", "json_schema": {"type": "integer"}}}}
    over_grpc = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=24,
                                     structured_output=("structural_tag", json.dumps(tag)))
    matcher = xgr.GrammarMatcher(compile_guide(stack.model, "structural_tag", json.dumps(tag)))
    assert all(matcher.accept_token(t) for t in over_grpc.token_ids)
    assert re.fullmatch(r"<n>-?[0-9]*(</n>)?" if over_grpc.finish_reason == "length" else r"<n>-?[0-9]+</n>",
                        over_grpc.text)
    http = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"response_format": {"type": "structural_tag", **tag}})
    assert http.choices[0].text == over_grpc.text
    vllm_form = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}})
    assert vllm_form.choices[0].text == over_grpc.text


@pytest.mark.parametrize("extra, fragment", [
    ({"structured_outputs": {"regex": "[0-9"}}, "invalid structured output regex"),
    ({"guided_json": "{not json"}, "invalid structured output json"),
    ({"structured_outputs": {"choice": []}}, "choice must be a list"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "give one structured output"),
    ({"response_format": {"type": "json_schema"}}, "response_format must be text, json_object, json_schema"),
    ({"structured_outputs": {"structural_tag": "x"}}, "invalid structured output structural_tag"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]}},
     "each structure of a structural tag needs"),
    ({"guided_regex": "a+", "min_tokens": 2}, "not supported together with min_tokens"),
    ({"guided_regex": "a+", "bad_words": ["a"]}, "not supported together with bad_words"),
])
def test_bad_structured_outputs_get_a_400_that_says_why(oai, model_id, extra, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, extra_body=extra)
    assert fragment in info.value.body["message"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def test_tools_and_earlier_calls_reach_the_chat_template(stack, grpc_client, model_id):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    messages = CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    want = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert "<tools>" in want and "<tool_call>" in want
    status, rendered = _post(stack, "/tokenize", {"model": model_id, "messages": messages, "tools": [WEATHER_TOOL]})
    assert status == 200 and rendered["tokens"] == tok(want, add_special_tokens=False).input_ids
    over_grpc = grpc_client.generate(messages=messages, tools=[WEATHER_TOOL], max_tokens=2)
    assert over_grpc.stats["prompt_tokens"] == rendered["count"]


def _tool_answer(oai, args: dict, stream: bool) -> tuple[list, str, str | None]:
    """(tool calls, finish reason, content) of a chat answer, whole or gathered from its stream."""
    if not stream:
        reply = oai.chat.completions.create(**args).choices[0]
        return reply.message.tool_calls, reply.finish_reason, reply.message.content
    deltas = [c.choices[0] for c in oai.chat.completions.create(**args, stream=True) if c.choices]
    calls: dict = {}   # a call's pieces put together by index, as OpenAI's clients do: its head, then its arguments
    for piece in (t for d in deltas for t in d.delta.tool_calls or []):
        if piece.index not in calls:
            assert piece.id and piece.function.name
            calls[piece.index] = piece.model_copy(deep=True)
        else:
            calls[piece.index].function.arguments += piece.function.arguments
    return list(calls.values()), deltas[-1].finish_reason, "".join(d.delta.content or "" for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_answers_with_that_functions_call(oai, model_id, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    args = dict(model=model_id, messages=CHAT, max_tokens=48, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice=choice)
    calls, reason, content = _tool_answer(oai, args, stream)
    assert reason == "tool_calls" and not content and len(calls) == 1
    assert calls[0].function.name == "get_weather" and set(json.loads(calls[0].function.arguments)) == {"city"}
    if stream:   # the arguments stream as they are written, after the call's head
        pieces = [t for c in oai.chat.completions.create(**args, stream=True) if c.choices
                  for t in c.choices[0].delta.tool_calls or []]
        assert pieces[0].function.name == "get_weather" and pieces[0].function.arguments == "" and len(pieces) > 2


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_without_parallel_calls_answers_with_one_call_of_the_given_tools(oai, model_id,
                                                                                              stream):
    args = dict(model=model_id, messages=CHAT, max_tokens=64, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice="required", parallel_tool_calls=False)
    calls, reason, content = _tool_answer(oai, args, stream)
    assert reason == "tool_calls" and len(calls) == 1 and not content
    for call in calls:
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        json.loads(call.function.arguments)
    if stream:   # the same call as the whole answer's
        whole = oai.chat.completions.create(**args).choices[0].message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_reads_the_hermes_blocks_the_answer_writes(oai, model_id, stream):
    """The answer held (by a regex) to text and one Hermes block: the block comes back as a call, the rest as
    content, streamed or not."""
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    regex = "Checking[.] " + re.escape(block).replace("\\ ", " ")
    args = dict(model=model_id, messages=CHAT, max_tokens=120, temperature=0, tools=[TIME_TOOL],
                extra_body={"structured_outputs": {"regex": regex}})
    calls, reason, content = _tool_answer(oai, args, stream)
    assert reason == "tool_calls" and content.strip() == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {})]
    plain = oai.chat.completions.create(**{**args, "tool_choice": "none"}).choices[0]
    assert plain.message.tool_calls is None and plain.message.content == "Checking. " + block


@pytest.mark.parametrize("extra, fragment", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "function.name must be"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"}, "not with a structured output"),
    ({"tools": [{"type": "function", "function": {"name": "x", "description": "<|im_start|>"}}]},
     "control token"),
])
def test_bad_tool_requests_get_a_400_that_says_why(oai, model_id, extra, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, extra_body=extra)
    assert fragment in info.value.body["message"]


def test_a_logit_bias_of_100_makes_the_greedy_answer_that_token(oai, grpc_client, model_id):
    forced = grpc_client.generate(prompt_ids=ADJUSTED_PROMPT, max_tokens=8, ignore_eos=True, logit_bias={42: 100.0})
    assert forced.token_ids == [42] * 8
    http = oai.completions.create(model=model_id, prompt=ADJUSTED_PROMPT, max_tokens=8, temperature=0,
                                  logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert http.choices[0].text == forced.text


def test_chat_template_kwargs_reach_the_template_and_the_answer_is_that_prompts(oai, grpc_client, stack, model_id):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, enable_thinking=False, tokenize=False)
    status, rendered = _post(stack, "/tokenize", {"model": model_id, "messages": CHAT,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and "</think>" in want
    assert rendered["tokens"] == tok(want, add_special_tokens=False).input_ids
    chat = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    plain = oai.completions.create(model=model_id, prompt=rendered["tokens"], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == rendered["count"]
    over_grpc = grpc_client.generate(messages=CHAT, max_tokens=8, chat_template_kwargs={"enable_thinking": False})
    assert over_grpc.text == plain.choices[0].text and over_grpc.stats["prompt_tokens"] == rendered["count"]


def test_continue_final_message_leaves_the_assistants_turn_open(oai, stack, model_id):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.model)
    messages = CHAT + [{"role": "assistant", "content": "The prime is"}]
    want = tok.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert want.endswith("The prime is")
    options = {"add_generation_prompt": False, "continue_final_message": True}
    status, rendered = _post(stack, "/tokenize", {"model": model_id, "messages": messages, **options})
    assert status == 200 and rendered["tokens"] == tok(want, add_special_tokens=False).input_ids
    chat = oai.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                       extra_body=options)
    plain = oai.completions.create(model=model_id, prompt=rendered["tokens"], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text


THINKING = CHAT + [{"role": "assistant", "content": "<think>\n"}]   # the block open, as Qwen3.5's template leaves it
OPEN_TURN = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_inside_an_open_think_block_is_reasoning_not_content(oai, stack, model_id, stream):
    """--reasoning-parser qwen3: the prompt opens <think> and the answer does not close it within max_tokens, so
    all of it is the message's reasoning (and reasoning_content), none content: the raw completion of that prompt,
    streamed or not."""
    _, rendered = _post(stack, "/tokenize", {"model": model_id, "messages": THINKING, **OPEN_TURN})
    raw = oai.completions.create(model=model_id, prompt=rendered["tokens"], max_tokens=12, temperature=0).choices[0]
    assert raw.text and "</think>" not in raw.text
    args = dict(model=model_id, messages=THINKING, max_tokens=12, temperature=0, extra_body=OPEN_TURN)
    if stream:
        deltas = [c.choices[0].delta for c in oai.chat.completions.create(**args, stream=True) if c.choices]
        reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        message = oai.chat.completions.create(**args).choices[0].message
        reasoning, content = message.model_extra["reasoning"], message.content
        assert message.model_extra["reasoning_content"] == reasoning
    assert reasoning == raw.text and not content


def test_with_thinking_switched_off_the_answer_is_all_content(oai, model_id):
    message = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, temperature=0, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content and "reasoning" not in (message.model_extra or {})


def test_a_structured_answer_reasons_freely_inside_an_open_block_the_grammar_waiting_for_its_end(oai, model_id):
    """As vLLM: the grammar holds from the end tag on, so an answer that never closes its block within max_tokens
    is the unguided answer, all reasoning."""
    args = dict(model=model_id, messages=THINKING, max_tokens=12, temperature=0)
    free = oai.chat.completions.create(**args, extra_body=OPEN_TURN).choices[0].message
    guided = oai.chat.completions.create(**args, extra_body={**OPEN_TURN, "structured_outputs": {
        "regex": "[a-z]{1,6}[.]"}}).choices[0].message
    assert guided.model_extra["reasoning"] == free.model_extra["reasoning"] and guided.content is None
    assert not re.fullmatch("[a-z]{1,6}[.]", free.model_extra["reasoning"])


def test_a_structured_answer_with_no_open_block_keeps_to_its_grammar_from_the_first_token(oai, model_id):
    message = oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "[a-z]{1,6}[.]"}}
    ).choices[0].message
    assert re.fullmatch("[a-z]{1,6}[.]", message.content) and "reasoning" not in (message.model_extra or {})


@pytest.mark.parametrize("extra, fragment", [
    ({"continue_final_message": True}, "cannot both be true"),
    ({"chat_template_kwargs": {"tools": "x"}}, "may not set 'tools'"),
    ({"chat_template_kwargs": {"enable_thinking": {"a": 1}}}, "must be a boolean, a number, null or a string"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(17)}}, "at most 16"),
    ({"add_generation_prompt": False, "continue_final_message": True}, "last message to be the assistant's"),
])
def test_bad_chat_options_get_a_400_that_says_why(oai, model_id, extra, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, extra_body=extra)
    assert fragment in info.value.body["message"]


def test_a_wrong_api_key_is_refused_while_health_and_metrics_stay_open(stack, model_id):
    bad = openai.OpenAI(base_url=stack.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    root = stack.http_url.removesuffix("/v1")
    assert urllib.request.urlopen(f"{root}/health", timeout=10).read() == b"ok"
    metrics = urllib.request.urlopen(f"{root}/metrics", timeout=10).read().decode()
    assert "vllm:request_success_total" in metrics


def _readme_curl_blocks() -> list[str]:
    """The shell blocks of README.md that call curl against the HTTP API."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [b for b in blocks if b.lstrip().startswith("curl") and "/v1/" in b]


@pytest.mark.parametrize("index", range(3))
def test_readme_curl_examples_run_against_the_stack(stack, index):
    blocks = _readme_curl_blocks()
    assert len(blocks) == 3, "README.md should hold three curl examples (models, chat, streamed chat)"
    port = stack.ports["http"]
    env = dict(os.environ, DDTREE_API_KEY=API_KEY)
    out = subprocess.run(["bash", "-c", blocks[index].replace("localhost:8000", f"127.0.0.1:{port}")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if '"stream": true' in blocks[index]:
        events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])
    else:
        reply = json.loads(out.stdout)
        assert reply["object"] in ("list", "chat.completion")


def test_cli_generate_finds_the_running_up_and_streams_a_chat_answer(stack, tmp_path, grpc_client):
    # what a running `up` leaves behind; the pid must be alive: this test process stands in for it
    (tmp_path / "up.json").write_text(json.dumps({"gateway": stack.gateway, "pid": os.getpid()}))
    env = dict(os.environ, DDTREE_SERVE_CACHE=str(tmp_path))
    env.pop("DDTREE_GATEWAY", None)
    out = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "Name a prime number.",
                          "--max-tokens", "24"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = grpc_client.generate(messages=CHAT, max_tokens=24)  # the chat template is the default
    assert out.stdout.startswith(expected.text)
    assert "tau (mean acceptance length)" in out.stdout
