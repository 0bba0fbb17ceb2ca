"""The status store: states, expiry and eviction, with time passed in."""

from __future__ import annotations

import asyncio

from batchserve.batching.request import QueuedRequest, Ticket
from batchserve.doors.status_store import ResultStore

from .conftest import PLAIN_KEY


def request(request_id: str) -> QueuedRequest:
    loop = asyncio.new_event_loop()
    try:
        return QueuedRequest(request_id, "x", 0.0, 10.0, loop.create_future(), PLAIN_KEY)
    finally:
        loop.close()


def ticket(request_id: str) -> Ticket:
    return Ticket(request(request_id))


def test_a_request_is_queued_then_running_then_has_its_answer():
    store = ResultStore(capacity=10, ttl_s=60)
    queued = request("a")
    store.add(Ticket(queued))
    assert store.get("a", 0.0) == {"request_id": "a", "status": "queued"}
    queued.running = True
    assert store.get("a", 0.0) == {"request_id": "a", "status": "running"}
    store.finish("a", {"status": "completed", "output": "x"}, now=1.0)
    assert store.get("a", 60.9) == {"status": "completed", "output": "x"}
    assert store.get("a", 61.0) is None  # expired ttl_s after it finished
    assert not store.holds("a")


def test_a_full_store_evicts_the_oldest_finished_never_an_unfinished_one():
    store = ResultStore(capacity=2, ttl_s=60)
    store.add(ticket("old"))
    store.add(ticket("pending"))
    assert not store.make_room(0.0)  # full of unfinished requests: refuse the next
    store.finish("old", {"status": "completed"}, now=1.0)
    assert store.make_room(2.0)
    assert store.get("old", 2.0) is None
    assert store.get("pending", 2.0) == {"request_id": "pending", "status": "queued"}


def test_the_store_is_bounded_in_bytes_the_oldest_finished_going_first():
    store = ResultStore(capacity=100, ttl_s=60, max_bytes=1000)
    assert store.make_room(0.0, 400)
    store.add(ticket("a"), size=400)
    assert store.make_room(0.0, 400)
    store.add(ticket("b"), size=400)
    assert not store.make_room(0.0, 400)  # 1,200 bytes of unfinished inputs: refused
    store.finish("a", {"status": "completed", "output": "y" * 300}, now=1.0)
    assert store.bytes < 800
    assert store.make_room(2.0, 400)  # the finished answer goes, the unfinished one stays
    assert store.get("a", 2.0) is None
    assert store.get("b", 2.0) == {"request_id": "b", "status": "queued"}
    assert store.bytes == 400
    store.finish("b", {"status": "completed", "output": "z" * 2000}, now=3.0)
    assert store.get("b", 3.0) is not None  # bigger than the bound, and kept until pushed out
