"""A long list (an /embed or /rerank of thousands, a /v1/embeddings of 2048) is counted off
the event loop before it is admitted: the loop serves other requests meanwhile, the list is
then admitted whole and answered in order, and a drain waits for it."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import pytest

from batchserve.batching.request import Ask
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller
from batchserve.errors import InputTooLarge
from batchserve.models.specs import ModelSpec

from .conftest import HANG_GUARD_S
from .sample_models import TinyEmbedder

LIST = ["hold " + "word " * 300] + [f"passage {i} " * 20 for i in range(50)]
"""Far over what is counted on the loop; its first text holds the count until let go."""
ASKS = [Ask(text) for text in LIST]
LISTED = Caller(request_id="list")


class HeldCounter(TinyEmbedder):
    """Counts by words, on whatever thread asks; a text starting "hold" waits for `go`."""

    counting = threading.Event()
    go = threading.Event()
    counted_on: dict[str, threading.Thread]
    """The thread that counted each text, last."""

    def count_tokens(self, text: str) -> int:
        self.counted_on[text] = threading.current_thread()
        if text.startswith("hold"):
            self.counting.set()
            assert self.go.wait(HANG_GUARD_S), "the test never let the count go"
        return super().count_tokens(text)


def held_engine() -> tuple[Engine, type[HeldCounter]]:
    class Counter(HeldCounter):
        counting = threading.Event()
        go = threading.Event()
        counted_on: ClassVar[dict[str, threading.Thread]] = {}

    spec = ModelSpec(
        name="tiny", version="1", fn_per_device=lambda device: Counter(), devices="sim:1",
        cost="length",
    )  # fmt: skip
    return Engine(Config(), models=[spec]), Counter


async def test_a_long_list_is_counted_off_the_loop_while_another_request_is_served():
    engine, counter = held_engine()
    async with engine:
        listed = asyncio.ensure_future(engine.infer_all(ASKS, LISTED))
        assert await asyncio.to_thread(counter.counting.wait, HANG_GUARD_S)
        # The loop is free while the list is counted: a one-input request is answered...
        one = await engine.infer("one more", Caller(request_id="one"))
        assert one.output == TinyEmbedder()(["one more"])[0]
        # ...and nothing of the list is admitted yet: it will be, whole, once counted.
        assert engine.stats().pending == 0
        assert not listed.done()
        counter.go.set()
        results = await listed
    assert [result.output for result in results] == TinyEmbedder()(LIST)
    loop_thread = threading.current_thread()
    assert all(counter.counted_on[text] is not loop_thread for text in LIST)
    assert counter.counted_on["one more"] is loop_thread  # a short one needs no hop


async def test_a_check_that_refuses_a_long_list_admits_none_of_it():
    engine, counter = held_engine()
    counter.go.set()

    def check() -> None:
        raise InputTooLarge('"inputs"[7] is too long')

    async with engine:
        with pytest.raises(InputTooLarge, match=r"\[7\]"):
            await engine.infer_all(ASKS, LISTED, check)
        assert engine.stats().batches == 0
        assert engine.stats().pending == 0


async def test_a_drain_waits_for_a_list_being_counted_then_answers_it():
    engine, counter = held_engine()
    async with engine:
        listed = asyncio.ensure_future(engine.infer_all(ASKS, LISTED))
        assert await asyncio.to_thread(counter.counting.wait, HANG_GUARD_S)
        drained = asyncio.ensure_future(engine.drain(refuse_new=False))
        for _ in range(100):  # loop passes enough for a drain with nothing in flight
            await asyncio.sleep(0)
        assert not drained.done()
        counter.go.set()
        assert len(await listed) == len(LIST)
        await drained
