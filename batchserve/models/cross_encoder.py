"""A cross-encoder (reranker) or text classifier: any local transformers
sequence-classification model in a folder (BERT, XLM-RoBERTa, ...: a `config.json`, its
weights and a `tokenizer.json`).

    [[model]]
    name = "rerank"
    version = "1"
    fn_per_device = "batchserve.models.cross_encoder:load"
    model_path = "/models/ms-marco-MiniLM-L-6-v2"
    cost = "length"

Each input is one text, or a (query, passage) pair written as a JSON array of two strings
(`retrieval.pair_text`); the output is the model's logits for it, one float a label. A pair
is one batch item costed by its tokens, so the length-aware batching and the fairness
between tenants apply to pairs as to any input. The doors turn logits into scores (sigmoid
for one label, softmax for several). Inputs are cut at the model's length; the doors refuse
a longer one unless the client asked for truncation.
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
from .retrieval import split_pair
from .text_tokens import DIRECTIONS, TextTokens


class CrossEncoder:
    """The loaded model on one device; calling it scores a batch."""

    def __init__(self, path: str, device: str) -> None:
        torch, transformers, tokenizers = _imports()
        self._torch = torch
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise StartupError(f"cross-encoder {path}: no tokenizer.json in the folder")
        model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder))
        self.model = model.to(device).eval()
        pack_linears(torch, self.model, Products(torch, device))
        config = self.model.config
        self.max_input_tokens = _max_tokens(folder, config)
        self.tokenizer = TextTokens(
            tokenizers,
            str(folder / "tokenizer.json"),
            self.max_input_tokens,
            pad_id=int(config.pad_token_id or 0),
        )
        self.labels = [str(config.id2label[i]) for i in range(int(config.num_labels))]
        self._type_ids = getattr(config, "type_vocab_size", 0) > 1
        self.device = device

    def __call__(self, inputs: list[str], truncation_direction: str = "right") -> list[list[float]]:
        if truncation_direction not in DIRECTIONS:
            raise ValueError(f"truncation_direction must be one of {', '.join(DIRECTIONS)}")
        torch = self._torch
        items = [split_pair(text) for text in inputs]
        encodings = self.tokenizer.encode_batch(items, truncation_direction)
        columns = {"input_ids": "ids", "attention_mask": "attention_mask"}
        if self._type_ids:
            columns["token_type_ids"] = "type_ids"
        tensors = {
            name: torch.tensor([getattr(e, field) for e in encodings], device=self.device)
            for name, field in columns.items()
        }
        with torch.inference_mode():
            logits = self.model(**tensors).logits.float()
        result: list[list[float]] = logits.cpu().tolist()
        return result

    def count_tokens(self, text: str) -> int:
        return self.tokenizer.count_cut(split_pair(text))


def load(device: str, model_path: str | None = None) -> CrossEncoder:
    """The per-device factory; `model_path` is the models file's. On CPU, torch keeps one
    core free for the event loop."""
    if model_path is None:
        raise StartupError(
            "batchserve.models.cross_encoder:load needs model_path (the model's folder)"
        )
    if device == "cpu":
        mkl_paths.report()
        torch = _imports()[0]
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    return CrossEncoder(model_path, device)


def _max_tokens(folder: Path, config: Any) -> int:
    """The model's positions, or less where its tokenizer says so (and says a real number:
    some files say 10^30 for "no limit")."""
    longest = int(getattr(config, "max_position_embeddings", 512))
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        longest -= 2  # their positions start after the padding index
    try:
        said = json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"]
    except (OSError, KeyError, ValueError):
        return longest
    return min(longest, int(said)) if isinstance(said, int | float) and said > 0 else longest


def _imports() -> tuple[Any, Any, Any]:
    try:
        return tuple(  # type: ignore[return-value]
            importlib.import_module(name) for name in ("torch", "transformers", "tokenizers")
        )
    except ImportError as exc:
        raise StartupError(
            f"batchserve.models.cross_encoder needs {exc.name}: pip install 'batchserve[minilm]'"
        ) from None
