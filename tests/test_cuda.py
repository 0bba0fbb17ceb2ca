"""The pool on real CUDA devices; skipped where torch sees none (CI has no GPU)."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
import torch

from batchserve.models.device_names import parse_devices

from . import sample_models
from .conftest import real_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_cuda_spec_names_every_visible_device():
    assert parse_devices("cuda") == [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def test_sample_models_give_the_same_answers_on_cuda_as_on_cpu():
    inputs = ["abc", "xyz", "héllo wörld", ""]
    for model in (sample_models.torch_model, sample_models.torch_shift):
        assert model("cuda:0")(inputs) == model("cpu")(inputs)


async def test_real_process_on_cuda_answers_each_request_with_its_own_output():
    """`python -m batchserve --devices cuda` with a torch model, 2,000 requests at once."""
    inputs = [f"request-{index}-{index * 7919 % 104729}" for index in range(2000)]
    async with real_server(
        "--devices", "cuda", "--fn-per-device", "tests.sample_models:torch_shift"
    ) as (process, banner, url):
        assert "devices=cuda:0" in banner
        async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=500)) as session:

            async def ask(text: str) -> tuple[int, dict[str, object]]:
                async with session.post("/api/inference", json={"input": text}) as answer:
                    return answer.status, await answer.json()

            answers = await asyncio.gather(*(ask(text) for text in inputs))
        assert [status for status, _ in answers] == [200] * len(inputs)
        expected = ["".join(chr(ord(char) + 1) for char in text) for text in inputs]
        assert [body["output"] for _, body in answers] == expected
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0


async def test_a_hung_cuda_call_marks_the_gpu_unhealthy_until_a_probe_answers():
    """The watchdog on a real GPU: a kernel that outlasts the budget, then recovery."""
    async with real_server(
        "--devices", "cuda:0", "--fn-per-device", "tests.sample_models:cuda_spinner",
        "--batch-timeout-ms", "1000",
    ) as (process, _, url):  # fmt: skip
        async with aiohttp.ClientSession(url) as session:
            warm = await session.post("/api/inference", json={"input": "warm"})
            assert (await warm.json())["output"] == "xbsn"
            hung = await session.post("/api/inference", json={"input": "x!spin!"})
            assert hung.status == 503  # its only device hung: nobody left to run it
            assert (await hung.json())["error"] == "NOT_READY"
            ready = await session.get("/readyz")
            assert (await ready.json())["devices"]["cuda:0"] in {"hung", "recovering"}
            for _ in range(100_000):  # the spin ends, a probe answers, the GPU rejoins
                if (await session.get("/readyz")).status == 200:
                    break
            else:
                pytest.fail("the GPU never rejoined")
            again = await session.post("/api/inference", json={"input": "abc"})
            assert (await again.json())["output"] == "bcd"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0


async def test_tiny_gpt_generates_on_cuda_through_a_real_server():
    """Continuous batching with real KV caches on the GPU: each of 64 concurrent streams
    gets max_tokens printable tokens, the same as when it runs alone."""
    prompts = [f"cuda prompt {i} " * (1 + i % 3) for i in range(64)]
    async with (
        real_server(
            "--devices", "cuda:0", "--generator", "batchserve.models.tiny_gpt:load",
            "--max-tokens", "32",
        ) as (process, _banner, url),
        aiohttp.ClientSession(url) as session,
    ):  # fmt: skip

        async def made(prompt: str) -> str:
            async with session.post("/api/generate", json={"prompt": prompt}) as answer:
                assert answer.status == 200
                body = await answer.json()
                assert body["tokens"] == 32 or body["finish_reason"] == "stop"
                output: str = body["output"]
                return output

        alone = [await made(p) for p in prompts[:8]]
        together = await asyncio.gather(*(made(p) for p in prompts))
        assert together[:8] == alone
        assert all(text.isprintable() for text in together)
        process.send_signal(signal.SIGTERM)
        assert await process.wait() == 0
