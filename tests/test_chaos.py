"""Invariants under thousands of concurrent requests while the simulated devices misbehave.

Whatever the faults: every request gets exactly one answer, every 200 carries its own input's
output, no device ever runs two calls at once, and nothing is left pending or queued.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp.test_utils import TestClient

from batchserve.engine.core import Engine
from batchserve.models.backends import (
    HANG_MARKER,
    POISON_MARKER,
    Chaos,
    Hangs,
    simulate,
    simulated_factory,
)

from .conftest import reach

ALLOWED_ERRORS = {500: "BACKEND_ERROR", 503: "NOT_READY", 504: "DEADLINE_EXCEEDED"}


async def run_load(client: TestClient, texts: list[str]) -> list[tuple[int, dict[str, object]]]:
    async def ask(text: str) -> tuple[int, dict[str, object]]:
        response = await client.post("/api/inference", json={"input": text})
        return response.status, await response.json()

    return list(await asyncio.gather(*(ask(text) for text in texts)))


def check_invariants(
    engine: Engine, texts: list[str], answers: list[tuple[int, dict[str, object]]]
) -> Counter[int]:
    assert len(answers) == len(texts)
    for text, (status, body) in zip(texts, answers, strict=True):
        if status == 200:
            assert body["output"] == simulate(text)
            assert POISON_MARKER not in text
        else:
            assert body["error"] == ALLOWED_ERRORS[status], body
            assert "two batch calls at once" not in str(body["message"])
    assert engine.stats().pending == 0
    stats = engine.stats()
    assert (stats.queued, stats.in_flight) == (0, 0)
    return Counter(status for status, _ in answers)


def texts_with_poison(count: int, every: int) -> list[str]:
    """Unique inputs; one in `every` carries the poison marker."""
    return [f"req-{n}" + (POISON_MARKER if n % every == 37 else "") for n in range(count)]


async def test_poison_and_a_hang_fail_only_the_poison_requests(start_server):
    """Every non-poison request succeeds, even those batched with poison or on a hung device.

    Three poison inputs arrive in one burst of 3,000: a backlog, during which the retry budget
    earns nothing, so its reserve must pay for all three isolations (about 14 calls each).
    """
    hangs = Hangs()  # the marked call stays wedged until released, however slow the loop
    factory = simulated_factory(0.002, 100, Chaos(hang_s=60), hangs=hangs)
    client, engine = await start_server(factory, devices=4, batch_timeout_ms=250, retry_reserve=100)
    texts = texts_with_poison(3000, every=1000)
    texts[1500] += HANG_MARKER  # wedges the first call that carries it, once
    try:
        answers = await run_load(client, texts)
    finally:
        hangs.release()
    statuses = check_invariants(engine, texts, answers)
    poison = [status for text, (status, _) in zip(texts, answers, strict=True)
              if POISON_MARKER in text]  # fmt: skip
    assert poison == [500] * 3
    assert statuses == Counter({200: 2997, 500: 3})
    # At least the marked call hangs: its requests were answered, so the watchdog handed its
    # batch back. A 2 ms call that ran past the 250 ms budget on a stalled machine would add
    # a hang, and its batch would simply run again elsewhere.
    assert engine.faults["batch_hung"] >= 1
    await reach(engine, lambda s: s.healthy_devices == 4)  # the hung one rejoins


async def release_after_a_hang(engine: Engine, hangs: Hangs) -> None:
    """Lets the wedged calls return once the watchdog has judged one of them hung: the
    hung batch's hand-back changes the batcher's state, so the count is read then."""
    try:
        await reach(engine, lambda _: engine.faults["batch_hung"] > 0)
    finally:
        hangs.release()


async def test_random_faults_never_lose_or_mix_up_a_request(start_server):
    # The drawn hangs hold their calls until one has been judged hung, however slow the loop.
    hangs = Hangs()
    chaos = Chaos(hang_rate=0.03, fail_rate=0.1, bad_output_rate=0.1, hang_s=60, seed=7)
    client, engine = await start_server(
        simulated_factory(0.002, 100, chaos, hangs=hangs), devices=4, batch_timeout_ms=100
    )
    texts = texts_with_poison(3000, every=100)
    async with asyncio.TaskGroup() as group:  # a failed load cancels the release: it releases
        group.create_task(release_after_a_hang(engine, hangs))
        answers = await run_load(client, texts)
    statuses = check_invariants(engine, texts, answers)
    assert statuses[200] > 0
    faults = engine.faults
    assert faults["batch_raised"] > 0
    assert faults["batch_malformed"] > 0
    assert faults["batch_hung"] > 0
    # Random faults also mark devices failing (their failed calls succeed elsewhere); they
    # restart with a back-off, so only some are sure to be back by now.
    await reach(engine, lambda s: s.healthy_devices >= 1)
    assert (await client.get("/readyz")).status == 200
