"""OpenAI's request vocabulary on /v1/completions and /v1/chat/completions: what changes
nothing is taken, the sampling fields reach the generator, what would change the answer is
refused by name; and `GET /v1/models/{id}` (issue #32, item 18; issue #31, item 6)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from batchserve.config import Config
from batchserve.engine import Engine
from batchserve.server import create_app

CHAT = [{"role": "user", "content": "abc"}]
CHAT_PROMPT = "<|user|>\nabc\n<|assistant|>\n"


async def sim_client(aiohttp_client: Any, **settings: object) -> TestClient:  # type: ignore[type-arg]
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0), **settings))  # type: ignore[arg-type]
    return await aiohttp_client(create_app(engine))  # type: ignore[no-any-return]


def openai_for(client: TestClient) -> openai.AsyncOpenAI:  # type: ignore[type-arg]
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


async def test_the_openai_client_retrieves_a_model_by_id(aiohttp_client):
    client = await sim_client(aiohttp_client)
    async with openai_for(client) as ai:
        model = await ai.models.retrieve("default")
        assert (model.id, model.object, model.owned_by) == ("default", "model", "batchserve")
        with pytest.raises(openai.NotFoundError, match="no model 'nope'"):
            await ai.models.retrieve("nope")
    response = await client.get("/v1/models/org/with-slash")
    assert response.status == 404
    body = await response.json()
    assert body["error"]["code"] == "MODEL_NOT_FOUND"
    assert response.headers["X-Request-Id"] == body["request_id"]


async def test_a_prompt_over_the_budget_is_told_so_in_plain_terms(aiohttp_client):
    client = await sim_client(aiohttp_client, sim_kv_budget=100)
    for extra in [{}, {"max_tokens": 4}]:
        response = await client.post(
            "/v1/completions", json={"model": "default", "prompt": "a" * 150, **extra}
        )
        message = (await response.json())["error"]["message"]
        assert response.status == 413
        assert "prompt is 150 tokens" in message, message
        assert "shorten the prompt" in message, message
    response = await client.post(
        "/v1/completions", json={"model": "default", "prompt": "a" * 90, "max_tokens": 20}
    )
    message = (await response.json())["error"]["message"]
    assert response.status == 413
    assert "ask for at most 10 new tokens" in message, message


async def test_an_embeddings_request_to_a_generation_server_names_what_it_runs(aiohttp_client):
    client = await sim_client(aiohttp_client)
    response = await client.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    message = (await response.json())["error"]["message"]
    assert response.status == 404
    assert "runs no batch model" in message, message
    assert "  " not in message
    response = await client.post("/v1/embeddings", json={"model": "default", "input": "a"})
    message = (await response.json())["error"]["message"]
    assert response.status == 400
    assert "generates text" in message, message
