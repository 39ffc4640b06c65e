"""Random-weight checkpoints at the real shapes, built where they run (the GPU machine has no model downloads).

Speed depends on shapes, not on weight values, so a benchmark of the engine can use N(0, 0.02) weights at the
exact dimensions of the models users deploy. The LM head is a permutation of the embedding (`_successor_head`), so greedy outputs are robust to bf16
rounding and equal across decode modes, which calibrated-acceptance runs need. Each checkpoint comes with a
word-level tokenizer that covers the
whole vocabulary ("t0 t1 ..."), so the gateway's detokenizer works on any generated id.

    qwen3-8b      Qwen3-8B: 36 dense layers, hidden 4096, 32 q / 8 kv heads x 128, MLP 12288, vocab 151936
    qwen3.6-27b   Qwen3.6-27B text layout: 64 layers, every 4th full (gated) attention, the rest Gated DeltaNet;
                  hidden 5120, MLP 17408, attention 24 q / 4 kv x 256, GDN 16 k / 48 v heads x 128, vocab 248320
    tiny          a few-MB dense model with the 8B layout's proportions, for CPU checks of the tooling

`layers` cuts a model to fewer layers (keeping the 27B's 3:1 GDN:attention pattern); per-layer costs scale.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPES = ("qwen3-8b", "qwen3.6-27b", "tiny")


def target_config(shape: str, layers: int | None = None):
    """The transformers config of a shape (text model only), optionally cut to `layers` layers."""
    from transformers import Qwen3Config, Qwen3_5TextConfig

    if shape == "qwen3-8b" or shape == "tiny":
        big = shape == "qwen3-8b"
        n = layers or (36 if big else 4)
        return Qwen3Config(
            vocab_size=151936 if big else 4096, hidden_size=4096 if big else 256,
            intermediate_size=12288 if big else 768, num_hidden_layers=n,
            num_attention_heads=32 if big else 8, num_key_value_heads=8 if big else 2, head_dim=128 if big else 32,
            max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
            eos_token_id=1, bos_token_id=None, pad_token_id=1,
        )
    if shape == "qwen3.6-27b":
        n = layers or 64
        return Qwen3_5TextConfig(
            vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=n,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
            num_attention_heads=24, num_key_value_heads=4, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
            eos_token_id=1, bos_token_id=None, pad_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        )
    raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")


def word_tokenizer(vocab_size: int, out_dir: Path) -> None:
    """Saves a word-level tokenizer whose token i is the word 't<i>' (every id decodes)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t1")
    hf.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # text words all map to t0
    hf.save_pretrained(str(out_dir))


def build_target(shape: str, out_dir: str | Path, layers: int | None = None, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """Writes a random-weight checkpoint of `shape` (built on `device`, saved in `dtype`) plus its tokenizer."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = target_config(shape, layers)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)  # HF init: N(0, 0.02), norms 1
    finally:
        torch.set_default_dtype(previous)
    _successor_head(model, seed)
    model.save_pretrained(str(out_dir))
    word_tokenizer(config.vocab_size, out_dir)
    del model
    return out_dir


EMBED_SCALE = 10.0


def _successor_head(model, seed: int) -> None:
    """Embeddings N(0, 10) and an LM head that is a row permutation of them: greedy decoding follows a fixed
    successor of the current token by a wide margin.

    With plain random weights every logit is near every other, so bf16 rounding, which differs between a 1-token
    step and a 65-node verify, flips greedy choices and two runs of one prompt diverge. Here the last hidden
    state is dominated by the token's own embedding (the layers add O(1) per element against 10), so the logit
    of j, <h, e_perm(j)>, is largest by ~10^4 where perm(j) is the current token. Shapes, and so speed, are those
    of the real model.
    """
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        gen = torch.Generator(device=emb.device).manual_seed(seed)
        emb.normal_(0.0, EMBED_SCALE, generator=gen)
        perm = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
        model.get_output_embeddings().weight.copy_(emb[perm] / EMBED_SCALE)


def build_drafter(target_dir: str | Path, out_dir: str | Path, num_layers: int = 5, block_size: int = 16,
                  device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> Path:
    """Writes a random DFlash drafter for the target at target_dir (z-lab layout: hidden = the target's)."""
    from drafter_svc.dflash_config import DFlashConfig, build_target_layer_ids
    from drafter_svc.dflash_model import DFlashDraftModel

    out_dir = Path(out_dir)
    t = json.loads((Path(target_dir) / "config.json").read_text())
    n_target = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    hidden = int(t["hidden_size"])
    rope = t.get("rope_parameters") or {}
    cfg = DFlashConfig.from_dict({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": int(t["vocab_size"]) - 1,
                          "target_layer_ids": build_target_layer_ids(n_target, num_layers)},
        "hidden_size": hidden, "intermediate_size": int(t["intermediate_size"]), "num_hidden_layers": num_layers,
        # The published drafters use Qwen3 attention (32 q / 8 kv heads x 128 for both targets).
        "num_attention_heads": 32 if hidden >= 4096 else heads, "num_key_value_heads": 8 if hidden >= 4096 else 2,
        "head_dim": 128 if hidden >= 4096 else int(t.get("head_dim") or hidden // heads),
        "rms_norm_eps": 1e-6, "rope_theta": float(rope.get("rope_theta", t.get("rope_theta", 1e6))),
        "rope_scaling": None, "max_position_embeddings": int(t.get("max_position_embeddings", 40960)),
        "vocab_size": int(t["vocab_size"]), "layer_types": ["full_attention"] * num_layers, "sliding_window": None,
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
    })
    torch.manual_seed(seed)
    with torch.device(device):
        model = DFlashDraftModel(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    return out_dir



def main(argv=None) -> None:
    """`python -m bench.shapes --shape S --out DIR`: writes DIR/target and DIR/drafter."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.shapes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=SHAPES)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    target = build_target(args.shape, Path(args.out) / "target", args.layers, args.device, dtype)
    build_drafter(target, Path(args.out) / "drafter", device=args.device, dtype=dtype)
    print(f"wrote {args.out}/target and {args.out}/drafter")


if __name__ == "__main__":
    main()
