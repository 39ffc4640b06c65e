"""Loads a local HF checkpoint (Qwen3, Llama, Qwen3.5/3.6 hybrid incl. the multimodal wrapper) onto a device."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from target_svc.quantization import (BITS, QuantizedWeight, activation_bits, attach_split_counters,
                                     check_quantize_mode, int8_matmul_backend, quantize_weight, quantized_placeholder,
                                     quantizes_head, replace_linears)

# Text model types whose decoder layers our forward (target_svc/model.py) implements.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5_text")
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# Checkpoint prefixes of the Qwen3.5 multimodal wrapper: the language model is served, the rest is skipped.
_WRAPPER_TEXT_PREFIX = "model.language_model."
_WRAPPER_SKIPPED_PREFIXES = ("model.visual.", "mtp.")
_LAYERS_PREFIX = "model.layers."


@dataclass
class LoadedTarget:
    """The text decoder's modules on (device, dtype) plus the config facts the runner needs."""

    model_dir: Path
    tokenizer_path: Path | None
    model_type: str  # top-level config model_type ("qwen3", "llama", "qwen3_5", ...)
    text_config: PretrainedConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module   # nn.Linear, or a QuantizedLinear with quantize="int8-head"
    rotary_emb: nn.Module  # HF's rotary module for the text config, on CPU, used to build cos/sin tables
    layer_types: tuple[str, ...]  # FULL_ATTENTION | LINEAR_ATTENTION per layer
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype
    quantize: str = "none"  # "int8" / "int4": the decoder layers' linear projections are QuantizedLinear

    @property
    def full_attention_layers(self) -> list[int]:
        """Indices of softmax-attention layers (they own K/V cache)."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        """Indices of Gated DeltaNet layers (they own conv + recurrent state)."""
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {model_dir} (model.safetensors or its index)")


def _eos_ids(model_dir: Path, text_config: PretrainedConfig, top_config: PretrainedConfig) -> tuple[int, ...]:
    """Union of eos ids from generation_config.json and the configs, in first-seen order."""
    found: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)

    gen = model_dir / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(text_config, "eos_token_id", None))
    add(getattr(top_config, "eos_token_id", None))
    return tuple(found)


def _check_supported(text_config: PretrainedConfig) -> tuple[str, ...]:
    """Raises ValueError for configs our forward does not implement; returns the per-layer types."""
    model_type = text_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported target model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    n = text_config.num_hidden_layers
    layer_types = tuple(getattr(text_config, "layer_types", None) or [FULL_ATTENTION] * n)
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} (sliding windows are not implemented)")
    if getattr(text_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not implemented")
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        # Their frequencies depend on the running sequence length: a fixed cos/sin table would not match HF.
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported")
    return layer_types


def _quantize_on(device: torch.device, weight: torch.Tensor, bits: int, dtype: torch.dtype,
                 scratch) -> QuantizedWeight:
    """Quantizes weight on device. On CUDA the float weight and the quantizer's temporaries live in the scratch
    pool and only the results are copied out, so the kept tensors are allocated back to back: temporaries
    interleaved with them leave holes (the 27B int8 fit on the H200 ran out of memory with ~4.5 GiB reserved by
    torch but unallocated)."""
    if scratch is None:
        return quantize_weight(weight.to(device), bits, dtype)
    index = device.index if device.index is not None else torch.cuda.current_device()   # the pool wants an index
    with torch.cuda.use_mem_pool(scratch, device=index):
        q = quantize_weight(weight.to(device), bits, dtype)
    return QuantizedWeight(q.qweight.clone(), q.scales.clone(), q.bits)


def _layer_index(name: str) -> int | None:
    """The decoder layer a tensor name belongs to ("model.layers.3.mlp..." -> 3), None outside the layers."""
    if not name.startswith(_LAYERS_PREFIX):
        return None
    index, _, _ = name[len(_LAYERS_PREFIX):].partition(".")
    return int(index) if index.isdigit() else None


def _load_weights(model: nn.Module, files: list[Path], wrapper: bool, device: torch.device, dtype: torch.dtype,
                  quantized: frozenset[str] = frozenset(), bits: int = 8, num_layers: int | None = None) -> None:
    """Assigns checkpoint tensors (cast to dtype, on device) to a meta-initialised model; strict on missing keys.

    The weights of the Linear modules named in `quantized` are quantized to `bits` one tensor at a time as they
    arrive (stored as `qweight` + `scales`): the float weights of those layers never exist on the device together.
    num_layers: the checkpoint's layers from this index on are skipped (never read).
    """
    # remove_duplicate=False: a tied lm_head.weight is its own name even when it shares the embedding's tensor.
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {**params, **dict(model.named_buffers(remove_duplicate=False))}
    loaded: dict[str, torch.Tensor] = {}
    scratch = torch.cuda.MemPool() if device.type == "cuda" and quantized else None
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = key
                if wrapper:
                    if key.startswith(_WRAPPER_SKIPPED_PREFIXES):
                        continue
                    if key.startswith(_WRAPPER_TEXT_PREFIX):
                        name = "model." + key[len(_WRAPPER_TEXT_PREFIX) :]
                elif key.startswith("mtp."):
                    continue  # multi-token-prediction head shipped with Qwen3.5 checkpoints: unused
                layer = _layer_index(name)
                if num_layers is not None and layer is not None and layer >= num_layers:
                    continue
                module_name, _, leaf = name.rpartition(".")
                if leaf == "weight" and module_name in quantized:
                    q = _quantize_on(device, f.get_tensor(key), bits, dtype, scratch)
                    loaded[module_name + ".qweight"], loaded[module_name + ".scales"] = q.qweight, q.scales
                    continue
                if name not in expected:
                    raise ValueError(f"unexpected tensor {key!r} in {path.name}")
                t = f.get_tensor(key)
                loaded[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and "lm_head.weight" not in loaded:
        if "lm_head" in quantized:   # an int8 copy of the embedding (which stays in dtype for its row gathers)
            q = _quantize_on(device, loaded["model.embed_tokens.weight"], bits, dtype, scratch)
            loaded["lm_head.qweight"], loaded["lm_head.scales"] = q.qweight, q.scales
        else:
            loaded["lm_head.weight"] = loaded["model.embed_tokens.weight"]
    # Non-persistent buffers (rotary inv_freq) are not in checkpoints; we build our own rotary tables instead.
    missing = [k for k in params if k not in loaded]
    missing += [f"{m}.{leaf}" for m in sorted(quantized) for leaf in ("qweight", "scales") if f"{m}.{leaf}" not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(loaded, strict=False, assign=True)


def load_target(
    model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    quantize: str = "none", num_layers: int | None = None,
) -> LoadedTarget:
    """Loads the text decoder of a local checkpoint directly onto (device, dtype); never touches the network.

    quantize="int8" / "int4": the decoder layers' linear projections are quantized as they load
    (target_svc/quantization.py); "int8-head": the LM head too; "w8a8": int8 projections whose inputs are quantized
    per row as they run. num_layers: only the first num_layers decoder
    layers (a tool's cut of the model: kernel_warmup.py runs the real widths without the real depth).
    """
    check_quantize_mode(quantize)
    model_dir = Path(model_dir)
    device = torch.device(device)
    top_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    wrapper = hasattr(top_config, "text_config") and top_config.model_type == "qwen3_5"
    if hasattr(top_config, "text_config") and not wrapper:
        raise ValueError(f"unsupported multimodal checkpoint {top_config.model_type!r}")
    text_config = top_config.text_config if wrapper else top_config
    if num_layers is not None:
        if not 1 <= num_layers <= text_config.num_hidden_layers:
            raise ValueError(f"num_layers must be in 1..{text_config.num_hidden_layers}, got {num_layers}")
        if getattr(text_config, "layer_types", None):
            text_config.layer_types = list(text_config.layer_types)[:num_layers]
        text_config.num_hidden_layers = num_layers
    layer_types = _check_supported(text_config)

    # Built on the meta device (no memory, no random init), then the tensors are assigned: the vision tower of
    # a wrapper checkpoint is never materialised, and weights go straight to the device without a CPU copy of
    # the whole model.
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(text_config)
    quantized: frozenset[str] = frozenset()
    bits = BITS.get(quantize, 0)
    if bits:
        backend = int8_matmul_backend(device)
        names = replace_linears(hf_model.model.layers, "model.layers.", dtype, backend, bits, activation_bits(quantize))
        if quantizes_head(quantize):
            hf_model.lm_head = quantized_placeholder(hf_model.lm_head, dtype, backend, bits)
            names.add("lm_head")
        quantized = frozenset(names)
    _load_weights(hf_model, _checkpoint_files(model_dir), wrapper, device, dtype, quantized, bits, num_layers)
    hf_model.eval().requires_grad_(False)
    if bits:
        attach_split_counters(hf_model.model.layers)
        attach_split_counters(hf_model.lm_head)

    decoder = hf_model.model
    rotary_emb = type(decoder.rotary_emb)(config=text_config)
    for name, t in [*decoder.layers.named_parameters(), *decoder.layers.named_buffers()]:
        if t.is_meta:
            raise ValueError(f"decoder tensor {name} was not loaded")
    # The target serves token ids; only a gateway needs the tokenizer (fetched over TokenizerFiles).
    has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return LoadedTarget(
        model_dir=model_dir,
        tokenizer_path=model_dir if has_tokenizer else None,
        model_type=top_config.model_type,
        text_config=text_config,
        embed_tokens=decoder.embed_tokens,
        layers=decoder.layers,
        norm=decoder.norm,
        lm_head=hf_model.lm_head,
        rotary_emb=rotary_emb,
        layer_types=layer_types,
        num_layers=text_config.num_hidden_layers,
        hidden_size=text_config.hidden_size,
        vocab_size=text_config.vocab_size,
        num_heads=text_config.num_attention_heads,
        num_kv_heads=text_config.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=text_config.rms_norm_eps,
        rope_parameters=dict(getattr(text_config, "rope_parameters", None) or {}),
        max_position_embeddings=text_config.max_position_embeddings,
        eos_token_ids=_eos_ids(model_dir, text_config, top_config),
        device=device,
        dtype=dtype,
        quantize=quantize,
    )
