"""DFlash drafter config (z-lab config.json <-> DFlashConfig), default feature layers and RoPE frequencies."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_NAME = "config.json"
SLIDING = "sliding_attention"
FULL = "full_attention"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default feature layers: evenly spaced from 1 to num_target_layers - 3 (middle layer for one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# --------------------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------------------


@dataclass
class DFlashConfig:
    """config.json of a DFlash drafter (published keys); `raw` keeps the file so unknown keys survive a save."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int | None
    target_layer_ids: list[int]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope type and its parameters (factor, original_max_position_embeddings, ...), without rope_theta
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    # explicit causality from the checkpoint (is_causal / dflash_config.causal); None = bidirectional (reference)
    causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for t in self.layer_types:
            if t not in (SLIDING, FULL):
                raise ValueError(f"unsupported draft layer type {t!r}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (DFlash drafters use silu)")
        if self.output_multiplier <= 0:
            raise ValueError(f"output_multiplier must be > 0, got {self.output_multiplier}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0, got {self.final_logit_softcapping}")

    @property
    def feature_dim(self) -> int:
        """Width of one context-feature row: len(target_layer_ids) * hidden_size."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of a layer (None = full attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def layer_is_causal(self, layer: int) -> bool:
        """Whether a layer is causal inside the block (reference: never, unless the config says so)."""
        return bool(self.causal)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        """Parses a config.json dict (block_size top level or in dflash_config; rope_theta or rope_parameters)."""
        raw = copy.deepcopy(d)
        dfc = dict(d.get("dflash_config") or {})
        n_layers = int(d["num_hidden_layers"])
        n_heads = int(d["num_attention_heads"])
        block_size = dfc.get("block_size", d.get("block_size"))
        if block_size is None:
            raise ValueError("DFlash config has no block_size (neither top level nor in dflash_config)")
        num_target_layers = d.get("num_target_layers")
        target_layer_ids = dfc.get("target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ValueError("DFlash config needs dflash_config.target_layer_ids or num_target_layers")
            target_layer_ids = build_target_layer_ids(int(num_target_layers), n_layers)
        mask_token_id = dfc.get("mask_token_id", d.get("mask_token_id"))
        rope_theta, rope_scaling = _parse_rope(d)
        layer_types = list(d.get("layer_types") or [])
        if not layer_types and dfc.get("use_swa"):
            # Newer engines' all-layers switch.
            layer_types = [SLIDING] * n_layers
        elif not layer_types and d.get("use_sliding_window") and d.get("sliding_window"):
            # transformers' Qwen3Config rule when layer_types is absent: sliding from max_window_layers on.
            first = int(d.get("max_window_layers", 28))
            layer_types = [SLIDING if i >= first else FULL for i in range(n_layers)]
        # Read the window straight from the file: transformers' Qwen3Config would drop it when
        # use_sliding_window is false, silently turning trained sliding layers into full attention.
        sliding_window = dfc.get("swa_window_size", d.get("sliding_window"))
        causal = d.get("is_causal", dfc.get("is_causal", dfc.get("causal")))
        softcap = dfc.get("final_logit_softcapping")
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // n_heads),
            vocab_size=int(d["vocab_size"]),
            block_size=int(block_size),
            mask_token_id=None if mask_token_id is None else int(mask_token_id),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            layer_types=layer_types,
            sliding_window=None if sliding_window is None else int(sliding_window),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            causal=None if causal is None else bool(causal),
            output_multiplier=float(dfc.get("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            input_embedding_scale=float(dfc.get("input_embedding_scale", 1.0)),
            raw=raw,
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json dict: the loaded file with our fields written back in its own layout."""
        d = copy.deepcopy(self.raw)
        raw_dfc = self.raw.get("dflash_config") or {}
        dfc = dict(d.get("dflash_config") or {})
        d.setdefault("architectures", ["DFlashDraftModel"])
        d.setdefault("model_type", "qwen3")
        d.update(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            hidden_act=self.hidden_act,
            layer_types=list(self.layer_types),
        )
        d.setdefault("attention_dropout", 0.0)
        d.setdefault("tie_word_embeddings", False)
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        # block_size stays where the file had it (Qwen3-8B-DFlash-b16: top level; newer: dflash_config).
        in_dfc, top = "block_size" in raw_dfc, "block_size" in self.raw
        if in_dfc:
            dfc["block_size"] = self.block_size
        if top or not in_dfc:
            d["block_size"] = self.block_size
        dfc["target_layer_ids"] = list(self.target_layer_ids)
        if self.mask_token_id is not None:
            dfc["mask_token_id"] = self.mask_token_id
        for key, value, default in (
            ("output_multiplier", self.output_multiplier, 1.0),
            ("final_logit_softcapping", self.final_logit_softcapping, None),
            ("input_embedding_scale", self.input_embedding_scale, 1.0),
        ):
            if value != default or key in raw_dfc:
                dfc[key] = value
        if "swa_window_size" in raw_dfc:
            dfc["swa_window_size"] = self.sliding_window
        d["sliding_window"] = self.sliding_window
        if "use_sliding_window" not in d:
            # The reference builds a transformers Qwen3Config, which keeps the window only with this flag on.
            d["use_sliding_window"] = SLIDING in self.layer_types
        # Causality goes back under the key the file used; a new override is written as dflash_config.causal.
        if "is_causal" in self.raw:
            d["is_causal"] = self.causal
        elif "is_causal" in raw_dfc:
            dfc["is_causal"] = self.causal
        elif "causal" in raw_dfc or self.causal is not None:
            dfc["causal"] = self.causal
        d["dflash_config"] = dfc
        _write_rope(d, self.rope_theta, self.rope_scaling)
        return d

    @classmethod
    def load(cls, model_dir: str | Path) -> "DFlashConfig":
        """Reads model_dir/config.json."""
        path = Path(model_dir) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no {CONFIG_NAME} in drafter directory {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    def save(self, model_dir: str | Path) -> None:
        """Writes model_dir/config.json."""
        Path(model_dir).mkdir(parents=True, exist_ok=True)
        (Path(model_dir) / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either transformers-4 keys (rope_theta/rope_scaling) or v5 rope_parameters."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-layer-type parameters (v5 style for mixed models); DFlash layers share one RoPE.
        uniq = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(uniq) != 1:
            raise NotImplementedError("per-layer-type RoPE parameters are not supported for DFlash drafters")
        params = next(iter(params.values()))
    scaling = dict(d.get("rope_scaling") or {})
    if isinstance(params, dict) and params:
        scaling = {**scaling, **params}
    theta = scaling.pop("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings are not supported for DFlash drafters")
    scaling.pop("partial_rotary_factor", None)
    if rope_type == "default" and not scaling:
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **scaling}


def _write_rope(d: dict[str, Any], theta: float, scaling: dict[str, Any] | None) -> None:
    """Writes RoPE keys in the layout the file used (rope_parameters for v5 files, else rope_theta/rope_scaling)."""
    if "rope_parameters" in d and isinstance(d["rope_parameters"], dict):
        d["rope_parameters"] = {"rope_theta": theta, **(scaling or {"rope_type": "default"})}
        if "rope_theta" in d:
            d["rope_theta"] = theta
        return
    d["rope_theta"] = theta
    d["rope_scaling"] = dict(scaling) if scaling else None


def rope_inv_freq(cfg: DFlashConfig) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [head_dim/2] and cos/sin scale, as transformers computes them."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(sc["factor"]), 1.0
    if kind == "llama3":
        factor, low, high = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        original = sc.get("original_max_position_embeddings") or cfg.max_position_embeddings
        factor = sc.get("factor") or cfg.max_position_embeddings / original
        factor = float(factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = sc.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = sc.get("mscale"), sc.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # avoids a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
        return inv, float(attention_factor)
    raise NotImplementedError(f"rope_type {kind!r} is not supported for DFlash drafters")
