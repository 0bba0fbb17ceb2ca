"""The step watchdog judges the device by its thread, not by when the loop looked (issue #39,
item 2: a loop stalled tokenizing a huge prompt got four healthy streams failed as "hung"),
and a slow step that still advances is not hung (issue #44, item 4: a busy CPU's slow step
failed every stream of the only device, with no `[DONE]` and no word of the flag)."""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.errors import BackendError
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

from .conftest import HANG_GUARD_S
from .test_generation import (
    HANG_AT_3,
    OneHang,
    RecordingGenerator,
    generate,
    recorders,
    watched_engine,
)

__all__ = ["recorders"]  # the fixture, shared with test_generation.py


class AdvancingGenerator(RecordingGenerator):
    """A recording generator that counts its progress, as the real one counts layers: the
    test bumps it while a step waits at the gate."""

    progress = 0


def hung_steps(engine) -> int:  # type: ignore[no-untyped-def]
    (row,) = engine.metrics.snapshot()["generation"]
    return int(row["hung_steps"])


async def test_a_loop_stall_past_the_budget_is_not_a_hung_device(recorders):
    engine, clock = watched_engine(recorders, OneHang(), "sim:1")
    async with engine:
        (recorder,) = recorders
        recorder.gate.clear()
        streamed = asyncio.ensure_future(generate(engine, "abc"))
        assert await asyncio.to_thread(recorder.entered.wait, HANG_GUARD_S)
        # The loop stalls from here (nothing below awaits) while the step returns in time:
        recorder.gate.set()
        (model,) = list(engine._generators)
        returned = threading.Event()  # queued behind the step: set once it has returned
        model.loops[0]._device.thread.submit(lambda _: returned.set(), None)
        assert returned.wait(HANG_GUARD_S)
        clock.advance(3.0)  # the watchdog looks only now, long past the 1 s budget
        output, _ = await streamed
        assert output == "cba"
        assert hung_steps(engine) == 0


def advancing(made: list[RecordingGenerator], hang: OneHang):  # type: ignore[no-untyped-def]
    def load(device: str) -> RecordingGenerator:
        made.append(AdvancingGenerator(device, hang=hang))
        return made[-1]

    return load


async def test_a_slow_step_that_advances_is_not_hung_until_it_stops(recorders):
    clock = FakeClock()
    spec = ModelSpec(
        name="writer", version="1", generator=advancing(recorders, OneHang()), devices="sim:1"
    )
    engine = Engine(Config(batch_timeout_ms=1000), models=[spec], clock=clock)
    async with engine:
        (recorder,) = recorders
        assert isinstance(recorder, AdvancingGenerator)
        recorder.gate.clear()
        streamed = asyncio.ensure_future(generate(engine, "abc"))
        assert await asyncio.to_thread(recorder.entered.wait, HANG_GUARD_S)
        for _ in range(3):  # three budgets, each with progress: a slow step, not a hang
            recorder.progress += 1
            clock.advance(1.0)
        assert hung_steps(engine) == 0
        assert not streamed.done()
        clock.advance(1.0)  # a whole budget without progress: hung, and the only device
        with pytest.raises(BackendError, match=r"without progress.*raise --batch-timeout-ms"):
            await streamed
        assert hung_steps(engine) == 1
        recorder.gate.set()


@pytest.mark.parametrize("path", ["/v1/completions", "/api/generate"])
async def test_a_stream_failed_by_a_hang_ends_with_an_error_then_done(
    recorders, aiohttp_client, path
):
    hang = OneHang()
    engine, clock = watched_engine(recorders, hang, "sim:1")
    client = await aiohttp_client(create_app(engine))
    body = {"model": "writer", "prompt": f"ab{HANG_AT_3}", "stream": True, "max_tokens": 20}
    answer = asyncio.ensure_future(client.post(path, json=body))
    assert await asyncio.to_thread(hang.entered.wait, HANG_GUARD_S)
    clock.advance(1.5)  # three pieces out, then the only device hangs
    response = await answer
    events = (await response.text()).strip().split("\n\n")
    assert response.status == 200
    assert events[-1] == "data: [DONE]", events
    error = orjson.loads(events[-2].split("data: ", 1)[1])["error"]
    assert error["code"] == "BACKEND_ERROR"
    assert "--batch-timeout-ms" in error["message"]


def test_the_real_generator_counts_its_layers_as_progress():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from batchserve.models.causal_lm import CausalLM
    from batchserve.models.generators import Seq

    from . import tiny_llama

    tok = tiny_llama.tokenizer()
    lm = CausalLM(tiny_llama.model(len(tok), tok.eos_token_id), tok, "cpu", kv_cache_bytes=2**20)
    lm.step([Seq("a", "the cat"), Seq("b", "a bird")])
    assert lm.progress == lm.model.config.num_hidden_layers  # one step: each layer once
