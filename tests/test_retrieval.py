"""The retrieval door: Text Embeddings Inference's routes and /v1/rerank over a real MiniLM
embedder beside a tiny BERT reranker and classifier (built from seeds), served from one
models file; bad bodies refused with TEI's shape and status before any device sees them.

One server (`served`) serves the module's tests of the routes, on the module's event loop
(`shared`): loading MiniLM and the two tiny models for each test would be most of their time."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.doors import retrieval_api
from batchserve.engine.core import Engine
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

from . import tiny_cross_encoder
from .conftest import HANG_GUARD_S, BatchserveTestServer, reach

QUERY = "what is a cat"
TEXTS = ["taxes are due in april", "a cat is a small furry animal", "paris is in france"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    reranker = tiny_cross_encoder.build(tmp_path_factory.mktemp("reranker"))
    classes = tiny_cross_encoder.build(
        tmp_path_factory.mktemp("classes"), labels=("neg", "neutral", "pos"), seed=1
    )
    return reranker, classes


def models_file(folder: Path, reranker: Path, classes: Path) -> Path:
    path = folder / "models.toml"
    path.write_text(
        f"""
[[model]]
name = "minilm"
version = "1"
fn_per_device = "batchserve.models.minilm:load"
devices = "cpu"
cost = "length"
dimensions = [128, 64]

[[model]]
name = "rerank"
version = "1"
fn_per_device = "batchserve.models.cross_encoder:load"
model_path = "{reranker}"
devices = "cpu"
cost = "length"

[[model]]
name = "classes"
version = "1"
fn_per_device = "batchserve.models.cross_encoder:load"
model_path = "{classes}"
devices = "cpu"
"""
    )
    return path


shared = pytest.mark.asyncio(loop_scope="module")
"""On the module's event loop, where `served` runs."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory, folders):
    """The models file's server, shared: a test may not change what it serves."""
    config = models_file(tmp_path_factory.mktemp("served"), *folders)
    engine = Engine(Config(models=str(config), retrieval_max_inputs=8))
    async with TestClient(BatchserveTestServer(create_app(engine))) as client:
        yield client, engine


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


@shared
async def test_embed_answers_vectors_in_order_cut_to_a_declared_size(served):
    client, _ = served
    one = await (await client.post("/embed", json={"inputs": "a cat"})).json()
    many = await (await client.post("/embed", json={"inputs": ["a cat", "a kitten"]})).json()
    assert len(one) == 1
    assert len(one[0]) == 384
    assert many[0] == pytest.approx(one[0], abs=1e-5)
    raw = await (await client.post("/embed", json={"inputs": "a cat", "normalize": False})).json()
    assert norm(raw[0]) != pytest.approx(1.0, abs=1e-3)
    assert [x / norm(raw[0]) for x in raw[0]] == pytest.approx(one[0], abs=1e-5)
    small = await client.post("/embed", json={"inputs": ["a cat"], "dimensions": 128})
    vector = (await small.json())[0]
    assert len(vector) == 128
    assert norm(vector) == pytest.approx(1.0, abs=1e-6)
    assert vector == pytest.approx([x / norm(one[0][:128]) for x in one[0][:128]], abs=1e-6)
    openai = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "a cat", "dimensions": 64}
    )
    assert len((await openai.json())["data"][0]["embedding"]) == 64
    refused = await client.post(
        "/v1/embeddings", json={"model": "minilm", "input": "a cat", "dimensions": 100}
    )
    assert refused.status == 400
    assert "dimensions" in (await refused.json())["error"]["message"]


@shared
@pytest.mark.parametrize("count", [6, 7, 8])
async def test_a_long_answer_is_written_in_slices_and_reads_as_one_list(served, monkeypatch, count):
    """Past `ANSWER_SLICE` items an answer goes out in slices (chunked), the loop free between
    them; the client reads the same list, in order: a multiple of the slice, one more, and a
    short last slice."""
    client, _ = served
    monkeypatch.setattr(retrieval_api, "ANSWER_SLICE", 3)
    texts = [f"text number {i} about cats" for i in range(count)]
    answer = await client.post("/embed", json={"inputs": texts})
    assert answer.status == 200
    assert answer.headers["Transfer-Encoding"] == "chunked"
    assert answer.headers["X-Request-Id"]
    vectors = await answer.json()
    assert len(vectors) == count
    monkeypatch.setattr(retrieval_api, "ANSWER_SLICE", 512)
    whole = await client.post("/embed", json={"inputs": texts})
    assert "Transfer-Encoding" not in whole.headers
    for sliced, one in zip(vectors, await whole.json(), strict=True):
        assert sliced == pytest.approx(one, abs=1e-6)


@shared
async def test_rerank_scores_each_text_against_the_query_best_first(served, folders):
    client, _ = served
    answer = await client.post("/rerank", json={"query": QUERY, "texts": TEXTS})
    ranks = await answer.json()
    assert sorted(rank["index"] for rank in ranks) == [0, 1, 2]
    assert [r["score"] for r in ranks] == sorted((r["score"] for r in ranks), reverse=True)
    raw = await (
        await client.post(
            "/rerank",
            json={"query": QUERY, "texts": TEXTS, "raw_scores": True, "return_text": True},
        )
    ).json()
    expected = _transformers_logits(folders[0], [(QUERY, text) for text in TEXTS])
    for rank in raw:
        assert rank["text"] == TEXTS[rank["index"]]
        assert rank["score"] == pytest.approx(expected[rank["index"]][0], abs=1e-5)
        sigmoid = 1 / (1 + math.exp(-rank["score"]))
        assert next(r["score"] for r in ranks if r["index"] == rank["index"]) == pytest.approx(
            sigmoid, abs=1e-6
        )
    cohere = await client.post(
        "/v1/rerank",
        json={"query": QUERY, "documents": [{"text": t} for t in TEXTS], "top_n": 2,
              "return_documents": True},
    )  # fmt: skip
    body = await cohere.json()
    assert [r["index"] for r in body["results"]] == [r["index"] for r in ranks][:2]
    assert body["results"][0]["document"] == {"text": TEXTS[ranks[0]["index"]]}


@shared
async def test_predict_tokenize_decode_and_info(served):
    client, _ = served
    predicted = await client.post("/predict", json={"inputs": "great", "model": "classes"})
    single = await predicted.json()
    assert sorted(p["label"] for p in single) == ["neg", "neutral", "pos"]
    assert sum(p["score"] for p in single) == pytest.approx(1.0)
    batch = await client.post(
        "/predict", json={"inputs": [["great"], ["a", "pair"]], "model": "classes"}
    )
    assert [len(row) for row in await batch.json()] == [3, 3]
    tokenized = await client.post("/tokenize", json={"inputs": "a cat", "model": "minilm"})
    tokens = await tokenized.json()
    assert [t["text"] for t in tokens[0]] == ["[CLS]", "a", "cat", "[SEP]"]
    assert tokens[0][1] == {"id": 1037, "text": "a", "special": False, "start": 0, "stop": 1}
    ids = [t["id"] for t in tokens[0]]
    decoded = await client.post("/decode", json={"ids": ids, "model": "minilm"})
    assert await decoded.json() == ["a cat"]
    info = await (await client.get("/info", params={"model": "rerank"})).json()
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"},
                                               "label2id": {"LABEL_0": 0}}}  # fmt: skip
    assert info["max_input_length"] == tiny_cross_encoder.MAX_POSITIONS
    assert (await (await client.get("/info", params={"model": "minilm"})).json())["model_type"] == {
        "embedding": {"pooling": "mean"}
    }


@shared
@pytest.mark.parametrize(
    ("path", "body", "status", "named"),
    [
        ("/rerank", {"query": "", "texts": ["a"]}, 400, "query"),
        ("/rerank", {"query": "q", "texts": []}, 400, "texts"),
        ("/rerank", {"query": "q", "texts": ["word " * 100]}, 413, "texts"),
        # Long enough to be checked off the loop (engine/counting.py): the same answer.
        ("/rerank", {"query": "q", "texts": ["word " * 30] * 7 + ["word " * 100]}, 413,
         '"texts"[7]'),
        ("/rerank", {"query": "q", "texts": ["a"], "truncation_direction": "up"}, 422,
         "truncation_direction"),
        ("/embed", {"inputs": "a", "dimensions": 100}, 400, "dimensions"),
        ("/embed", {"inputs": ["a"] * 9}, 413, "inputs"),
        ("/embed", {"inputs": [1, 2]}, 422, "inputs"),
        ("/embed", {"inputs": "a", "shout": True}, 422, "shout"),
        ("/predict", {"inputs": [], "model": "classes"}, 400, "inputs"),
        ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, 400, "top_n"),
    ],
)  # fmt: skip
async def test_bad_input_is_refused_naming_the_field_and_reaches_no_device(
    served, path, body, status, named
):
    client, engine = served
    await engine.started.wait()
    batches = engine.stats().batches
    answer = await client.post(path, json=body)
    error = await answer.json()
    assert answer.status == status, error
    message = error["error"] if path != "/v1/rerank" else error["message"]
    assert named in message
    if path != "/v1/rerank":
        assert set(error) == {"error", "error_type"}
    assert engine.stats().batches == batches


@shared
async def test_a_long_pair_is_cut_when_truncate_is_asked_for(served):
    client, _ = served
    for direction in ("right", "Left"):
        answer = await client.post(
            "/rerank",
            json={"query": "q", "texts": ["word " * 100], "truncate": True,
                  "truncation_direction": direction},
        )  # fmt: skip
        assert answer.status == 200


def _transformers_logits(folder: Path, pairs: list[tuple[str, str]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    batch = tokenizer(
        [q for q, _ in pairs], [p for _, p in pairs], padding=True, return_tensors="pt"
    )
    with torch.inference_mode():
        return model(**batch).logits.tolist()  # type: ignore[no-any-return]


KEYS = """
[keys."sk-alice"]
tenant = "alice"
tier = "paid"

[keys."sk-bob"]
tenant = "bob"
tier = "paid"

[tiers.paid]
rate = 1000
burst = 1000
"""


class GatedEmbedder:
    """An embedder whose calls wait for `gate`; it records each call's inputs, and exposes a
    word tokenizer, so that the retrieval door serves it."""

    embedding_dim = 1
    max_input_tokens = 64

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[list[str]] = []
        self.tokenizer = WordTokens()

    def __call__(self, inputs: list[str]) -> list[list[float]]:
        self.calls.append(list(inputs))
        self.entered.set()
        assert self.gate.wait(HANG_GUARD_S)
        return [[float(len(text))] for text in inputs]


class WordTokens:
    def count(self, item: object) -> int:
        return len(str(item).split()) + 2

    def tokens(self, text: str, add_special_tokens: bool) -> list[dict[str, object]]:
        return []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return ""


async def test_a_large_list_is_split_over_batches_and_another_tenant_takes_its_turn(
    aiohttp_client, tmp_path
):
    """Alice's 40 inputs wait as 40 batch items; Bob's one input, sent after all of them,
    runs in the next call, beside Alice's, not after her ten: the tenants take turns."""
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    embedder = GatedEmbedder()
    spec = ModelSpec(
        name="e", version="1", fn_per_device=lambda device: embedder, devices="sim:1",
        max_batch_size=4, max_linger_ms=0,
    )  # fmt: skip
    engine = Engine(Config(keys_file=str(keys)), models=[spec], clock=FakeClock())
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    alice, bob = ({"Authorization": f"Bearer sk-{name}"} for name in ("alice", "bob"))

    async def embed(texts: list[str], headers: dict[str, str]) -> list[list[float]]:
        answer = await client.post("/embed", json={"inputs": texts}, headers=headers)
        assert answer.status == 200, await answer.text()
        return await answer.json()  # type: ignore[no-any-return]

    held = asyncio.ensure_future(embed(["hold"], bob))
    assert await asyncio.to_thread(embedder.entered.wait, HANG_GUARD_S)
    big = [f"a{'x' * (n % 7)}" for n in range(40)]
    large = asyncio.ensure_future(embed(big, alice))
    await reach(engine, lambda stats: stats.queued == 40)
    small = asyncio.ensure_future(embed(["bob"], bob))
    await reach(engine, lambda stats: stats.queued == 41)
    embedder.gate.set()
    assert await small == [[3.0]]
    assert await large == [[float(len(text))] for text in big]  # in the order given
    await held
    assert "bob" in embedder.calls[1]
    assert sorted(len(call) for call in embedder.calls[1:]) == [1] + [4] * 10
