"""OpenAI's request vocabulary on /v1/completions and /v1/chat/completions: what changes
nothing is taken, the sampling fields reach the generator, what would change the answer is
refused by name; and `GET /v1/models/{id}` (issue #32, item 18; issue #31, item 6)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.server import create_app

CHAT = [{"role": "user", "content": "abc"}]
CHAT_PROMPT = "<|user|>\nabc\n<|assistant|>\n"


async def sim_client(aiohttp_client: Any, **settings: object) -> TestClient:  # type: ignore[type-arg]
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0), **settings))  # type: ignore[arg-type]
    return await aiohttp_client(create_app(engine))  # type: ignore[no-any-return]


def openai_for(client: TestClient) -> openai.AsyncOpenAI:  # type: ignore[type-arg]
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


async def test_the_openai_client_sends_neutral_and_vendor_fields_and_they_are_honoured(
    aiohttp_client,
):
    client = await sim_client(aiohttp_client)
    async with openai_for(client) as ai:
        for n, best_of in [(None, None), (1, 1)]:
            completion = await ai.completions.create(
                model="default", prompt="abcdef", max_tokens=3, n=n, best_of=best_of
            )
            assert completion.choices[0].text == "fed"

        # what a chat client or a benchmark tool sends, none of it changing the answer here;
        # AIPerf's ignore_eos and min_tokens go to the generator: the sim goes on past its end
        chat = await ai.chat.completions.create(
            model="default",
            messages=CHAT,  # type: ignore[arg-type]
            max_completion_tokens=40,
            n=None,
            temperature=0,
            top_p=1,
            seed=7,
            response_format={"type": "text"},
            tools=[],
            tool_choice="none",
            parallel_tool_calls=False,
            store=False,
            metadata={"run": "1"},
            service_tier="auto",
            user="someone",
            logprobs=False,
            top_logprobs=None,
            presence_penalty=0,
            frequency_penalty=0.0,
            logit_bias={},
            extra_body={"top_k": -1, "ignore_eos": True, "min_tokens": 40},
        )
        choice = chat.choices[0]
        assert choice.message.content == (CHAT_PROMPT[::-1] * 2)[:40]
        assert choice.finish_reason == "length"

        chunks = await ai.completions.create(
            model="default",
            prompt="xyz",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=None,
            echo=False,
            suffix=None,
            extra_body={"min_tokens": 5, "ignore_eos": None, "top_k": 3},
        )
        pieces = [chunk.choices[0].text async for chunk in chunks if chunk.choices]
        assert "".join(pieces) == "zyxzy"


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


REFUSED = [
    ({"n": 17}, "n"),
    ({"n": True}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": 1}, "echo"),
    ({"suffix": "end"}, "suffix"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"bogus": 1}, "bogus"),
]
CHAT_REFUSED = [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 0}, "n"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"store": "yes"}, "store"),
    ({"echo": False}, "echo"),  # a completions field, unknown to chat
    ({"top_k": "many"}, "top_k"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
]


async def test_what_would_change_the_answer_is_refused_naming_the_field(aiohttp_client):
    client = await sim_client(aiohttp_client)
    chat = "/v1/chat/completions"
    cases = [("/v1/completions", {"prompt": "abc"}, extra, name) for extra, name in REFUSED]
    cases += [(chat, {"messages": CHAT}, extra, name) for extra, name in CHAT_REFUSED]
    for path, body, extra, name in cases:
        response = await client.post(path, json={"model": "default", **body, **extra})
        answer = await response.json()
        assert response.status == 400, (path, extra, answer)
        assert name in answer["error"]["message"], (path, extra, answer)
        assert answer["error"]["code"] == "INVALID_INPUT"


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
