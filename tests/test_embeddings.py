"""POST /v1/embeddings, driven by the official openai client against live servers: a tiny
embedder for the API's shape and errors, and the real all-MiniLM-L6-v2 on CPU (and CUDA)."""

from __future__ import annotations

import math

import aiohttp
import openai
import pytest

from batchserve.models.minilm import load as load_minilm

from .conftest import real_server


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _cuda(), reason="no CUDA"))]
"""MiniLM's batch path on each device it can run on here (benchmarks/gpu_check.sh: a GPU's)."""


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_the_openai_client_gets_one_vector_per_input_in_order(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text(
        '[[model]]\nname = "tiny"\nversion = "1"\n'
        'fn_per_device = "tests.sample_models:tiny_embedder"\ndevices = "sim:2"\n'
        '[[model]]\nname = "words"\nversion = "1"\nfn = "tests.sample_models:shout"\n'
    )
    async with real_server("--models", str(models)) as server:
        client = client_for(server.url)
        texts = ["a banana", "cat", "", "aaa a"]
        answer = await client.embeddings.create(model="tiny", input=texts)  # base64 on the wire
        assert [d.index for d in answer.data] == [0, 1, 2, 3]
        assert [d.embedding for d in answer.data] == [
            [float(len(t)), float(t.count("a")), 0.5] for t in texts
        ]
        assert (answer.model, answer.usage.prompt_tokens, answer.usage.total_tokens) == (
            "tiny", 5, 5,
        )  # fmt: skip
        floats = await client.embeddings.create(model="tiny", input="one", encoding_format="float")
        assert floats.data[0].embedding == [3.0, 0.0, 0.5]
        with pytest.raises(openai.BadRequestError, match="does not return embedding vectors"):
            await client.embeddings.create(model="words", input="x")
        with pytest.raises(openai.NotFoundError, match="no model 'nope'"):
            await client.embeddings.create(model="nope", input="x")
        with pytest.raises(openai.BadRequestError, match="non-empty list of strings"):
            await client.embeddings.create(model="tiny", input=[])
        async with aiohttp.ClientSession() as session:
            raw = await session.post(f"{server.url}/v1/embeddings", data=b"{not json")
            body = await raw.json()
            assert (raw.status, body["error"]["code"]) == (400, "INVALID_INPUT")
        await client.close()


@pytest.mark.parametrize("device", DEVICES)
def test_minilm_matches_sentence_transformers_reference_shape_and_meaning(device):
    model = load_minilm(device)
    short, longer = model(["a cat", "a kitten sleeps on the warm windowsill in the sun"])
    assert len(short) == len(longer) == model.embedding_dim == 384
    assert math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-5)
    # Padding to the batch's longest must not change an input's vector.
    alone = model(["a cat"])[0]
    assert max(abs(a - b) for a, b in zip(alone, short, strict=True)) < 1e-5
    assert model.count_tokens("a cat") == 4  # [CLS] a cat [SEP]


@pytest.mark.parametrize("device", DEVICES)
async def test_minilm_serves_the_openai_client(device):
    async with real_server(
        "--fn-per-device", "batchserve.models.minilm:load", "--devices", device
    ) as server:
        client = client_for(server.url)
        answer = await client.embeddings.create(
            model="default", input=["a cat", "a kitten", "a tax return"]
        )
        cat, kitten, tax = (d.embedding for d in answer.data)

        def cosine(a: list[float], b: list[float]) -> float:
            return sum(x * y for x, y in zip(a, b, strict=True))

        assert cosine(cat, kitten) > cosine(cat, tax)
        assert answer.usage.prompt_tokens == 4 + 4 + 5
        await client.close()
