"""The cross-encoder backend on a tiny BERT built from a seed: its scores are transformers'
own on the same pairs, batched or alone, and its tokens are counted as a batch runs them."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchserve.errors import StartupError
from batchserve.models.cross_encoder import load
from batchserve.models.retrieval import pair_text, split_pair

from . import tiny_cross_encoder

PAIRS = [
    ("what is a cat", "a cat is a small furry animal"),
    ("what is a cat", "taxes are due in april"),
    ("capital of france", "paris is the capital and largest city of france, on the seine"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_cross_encoder.build(tmp_path_factory.mktemp("reranker"))


def test_scores_agree_with_transformers_called_directly(folder):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = load("cpu", model_path=str(folder))
    ours = model([pair_text(q, p) for q, p in PAIRS])
    reference_model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(
        [q for q, _ in PAIRS], [p for _, p in PAIRS], padding=True, truncation=True,
        return_tensors="pt",
    )  # fmt: skip
    with torch.inference_mode():
        reference = reference_model(**batch).logits.tolist()
    assert [len(row) for row in ours] == [1] * len(PAIRS)
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine[0] == pytest.approx(theirs[0], abs=1e-5)
    # Padding to a batch's longest pair changes no pair's score.
    alone = model([pair_text(*PAIRS[0])])[0][0]
    assert alone == pytest.approx(ours[0][0], abs=1e-5)
    assert (model.labels, model.max_input_tokens) == (["LABEL_0"], tiny_cross_encoder.MAX_POSITIONS)
    q, p = PAIRS[0]
    assert model.count_tokens(pair_text(q, p)) == len(tokenizer(q, p)["input_ids"])


def test_a_long_pair_is_cut_at_the_models_length_and_counted_so(folder):
    model = load("cpu", model_path=str(folder))
    long = pair_text("query", "word " * 200)
    assert model.tokenizer.count(split_pair(long)) > tiny_cross_encoder.MAX_POSITIONS
    assert model.count_tokens(long) == tiny_cross_encoder.MAX_POSITIONS
    assert len(model([long], truncation_direction="left")[0]) == 1


def test_a_pair_is_a_json_array_of_two_strings_and_nothing_else():
    assert split_pair(pair_text("a", 'b "c"')) == ("a", 'b "c"')
    assert split_pair('["only one"]') == '["only one"]'
    assert split_pair("[not json") == "[not json"
    assert split_pair("plain") == "plain"


def test_without_a_folder_it_says_what_it_needs(tmp_path):
    with pytest.raises(StartupError, match="needs model_path"):
        load("cpu")
    with pytest.raises(StartupError, match=r"no tokenizer\.json"):
        load("cpu", model_path=str(tmp_path))
