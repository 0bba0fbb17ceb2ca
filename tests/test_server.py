"""The HTTP contract end to end, in-process: answers, errors, ordering, lifecycle."""

from __future__ import annotations

import asyncio
import functools
import gzip
import io
import threading
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import ClientResponse, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.typedefs import Handler

from batchserve.clock import FakeClock
from batchserve.config import Config
from batchserve.doors.connections import DECODED_ENCODINGS
from batchserve.engine.core import Engine
from batchserve.models.backends import simulate, simulated_factory
from batchserve.server import create_app

from . import raw_http
from .conftest import BatchserveTestServer, GatedBackend, hold_one_and_queue_one, reach


async def finish_and_check_never_ran(
    engine: Engine, gated: GatedBackend, running: asyncio.Future[ClientResponse], text: str
) -> None:
    """Lets the blocking batch finish, then proves `text` never reached a device."""
    gated.gate.set()
    assert (await running).status == 200
    await reach(engine, lambda s: s.in_flight == 0)
    assert text not in gated.seen_inputs()
    assert engine.stats().pending == 0


async def test_answers_with_output_and_timings(start_server):
    client, _ = await start_server(simulated_factory(0.001, 100))
    response = await client.post(
        "/api/inference", json={"input": "hello"}, headers={"X-Request-Id": "abc-1"}
    )
    assert response.status == 200
    body = await response.json()
    assert body["output"] == "olleh"
    assert body["request_id"] == "abc-1"
    assert response.headers["X-Request-Id"] == "abc-1"
    assert body["batch_size"] == 1
    assert body["latency_ms"] >= body["compute_ms"] >= 0
    assert body["queue_ms"] >= 0
    assert response.headers["Server-Timing"].startswith("queue;dur=")
    assert "compute;dur=" in response.headers["Server-Timing"]


async def test_two_thousand_concurrent_requests_each_get_their_own_output(start_server):
    client, engine = await start_server(simulated_factory(0.002, 100), devices=4)
    inputs = [f"request-{index}-{'x' * (index % 7)}" for index in range(2000)]

    async def ask(text: str) -> tuple[str, dict[str, object]]:
        response = await client.post("/api/inference", json={"input": text})
        assert response.status == 200, await response.text()
        return text, await response.json()

    answers = await asyncio.gather(*(ask(text) for text in inputs))
    assert [body["output"] for _, body in answers] == [simulate(text) for text in inputs]
    assert len({body["request_id"] for _, body in answers}) == len(inputs)
    assert max(body["batch_size"] for _, body in answers) > 1  # it really batched
    assert engine.stats().pending == 0
    stats = engine.stats()
    assert (stats.queued, stats.in_flight, stats.completed) == (0, 0, len(inputs))


async def test_a_device_never_runs_two_batches_and_batches_respect_the_limit(start_server):
    backend = GatedBackend()
    backend.gate.set()
    client, _engine = await start_server(backend, devices=3, max_batch_size=7)
    responses = await asyncio.gather(
        *(client.post("/api/inference", json={"input": f"in-{n}"}) for n in range(300))
    )
    assert all(response.status == 200 for response in responses)
    assert set(backend.max_concurrent.values()) == {1}
    assert all(1 <= len(inputs) <= 7 for _, inputs in backend.calls)
    assert sorted(backend.seen_inputs()) == sorted(f"in-{n}" for n in range(300))


async def test_a_batch_grows_while_every_device_is_busy(start_server, gated):
    client, engine = await start_server(gated, devices=1)
    first = asyncio.ensure_future(client.post("/api/inference", json={"input": "first"}))
    await reach(engine, lambda s: s.in_flight == 1)
    rest = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": f"r{n}"}))
        for n in range(5)
    ]
    await reach(engine, lambda s: s.queued == 5)
    gated.gate.set()
    bodies = [await (await task).json() for task in [first, *rest]]
    assert [body["batch_size"] for body in bodies] == [1, 5, 5, 5, 5, 5]
    assert [inputs for _, inputs in gated.calls] == [["first"], [f"r{n}" for n in range(5)]]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"not json", "not valid UTF-8 JSON"),
        (b'["a list"]', "JSON object"),
        (b"{}", '"input"'),
        (b'{"input": 5}', '"input"'),
        (b'{"input": null}', '"input"'),
        (b'{"input": "x", "extra": 1}', "unknown field(s): extra"),
        (b'{"input": "x", "timeout_ms": "soon"}', "timeout_ms"),
        (b'{"input": "x", "timeout_ms": -1}', "timeout_ms"),
        (b'{"input": "x", "timeout_ms": true}', "timeout_ms"),
        (b'{"input": "\xff\xfe"}', "the body is not valid UTF-8 text"),
        (b'{"input": "\\ud800"}', "UTF-8"),
    ],
)
async def test_bad_bodies_get_400_invalid_input(start_server, body, fragment):
    client, engine = await start_server(simulated_factory(0.0, 100))
    response = await client.post("/api/inference", data=body)
    assert response.status == 400
    answer = await response.json()
    assert answer["error"] == "INVALID_INPUT"
    assert fragment in answer["message"]
    assert answer["request_id"]
    assert engine.stats().pending == 0


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/api/inference", '{"input": '),
        ("/api/requests", '{"input": '),
        ("/v1/embeddings", '"input": '),
        ("/v1/completions", '"prompt": '),
        ("/v1/chat/completions", '"messages": '),
        ("/api/generate", '{"prompt": '),
        ("/v2/models/default/infer", '{"inputs": '),
    ],
)
async def test_a_body_that_is_not_an_object_is_told_what_its_route_takes(start_server, path, field):
    client, _ = await start_server(simulated_factory(0.0, 100))
    response = await client.post(path, data=b'["a list"]')
    assert response.status == 400
    answer = await response.json()
    error = answer["error"]  # OpenAI's shape nests the message; OIP's error is the message
    message = error["message"] if isinstance(error, dict) else answer.get("message", error)
    assert message.startswith("the body must be a JSON object like "), message
    assert field in message


async def test_bad_timeout_header_and_overlong_request_id_get_400(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100))
    response = await client.post(
        "/api/inference", json={"input": "x"}, headers={"X-Request-Timeout-Ms": "abc"}
    )
    assert response.status == 400
    # Refused even where the body's timeout_ms wins (Schemathesis found it ignored).
    response = await client.post(
        "/api/inference",
        json={"input": "x", "timeout_ms": 5000},
        headers={"X-Request-Timeout-Ms": ""},
    )
    assert response.status == 400
    for header in ("0", "-5", "inf", "nan"):  # a number, but not one above 0
        response = await client.post(
            "/api/inference",
            json={"input": "x", "timeout_ms": 5000},
            headers={"X-Request-Timeout-Ms": header},
        )
        assert response.status == 400, header
    response = await client.post(
        "/api/inference", json={"input": "x"}, headers={"X-Request-Id": "i" * 500}
    )
    assert response.status == 400
    assert (await response.json())["request_id"] != "i" * 500


async def test_ten_megabyte_body_gets_413(start_server):
    client, engine = await start_server(simulated_factory(0.0, 100), max_input_bytes=1024)
    response = await client.post("/api/inference", data=io.BytesIO(b"x" * (10 << 20)))
    assert response.status == 413
    assert (await response.json())["error"] == "INPUT_TOO_LARGE"
    ok = await client.post("/api/inference", json={"input": "fine"})
    assert ok.status == 200
    assert engine.stats().pending == 0


async def test_ten_megabyte_chunked_body_without_length_gets_413(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100), max_input_bytes=1024)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b"x" * (1 << 20)

    response = await client.post("/api/inference", data=chunks())
    assert response.status == 413
    assert (await response.json())["error"] == "INPUT_TOO_LARGE"


async def test_a_whole_chunked_body_over_the_limit_gets_413_and_one_within_is_served(
    start_server,
):
    """A body without Content-Length that has all arrived when its handler runs is taken
    at once; its size is checked as a streamed one's is."""
    client, _ = await start_server(simulated_factory(0.0, 100), max_input_bytes=10)
    limit = (10 * 6) + 4096  # Config.max_body_bytes
    reader, writer = await asyncio.open_connection(client.host, client.port)
    for size, status in [(limit + 1, b"413"), (limit, b"200")]:
        body = b'{"input": "x"}'.ljust(size)
        writer.write(
            b"POST /api/inference HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.split()[1] == status
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    writer.close()
    await writer.wait_closed()


async def test_input_over_the_byte_limit_gets_413(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100), max_input_bytes=10)
    response = await client.post("/api/inference", json={"input": "é" * 6})  # 12 bytes
    assert response.status == 413
    assert "12 bytes" in (await response.json())["message"]
    assert (await client.post("/api/inference", json={"input": "é" * 5})).status == 200


async def test_full_queue_gets_503_overloaded_with_retry_after(start_server, gated):
    client, engine = await start_server(gated, max_batch_size=1, max_queue=1)
    running, queued = await hold_one_and_queue_one(client, engine)
    response = await client.post("/api/inference", json={"input": "c"})
    assert response.status == 503
    body = await response.json()
    assert body["error"] == "OVERLOADED"
    assert body["retry_after_ms"] >= 1
    assert int(response.headers["Retry-After"]) >= 1
    gated.gate.set()
    assert [(await task).status for task in (running, queued)] == [200, 200]
    assert "c" not in gated.seen_inputs()


async def test_duplicate_request_id_in_flight_gets_409(start_server, gated):
    client, engine = await start_server(gated)
    headers = {"X-Request-Id": "same"}
    first = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "a"}, headers=headers)
    )
    await reach(engine, lambda s: s.in_flight == 1)
    response = await client.post("/api/inference", json={"input": "b"}, headers=headers)
    assert response.status == 409
    assert (await response.json())["error"] == "DUPLICATE_REQUEST_ID"
    gated.gate.set()
    assert (await (await first).json())["output"] == "a"


async def test_expired_request_gets_504_and_never_reaches_a_device(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, clock=clock)
    running = asyncio.ensure_future(client.post("/api/inference", json={"input": "slow"}))
    await reach(engine, lambda s: s.in_flight == 1)
    late = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "late", "timeout_ms": 20})
    )
    await reach(engine, lambda s: s.queued == 1)
    clock.advance(0.020)
    response = await late
    assert response.status == 504
    assert (await response.json())["error"] == "DEADLINE_EXCEEDED"
    assert engine.stats().queued == 0
    await finish_and_check_never_ran(engine, gated, running, "late")


async def test_timeout_header_is_used_and_capped_by_the_server(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, timeout_ms=30, clock=clock)
    # Asks for a minute; the server's 30 ms cap still applies while the device is stuck.
    capped = asyncio.ensure_future(
        client.post(
            "/api/inference", json={"input": "x"}, headers={"X-Request-Timeout-Ms": "60000"}
        )
    )
    shorter = asyncio.ensure_future(
        client.post("/api/inference", json={"input": "y"}, headers={"X-Request-Timeout-Ms": "10"})
    )
    await reach(engine, lambda s: s.pending == 2)  # in one batch or two, on the stuck device
    clock.advance(0.010)
    assert (await shorter).status == 504
    assert not capped.done()
    clock.advance(0.020)
    assert (await capped).status == 504
    gated.gate.set()


async def test_backend_exception_gets_500_with_its_type_and_message(start_server):
    def factory(device: str):
        def fail(inputs: list[str]) -> list[str]:
            raise ValueError("the model is broken")

        return fail

    client, _engine = await start_server(factory)
    response = await client.post("/api/inference", json={"input": "x"})
    assert response.status == 500
    body = await response.json()
    assert body["error"] == "BACKEND_ERROR"
    assert "ValueError: the model is broken" in body["message"]
    assert "Traceback" not in body["message"]


@pytest.mark.parametrize(
    ("returned", "fragment"),
    [
        ("not a list", "returned str, not a list"),
        ([], "returned 0 outputs for 1 inputs"),
        (["a", "b"], "returned 2 outputs for 1 inputs"),
        ([{"a set"}], "not JSON: Type is not JSON serializable: set"),
        ([b"bytes"], "not JSON: Type is not JSON serializable: bytes"),
    ],
)
async def test_malformed_results_resolve_nobody_and_get_500(start_server, returned, fragment):
    def factory(device: str):
        return lambda inputs: returned

    client, _ = await start_server(factory)
    response = await client.post("/api/inference", json={"input": "x"})
    assert response.status == 500
    assert fragment in (await response.json())["message"]


async def test_client_disconnect_removes_the_queued_request(start_server, gated):
    client, engine = await start_server(gated)
    running = asyncio.ensure_future(client.post("/api/inference", json={"input": "kept"}))
    await reach(engine, lambda s: s.in_flight == 1)
    _reader, writer = await asyncio.open_connection(client.host, client.port)
    body = b'{"input": "gone"}'
    writer.write(
        b"POST /api/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await reach(engine, lambda s: s.queued == 1)
    writer.close()
    await writer.wait_closed()
    await reach(engine, lambda s: s.queued == 0)
    await finish_and_check_never_ran(engine, gated, running, "gone")


async def test_drain_answers_everything_accepted_and_refuses_new_work(start_server, gated):
    client, engine = await start_server(gated, max_batch_size=1)
    accepted = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": f"a{n}"}))
        for n in range(3)
    ]
    await reach(engine, lambda s: s.in_flight == 1 and s.queued == 2)
    draining = asyncio.ensure_future(engine.drain())
    await asyncio.sleep(0)
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/healthz")).status == 200
    refused = await client.post("/api/inference", json={"input": "new"})
    assert refused.status == 503
    assert (await refused.json())["error"] == "NOT_READY"
    gated.gate.set()
    outputs = [(await (await task).json())["output"] for task in accepted]
    await draining
    assert outputs == ["0a", "1a", "2a"]
    assert engine.stats().pending == 0


async def test_a_request_that_arrives_as_the_server_shuts_down_is_served_not_refused(
    start_server,
):
    """A keep-alive connection's request, received in the same loop turn that the shutdown
    (aiohttp's cleanup: sites closed, each connection closing after its request in hand, then
    the engine's drain) begins, reaches the engine after the drain began. It was sent
    before the server closed its doors and a load balancer does not retry a 503: served."""
    client, engine = await start_server(simulated_factory(0.0, 100))
    reader, writer = await asyncio.open_connection(client.host, client.port)

    async def post(text: str) -> None:
        body = b'{"input": "%s"}' % text.encode()
        writer.write(
            b"POST /api/inference HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    async def answer() -> tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        return head, await reader.readexactly(length)

    await post("first")
    assert (await answer())[0].startswith(b"HTTP/1.1 200 OK")  # now an idle keep-alive
    await post("late")
    closing = asyncio.ensure_future(client.server.close())  # no turn of the loop between
    head, body = await answer()
    await closing
    assert head.startswith(b"HTTP/1.1 200 OK"), body
    assert orjson.loads(body)["output"] == "etal"
    assert engine.readiness() == (False, "draining")
    assert await reader.read() == b"", "the connection closes after its request in hand"
    writer.close()
    await writer.wait_closed()


async def test_drain_timeout_answers_the_rest_503(start_server, gated):
    clock = FakeClock()
    client, engine = await start_server(gated, max_batch_size=1, drain_timeout_s=1, clock=clock)
    accepted = [
        asyncio.ensure_future(client.post("/api/inference", json={"input": f"a{n}"}))
        for n in range(2)
    ]
    await reach(engine, lambda s: s.in_flight == 1 and s.queued == 1)
    draining = asyncio.ensure_future(engine.drain())
    await asyncio.sleep(0)
    clock.advance(1.0)
    await draining
    statuses = [(await task).status for task in accepted]
    assert statuses == [503, 503]
    assert engine.stats().pending == 0
    gated.gate.set()


async def test_readiness_and_health(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100))
    assert (await client.get("/healthz")).status == 200
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["status"] == "ready"


async def test_a_blocked_device_thread_does_not_hold_up_teardown(start_server, gated):
    """The gate stays closed through teardown: the drain runs out, the in-flight request is
    answered 503, and the app closes without waiting for the wedged thread (the fixture
    opens the gate only after the test)."""
    clock = FakeClock()
    client, engine = await start_server(gated, drain_timeout_s=1, clock=clock)
    stuck = asyncio.ensure_future(client.post("/api/inference", json={"input": "x"}))
    await gated.entered("sim:0")
    draining = asyncio.ensure_future(engine.drain())
    await asyncio.sleep(0)
    clock.advance(1.0)
    await draining
    assert (await stuck).status == 503
    await client.close()  # the app's cleanup: the engine stops with the call still inside
    assert not gated.gate.is_set()
    assert any(t.name == "batchserve-sim:0" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/no/such/route", 404, "NOT_FOUND"),
        ("POST", "/", 405, "METHOD_NOT_ALLOWED"),
        ("GET", "/api/inference", 405, "METHOD_NOT_ALLOWED"),
        ("DELETE", "/healthz", 405, "METHOD_NOT_ALLOWED"),
        ("GET", "/static/vendor/missing.js", 404, "NOT_FOUND"),
    ],
)
async def test_unknown_routes_and_methods_get_the_api_s_json_errors(
    start_server, method, path, status, code
):
    client, _ = await start_server(simulated_factory(0.0, 100))
    response = await client.request(method, path, headers={"X-Request-Id": "lost-1"})
    assert response.status == status
    body = await response.json()
    assert (body["error"], body["request_id"]) == (code, "lost-1")
    assert response.headers["X-Request-Id"] == "lost-1"
    if status == 405:
        assert method not in response.headers["Allow"]
        assert response.headers["Allow"] in body["message"]


async def test_the_dashboard_s_vendored_files_are_served(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100))
    for name in ("uPlot.iife.min.js", "uPlot.min.css"):
        assert (await client.get(f"/static/vendor/{name}")).status == 200


async def test_the_runner_answers_inference_ahead_of_routing_and_routes_the_rest(aiohttp_client):
    """server.py's `AppRunner` hands `POST /api/inference` to the inference door itself; a
    middleware (which only aiohttp's routing runs) sees every other request, and the same
    request with a query or `Expect: 100-continue`, all answered as before. Under aiohttp's
    own runner the middleware sees the plain request too."""
    routed: list[str] = []

    @web.middleware
    async def note_routed(request: web.Request, handler: Handler) -> web.StreamResponse:
        routed.append(f"{request.method} {request.path_qs}")
        return await handler(request)

    def app() -> web.Application:
        app = create_app(Engine(Config(sim_latency_ms=0)))
        app.middlewares.append(note_routed)
        return app

    client = await aiohttp_client(BatchserveTestServer(app()))
    post = functools.partial(client.post, json={"input": "abc"})
    for response in [
        await post("/api/inference"),
        await post("/api/inference?trace=1"),
        await post("/api/inference", expect100=True),
    ]:
        assert (response.status, (await response.json())["output"]) == (200, "cba")
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/api/inference")).status == 405
    assert routed == [
        "POST /api/inference?trace=1",
        "POST /api/inference",
        "GET /healthz",
        "GET /api/inference",
    ]
    routed.clear()
    plain = await aiohttp_client(app())
    assert (await plain.post("/api/inference", json={"input": "abc"})).status == 200
    assert routed == ["POST /api/inference"]


@pytest.mark.parametrize(
    ("encoding", "status", "code"),
    [
        ("gzip", 400, "INVALID_INPUT"),
        ("deflate", 400, "INVALID_INPUT"),
        # Decoded where their packages are installed: then a body that is not br is a 400.
        ("br", *((400, "INVALID_INPUT") if HAS_BROTLI else (415, "UNSUPPORTED_MEDIA_TYPE"))),
        ("zstd", *((400, "INVALID_INPUT") if HAS_ZSTD else (415, "UNSUPPORTED_MEDIA_TYPE"))),
    ],
)
async def test_a_body_that_is_not_what_its_content_encoding_says_gets_a_json_error(
    start_server, caplog, encoding, status, code
):
    client, engine = await start_server(simulated_factory(0.0, 100))
    request = raw_http.post(
        "/api/inference", b'{"input": "abc"}', b"Content-Encoding: %s" % encoding.encode()
    )
    [answer] = await raw_http.exchange(client.host, client.port, request)
    assert (answer.status, answer.json()["error"]) == (status, code)
    assert answer.headers["x-request-id"] == answer.json()["request_id"]
    if status == 415:
        assert answer.headers["accept-encoding"] == DECODED_ENCODINGS
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
    compressed = await client.post(
        "/api/inference", data=gzip.compress(b'{"input": "abc"}'),
        headers={"Content-Encoding": "gzip"},
    )  # fmt: skip
    assert (compressed.status, (await compressed.json())["output"]) == (200, "cba")
    assert engine.stats().pending == 0


async def test_every_routed_answer_carries_the_request_s_id(start_server):
    client, _ = await start_server(simulated_factory(0.0, 100))
    submitted = await client.post("/api/requests", json={"input": "abc"})
    request_id = (await submitted.json())["request_id"]
    polled = await client.get(f"/api/requests/{request_id}", params={"wait_ms": "5000"})
    assert polled.status == 200
    assert polled.headers["X-Request-Id"] == request_id
    for path in (
        "/healthz", "/readyz", "/metrics", "/api/models", "/v1/models", "/api/stats", "/",
        "/static/vendor/uPlot.min.css",
    ):  # fmt: skip
        given = await client.get(path, headers={"X-Request-Id": "mine-1"})
        assert (given.status, given.headers.get("X-Request-Id")) == (200, "mine-1"), path
        fresh = await client.get(path)
        assert len(fresh.headers.get("X-Request-Id", "")) == 32, path


async def test_expect_100_continue_is_refused_first_when_the_answer_is_known(
    start_server, tmp_path
):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys."sk-1"]\ntenant = "acme"\ntier = "paid"\n')
    client, _ = await start_server(
        simulated_factory(0.0, 100), keys_file=str(keys), max_input_bytes=10
    )
    limit = 10 * 6 + 4096  # Config.max_body_bytes
    head = "POST /api/inference HTTP/1.1\r\nHost: x\r\nExpect: {}\r\nContent-Length: {}\r\n{}\r\n"
    for expect, length, key, status in [
        ("100-continue", 16, "", 401),
        ("100-continue", limit + 1, "Authorization: Bearer sk-1\r\n", 413),
        ("something-else", 16, "Authorization: Bearer sk-1\r\n", 417),
    ]:
        sent = head.format(expect, length, key).encode()
        answers = await raw_http.exchange(client.host, client.port, sent)  # no body sent
        assert [a.status for a in answers] == [status], expect  # no 100 first, then closed
        assert answers[0].headers["x-request-id"] == answers[0].json()["request_id"]
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(head.format("100-continue", 16, "Authorization: Bearer sk-1\r\n").encode())
    go_on = await raw_http.read_answer(reader)
    assert go_on is not None
    assert go_on.status == 100
    writer.write(b'{"input": "abc"}')
    answer = await raw_http.read_answer(reader)
    assert answer is not None
    assert (answer.status, answer.json()["output"]) == (200, "cba")
    writer.close()
    await writer.wait_closed()
