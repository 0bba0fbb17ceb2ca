"""OpenAI's Files and Batch API over HTTP, in process: the shapes, the caps, tenants kept
apart, validation, cancelling, and the unmodified openai client's flow."""

from __future__ import annotations

import asyncio
import io
import threading
from typing import Any

import openai
import orjson
import pytest
from aiohttp import FormData
from aiohttp.test_utils import TestClient

from batchserve import Config, Engine
from batchserve.models.backends import simulate
from batchserve.models.specs import ModelSpec
from batchserve.rules.tenants import Tenant
from batchserve.server import create_app

from . import tiny_llama
from .conftest import HANG_GUARD_S, TWO_TENANT_KEYS, BatchserveTestServer
from .sample_models import TinyEmbedder

IDLE = Tenant("batch-owner", "free", idle=True)
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"\n".join(orjson.dumps(line) for line in lines) + b"\n"


def line(n: int, url: str = "/api/inference", **body: Any) -> dict[str, Any]:
    return {"custom_id": f"r{n}", "method": "POST", "url": url,
            "body": body or {"input": f"in-{n}"}}  # fmt: skip


async def upload(client: TestClient, content: bytes, headers: dict[str, str] | None = None) -> Any:
    form = FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="in.jsonl")
    answer = await client.post("/v1/files", data=form, headers=headers)
    return answer.status, await answer.json()


async def create(
    client: TestClient, file_id: str, url: str = "/api/inference", headers: Any = None
) -> Any:
    body = {"input_file_id": file_id, "endpoint": url, "completion_window": "24h"}
    answer = await client.post("/v1/batches", json=body, headers=headers)
    return answer.status, await answer.json()


async def ended(client: TestClient, batch_id: str, headers: Any = None) -> dict[str, Any]:
    """The batch once it has ended: polled, each poll a round trip through the server."""
    async with asyncio.timeout(HANG_GUARD_S):
        while True:
            batch = await (await client.get(f"/v1/batches/{batch_id}", headers=headers)).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return batch  # type: ignore[no-any-return]


async def lines_of(client: TestClient, file_id: str, headers: Any = None) -> list[Any]:
    answer = await client.get(f"/v1/files/{file_id}/content", headers=headers)
    assert answer.status == 200
    return [orjson.loads(raw) for raw in (await answer.read()).splitlines()]


@pytest.fixture
async def served(start_server, gated, tmp_path):
    gated.gate.set()
    client, _ = await start_server(gated, batch_db=str(tmp_path / "b.db"))
    return client


async def test_a_batch_runs_every_line_once_and_a_failing_line_goes_to_the_error_file(served):
    content = jsonl(*(line(n) for n in range(5)), line(5, input="x", params={"nope": 1}))
    status, file = await upload(served, content)
    assert status == 200
    assert file | {"id": "", "created_at": 0} == {
        "id": "", "object": "file", "bytes": len(content), "created_at": 0,
        "filename": "in.jsonl", "purpose": "batch", "status": "processed",
        "expires_at": None, "status_details": None,
    }  # fmt: skip
    status, batch = await create(served, file["id"])
    assert (status, batch["status"], batch["request_counts"]["total"]) == (200, "validating", 6)
    batch = await ended(served, batch["id"])
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
    assert all(batch[stamp] for stamp in ("in_progress_at", "finalizing_at", "completed_at"))
    outputs = await lines_of(served, batch["output_file_id"])
    assert [(o["custom_id"], o["response"]["body"]["output"]) for o in outputs] == [
        (f"r{n}", simulate(f"in-{n}")) for n in range(5)
    ]
    (error,) = await lines_of(served, batch["error_file_id"])
    assert error["custom_id"] == "r5"
    assert error["response"]["status_code"] == 400
    refused = error["response"]["body"]["error"]
    assert (refused["type"], refused["param"], refused["code"]) == (
        "invalid_request_error",
        None,
        "INVALID_INPUT",
    )  # OpenAI's error object, as the same request online gets
    listed = await (await served.get("/v1/files")).json()
    assert {f["purpose"] for f in listed["data"]} == {"batch", "batch_output"}
    assert len(listed["data"]) == 3
    assert listed["has_more"] is False


@pytest.mark.parametrize(
    ("lines", "code", "param"),
    [
        ([line(0), line(0)], "duplicate_custom_id", "custom_id"),
        ([line(0), line(1, url="/v1/embeddings")], "url_mismatch", "url"),
        ([line(0, model="default"), line(1, model="nope")], "model_not_found", "body.model"),
    ],
)  # fmt: skip
async def test_lines_that_make_no_batch_fail_it_with_openais_validation_errors(
    served, lines, code, param
):
    _, file = await upload(served, jsonl(*lines))
    status, batch = await create(served, file["id"])
    assert (status, batch["status"]) == (200, "failed")
    assert batch["errors"]["data"][0]["code"] == code
    assert batch["errors"]["data"][0]["param"] == param
    assert batch["errors"]["data"][0]["line"] == 2
    assert batch["failed_at"]
    assert batch["output_file_id"] is None


def test_lines_of_two_served_models_are_a_model_mismatch():
    from batchserve.doors.batch_lines import check_lines

    lines = [line(0, input="a", model="a"), line(1, input="b", model="b")]
    checked = check_lines(jsonl(*lines), "/api/inference", {"a", "b"})
    assert [(e["code"], e["param"], e["line"]) for e in checked.errors] == [
        ("model_mismatch", "body.model", 2)
    ]


async def test_bad_uploads_and_bodies_get_openais_error_shape(served, tmp_path):
    assert (await upload(served, b"not json\n"))[0] == 400
    assert (await upload(served, b"\n"))[0] == 400
    _, file = await upload(served, jsonl(line(0)))
    status, body = await create(served, file["id"], url="/v1/images")
    assert status == 400
    assert set(body["error"]) >= {"message", "type", "code"}
    assert (body["error"]["type"], body["error"]["param"]) == ("invalid_request_error", None)
    assert (await create(served, "file-unknown"))[0] == 404
    answer = await served.post(f"/v1/batches/{'batch_unknown'}/cancel")
    assert answer.status == 404
    assert (await served.get("/v1/files?limit=0")).status == 400


async def test_each_listings_documented_limit_is_the_one_it_enforces(served):
    """The files and batches listings read `limit` from the definition that /openapi.json
    describes: its maximum is taken, one more is refused."""
    spec = await (await served.get("/openapi.json")).json()
    for path in ("/v1/files", "/v1/batches"):
        (limit,) = (p for p in spec["paths"][path]["get"]["parameters"] if p["name"] == "limit")
        most = limit["schema"]["maximum"]
        assert (await served.get(f"{path}?limit={most}")).status == 200
        assert (await served.get(f"{path}?limit={most + 1}")).status == 400


async def test_a_file_over_either_cap_is_413(start_server, gated, tmp_path):
    client, _ = await start_server(
        gated, batch_db=str(tmp_path / "b.db"), batch_file_bytes=200, batch_file_lines=2
    )
    assert (await upload(client, jsonl(line(0), line(1), line(2))))[0] == 413
    status, refused = await upload(client, jsonl(*(line(n, input="x" * 50) for n in range(2))))
    assert (status, refused["error"]["message"]) == (
        413,
        "the file is over the limit of 200 bytes (--batch-file-bytes)",
    )
    assert (await upload(client, jsonl(line(0), line(1))))[0] == 200


async def test_a_file_over_the_body_limit_names_the_flag_that_sets_it(
    start_server, gated, tmp_path
):
    client, _ = await start_server(gated, batch_db=str(tmp_path / "b.db"), max_input_bytes=100)
    status, refused = await upload(client, jsonl(*(line(n, input="x" * 90) for n in range(60))))
    assert status == 413
    assert refused["error"]["message"] == (
        "the file is over the limit of 4696 bytes"
        " (--max-input-bytes: the body limit is 6x it plus 4096)"
    )


async def test_a_tenant_sees_and_uses_only_its_own_files_and_batches(start_server, gated, tmp_path):
    gated.gate.set()
    keys = tmp_path / "keys.toml"
    keys.write_text(TWO_TENANT_KEYS)
    client, _ = await start_server(gated, keys_file=str(keys), batch_db=str(tmp_path / "b.db"))
    _, file = await upload(client, jsonl(line(0)), ALICE)
    assert (await client.get(f"/v1/files/{file['id']}", headers=BOB)).status == 404
    assert (await client.get(f"/v1/files/{file['id']}/content", headers=BOB)).status == 404
    assert (await client.delete(f"/v1/files/{file['id']}", headers=BOB)).status == 404
    assert (await (await client.get("/v1/files", headers=BOB)).json())["data"] == []
    assert (await create(client, file["id"], headers=BOB))[0] == 404
    _, batch = await create(client, file["id"], headers=ALICE)
    assert (await client.get(f"/v1/batches/{batch['id']}", headers=BOB)).status == 404
    assert (await client.post(f"/v1/batches/{batch['id']}/cancel", headers=BOB)).status == 404
    assert (await ended(client, batch["id"], ALICE))["request_counts"]["completed"] == 1
    assert (await client.get("/v1/files")).status == 401


async def test_deleting_the_input_file_loses_nothing_of_its_batch(start_server, gated, tmp_path):
    client, _ = await start_server(gated, batch_db=str(tmp_path / "b.db"))
    _, file = await upload(client, jsonl(*(line(n) for n in range(3))))
    _, batch = await create(client, file["id"])
    deleted = await (await client.delete(f"/v1/files/{file['id']}")).json()
    assert deleted == {"id": file["id"], "object": "file", "deleted": True}
    assert (await client.get(f"/v1/files/{file['id']}")).status == 404
    gated.gate.set()
    assert (await ended(client, batch["id"]))["request_counts"]["completed"] == 3


async def test_a_cancelled_batch_keeps_what_ran_and_cannot_be_cancelled_once_ended(
    start_server, gated, tmp_path
):
    client, _engine = await start_server(gated, batch_db=str(tmp_path / "b.db"),
                                        batch_lines_in_flight=2)  # fmt: skip
    _, file = await upload(client, jsonl(*(line(n) for n in range(20))))
    _, batch = await create(client, file["id"])
    await gated.entered("sim:0")  # the first line is on the device; the rest wait
    cancelling = await (await client.post(f"/v1/batches/{batch['id']}/cancel")).json()
    assert cancelling["status"] == "cancelling"
    assert cancelling["cancelling_at"]
    gated.gate.set()
    batch = await ended(client, batch["id"])
    assert batch["status"] == "cancelled"
    assert batch["cancelled_at"]
    # Cancelled here, the runner here took no line after it: only the two it held ran.
    assert batch["request_counts"]["completed"] == 2
    answer = await client.post(f"/v1/batches/{batch['id']}/cancel")
    assert answer.status == 200  # cancelled: as it is
    listed = await (await client.get("/v1/batches?limit=1")).json()
    assert listed["data"][0]["id"] == batch["id"]


async def test_batches_list_newest_first_by_pages(served):
    _, file = await upload(served, jsonl(line(0)))
    ids = [(await create(served, file["id"]))[1]["id"] for _ in range(3)]
    first = await (await served.get("/v1/batches?limit=2")).json()
    assert [b["id"] for b in first["data"]] == ids[:0:-1]
    assert first["has_more"]
    rest = await (await served.get(f"/v1/batches?limit=2&after={first['last_id']}")).json()
    assert [b["id"] for b in rest["data"]] == ids[:1]
    assert not rest["has_more"]


def openai_for(client: TestClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


async def client_flow(ai: openai.AsyncOpenAI, content: bytes, endpoint: Any) -> Any:
    file = await ai.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = await ai.batches.create(
        input_file_id=file.id, endpoint=endpoint, completion_window="24h", metadata={"k": "v"}
    )
    async with asyncio.timeout(HANG_GUARD_S):
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            batch = await ai.batches.retrieve(batch.id)
    assert batch.metadata == {"k": "v"}
    assert batch.output_file_id is not None
    text = (await ai.files.content(batch.output_file_id)).text
    return batch, [orjson.loads(raw) for raw in text.splitlines()]


async def test_the_openai_client_runs_a_batch_and_cancels_one(start_server, gated, tmp_path):
    gated.gate.set()
    client, _ = await start_server(gated, batch_db=str(tmp_path / "b.db"))
    async with openai_for(client) as ai:
        content = jsonl(*(line(n) for n in range(4)))
        batch, outputs = await client_flow(ai, content, "/api/inference")
        assert batch.request_counts.completed == 4
        assert [o["custom_id"] for o in outputs] == ["r0", "r1", "r2", "r3"]
        listed = await ai.batches.list(limit=5)
        assert listed.data[0].id == batch.id
        with pytest.raises(openai.ConflictError):
            await ai.batches.cancel(batch.id)
        with pytest.raises(openai.NotFoundError):
            await ai.files.retrieve("file-none")


async def test_the_openai_client_runs_a_chat_batch_on_the_tiny_llama(
    aiohttp_client, tok, tiny, tmp_path
):
    pytest.importorskip("transformers")
    from batchserve.models.causal_lm import CausalLM

    spec = ModelSpec(
        name="llm", version="1", devices="cpu",
        generator=lambda device: CausalLM(tiny, tok, "cpu", kv_cache_bytes=2**20),
    )  # fmt: skip
    config = Config(batch_db=str(tmp_path / "b.db"), timeout_ms=600_000.0)
    engine = Engine(config, models=[spec])
    client = await aiohttp_client(BatchserveTestServer(create_app(engine)))
    body = {"model": "llm", "max_tokens": 4, "temperature": 0}
    prompts = [tiny_llama.CORPUS[n] for n in range(3)]
    chats = [{"custom_id": f"c{n}", "method": "POST", "url": "/v1/chat/completions",
              "body": body | {"messages": [{"role": "user", "content": p}]}}
             for n, p in enumerate(prompts)]  # fmt: skip
    async with openai_for(client) as ai:
        batch, outputs = await client_flow(ai, jsonl(*chats), "/v1/chat/completions")
        assert batch.request_counts.completed == 3
        for chat, output in zip(chats, outputs, strict=True):
            online = await ai.chat.completions.create(**chat["body"])
            answer = output["response"]["body"]
            assert output["custom_id"] == chat["custom_id"]
            assert answer["object"] == "chat.completion"
            assert answer["choices"][0]["message"] == online.choices[0].message.model_dump(
                include={"role", "content"}
            )


class HeldEmbedder(TinyEmbedder):
    """The tiny embedder, whose calls wait while `gate` is shut (`entered` says one does)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, inputs: list[str]) -> list[list[float]]:
        if not self.gate.is_set():
            self.entered.set()
        assert self.gate.wait(HANG_GUARD_S), "the test never opened the gate"
        return super().__call__(inputs)


async def test_the_openai_client_runs_an_embeddings_batch_and_cancels_one(aiohttp_client, tmp_path):
    embedder = HeldEmbedder()
    spec = ModelSpec(name="tiny", version="1", devices="sim:1", fn_per_device=lambda _: embedder)
    # The held call must not count as hung, however long a slow machine takes to cancel it.
    config = Config(
        batch_db=str(tmp_path / "b.db"), batch_lines_in_flight=2, batch_timeout_ms=600_000
    )
    client = await aiohttp_client(BatchserveTestServer(create_app(Engine(config, models=[spec]))))
    inputs: list[str | list[str]] = ["a banana", ["cat", "aaa a"], "one more", "the last"]
    lines = [
        {"custom_id": f"e{n}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "tiny", "input": text}}
        for n, text in enumerate(inputs)
    ]  # fmt: skip

    async def each_as_online(ai: openai.AsyncOpenAI, outputs: list[Any]) -> None:
        """Each output line once, answered as the same request sent online."""
        assert len({o["custom_id"] for o in outputs}) == len(outputs)
        for output in outputs:
            body = lines[int(output["custom_id"][1:])]["body"]
            online = await ai.embeddings.create(**body)
            answer = output["response"]["body"]
            assert answer["object"] == "list"
            assert [d["embedding"] for d in answer["data"]] == [d.embedding for d in online.data]
            assert answer["usage"] == online.usage.model_dump()

    async with openai_for(client) as ai:
        batch, outputs = await client_flow(ai, jsonl(*lines), "/v1/embeddings")
        assert (batch.status, batch.request_counts.completed) == ("completed", len(lines))
        assert [o["custom_id"] for o in outputs] == ["e0", "e1", "e2", "e3"]
        await each_as_online(ai, outputs)

        embedder.gate.clear()  # the next batch's first call waits on the device
        try:
            file = await ai.files.create(
                file=("in.jsonl", io.BytesIO(jsonl(*lines))), purpose="batch"
            )
            batch = await ai.batches.create(
                input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h"
            )
            assert await asyncio.to_thread(embedder.entered.wait, HANG_GUARD_S)
            cancelling = await ai.batches.cancel(batch.id)
            assert cancelling.status == "cancelling"
        finally:  # a failed step must not leave the device's thread held
            embedder.gate.set()
        async with asyncio.timeout(HANG_GUARD_S):
            while batch.status != "cancelled":
                batch = await ai.batches.retrieve(batch.id)
        assert batch.cancelled_at is not None
        assert batch.output_file_id is not None  # what ran is kept
        text = (await ai.files.content(batch.output_file_id)).text
        await each_as_online(ai, [orjson.loads(raw) for raw in text.splitlines()])


async def test_files_listed_by_purpose_fill_their_page(served):
    """A batch's output file is newer than its input: a page of one `batch` file must still
    hold the input, the filter applied before the page is cut, not after."""
    _, file = await upload(served, jsonl(line(0)))
    for _ in range(2):  # two output files, newer than the input
        _, batch = await create(served, file["id"])
        done = await ended(served, batch["id"])
    page = await (await served.get("/v1/files?purpose=batch&limit=1")).json()
    assert ([f["id"] for f in page["data"]], page["has_more"]) == ([file["id"]], False)
    outputs = await (await served.get("/v1/files?purpose=batch_output&limit=1")).json()
    assert [f["id"] for f in outputs["data"]] == [done["output_file_id"]]


async def test_a_batch_past_its_window_expires_and_its_unrun_lines_say_so(
    start_server, gated, tmp_path, monkeypatch
):
    """Its window (24h) ends while two of its lines are held: those two are answered, the
    rest go to the error file as `batch_expired`, and the batch is `expired`."""
    from batchserve.doors import batch_runner

    client, _ = await start_server(gated, batch_db=str(tmp_path / "b.db"),
                                   batch_lines_in_flight=2)  # fmt: skip
    _, file = await upload(client, jsonl(*(line(n) for n in range(6))))
    _, batch = await create(client, file["id"])
    await gated.entered("sim:0")
    later = batch["expires_at"] + 1
    monkeypatch.setattr(batch_runner, "now_s", lambda: later)  # the day has passed
    gated.gate.set()
    done = await ended(client, batch["id"])
    assert (done["status"], done["expired_at"]) == ("expired", later)
    assert done["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    errors = await lines_of(client, done["error_file_id"])
    assert sorted(e["custom_id"] for e in errors) == [f"r{n}" for n in range(2, 6)]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(await lines_of(client, done["output_file_id"])) == 2
