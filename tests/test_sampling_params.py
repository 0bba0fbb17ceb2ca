"""Sampling params: one rule per key, checked at admission, so a wrong type or range is the
client's 400 and never a failed step of the generator (issue #32, item 12)."""

from __future__ import annotations

import math
import threading
from typing import Any

import pytest

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Prompt
from batchserve.errors import InvalidInput
from batchserve.models.generators import Seq, SimulatedGenerator, sim_token
from batchserve.models.specs import ModelSpec
from batchserve.rules.sampling_params import checked_params
from batchserve.server import create_app

BAD = [
    ("temperature", "hot"),
    ("temperature", 1e308),
    ("temperature", -0.5),
    ("temperature", True),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", 10**400),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", 10**7),
    ("top_k", False),
    ("seed", 2**200),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", "x"),
    ("seed", True),
    ("ignore_eos", 1),
    ("ignore_eos", "true"),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("min_tokens", [3]),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_known_key_of_the_wrong_type_or_range_is_refused_by_name(name: str, value: object):
    with pytest.raises(InvalidInput, match=f'"{name}" must be') as refused:
        checked_params({name: value}, max_tokens=16)
    assert len(str(refused.value)) < 200  # a huge value is not echoed back whole


def test_good_params_pass_nulls_drop_and_unknown_keys_pass_through():
    assert checked_params(None, 16) == checked_params({}, 16) == {}
    good = {
        "temperature": 0,
        "top_p": 1,
        "top_k": -1,
        "seed": -(2**63),
        "ignore_eos": False,
        "min_tokens": 16,
        "mirostat": {"tau": 5},
        "typical_p": None,
    }
    checked = checked_params(good, 16)
    assert checked == {name: value for name, value in good.items() if name != "typical_p"}
    assert type(checked["temperature"]) is float
    assert type(checked["top_p"]) is float
    assert checked_params({"temperature": 100, "top_k": 1_000_000, "seed": 2**63 - 1}, 1) == {
        "temperature": 100.0,
        "top_k": 1_000_000,
        "seed": 2**63 - 1,
    }
    assert checked_params({"temperature": None, "seed": None}, 1) == {}


def test_a_whole_float_is_an_integer_as_in_json_schema():
    # 482.0 and 482 are one JSON number; /openapi.json calls these fields integers, and
    # Schemathesis sent 482.0 for top_k, which was refused.
    checked = checked_params({"top_k": 482.0, "seed": 1.0, "min_tokens": 2.0}, max_tokens=8)
    assert checked == {"top_k": 482, "seed": 1, "min_tokens": 2}
    assert all(type(value) is int for value in checked.values())


def test_min_tokens_may_not_pass_max_tokens():
    assert checked_params({"min_tokens": 8}, max_tokens=8) == {"min_tokens": 8}
    with pytest.raises(InvalidInput, match='"min_tokens" 9 is more than max_tokens 8'):
        checked_params({"min_tokens": 9}, max_tokens=8)


def test_params_that_are_not_an_object_are_refused():
    with pytest.raises(InvalidInput, match="JSON object"):
        checked_params(["temperature"], 8)  # type: ignore[arg-type]


class ParamsReader:
    """The simulated generator, instant, reading each sequence's params as a real model's
    sampler does (a float temperature, a 64-bit seed): a bad value makes its step raise.
    It records every params dict it was handed."""

    def __init__(self, device: str) -> None:
        self._inner = SimulatedGenerator(
            device, fixed_s=0.0, per_token_s=0.0, kv_budget_tokens=10_000
        )
        self.kv_budget_tokens = 10_000
        self.seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def step(self, seqs: list[Seq]) -> list[str | None]:
        for seq in seqs:
            with self._lock:
                self.seen.append(dict(seq.params))
            if not 0 <= float(seq.params.get("temperature", 0)) <= 100:
                raise ValueError("temperature out of range")
            int(seq.params.get("seed", 0)).to_bytes(8, "little", signed=True)
        return self._inner.step(seqs)

    def release(self, seq_ids: list[str]) -> None:
        self._inner.release(seq_ids)


def reading_engine(readers: list[ParamsReader]) -> Engine:
    def load(device: str) -> ParamsReader:
        readers.append(ParamsReader(device))
        return readers[-1]

    spec = ModelSpec(name="writer", version="1", generator=load, devices="sim:1")  # type: ignore[arg-type]
    return Engine(Config(), models=[spec])


def step_failures(engine: Engine) -> int:
    assert engine.metrics is not None
    (row,) = engine.metrics.snapshot()["generation"]
    return int(row["step_failures"])


async def test_bad_params_are_a_400_at_every_door_and_never_reach_the_generator(aiohttp_client):
    readers: list[ParamsReader] = []
    engine = reading_engine(readers)
    client = await aiohttp_client(create_app(engine))
    for name, value in [
        ("temperature", "hot"),
        ("temperature", 1e308),
        ("seed", 2**200),
        ("seed", "x"),
        ("top_k", 2.5),
    ]:
        for path, body in [
            ("/api/generate", {"prompt": "abc", "params": {name: value}}),
            ("/v1/completions", {"model": "writer", "prompt": "abc", name: value}),
            (
                "/v1/chat/completions",
                {"model": "writer", "messages": [{"role": "user", "content": "a"}], name: value},
            ),
        ]:
            response = await client.post(path, json=body)
            assert response.status == 400, (path, body, await response.text())
            answer = await response.json()
            message = answer["error"]["message"] if path != "/api/generate" else answer["message"]
            assert f'"{name}" must be' in message, message
    (reader,) = readers
    assert reader.seen == []
    assert step_failures(engine) == 0

    # good params reach the generator as given, each sequence its own; unknown keys of
    # /api/generate's params pass through, nulls are absent
    response = await client.post(
        "/api/generate",
        json={"prompt": "abc", "params": {"seed": 2**63 - 1, "temperature": None, "own": [1]}},
    )
    assert response.status == 200, await response.text()
    response = await client.post(
        "/v1/completions",
        json={"model": "writer", "prompt": "xyz", "temperature": 0.7, "top_k": 5, "top_p": None},
    )
    assert response.status == 200, await response.text()
    assert reader.seen[0] == {"seed": 2**63 - 1, "own": [1]}
    assert reader.seen[-1] == {"temperature": 0.7, "top_k": 5}
    assert step_failures(engine) == 0


async def test_min_tokens_over_max_tokens_is_refused_even_when_max_tokens_is_the_default():
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0), max_tokens=8))
    async with engine:
        with pytest.raises(InvalidInput, match="min_tokens"):
            async with engine.generate(Prompt("abc", params={"min_tokens": 9})):
                pass
        with pytest.raises(InvalidInput, match="min_tokens"):
            async with engine.generate(Prompt("abc", max_tokens=4, params={"min_tokens": 5})):
                pass


async def test_the_simulated_generator_holds_its_end_back_for_ignore_eos_and_min_tokens():
    assert [sim_token("ab", i, held=True) for i in range(5)] == ["b", "a", "b", "a", "b"]
    assert sim_token("", 0, held=True) == " "
    engine = Engine(Config(generator="sim", devices="sim:1", sim_step_ms=(0, 0)))
    async with engine:
        for params, max_tokens, expected in [
            ({"ignore_eos": True}, 7, ("cbacbac", "length")),
            ({"min_tokens": 5}, 7, ("cbacb", "stop")),
            ({"min_tokens": 2}, 7, ("cba", "stop")),
            ({"ignore_eos": False}, 7, ("cba", "stop")),
        ]:
            async with engine.generate(Prompt("abc", max_tokens=max_tokens, params=params)) as gen:
                output = await gen.result()
                assert (output, gen.finish_reason) == expected, params


def test_tiny_gpt_steps_with_every_key_at_its_extremes_and_holds_its_end_back():
    pytest.importorskip("torch")
    from batchserve.models.tiny_gpt import load

    model = load("cpu")

    def run(seqs: list[Seq], steps: int = 12) -> None:
        running = list(seqs)
        for _ in range(steps):
            for seq, token in zip(list(running), model.step(running), strict=True):
                if token is None:
                    running.remove(seq)
                    model.release([seq.id])
                else:
                    seq.tokens.append(token)
            if not running:
                return

    # "p159" ends after 6 tokens, greedy
    greedy = Seq("greedy", "p159")
    run([greedy])
    assert len(greedy.tokens) == 6
    held = [
        Seq("ignore", "p159", params=checked_params({"ignore_eos": True}, 12)),
        Seq("min", "p159", params=checked_params({"min_tokens": 9}, 12)),
        Seq("hot", "a", params=checked_params({"temperature": 100, "seed": 2**63 - 1}, 12)),
        Seq("cold", "b", params=checked_params({"seed": -(2**63), "top_k": 1, "top_p": 1e-9}, 12)),
    ]
    run(held)
    assert len(held[0].tokens) == 12
    assert held[0].tokens[:6] == greedy.tokens
    assert len(held[1].tokens) >= 9
