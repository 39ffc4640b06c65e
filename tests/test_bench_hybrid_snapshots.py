"""bench.hybrid_prefix_snapshots' prompts (the bench itself runs the real services): one system prompt, a different
question per chat, each text the exact ids back through the shapes' word tokenizer."""
from __future__ import annotations

from bench.hybrid_prefix_snapshots import chats, words
from bench.shapes import word_tokenizer


def test_every_chat_shares_the_system_prompt_and_asks_its_own_question():
    conversations = chats(vocab=64, system_tokens=40, user_tokens=5, n=4)
    assert len({c[0] for c in conversations}) == 1 and len({c[1] for c in conversations}) == 4
    assert [role for role, _ in conversations[0]] == ["system", "user"]
    assert len(conversations[0][0][1].split()) == 40


def test_the_words_are_the_ids_through_the_word_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    word_tokenizer(64, tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = [5, 27, 63, 2]   # words of ids from 1 and 0 would meet the special t1 and t0 first
    assert tok(words(ids), add_special_tokens=False).input_ids == ids
