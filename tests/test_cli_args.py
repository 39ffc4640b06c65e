"""The command line as a user meets it: one-line usage errors (exit 2), documented options, a findable gateway."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from ddtree_serve.decoding.config import default_budget
from launch import cli, client_commands
from launch.local_stack import free_port

BAD_ARGS = {
    "token ids that are not numbers": ["generate", "--prompt-ids", "abc"],
    "negative seed": ["generate", "--seed", "-1", "hi"],
    "max_tokens beyond int32": ["generate", "--max-tokens", "3000000000", "hi"],
    "top_p zero": ["generate", "--top-p", "0", "hi"],
    "negative top_k": ["generate", "--top-k", "-2", "hi"],
    "NaN temperature": ["generate", "--temperature", "nan", "hi"],
    "zero repetition penalty": ["generate", "--repetition-penalty", "0", "hi"],
    "presence penalty beyond 2": ["generate", "--presence-penalty", "2.5", "hi"],
    "min_p above 1": ["up", "--min-p", "1.5"],
    "no prompt": ["generate"],
    "empty prompt": ["generate", "  "],
    "up with max_tokens 0": ["up", "--max-tokens", "0"],
    "up with an empty prompt": ["up", "--prompt", ""],
    "up with a missing model directory": ["up", "--model", "/nonexistent/model", "--prompt", "hi"],
    "up with clashing ports": ["up", "--port", "50100", "--http-port", "50100"],
    "up passing the target a flag it does not have": ["up", "--target-args=--no-such-flag"],
    "up passing the gateway a bad value": ["up", "--gateway-args=--drain-s soon"],
    "up with unbalanced quotes in pass-through flags": ["up", "--drafter-args=--log-level 'DEBUG"],
    "up with a gpu memory share above 1": ["up", "--gpu-memory-utilization", "1.5"],
    "gateway port out of range": ["gateway", "--http-port", "70000"],
    "guided overdraft below 1": ["gateway", "--guided-overdraft", "0"],
    "preemption without priority scheduling": ["gateway", "--priority-scheduling-preemption-threshold", "0"],
    "negative preemption threshold": ["gateway", "--scheduling-policy", "priority",
                                      "--priority-scheduling-preemption-threshold", "-1"],
    "zero gpu memory cap": ["target", "--model", "m", "--gpu-memory-cap", "0"],
    "negative gpu memory cap": ["target", "--model", "m", "--gpu-memory-cap", "-48"],
    "gpu memory cap not a number": ["target", "--model", "m", "--gpu-memory-cap", "48GB"],
}


@pytest.mark.parametrize("name", sorted(BAD_ARGS))
def test_a_bad_argument_is_one_line_and_exit_code_2(name, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(BAD_ARGS[name])  # `up` checks before it starts anything: this returns at once
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and ": error: " in err and "Traceback" not in err


def test_the_installed_command_reports_a_bad_argument_without_a_traceback():
    out = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--prompt-ids", "1,x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ddtree-serve generate: error: argument --prompt-ids: '1,x' is not a comma-separated list of token ids, "
        "e.g. 1,2,3 (see ddtree-serve generate -h)"]


def test_up_hands_each_service_its_engine_limits_memory_options_and_pass_through_flags(tmp_path):
    args = cli.build_parser().parse_args([
        "up", "--max-seq-len", "512", "--max-batch", "4", "--quantize", "int8", "--gpu-memory-utilization", "0.8",
        "--target-args=--prefill-chunk 64", "--drafter-args=--lease-s 30", "--gateway-args=--drain-s 5"])
    extra = cli.up_service_args(args)
    assert extra["target"] == ["--max-seq-len", "512", "--max-batch", "4", "--quantize", "int8",
                               "--gpu-memory-utilization", "0.8", "--prefill-chunk", "64"]
    assert extra["drafter"] == ["--max-seq-len", "512", "--max-batch", "4", "--lease-s", "30"]
    assert extra["gateway"] == ["--drain-s", "5"]
    from launch.local_stack import LocalStack

    stack = LocalStack(model="m", drafter="d", extra=extra, log_dir=str(tmp_path))
    commands = stack.commands()
    stack.stop()   # nothing started; removes the socket folder it made
    assert all(commands[name][-len(flags):] == flags for name, flags in extra.items())   # what the services get
    plain = cli.up_service_args(cli.build_parser().parse_args(["up"]))
    assert plain == {"target": [], "drafter": [], "gateway": []}   # the services' own defaults


@pytest.mark.parametrize("command", ["target", "drafter", "gateway", "up", "generate"])
def test_every_option_is_described_and_shows_its_default(command, capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    undocumented = [a.dest for a in sub._actions if a.help is None]
    assert undocumented == []
    with pytest.raises(SystemExit):
        cli.main([command, "-h"])
    assert "(default:" in capsys.readouterr().out


def test_generate_without_a_gateway_says_how_to_start_one():
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "launch.cli", "generate", "--gateway", f"127.0.0.1:{port}",
                          "hi"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr and "ddtree-serve up" in out.stderr and "Traceback" not in out.stderr


def test_generate_finds_a_live_up_and_ignores_a_dead_one(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_SERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("DDTREE_GATEWAY", raising=False)
    state = tmp_path / "up.json"
    state.write_text(json.dumps({"gateway": "127.0.0.1:41234", "pid": os.getpid()}))
    assert client_commands.find_gateway()[0] == "127.0.0.1:41234"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state.write_text(json.dumps({"gateway": "127.0.0.1:41234", "pid": dead.pid}))
    assert client_commands.find_gateway()[0] == "127.0.0.1:50050"
    monkeypatch.setenv("DDTREE_GATEWAY", "10.0.0.1:1")
    assert client_commands.find_gateway()[0] == "10.0.0.1:1"


def test_text_prompts_use_the_chat_template_unless_raw():
    args = cli.build_parser().parse_args(["generate", "hi"])
    chat = cli.build_request(args.prompt, None, 8, 0.0, None, None, 0, not args.raw)
    raw = cli.build_request("hi", None, 8, 0.0, None, None, 0, chat=False)
    assert chat.WhichOneof("prompt") == "chat" and chat.chat.messages[0].content == "hi"
    assert raw.WhichOneof("prompt") == "text"


def test_top_p_and_top_k_reach_the_request():
    req = cli.build_request("hi", None, 8, 0.7, 3, None, 0, True, top_p=0.9, top_k=40)
    assert (round(req.sampling.top_p, 6), req.sampling.top_k, req.sampling.seed) == (0.9, 40, 3)


def test_min_p_the_penalties_and_min_tokens_reach_the_request():
    args = cli.build_parser().parse_args(["generate", "--min-p", "0.25", "--repetition-penalty", "1.5",
                                          "--presence-penalty", "-0.5", "--frequency-penalty", "0.75",
                                          "--min-tokens", "5", "hi"])
    req = cli.build_request("hi", None, 8, 0.0, None, None, 0, True, **client_commands.adjust_args(args))
    s = req.sampling
    assert (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_tokens) == \
        (0.25, 1.5, -0.5, 0.75, 5)


def test_generates_priority_reaches_the_request_it_sends(monkeypatch):
    sent = []

    async def fake_generate_once(address, request, **kw):
        sent.append(request)
        return {"token_ids": [], "text": "", "stats": {}}

    monkeypatch.setattr(client_commands, "generate_once", fake_generate_once)
    args = cli.build_parser().parse_args(["generate", "--gateway", "127.0.0.1:1", "--priority", "-3", "--json", "hi"])
    args.func(args)
    assert [r.priority for r in sent] == [-3]


@pytest.mark.parametrize("flags, kind, spec", [
    (["--json-schema", '{"type": "object"}'], "json", '{"type": "object"}'),
    (["--json-object"], "json_object", ""),
    (["--regex", "[0-9]+"], "regex", "[0-9]+"),
    (["--choice", "yes", "--choice", "no"], "choice", '["yes", "no"]'),
    (["--structural-tag", '{"format": {}}'], "structural_tag", '{"format": {}}'),
])
def test_structured_output_flags_reach_the_request_as_its_guide(flags, kind, spec):
    args = cli.build_parser().parse_args(["generate", *flags, "hi"])
    req = cli.build_request("hi", None, 8, 0.0, None, None, 0, True, **client_commands.adjust_args(args))
    assert (req.guide.kind, req.guide.spec) == (kind, spec)


def test_a_json_schema_flag_reads_a_file_after_an_at_sign(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array"}')
    args = cli.build_parser().parse_args(["generate", "--json-schema", f"@{schema}", "hi"])
    assert client_commands.adjust_args(args)["structured_output"] == ("json", '{"type": "array"}')
    with pytest.raises(SystemExit):   # one structured output at a time
        cli.build_parser().parse_args(["generate", "--regex", "a", "--json-object", "hi"])


def test_the_default_budget_is_small_on_cpu_and_large_on_gpu():
    assert default_budget("cpu") == 16
    assert default_budget("cuda") == default_budget("cuda:1") == 64


def test_the_gpu_memory_cap_reaches_the_target_config():
    parser = cli.build_parser()
    cfg = cli.target_config(parser.parse_args(["target", "--model", "m", "--device", "cuda", "--quantize", "int8",
                                               "--gpu-memory-cap", "44.98828125"]))
    assert cfg.gpu_memory_cap_gb == 44.98828125 and cfg.quantize == "int8" and cfg.device == "cuda"
    assert cli.target_config(parser.parse_args(["target", "--model", "m"])).gpu_memory_cap_gb is None


def test_graph_node_sizes_reach_the_target_config_and_a_zero_is_refused(capsys):
    parser = cli.build_parser()
    cfg = cli.target_config(parser.parse_args(["target", "--model", "m", "--graph-node-sizes", "64, 129"]))
    assert cfg.graph_node_sizes == (64, 129)
    assert cli.target_config(parser.parse_args(["target", "--model", "m"])).graph_node_sizes == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["target", "--model", "m", "--graph-node-sizes", "64,0"])
    assert "out of range" in capsys.readouterr().err


def test_a_gpu_memory_cap_on_the_cpu_exits_with_one_line(tmp_path, capsys):
    # The refusal is the target's (MemoryPlanError before the weights load), printed as one line with exit 1.
    with pytest.raises(SystemExit) as info:
        cli.main(["target", "--model", str(tmp_path), "--port", "0", "--gpu-memory-cap", "48", "--log-level",
                  "ERROR"])
    err = capsys.readouterr().err
    assert info.value.code == 1
    assert err.strip().splitlines()[-1].startswith("ddtree-serve target: error: --gpu-memory-cap needs a CUDA device")


def test_free_ports_are_distinct_even_when_many_are_asked_for_at_once():
    from launch.local_stack import free_ports

    ports = free_ports(64)
    assert len(set(ports)) == 64 and all(0 < p < 65536 for p in ports)


def test_the_targets_quantize_choices_are_the_modes_the_target_serves():
    """The CLI spells the modes out (it imports no torch until a service starts): they must stay the served ones;
    w8a8, a bench-only mode, is refused."""
    from target_svc.quantization import SERVED_QUANTIZE_MODES

    target = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["target"]._actions
                  if "--quantize" in a.option_strings)
    assert tuple(target.choices) == SERVED_QUANTIZE_MODES
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["target", "--model", "m", "--quantize", "w8a8"])
