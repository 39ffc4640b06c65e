"""transformers' own decoding as the speed baseline: greedy `generate()` (batch 1 and left-padded batches) and its
prompt-lookup assisted generation, on the same device, dtype and prompts as the services (used by bench.speed)."""
from __future__ import annotations

import time

class HFModel:
    """transformers' own model in this process, greedy generate() with left padding; EOS cuts each row."""

    def __init__(self, model_dir: str, device: str, dtype: str):
        import torch
        import transformers

        self.torch, self.device = torch, device
        config = transformers.AutoConfig.from_pretrained(model_dir)
        cls = getattr(transformers, config.architectures[0], None) or transformers.AutoModelForCausalLM
        t0 = time.perf_counter()
        self.model = cls.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        print(f"transformers model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        gc = self.model.generation_config
        eos = gc.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad = gc.pad_token_id if gc.pad_token_id is not None else (min(self.eos) if self.eos else 0)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def generate(self, batch_ids: list[list[int]], new_tokens: int, **kw) -> list[list[int]]:
        torch, pad = self.torch, self.pad
        width = max(len(x) for x in batch_ids)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch_ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids], device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                      pad_token_id=pad, **kw)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))
            rows.append(row[:cut])
        return rows


class HFSystem:
    """One transformers configuration (plain greedy, or prompt-lookup assisted); accumulates over chunks."""

    def __init__(self, hf: HFModel, name: str, batch: int, max_tokens: int, **kw):
        self.hf, self.name, self.batch, self.max_tokens, self.kw = hf, name, batch, max_tokens, kw
        self.outputs: dict[int, list[int]] = {}
        self.lat: list[float] = []
        self.error: str | None = None

    def warmup(self, chunk: list[tuple[int, list[int]]], tokens: int) -> None:
        self._generate(chunk, tokens)

    def _generate(self, chunk: list[tuple[int, list[int]]], tokens: int) -> list[list[int]] | None:
        if self.error:
            return None
        try:
            return self.hf.generate([ids for _, ids in chunk], tokens, **self.kw)
        except Exception as exc:  # noqa: BLE001 - e.g. assisted generation unsupported: report, keep the rest
            print(f"{self.name} failed: {exc!r}", flush=True)
            self.error = repr(exc)
            return None

    def run(self, chunk: list[tuple[int, list[int]]]) -> None:
        self.hf.sync()
        t = time.perf_counter()
        out = self._generate(chunk, self.max_tokens)
        self.hf.sync()
        if out is None:
            return
        self.lat.append(time.perf_counter() - t)
        for (i, _), o in zip(chunk, out):
            self.outputs[i] = o

    def summary(self) -> dict:
        if self.error:
            return {"system": self.name, "mode": None, "batch": self.batch, "error": self.error}
        if not self.lat:   # a report line, not a ZeroDivisionError that loses the whole run's report
            return {"system": self.name, "mode": None, "batch": self.batch, "error": "never run"}
        outputs = [self.outputs[i] for i in sorted(self.outputs)]
        tokens, wall = sum(len(o) for o in outputs), sum(self.lat)
        return {"system": self.name, "mode": None, "budget": None, "batch": self.batch, "requests": len(outputs),
                "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 3),
                "mean_latency_s": round(wall / len(self.lat), 3) if self.batch == 1 else None, "outputs": outputs}


# ---- the run ----------------------------------------------------------------------------------------------------
