"""The real default pair: SmolLM2-135M-Instruct and the bundled trained drafter, through the three services."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ddtree_serve.default_model import default_drafter_dir
from ddtree_serve.proto import common_pb2, gateway_pb2
from tests.conftest import make_request, reference_greedy, run_streams, start_stack

pytestmark = pytest.mark.slow
PERSON_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                             "birth_year": {"type": "integer"}},
                            "required": ["name", "birth_year"], "additionalProperties": False})


def test_chat_answer_equals_transformers_greedy_and_drafts_are_accepted(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = [{"role": "user", "content": "Write a Python function that returns the factorial of n."}]
    prompt = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    person = [{"role": "user", "content": "Describe a famous scientist as JSON with name and birth year."}]
    person_prompt = tok(tok.apply_chat_template(person, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False).input_ids
    stack = start_stack(smollm2_dir, default_drafter_dir())
    try:
        by_ids, by_chat, guided = run_streams(stack.gateway, [
            make_request(prompt, 48, mode="ddtree", budget=32),
            gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**chat[0])]),
                                        max_tokens=48, ignore_eos=True, mode=gateway_pb2.DECODE_MODE_DFLASH),
            make_request(person_prompt, 64, mode="ddtree", budget=32, ignore_eos=False,
                         guide=common_pb2.Guide(kind="json", spec=PERSON_SCHEMA, compact_json=True)),
        ])
    finally:
        stack.stop()
    # the real tokenizer's byte-level vocabulary under a JSON schema: the answer is that JSON, then EOS
    person_json = json.loads(guided["text"])
    assert set(person_json) == {"name", "birth_year"} and isinstance(person_json["birth_year"], int)
    assert guided["finish_reason"] == "stop" and guided["stats"].mean_acceptance_length > 1.2
    expected = reference_greedy(smollm2_dir, prompt, 48)
    assert by_ids["token_ids"] == expected
    assert by_chat["token_ids"] == expected      # the gateway renders the chat template the same way
    assert by_chat["text"] == tok.decode(expected, skip_special_tokens=True)
    # a trained drafter: more than one token per step on average (a random one gives ~1.0)
    assert by_ids["stats"].mean_acceptance_length > 1.5
    assert by_chat["stats"].mean_acceptance_length > 1.2
