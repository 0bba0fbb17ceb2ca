"""Cost-aware batching for models whose cost grows with input length: the learned cost line,
length buckets, token limits on batches and the SLO-derived linger budget."""

from __future__ import annotations

import asyncio

import pytest

from batchserve.batching.request import Ask
from batchserve.cli import config_from_args
from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.engine.requests import Caller
from batchserve.models.specs import ModelSpec
from batchserve.rules.capacity import CallTime, LengthCost
from batchserve.rules.policy import AdaptivePolicy, Decision, QueueView
from batchserve.rules.tenants import Tenant

from .conftest import GatedBackend


def test_the_cost_line_is_learned_from_calls_of_different_sizes():
    cost = LengthCost()
    assert cost.predict(1000) is None  # nothing seen
    cost.observe(0.030, 1000)
    assert cost.line() is None  # one size seen: no line yet
    assert cost.predict(5000) == 0.030  # so the plain average
    for padded in [200, 800, 3200, 100, 6400] * 10:
        cost.observe(0.010 + 0.00002 * padded, padded)
    a, b = cost.line()  # type: ignore[misc]
    assert a == pytest.approx(0.010, rel=0.05)
    assert b == pytest.approx(0.00002, rel=0.05)
    assert cost.predict(10_000) == pytest.approx(0.210, rel=0.05)


def test_sim_cost_takes_two_numbers():
    assert config_from_args(["--sim-cost", "5,0.01"])[0].sim_cost == (5.0, 0.01)
    with pytest.raises(SystemExit):
        config_from_args(["--sim-cost", "5"])


def test_the_linger_budget_is_what_the_slo_leaves_after_the_batch_time():
    call_time = CallTime()
    call_time.observe(0.100)
    policy = AdaptivePolicy(max_batch_size=100, max_linger_s=None, call_time=call_time, slo_s=0.3)
    queue = QueueView(size=3, oldest_arrival=10.0, earliest_deadline=20.0)
    # A device started 10 ms ago (spacing 0.9 x 100 ms / 2 = 45 ms): the hold ends at the
    # spacing, since the SLO leaves 200 ms of linger.
    assert policy.decide(10.0, queue, 1, [9.99]) == Decision(0, pytest.approx(10.035))
    # With only 20 ms of SLO left after the batch, the linger budget ends the hold first.
    tight = AdaptivePolicy(max_batch_size=100, max_linger_s=None, call_time=call_time, slo_s=0.12)
    assert tight.decide(10.0, queue, 1, [9.99]) == Decision(0, pytest.approx(10.02))
    # A batch whose predicted time is longer (a longer bucket) leaves it less linger.
    longer = QueueView(size=3, oldest_arrival=10.0, earliest_deadline=20.0, service_s=0.11)
    assert tight.decide(10.0, longer, 1, [9.99]) == Decision(0, pytest.approx(10.01))


async def test_length_cost_batches_group_similar_lengths_and_cap_tokens(gated: GatedBackend):
    model = ModelSpec(
        name="m", version="1", fn_per_device=gated, devices="sim:1", cost="length",
        max_batch_tokens=64,
    )  # fmt: skip
    async with Engine(Config(), models=[model]) as engine:
        first = engine.submit("first")
        await gated.entered("sim:0")  # the device is busy: what follows waits in lanes
        short = [engine.submit(f"s{n}") for n in range(6)]  # 2 characters: bucket 2 (2-3)
        long = [engine.submit(f"long-input-{n:02d}") for n in range(6)]  # 13: bucket 4 (8-15)
        gated.gate.set()
        await asyncio.gather(first, *short, *long)
    calls = sorted(inputs for _, inputs in gated.calls[1:])
    # Short and long inputs never share a call; a long call holds at most 64 // 15 = 4.
    assert calls == [
        [f"long-input-{n:02d}" for n in range(4)],
        [f"long-input-{n:02d}" for n in range(4, 6)],
        [f"s{n}" for n in range(6)],
    ]


async def test_a_backlog_of_lists_under_a_one_list_token_cap_runs_in_arrival_order(
    gated: GatedBackend,
):
    """A reranker's backlog (three 4-pair requests behind a busy device), with
    max_batch_tokens of one request's pairs: one request a call, oldest first, so the first
    is answered after one call, not after one call holding all three (docs/models.md)."""
    model = ModelSpec(
        name="m", version="1", fn_per_device=gated, devices="sim:1", cost="length",
        max_batch_tokens=60,  # 4 inputs of bucket 4 (8 to 15 characters)
    )  # fmt: skip
    async with Engine(Config(), models=[model], clock=FakeClock()) as engine:
        first = engine.submit("first")
        await gated.entered("sim:0")
        lists = [[f"list{k}-pair{n}" for n in range(4)] for k in range(3)]
        answers = []
        for texts in lists:
            answers.append(asyncio.ensure_future(engine.infer_all([Ask(t) for t in texts])))
            await asyncio.sleep(0)  # each admitted before the next arrives
        gated.gate.set()
        await asyncio.gather(first, *answers)
    assert [inputs for _, inputs in gated.calls[1:]] == lists


async def test_a_tenant_alone_in_a_length_bucket_gets_a_tenants_share_not_the_buckets(
    gated: GatedBackend,
):
    """Tenant a floods long inputs into a bucket of its own; b and c share the short one.
    Lanes share device time by the tenants waiting in them, so a's lane gets a third of
    the calls (each predicts the same time here: the virtual clock stands still), not half.
    Batches are not cut for the tenants sharing the model (--shared-batch-ratio 0): the
    lanes' shares are what is counted here, not the calls' sizes (test_shared_batches.py)."""
    model = ModelSpec(
        name="m", version="1", fn_per_device=gated, devices="sim:1", cost="length",
        max_batch_size=10,
    )  # fmt: skip
    a, b, c = (Tenant(name, "paid") for name in "abc")
    config = Config(shared_batch_ratio=0)
    async with Engine(config, models=[model], clock=FakeClock()) as engine:
        first = engine.submit("first")
        await gated.entered("sim:0")
        flood = [engine.submit(f"L{n:020d}", Caller(tenant=a)) for n in range(40)]
        short = [engine.submit(f"{t.name}{n}", Caller(tenant=t)) for n in range(20) for t in (b, c)]
        gated.gate.set()
        await asyncio.gather(first, *flood, *short)
    kinds = ["L" if inputs[0][0] == "L" else "S" for _, inputs in gated.calls[1:]]
    assert kinds == ["L", "S", "S", "L", "S", "S", "L", "L"]
