"""The target's grammar compiler for structured outputs: xgrammar over the checkpoint's own tokenizer and the
model's vocabulary (its logits' width), stop tokens the model's EOS ids."""
from __future__ import annotations

import importlib.util
import logging
import threading
from collections import OrderedDict
from pathlib import Path

from ddtree_serve.decoding.guides import GuideSpec

log = logging.getLogger(__name__)

UNAVAILABLE = "structured outputs are not available on this target (xgrammar or the checkpoint's tokenizer is missing)"


class GrammarCompiler:
    """Compiles GuideSpecs for this target (thread-safe), keeping the last cache_size (a compiled grammar holds
    per-token masks: megabytes at a 152k vocabulary, so the cache is bounded)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: list[int], threads: int = 2,
                 cache_size: int = 64):
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, eos_token_ids
        self.threads = threads
        self._compiler = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GuideSpec, object] = OrderedDict()   # least recently used first
        self._cache_size = cache_size

    def available(self) -> bool:
        """True when guides can be compiled here: xgrammar imports and the checkpoint has a tokenizer."""
        if importlib.util.find_spec("xgrammar") is None:
            return False
        return any((Path(self.model_dir) / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.eos_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
                log.info("structured outputs: grammar compiler ready (vocabulary %d)", self.vocab_size)
            return self._compiler

    def compiled(self, spec: GuideSpec):
        """The grammar compiled already (by prepare or compile), or None."""
        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
            return found

    def compile(self, spec: GuideSpec):
        """The compiled grammar, from the cache when there (ValueError with the reason when the spec is not valid)."""
        found = self.compiled(spec)
        if found is not None:
            return found
        compiled = self._get().compile_grammar(spec.grammar())
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled
