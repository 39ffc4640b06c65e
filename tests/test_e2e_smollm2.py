"""The real default pair: SmolLM2-135M-Instruct and the bundled trained drafter, through the three services."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from ddtree_serve.default_model import default_drafter_dir
from ddtree_serve.proto import gateway_pb2
from tests.conftest import make_request, reference_greedy, run_streams, start_stack

pytestmark = pytest.mark.slow


def test_chat_answer_equals_transformers_greedy_and_drafts_are_accepted(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": "Write a Python function that returns the factorial of n."}]
    prompt = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    stack = start_stack(smollm2_dir, default_drafter_dir())
    try:
        by_ids, by_chat = run_streams(stack.gateway, [
            make_request(prompt, 48, mode="ddtree", budget=32),
            gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**chat[0])]),
                                        max_tokens=48, ignore_eos=True, mode=gateway_pb2.DECODE_MODE_DFLASH),
        ])
    finally:
        stack.stop()
    expected = reference_greedy(smollm2_dir, prompt, 48)
    assert by_ids["token_ids"] == expected
    assert by_chat["token_ids"] == expected      # the gateway renders the chat template the same way
    assert by_chat["text"] == tok.decode(expected, skip_special_tokens=True)
    # a trained drafter: more than one token per step on average (a random one gives ~1.0)
    assert by_ids["stats"].mean_acceptance_length > 1.5
    assert by_chat["stats"].mean_acceptance_length > 1.2
