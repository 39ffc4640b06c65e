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
    tiny-hybrid   a few-MB model with the 27B's layout (3 GDN : 1 gated attention), for CPU checks of the tooling

`layers` cuts a model to fewer layers (keeping the 27B's 3:1 GDN:attention pattern); per-layer costs scale.
`build_target` makes the whole model at once; `build_target_streaming` writes it shard by shard (the 27B's
~54 GB of bf16 weights never exist at once, on the device or in host memory).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPES = ("qwen3-8b", "qwen3.6-27b", "tiny", "tiny-hybrid")


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
    if shape in ("qwen3.6-27b", "tiny-hybrid"):
        big = shape == "qwen3.6-27b"
        n = layers or (64 if big else 4)
        return Qwen3_5TextConfig(
            vocab_size=248320 if big else 4096, hidden_size=5120 if big else 256,
            intermediate_size=17408 if big else 768, num_hidden_layers=n,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
            num_attention_heads=24 if big else 4, num_key_value_heads=4 if big else 2, head_dim=256 if big else 64,
            linear_num_key_heads=16 if big else 2, linear_num_value_heads=48 if big else 4,
            linear_key_head_dim=128 if big else 32, linear_value_head_dim=128 if big else 32,
            linear_conv_kernel_dim=4, max_position_embeddings=262144 if big else 40960, rms_norm_eps=1e-6,
            tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10] if big else [4, 2, 2], "mrope_interleaved": True},
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
    remove_checkpoint_files(out_dir)
    model.save_pretrained(str(out_dir))
    word_tokenizer(config.vocab_size, out_dir)
    del model
    return out_dir


def remove_checkpoint_files(out_dir: Path) -> None:
    """Drops an earlier build's weights, index and marker from out_dir: save_pretrained writes one file where the
    streamed build wrote shards, and a stale index would send the loader to shards that are gone."""
    if not out_dir.is_dir():
        return
    for path in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json", out_dir / STREAMED_MARKER]:
        path.unlink(missing_ok=True)


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
    _fill_successor(model.get_input_embeddings().weight, model.get_output_embeddings().weight, seed)


def _fill_successor(emb: torch.Tensor, head: torch.Tensor, seed: int) -> None:
    """Fills emb with N(0, EMBED_SCALE) and head with a row permutation of emb / EMBED_SCALE (_successor_head)."""
    with torch.no_grad():
        gen = torch.Generator(device=emb.device).manual_seed(seed)
        emb.normal_(0.0, EMBED_SCALE, generator=gen)
        perm = torch.randperm(emb.shape[0], generator=gen, device=emb.device)
        head.copy_(emb[perm] / EMBED_SCALE)


STREAM_SHARD_BYTES = 4 * 1024**3
STREAMED_MARKER = "streamed.json"   # written last: a directory without it is an interrupted build


def checkpoint_bytes(shape: str, layers: int | None = None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the weights of a shape's checkpoint in dtype (counted on the meta device)."""
    model = _meta_model(target_config(shape, layers), dtype)
    return sum(t.numel() for t in model.state_dict().values()) * torch.empty((), dtype=dtype).element_size()


def _meta_model(config, dtype: torch.dtype):
    """The HF model of config on the meta device, its floating tensors in dtype (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def is_streamed_checkpoint(out_dir: str | Path, shape: str, layers: int | None, dtype: torch.dtype) -> bool:
    """True when out_dir holds a finished build_target_streaming checkpoint of this shape, layers and dtype."""
    marker = Path(out_dir) / STREAMED_MARKER
    if not marker.is_file():
        return False
    want = {"shape": shape, "layers": target_config(shape, layers).num_hidden_layers, "dtype": str(dtype)}
    return {k: json.loads(marker.read_text()).get(k) for k in want} == want


def _check_initialised(name: str, t: torch.Tensor) -> None:
    """RuntimeError unless t looks initialised: finite, and a matrix spread like N(0, 0.02) .. N(0, 10) (an init
    skipped would leave torch.empty's leftovers, which a long build should not write to disk)."""
    if not bool(torch.isfinite(t).all()):
        raise RuntimeError(f"{name}: not finite after init")
    if t.dim() >= 2 and t.numel() > 1 and not 0.005 < float(t.float().std()) < 20:
        raise RuntimeError(f"{name}: std {float(t.float().std()):.3g} after init, not HF's N(0, 0.02) or N(0, 10)")


def build_target_streaming(shape: str, out_dir: str | Path, layers: int | None = None, device: str = "cuda",
                           dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                           shard_bytes: int = STREAM_SHARD_BYTES) -> Path:
    """Writes a random-weight checkpoint of `shape` like build_target (HF's init, the successor LM head, the
    word tokenizer), one safetensors shard at a time: only one shard's tensors (plus the embedding and LM head,
    the first shard) exist at once, on `device` and in host memory."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_checkpoint_files(out_dir)
    config = target_config(shape, layers)
    model = _meta_model(config, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    decoder = model.model
    # Units written whole, in order: the embedding with the LM head (the head is a permutation of it), each
    # decoder layer, the final norm. Grouped into shards of about shard_bytes, planned on the meta tensors so
    # the file names can carry the shard count.
    units: list[dict[str, torch.nn.Module]] = [{"model.embed_tokens": decoder.embed_tokens, "lm_head": model.lm_head}]
    units += [{f"model.layers.{i}": layer} for i, layer in enumerate(decoder.layers)]
    units += [{"model.norm": decoder.norm}]
    shards: list[list[dict[str, torch.nn.Module]]] = [[]]
    shard_size = 0
    for modules in units:
        nbytes = sum(t.numel() * size for m in modules.values() for t in m.state_dict().values())
        if shards[-1] and shard_size + nbytes > shard_bytes:
            shards.append([])
            shard_size = 0
        shards[-1].append(modules)
        shard_size += nbytes
    torch.manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for modules in shard:
            for module in modules.values():
                module.to_empty(device=device)
                with torch.no_grad():
                    for sub in module.modules():
                        model._init_weights(sub)   # HF's init: N(0, 0.02) projections, norms, GDN A_log / dt_bias
            if "lm_head" in modules:
                _fill_successor(decoder.embed_tokens.weight, model.lm_head.weight, seed)
            for prefix, module in modules.items():
                for key, t in module.state_dict().items():
                    _check_initialised(f"{prefix}.{key}", t)
                    tensors[f"{prefix}.{key}"] = t.detach().to("cpu").contiguous()
            for module in modules.values():
                module.to_empty(device="meta")   # frees the device copy before the next unit
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(str(out_dir))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out_dir))
    word_tokenizer(config.vocab_size, out_dir)
    (out_dir / STREAMED_MARKER).write_text(json.dumps({
        "shape": shape, "layers": config.num_hidden_layers, "dtype": str(dtype), "seed": seed, "bytes": total,
        "shards": len(shards)}))
    return out_dir


def drafter_config(target: dict, num_layers: int = 5, block_size: int = 16):
    """The DFlashConfig of a random drafter for a target's config.json fields (z-lab layout: hidden = the
    target's)."""
    from drafter_svc.dflash_config import DFlashConfig, build_target_layer_ids

    t = target
    n_target = int(t["num_hidden_layers"])
    heads = int(t["num_attention_heads"])
    hidden = int(t["hidden_size"])
    rope = t.get("rope_parameters") or {}
    return DFlashConfig.from_dict({
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


def drafter_bytes(target: dict, num_layers: int = 5, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the weights build_drafter writes for a target's config.json fields (counted on the meta device)."""
    from drafter_svc.dflash_model import DFlashDraftModel

    with torch.device("meta"):
        model = DFlashDraftModel(drafter_config(target, num_layers))
    return sum(t.numel() for t in model.state_dict().values()) * torch.empty((), dtype=dtype).element_size()


def build_drafter(target_dir: str | Path, out_dir: str | Path, num_layers: int = 5, block_size: int = 16,
                  device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 1) -> Path:
    """Writes a random DFlash drafter for the target at target_dir (z-lab layout: hidden = the target's)."""
    from drafter_svc.dflash_model import DFlashDraftModel

    out_dir = Path(out_dir)
    cfg = drafter_config(json.loads((Path(target_dir) / "config.json").read_text()), num_layers, block_size)
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
