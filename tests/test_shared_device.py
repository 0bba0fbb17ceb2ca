"""One device, one owner (issue #40, item 1): a batch model and a generation model placed on
the same device run their calls one at a time through its one runner, and a hung step is
handled by the same health machine as a hung batch call: hung, recovering once it returns,
probed, back in service."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from batchserve.batching.request import Ask
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.errors import BackendError, NotReady
from batchserve.models.generators import Seq
from batchserve.models.specs import ModelSpec

from .conftest import HANG_GUARD_S, polled, reach, recovering, until
from .test_batch_idle import online_wait_s
from .test_generation import HANG_AT_3, OneHang, RecordingGenerator, generate


class Calls:
    """Every call made on the device, from whichever thread: who is inside, and any two
    that were inside at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside: list[str] = []
        self.log: list[tuple[str, str]] = []
        self.overlaps: list[tuple[str, ...]] = []
        self.gate = threading.Event()
        """The first batch call waits here: a call held on the device."""
        self.gate.set()

    def enter(self, what: str) -> None:
        with self._lock:
            self._inside.append(what)
            self.log.append(("enter", what))
            if len(self._inside) > 1:
                self.overlaps.append(tuple(self._inside))

    def leave(self, what: str) -> None:
        with self._lock:
            self._inside.remove(what)
            self.log.append(("exit", what))

    def batch_fn(self, inputs: list[str]) -> list[str]:
        self.enter("batch")
        try:
            assert self.gate.wait(HANG_GUARD_S), "the test never opened the gate"
            return [text[::-1] for text in inputs]
        finally:
            self.leave("batch")

    def generator(self, hang: OneHang) -> object:
        calls = self

        class Tracked(RecordingGenerator):
            def step(self, seqs: list[Seq]) -> list[str | None]:
                calls.enter("step")
                try:
                    return super().step(seqs)
                finally:
                    calls.leave("step")

            def release(self, seq_ids: list[str]) -> None:
                calls.enter("release")
                try:
                    super().release(seq_ids)
                finally:
                    calls.leave("release")

        return lambda device: Tracked(device, hang=hang)


@pytest.fixture
def hang() -> Iterator[OneHang]:
    hang = OneHang()
    yield hang
    hang.release.set()


def shared_engine(calls: Calls, hang: OneHang, linger_ms: int = 0) -> tuple[Engine, FakeClock]:
    """A batch model ("embed", whose batches linger `linger_ms`) and a generation model
    ("writer") on the one device sim:0; calls may take 1 s of the fake clock before the
    device counts as hung."""
    clock = FakeClock()
    models = [
        ModelSpec(
            name="embed", version="1", fn=calls.batch_fn, devices="sim:1", max_linger_ms=linger_ms
        ),
        ModelSpec(name="writer", version="1", generator=calls.generator(hang), devices="sim:1"),
    ]
    config = Config(
        batch_timeout_ms=1000,
        policy="fixed" if linger_ms else "adaptive",
        count_online_wait=bool(linger_ms),  # with no Batch API line, only where asked
    )
    return Engine(config, models=models, clock=clock), clock


async def test_a_batch_and_a_step_on_one_device_never_overlap_under_load(hang):
    calls = Calls()
    engine, _ = shared_engine(calls, hang)
    async with engine:
        (device,) = engine._pool.devices
        calls.gate.clear()
        held = asyncio.ensure_future(engine.infer(Ask("held", model="embed")))
        streamed = asyncio.ensure_future(generate(engine, "abc", model="writer"))
        # Polled: either the step waits its turn, or (two owners) it entered beside the batch.
        await until(lambda: bool(device.turns) or bool(calls.overlaps))
        overlapped = list(calls.overlaps)
        calls.gate.set()
        assert overlapped == []
        assert (await held).output == "dleh"
        assert (await streamed)[0] == "cba"
        batches = [engine.infer(Ask(f"in{n}", model="embed")) for n in range(40)]
        streams = [generate(engine, f"prompt {n}", model="writer") for n in range(6)]
        answers = await asyncio.gather(*batches, *streams)
    assert [a.output for a in answers[:40]] == [f"in{n}"[::-1] for n in range(40)]
    assert [a[0] for a in answers[40:]] == [f"prompt {n}"[::-1] for n in range(6)]
    assert calls.overlaps == []
    kinds = {what for _, what in calls.log}
    assert kinds == {"batch", "step", "release"}


async def test_a_hung_step_goes_through_the_device_health_machine(hang):
    calls = Calls()
    engine, clock = shared_engine(calls, hang)
    async with engine:
        assert (await engine.infer(Ask("warm", model="embed"))).output == "mraw"
        streamed = asyncio.ensure_future(generate(engine, f"abcdef{HANG_AT_3}", model="writer"))
        assert await asyncio.to_thread(hang.entered.wait, HANG_GUARD_S)
        clock.advance(1.5)  # past the step's budget: the device is hung, for both models
        with pytest.raises(BackendError, match=r"on sim:0 ran past its budget of 1000 ms"):
            await streamed
        assert engine.device_states()["sim:0"] == "hung"
        assert engine.device_states()["sim:0 (writer@1)"] == "hung"
        with pytest.raises(NotReady):  # the batch model has no device in service either
            await engine.infer(Ask("refused", model="embed"))
        later = asyncio.ensure_future(generate(engine, "later", model="writer"))
        hang.release.set()  # the step returns: its results are dropped, and probes begin
        await recovering(engine, "sim:0")
        assert engine.faults["late_result_discarded"] == 1
        assert not later.done()
        clock.advance(1.0)  # one probe budget: the probe runs, answers, and the device is back
        assert (await later)[0] == "retal"
        assert engine.device_states()["sim:0"] in {"idle", "busy"}  # in service (a release)
        assert engine.faults["device_recovered"] == 1
        assert (await engine.infer(Ask("again", model="embed"))).output == "niaga"
    assert calls.overlaps == []


async def test_a_step_holding_the_device_is_not_counted_as_online_waiting(hang):
    """A batch request lingers on the free device, then a step takes the device through its
    runner, not the batcher. From then no device is free: the request waits for the step,
    and the count of time a free device was held for online requests (the Batch API's idle
    share leaves it out) stops."""
    calls = Calls()
    engine, clock = shared_engine(calls, hang, linger_ms=50)
    async with engine:
        online = asyncio.ensure_future(engine.infer(Ask("online", model="embed")))
        await reach(engine, lambda s: s.queued == 1)
        streamed = asyncio.ensure_future(generate(engine, f"abcdef{HANG_AT_3}", model="writer"))
        assert await asyncio.to_thread(hang.entered.wait, HANG_GUARD_S)
        clock.advance(0.040)  # the step holds the device
        held_by_the_step = online_wait_s(engine)
        hang.release.set()
        assert (await streamed)[0] == f"abcdef{HANG_AT_3}"[::-1]
        await polled(engine, lambda: engine.device_states()["sim:0"] == "idle",
                     "sim:0 was free after the stream's release")  # fmt: skip
        clock.advance(0.010)  # the device free again, the linger ends
        assert (await online).output == "enilno"
        in_all = online_wait_s(engine)
    assert held_by_the_step == 0.0
    assert in_all == pytest.approx(0.010)


class Broken(RecordingGenerator):
    """A generator whose every step raises: the device, not an input, is to blame."""

    def step(self, seqs: list[Seq]) -> list[str | None]:
        raise RuntimeError("the device fell off the bus")


async def test_a_generation_device_whose_steps_keep_failing_is_probed_and_restarted():
    loaded: list[RecordingGenerator] = []

    def load(device: str) -> RecordingGenerator:  # broken at first; a restart loads it well
        loaded.append((Broken if not loaded else RecordingGenerator)(device))
        return loaded[-1]

    spec = ModelSpec(name="writer", version="1", generator=load, devices="sim:1")
    engine = Engine(Config(batch_timeout_ms=1000), models=[spec], clock=FakeClock())
    async with engine:
        for prompt in ["one", "two"]:  # two whole steps in a row fail there: suspect, probed
            with pytest.raises(BackendError, match="fell off the bus"):
                await generate(engine, prompt)
        # The probe and the reload run on the device's threads.
        await polled(engine, lambda: engine.faults["device_restarted"] > 0, "a restart")
        assert engine.faults["device_failing"] == 1  # its probe failed too
        assert len(loaded) == 2  # loaded again on a fresh thread, then probed
        assert (await generate(engine, "three"))[0] == "eerht"


def failing_on(dead: str) -> object:
    """A batch model's per-device factory that cannot load on `dead` (out of memory there)."""

    def load(device: str) -> object:
        if device == dead:
            raise RuntimeError("CUDA out of memory")
        return lambda inputs: [text[::-1] for text in inputs]

    return load


def dead_device_engine(writer_devices: str, load: object = RecordingGenerator) -> Engine:
    """ "embed" fails to load on sim:0 and loads on sim:1, so sim:0 is dead; "writer" is on
    `writer_devices`."""
    models = [
        ModelSpec(name="embed", version="1", fn_per_device=failing_on("sim:0"), devices="sim:2"),
        ModelSpec(name="writer", version="1", generator=load, devices=writer_devices),  # type: ignore[arg-type]
    ]
    return Engine(Config(batch_timeout_ms=1000), models=models, clock=FakeClock())


async def test_a_generation_model_whose_only_device_is_dead_refuses_at_once():
    """A device where a batch model failed to load is dead: a generation model placed there
    alone would queue its requests until their deadline; it answers 503 naming the device."""
    async with dead_device_engine("sim:1") as engine:
        assert engine.device_states()["sim:0 (writer@1)"] == "dead"
        with pytest.raises(NotReady, match=r"writer@1: sim:0 is dead") as refused:
            async with asyncio.timeout(HANG_GUARD_S):  # queued, it would wait forever
                await generate(engine, "abc", model="writer")
        assert refused.value.status == 503
        assert (await engine.infer(Ask("still", model="embed"))).output == "llits"


async def test_a_dead_device_gets_no_generator_and_no_step_loop():
    """With another device the model serves there; the dead one neither loads the
    generator nor runs a step loop that would wait forever for it to come back."""
    made: list[RecordingGenerator] = []

    def load(device: str) -> RecordingGenerator:
        made.append(RecordingGenerator(device))
        return made[-1]

    async with dead_device_engine("sim:2", load) as engine:
        (writer,) = engine._generators
        assert [recorder.device for recorder in made] == ["sim:1"]
        assert len(writer._tasks) == 1
        assert (await generate(engine, "abc", model="writer"))[0] == "cba"
