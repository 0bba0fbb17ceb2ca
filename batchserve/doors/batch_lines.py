"""A Batch API input file's lines: checked as OpenAI checks them when a batch is created,
then each run as its endpoint's door runs a request, answered in the output file's shape.

A file whose lines do not make a batch (a line that is not JSON, lacks `custom_id`,
`method`, `url` or `body`, names another endpoint or model than the others, or repeats a
`custom_id`) fails the whole batch with OpenAI's validation errors (`errors.data`: code,
line, message, param), as OpenAI does. A line whose request fails, its body refused as its
door would refuse it, or its run failed on the device, goes to the error file with its
`custom_id` and its status and error; the batch goes on. A line the server cannot take now
(draining, its device unhealthy) is tried again later: `run` answers None. One whose own
deadline passed (online work held the devices) answers `Late`, the 504 it would be
recorded with: its runner tries it again a few times, then records that; one whose deadline
can never be met by itself (shorter than a call, a prompt that prefills past it) is
recorded at once.

Each line runs as its owner, in the idle tier (`Tenant.idle`): below every online tier,
spending none of its rate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, cast

import orjson
from aiohttp import web

from ..batching.request import Ask, Result, new_request_id
from ..engine.requests import Caller, Prompt
from ..errors import (
    BatchserveError,
    ClientClosed,
    DeadlineExceeded,
    DeadlineTooShort,
    InvalidInput,
    NotReady,
    Overloaded,
    PrefillTooLong,
    RateLimited,
)
from ..generation.request import Generation
from ..rules.tenants import Tenant
from .batch_store import Outcome
from .openai_api import embeddings_answer, embeddings_request
from .openai_choices import choice_params
from .openai_completions import read_line, whole_answer
from .wire import answer_body, openai_error, parse_input

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/inference")
ROUTE = "batch"
"""The route the lines are recorded under, in the metrics and the access log."""
TRY_LATER = (NotReady, Overloaded, RateLimited, ClientClosed)
"""What a line is refused or failed for that says nothing of the line: it runs again later."""


class Late(NamedTuple):
    """A line whose deadline passed while it waited: not its fault, unless it keeps coming."""

    outcome: Outcome
    """What it is recorded with once its tries are spent: the 504 online would answer."""


class Checked(NamedTuple):
    lines: list[bytes]
    errors: list[dict[str, Any]]
    """OpenAI's validation errors (`errors.data`); none: the lines make a batch."""


def check_lines(content: bytes, endpoint: str, served: Collection[str]) -> Checked:
    """The file's lines, or why they do not make a batch for `endpoint` of the `served`
    models (the first few reasons, as OpenAI lists them)."""
    lines: list[bytes] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    models: set[str] = set()
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _line_problem(raw, endpoint, seen, models, served)
        if problem is not None:
            code, message, param = problem
            errors.append({"code": code, "message": message, "param": param, "line": number})
            if len(errors) == MAX_ERRORS:
                break
        lines.append(raw)
    if not lines and not errors:
        errors.append(_error("empty_file", "The input file has no requests.", None, None))
    return Checked(lines, errors)


MAX_ERRORS = 10
"""The most validation errors listed for one batch: enough to fix a file, bounded."""


def _line_problem(
    raw: bytes, endpoint: str, seen: set[str], models: set[str], served: Collection[str]
) -> tuple[str, str, str | None] | None:
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "invalid_json_line", "This line is not parseable as valid JSON.", None
    if not isinstance(line, dict):
        return "invalid_json_line", "This line is not a JSON object.", None
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing_required_parameter", "Missing required parameter: custom_id.", "custom_id"
    if custom_id in seen:
        return (
            "duplicate_custom_id",
            "The custom_id for this request is a duplicate of another request. The custom_id"
            " parameter must be unique for each request in a batch.",
            "custom_id",
        )
    seen.add(custom_id)
    if line.get("method") != "POST":
        return "invalid_method", "The method of each request must be POST.", "method"
    if line.get("url") != endpoint:
        return (
            "url_mismatch",
            f"The URL provided for this request does not match the batch endpoint {endpoint}.",
            "url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        return "missing_required_parameter", "Missing required parameter: body.", "body"
    model = body.get("model")
    if isinstance(model, str):
        if model not in served:
            return (
                "model_not_found",
                f"The provided model {model[:64]!r} is not served here (GET /v1/models lists"
                " them).",
                "body.model",
            )
        models.add(model)
        if len(models) > 1:
            return (
                "model_mismatch",
                "The model of this request differs from the others: a batch runs one model.",
                "body.model",
            )
    return None


def _error(code: str, message: str, param: str | None, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass(frozen=True, slots=True)
class LineEngine:
    """The engine's methods a line runs through: the doors' own."""

    infer: Callable[[Ask, Caller], Awaitable[Result]]
    infer_all: Callable[[Sequence[Ask], Caller], Awaitable[list[Result]]]
    generate: Callable[[Prompt, Caller], contextlib.AbstractAsyncContextManager[Generation]]
    chat_prompt: Callable[[str | None, list[dict[str, Any]], list[dict[str, Any]] | None], str]
    embedding_dim: Callable[[str], int]
    dimensions: Callable[[str], frozenset[int]]
    count_tokens: Callable[[Result, str], int]


class LineRunner:
    def __init__(self, engine: LineEngine) -> None:
        self._engine = engine

    async def run(self, raw: bytes, endpoint: str, tenant: Tenant) -> Outcome | Late | None:
        """The line's outcome; Late: its deadline passed as it waited; None: the server
        cannot take it now (TRY_LATER)."""
        line = orjson.loads(raw)
        request_id = f"batch_req_{new_request_id()}"
        try:
            status, body = 200, await self._answer(endpoint, line["body"], request_id, tenant)
        except (DeadlineTooShort, PrefillTooLong) as error:  # never met, however often tried
            status, body = error.status, _error_body(error)
        except DeadlineExceeded as error:  # online work held the devices past its deadline
            return Late(_outcome(line["custom_id"], request_id, error.status, _error_body(error)))
        except TRY_LATER:
            return None
        except BatchserveError as error:
            status, body = error.status, _error_body(error)
        return _outcome(line["custom_id"], request_id, status, body)

    async def _answer(
        self, endpoint: str, body: dict[str, Any], request_id: str, tenant: Tenant
    ) -> dict[str, Any]:
        engine = self._engine
        caller = Caller(request_id=request_id, tenant=tenant, route=ROUTE)
        if endpoint == "/v1/embeddings":
            model, texts, base64_wanted, size = embeddings_request(
                body, engine.embedding_dim, engine.dimensions
            )
            results = await engine.infer_all([Ask(text, model=model) for text in texts], caller)
            tokens = sum(engine.count_tokens(r, t) for r, t in zip(results, texts, strict=True))
            return embeddings_answer(model, results, tokens, base64_wanted=base64_wanted, size=size)
        if endpoint == "/api/inference":
            ask = parse_input(body, cast(web.BaseRequest, _NO_HEADERS))
            result = await engine.infer(ask, caller)
            return answer_body(request_id, result, result.queue_s + result.compute_s)
        chat = endpoint == "/v1/chat/completions"
        asked = read_line(body, chat=chat)
        if asked.stream:
            raise InvalidInput("a batch line cannot stream: leave out stream")
        if asked.choices.n > 1:
            raise InvalidInput('a batch line answers one choice: leave out "n" or send 1')
        prompt = asked.prompt
        if asked.messages is not None:
            text = engine.chat_prompt(asked.model, asked.messages, asked.tools.listed)
            prompt = replace(prompt, text=text)
        params = choice_params(dict(prompt.params or {}), asked.choices, 0, prompt.prompt_ids)
        async with engine.generate(replace(prompt, params=params), caller) as gen:
            output = await gen.result()
        answer_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        return whole_answer(gen, output, answer_id=answer_id, asked=asked)


def _outcome(custom_id: str, request_id: str, status: int, body: dict[str, Any]) -> Outcome:
    output = {
        "id": request_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }
    return Outcome(status != 200, orjson.dumps(output, option=orjson.OPT_SERIALIZE_NUMPY))


def _error_body(error: BatchserveError) -> dict[str, Any]:
    return {"error": openai_error(error)}


def expired_line(raw: bytes, code: str, message: str) -> bytes:
    """The error file's line for a line that never ran: the batch expired or was cancelled
    (OpenAI's `error`, with no response)."""
    custom_id = orjson.loads(raw)["custom_id"]
    output = {
        "id": f"batch_req_{new_request_id()}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return orjson.dumps(output)


class _NoHeaders:
    headers: dict[str, str] = {}  # noqa: RUF012 (read only)


_NO_HEADERS = _NoHeaders()
