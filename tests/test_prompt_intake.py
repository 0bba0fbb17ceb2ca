"""A prompt is never tokenized on the event loop (issue #39, item 2: one 512 KiB prompt,
itself answered 413, stalled the loop long enough for four healthy streams to be failed), and
a prompt too long by its bytes alone is refused before any tokenizer runs."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from batchserve.errors import InputTooLarge

from . import tiny_llama

pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models.causal_lm import CausalLM

from .test_causal_lm import KV_BYTES, engine_for


class WatchedTokenizer:
    """The tiny Llama's real tokenizer, recording the thread of every `encode`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.encoded_on: list[threading.Thread] = []

    def encode(self, text: str) -> list[int]:
        self.encoded_on.append(threading.current_thread())
        ids: list[int] = self._inner.encode(text)
        return ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def lm_parts() -> tuple[Any, Any]:
    tok = tiny_llama.tokenizer()
    return tok, tiny_llama.model(len(tok), tok.eos_token_id)


def watched_engine(lm_parts: tuple[Any, Any]) -> tuple[Any, WatchedTokenizer]:
    tok, model = lm_parts
    watched = WatchedTokenizer(tok)
    engine = engine_for(lambda device: CausalLM(model, watched, device, kv_cache_bytes=KV_BYTES))
    return engine, watched


async def test_the_prompt_is_tokenized_off_the_event_loop(lm_parts):
    engine, watched = watched_engine(lm_parts)
    async with engine, engine.generate("the cat sat on the mat", max_tokens=3) as gen:
        await gen.result()
    loop_thread = threading.current_thread()
    assert watched.encoded_on  # counted at admission, then encoded again on the device
    assert loop_thread not in watched.encoded_on
    assert gen.prompt_tokens == len(lm_parts[0].encode("the cat sat on the mat"))


async def test_a_prompt_too_long_by_its_bytes_is_refused_without_tokenizing(lm_parts):
    engine, watched = watched_engine(lm_parts)
    async with engine:
        (model,) = list(engine._generators)
        longest = model.max_token_bytes
        assert longest == max(len(token) for token in lm_parts[0].get_vocab())
        prompt = "a" * (model.kv_budget * longest + 1)
        with pytest.raises(InputTooLarge, match=f"at least {model.kv_budget + 1} tokens"):
            async with engine.generate(prompt, max_tokens=1):
                pass
        assert watched.encoded_on == []
        # One that may fit by its bytes is tokenized, then judged by its tokens.
        with pytest.raises(InputTooLarge, match="the prompt is"):
            async with engine.generate("a" * (model.kv_budget + 5), max_tokens=1):
                pass
        assert len(watched.encoded_on) == 1
