"""Clients no one here wrote, against the retrieval door: huggingface_hub's InferenceClient
(feature extraction and text classification on TEI's URLs), LlamaIndex's TEI embeddings
and Cohere's client's rerank, over MiniLM beside a tiny reranker from one models file."""

from __future__ import annotations

from pathlib import Path

import cohere
import httpx
import pytest
from huggingface_hub import AsyncInferenceClient
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.server import create_app

from . import tiny_cross_encoder
from .conftest import BatchserveTestServer

MODELS = """
[[model]]
name = "minilm"
version = "1"
fn_per_device = "batchserve.models.minilm:load"
devices = "cpu"
cost = "length"

[[model]]
name = "rerank"
version = "1"
fn_per_device = "batchserve.models.cross_encoder:load"
model_path = "{folder}"
devices = "cpu"
cost = "length"
"""


@pytest.fixture
async def url(aiohttp_client, tmp_path: Path) -> str:
    folder = tiny_cross_encoder.build(tmp_path / "reranker")
    models = tmp_path / "models.toml"
    models.write_text(MODELS.format(folder=folder))
    client = await aiohttp_client(
        BatchserveTestServer(create_app(Engine(Config(models=str(models)))))
    )
    return str(client.server.make_url("")).rstrip("/")


async def test_real_clients_embed_classify_and_rerank(url: str):
    hub = AsyncInferenceClient()
    vectors = await hub.feature_extraction(["a cat", "a kitten"], model=f"{url}/embed")
    assert vectors.shape == (2, 384)
    # TEI answers one text with a flat list of labels, which this client reads as its first
    # (best) label: as against TEI itself.
    best_label = await hub.text_classification("a cat", model=f"{url}/predict")
    assert best_label.label == "LABEL_0"  # type: ignore[attr-defined]
    assert 0 < best_label.score < 1  # type: ignore[attr-defined]
    await hub.close()

    llama = TextEmbeddingsInference(model_name="minilm", base_url=url, embed_batch_size=2)
    many = await llama.aget_text_embedding_batch(["a cat", "a kitten", "a tax return"])
    assert [len(vector) for vector in many] == [384] * 3
    assert many[0] == pytest.approx([float(x) for x in vectors[0]], abs=1e-5)

    documents = ["taxes are due in april", "a cat is a small furry animal", "paris"]
    async with httpx.AsyncClient() as http:
        reranker = cohere.AsyncClient(api_key="unused", base_url=url, httpx_client=http)
        ranked = await reranker.rerank(
            model="rerank", query="what is a cat", documents=documents, top_n=2,
            return_documents=True,
        )  # fmt: skip
        # Cohere's v2 client posts to /v2/rerank: the same ranking, without the documents.
        v2 = cohere.AsyncClientV2(api_key="unused", base_url=url, httpx_client=http)
        ranked_v2 = await v2.rerank(model="rerank", query="what is a cat", documents=documents)
    assert [(r.index, r.relevance_score) for r in ranked_v2.results[:2]] == [
        (r.index, r.relevance_score) for r in ranked.results
    ]
    assert len(ranked_v2.results) == len(documents)
    assert len(ranked.results) == 2
    assert ranked.results[0].relevance_score >= ranked.results[1].relevance_score
    best = ranked.results[0]
    assert best.document is not None
    assert best.document.text == documents[best.index]
