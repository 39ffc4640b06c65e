"""SamplingParams: how the target picks each committed token."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Below this, logits / temperature overflow to inf and softmax yields NaN; vLLM treats such temperatures as greedy.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's ranges: presence and frequency penalties in [-2, 2], logit biases in [-100, 100], at most 300 of them.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ALLOWED_TOKEN_IDS = 16384   # a request's allowed_token_ids (a bound on what one request makes each step carry)
# A request's bad_words as token sequences (each word gives one or two: with and without a leading space, as vLLM
# tokenizes them) and each sequence's length: they bound the host work of matching every tree node's context.
MAX_BAD_WORD_SEQUENCES = 256
MAX_BAD_WORD_TOKENS = 32


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks each committed token: greedy at temperature 0, else a tempered sample.

    Before the choice the logits may be adjusted as in vLLM and transformers (logits_processing.py): logit_bias
    added, then the repetition penalty (over prompt and output tokens), then the frequency and presence penalties
    (over output tokens). min_p filters the tempered distribution after top-k and top-p, as transformers does."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias), ids distinct and ascending
    # The first min_tokens generated tokens are never one of min_tokens_blocked (the gateway fills it: EOS unless
    # ignored, and the request's stop ids), as vLLM's min_tokens holds back every stop token.
    min_tokens: int = 0
    min_tokens_blocked: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()   # non-empty: every other token's logit is -inf (vLLM's)
    # vLLM's bad_words as token sequences: a sequence's last token is -inf wherever the output so far ends with the
    # rest of it (a one-token sequence: everywhere)
    bad_words: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def from_wire(cls, temperature: float, top_p: float, top_k: int, seed: int | None, *, min_p: float = 0.0,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                  logit_bias: dict[int, float] | None = None, min_tokens: int = 0,
                  min_tokens_blocked: list[int] | tuple[int, ...] = (),
                  allowed_token_ids: list[int] | tuple[int, ...] = (),
                  bad_words: list[list[int]] | tuple[tuple[int, ...], ...] = ()) -> "SamplingParams":
        """Request fields -> validated params: 0 turns top_p and the repetition penalty off, NaN is refused, tiny
        temperatures are greedy."""
        temperature, top_p = float(temperature), float(top_p)
        if math.isnan(top_p):
            raise ValueError("top_p must be in (0, 1], got nan")
        if math.isfinite(temperature) and 0 < temperature < GREEDY_TEMPERATURE:
            temperature = 0.0
        repetition_penalty = float(repetition_penalty)
        bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        params = cls(temperature=temperature, top_p=1.0 if top_p == 0 else top_p, top_k=int(top_k),
                     seed=None if seed is None else int(seed), min_p=float(min_p),
                     presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                     repetition_penalty=1.0 if repetition_penalty == 0 else repetition_penalty, logit_bias=bias,
                     min_tokens=int(min_tokens),
                     min_tokens_blocked=tuple(sorted({int(t) for t in min_tokens_blocked})),
                     allowed_token_ids=tuple(sorted({int(t) for t in allowed_token_ids})),
                     bad_words=tuple(dict.fromkeys(tuple(int(t) for t in w) for w in bad_words)))
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """True when the logits are changed before the choice (a bias or a penalty): the choice then depends on the
        sequence's tokens, not on the logits alone."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1.0 or self.holds_back_stops or bool(self.allowed_token_ids) \
            or bool(self.bad_words)

    @property
    def holds_back_stops(self) -> bool:
        """True when min_tokens keeps some stop tokens out of the first tokens."""
        return self.min_tokens > 0 and bool(self.min_tokens_blocked)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with unadjusted logits: the choice is the raw argmax (the verify step's fast path)."""
        return self.greedy and not self.adjusts_logits

    def validate(self) -> None:
        """Raises ValueError with a user-facing message when a field is out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(self.logit_bias)}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.min_tokens_blocked) > MAX_LOGIT_BIAS_ENTRIES or any(t < 0 for t in self.min_tokens_blocked):
            raise ValueError(f"min_tokens_blocked must be at most {MAX_LOGIT_BIAS_ENTRIES} token ids >= 0")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS or any(t < 0 for t in self.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be at most {MAX_ALLOWED_TOKEN_IDS} token ids >= 0")
        if self.holds_back_stops and self.allowed_token_ids and \
                set(self.allowed_token_ids) <= set(self.min_tokens_blocked):
            # every token would be -inf for the first min_tokens choices: nothing could be generated
            raise ValueError("allowed_token_ids are all stop tokens, which min_tokens holds back")
        if len(self.bad_words) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(f"bad_words make at most {MAX_BAD_WORD_SEQUENCES} token sequences, "
                             f"got {len(self.bad_words)}")
        for word in self.bad_words:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS or any(t < 0 for t in word):
                raise ValueError(f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} token ids >= 0, got {len(word)}")
        if self.allowed_token_ids and set(self.allowed_token_ids) <= {w[0] for w in self.bad_words if len(w) == 1}:
            raise ValueError("allowed_token_ids are all bad words")
        ids = [t for t, _ in self.logit_bias]
        if ids != sorted(set(ids)):
            raise ValueError("logit_bias token ids must be distinct, in ascending order")
        for token, bias in self.logit_bias:
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not math.isfinite(bias) or abs(bias) > MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}], "
                                 f"got {bias} for token {token}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError when logit_bias, allowed_token_ids, min_tokens_blocked or bad_words names a token outside
        [0, vocab_size)."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab_size}), got {self.logit_bias[-1][0]}")
        if self.allowed_token_ids and self.allowed_token_ids[-1] >= vocab_size:
            raise ValueError(f"allowed_token_ids must lie in [0, {vocab_size}), got {self.allowed_token_ids[-1]}")
        if self.min_tokens_blocked and max(self.min_tokens_blocked) >= vocab_size:
            raise ValueError(f"min_tokens_blocked ids must lie in [0, {vocab_size}), got {max(self.min_tokens_blocked)}")
        if self.bad_words and max(max(w) for w in self.bad_words) >= vocab_size:
            raise ValueError(f"bad_words token ids must lie in [0, {vocab_size})")


def default_budget(device: str) -> int:
    """The DDTree node budget that wins on this device when the user gives none.

    On CPU a verify forward costs roughly in proportion to the tree's nodes, so a small tree wins: SmolLM2-135M on 2
    Xeon cores, batch 1, ran 15.13 tok/s at budget 16, 13.00 at 64 and 13.17 for ar (bench/results/
    speed-cpu-intel-xeon-2c.md). On a GPU a 65-node verify is one kernel launch like a 17-node one, so the larger tree's
    higher acceptance is what counts: tau 4.55 at 64 vs 3.97 at 16 (bench/results/acceptance.md). The GPU choice rests
    on that acceptance figure and the H200 validation run, not on a measured GPU speed table.
    """
    return 16 if _on_cpu(device) else 64


def _on_cpu(device: str) -> bool:
    """True for "cpu" (a device string like "cuda:1" or "cpu")."""
    return str(device).split(":")[0] == "cpu"


# On a GPU target, from 4 sequences in a step on, DDTree budgets are at most 16. Measured through the services on an
# H100 at the Qwen3-8B shape, calibrated acceptance (bench/results/h100-engine-2026-12-05-2135/): batch 1 budget 64
# 998 tok/s against budget 16's 848; batch 8 budget 16 3780 against 64's 3376; batch 32 budget 16 5935 against 64's
# 3810 (the hybrid layout on the H200 at batch 4: budget 32 2250 against 64's 1944). A verify of many rows turns
# compute-bound, so a wide batch gains more from cheap trees than from deep acceptance.
GPU_BATCH_BUDGETS: tuple[tuple[int, int], ...] = ((4, 16),)


def default_batch_budgets(device: str) -> tuple[tuple[int, int], ...]:
    """The (from batch size, max budget) ceilings for this device when the user sets none: GPU_BATCH_BUDGETS on a
    GPU; none on CPU, whose default budget (16) is small already."""
    return () if _on_cpu(device) else GPU_BATCH_BUDGETS
