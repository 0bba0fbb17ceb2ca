"""The retrieval door: Text Embeddings Inference's routes (`POST /embed`, `/rerank`,
`/predict`, `/tokenize`, `/decode`, `GET /info`) and a Cohere/Jina-shaped `POST /v1/rerank`
(also at `/v2/rerank`, where Cohere's v2 client and AIPerf's `cohere-rankings` send it), so
TEI's clients and rerankers' clients work unchanged.

Every input of a request (a text, or a query-passage pair) is one engine request, batched
with everyone's and costed by its tokens (`Engine.infer_all`), so a list of 10,000 is split
over many batches, and with API keys another tenant's request takes its turn between them.
Keys, tiers, deadlines, metrics and traces are the engine's, as on every route. A body
may name its `model`; without one, the route takes the one model of its kind (an embedder
for /embed, a classifier for /predict, a one-label classifier for the rerank routes). TEI's
routes answer errors in TEI's shape, `{"error", "error_type"}`; /v1/rerank and /v2/rerank in
ours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from ..batching.request import Ask, Result
from ..engine.requests import Caller
from ..errors import BatchserveError, InvalidInput, Overloaded, RateLimited, Unprocessable
from ..models.registry import TextKind
from ..models.retrieval import TextModel
from . import tei_bodies as bodies
from .face import Reception
from .wire import error_response, json_response, read_call, request_id_of

ROUTES = {"/embed": "embed", "/rerank": "rerank", "/predict": "predict", "/v1/rerank": "rerank"}
"""Each POST route that runs a model, to the name metrics and logs give it."""
ANSWER_SLICE = 512
"""A longer list answer is serialized this many items at a time, the event loop free between
slices: 10,000 vectors of 384 floats are 92 ms of orjson in one piece, which every other
request would wait for."""
_EMBED = frozenset({"inputs", "normalize", "truncate", "truncation_direction", "prompt_name",
                    "dimensions", "model"})  # fmt: skip
_RERANK = frozenset({"query", "texts", "raw_scores", "return_text", "truncate",
                     "truncation_direction", "model"})  # fmt: skip
_PREDICT = frozenset({"inputs", "raw_scores", "truncate", "truncation_direction", "model",
                      "parameters"})  # fmt: skip
_COHERE = frozenset({"model", "query", "documents", "top_n", "return_documents",
                     "max_chunks_per_doc", "rank_fields", "truncate"})  # fmt: skip


InferAll = Callable[
    [Sequence[Ask], Caller | None, Callable[[], None] | None], Awaitable[list[Result]]
]
"""`Engine.infer_all`."""
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def tei_error(error: BatchserveError, request_id: str) -> dict[str, Any]:
    """TEI's error body; the request id travels in X-Request-Id."""
    if isinstance(error, Overloaded | RateLimited):
        kind = "overloaded"
    elif error.status == 503:
        kind = "unhealthy"
    elif error.status >= 500:
        kind = "backend"
    elif error.status == 400 and "empty" in str(error):
        kind = "empty"
    else:
        kind = "validation"
    return {"error": str(error), "error_type": kind}


class RetrievalApi:
    def __init__(
        self,
        *,
        reception: Reception,
        infer_all: InferAll,
        text_model: Callable[[str | None, TextKind], tuple[str, TextModel]],
        dimensions: Callable[[str], frozenset[int]],
        max_inputs: Callable[[], int],
        version: str,
    ) -> None:
        self._reception = reception
        self._infer_all = infer_all
        self._text_model = text_model
        self._dimensions = dimensions
        self._max_inputs = max_inputs
        self._version = version

    def mount(self, add: Callable[[str, str, Handler], None]) -> None:
        add("POST", "/embed", self.embed)
        add("POST", "/rerank", self.rerank)
        add("POST", "/predict", self.predict)
        add("POST", "/v1/rerank", self.cohere_rerank)
        add("POST", "/v2/rerank", self.cohere_rerank)
        add("POST", "/tokenize", self.tokenize)
        add("POST", "/decode", self.decode)
        add("GET", "/info", self.info)

    async def _run(
        self,
        request: web.Request,
        path: str,
        parse: Callable[[dict[str, Any], web.Request], bodies.Plan],
        answer: Callable[[bodies.Plan, list[Result], str], object],
        tei: bool = True,
    ) -> web.StreamResponse:
        """The request path of every route that runs a model: read, run each input, answer."""
        shape = tei_error if tei else None
        call = await read_call(
            request, self._reception, ROUTES[path], parse, like="{...}", shape=shape
        )
        if isinstance(call, web.Response):
            return call
        request_id, plan = call.request_id, call.body
        try:
            asks = [Ask(text, model=plan.model, params=plan.params) for text in plan.texts]
            results = await self._infer_all(asks, call.caller, plan.check)
        except BatchserveError as error:
            return error_response(error, request_id, shape=shape)
        body = answer(plan, results, request_id)
        if isinstance(body, list) and len(body) > ANSWER_SLICE:
            return await _json_in_slices(request, body, request_id)
        return _json(body, request_id)

    # /embed

    async def embed(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, "/embed", self._parse_embed, _embed_answer)

    def _parse_embed(self, payload: dict[str, Any], _: web.Request) -> bodies.Plan:
        bodies.check_fields(payload, _EMBED)
        model, facts = self._text_model(bodies.model_field(payload), "embed")
        texts = bodies.texts_of(payload.get("inputs"), "inputs")
        bodies.check_count(len(texts), "inputs", self._max_inputs())
        normalize = bodies.flag(payload, "normalize", True)
        truncate = bodies.flag(payload, "truncate", False)
        wanted = bodies.direction(payload)
        bodies.no_prompt(payload)
        size = bodies.dimensions_of(payload, lambda: self._dimensions(model))
        check = bodies.lengths(lambda: texts, "inputs", facts, truncate)
        params = bodies.params_of(wanted, normalize=None if normalize else False)
        return bodies.Plan(model, texts, params, {"size": size, "normalize": normalize}, check)

    # /rerank and /v1/rerank

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, "/rerank", self._parse_rerank, _rerank_answer)

    def _parse_rerank(self, payload: dict[str, Any], _: web.Request) -> bodies.Plan:
        bodies.check_fields(payload, _RERANK)
        model, facts = self._text_model(bodies.model_field(payload), "rerank")
        query = bodies.query_of(payload)
        texts = bodies.texts_of(payload.get("texts"), "texts", single=False)
        return self._pairs(
            model, facts, query, texts, "texts", bodies.flag(payload, "truncate", False),
            bodies.direction(payload),
            {
                "raw": bodies.flag(payload, "raw_scores", False),
                "return_text": bodies.flag(payload, "return_text", False),
            },
        )  # fmt: skip

    def _pairs(
        self,
        model: str,
        facts: TextModel,
        query: str,
        texts: list[str],
        field: str,
        truncate: bool,
        wanted: str,
        options: dict[str, Any],
    ) -> bodies.Plan:
        bodies.check_count(len(texts), field, self._max_inputs())
        check = bodies.lengths(lambda: [(query, text) for text in texts], field, facts, truncate)
        params = bodies.params_of(wanted)
        return bodies.Plan(
            model, bodies.pairs(query, texts), params, {**options, "texts": texts}, check
        )

    async def cohere_rerank(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, "/v1/rerank", self._parse_cohere, _cohere_answer, tei=False)

    def _parse_cohere(self, payload: dict[str, Any], _: web.Request) -> bodies.Plan:
        try:
            bodies.check_fields(payload, _COHERE)
            model, facts = self._text_model(bodies.model_field(payload), "rerank")
            query = bodies.query_of(payload)
            texts = _documents(payload.get("documents"))
            top_n = payload.get("top_n")
            if top_n is not None and (type(top_n) is not int or top_n < 1):
                raise InvalidInput('"top_n" must be a whole number of 1 or more')
            options = {
                "top_n": top_n,
                "return_documents": bodies.flag(payload, "return_documents", False),
                "model": model,
            }
            # Cohere cuts long documents ("END") unless told "NONE".
            truncate = payload.get("truncate", "END") != "NONE"
            return self._pairs(model, facts, query, texts, "documents", truncate, "right", options)
        except InvalidInput as error:  # our routes answer a bad field with 400, not TEI's 422
            if error.status == 400:
                raise
            raise InvalidInput(str(error)) from None

    # /predict

    async def predict(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, "/predict", self._parse_predict, _predict_answer)

    def _parse_predict(self, payload: dict[str, Any], _: web.Request) -> bodies.Plan:
        bodies.check_fields(payload, _PREDICT)
        parameters = payload.get("parameters")
        if parameters is not None and not (
            isinstance(parameters, dict) and all(v is None for v in parameters.values())
        ):
            raise Unprocessable('"parameters" is taken only empty (or null)')
        model, facts = self._text_model(bodies.model_field(payload), "predict")
        items, listed = bodies.predict_items(payload.get("inputs"))
        bodies.check_count(len(items), "inputs", self._max_inputs())
        truncate = bodies.flag(payload, "truncate", False)
        check = bodies.lengths(lambda: items, "inputs", facts, truncate)
        options = {"raw": bodies.flag(payload, "raw_scores", False), "listed": listed,
                   "labels": facts.labels}  # fmt: skip
        texts = [bodies.item_text(item) for item in items]
        params = bodies.params_of(bodies.direction(payload))
        return bodies.Plan(model, texts, params, options, check)

    # /tokenize, /decode, /info: the tokenizer's, on the loop; no device

    async def tokenize(self, request: web.Request) -> web.Response:
        def parse(payload: dict[str, Any], _: web.Request) -> bodies.Plan:
            bodies.check_fields(payload, frozenset({"inputs", "add_special_tokens",
                                                    "prompt_name", "model"}))  # fmt: skip
            model, facts = self._text_model(bodies.model_field(payload), "any")
            texts = bodies.texts_of(payload.get("inputs"), "inputs")
            bodies.check_count(len(texts), "inputs", self._max_inputs())
            bodies.no_prompt(payload)
            special = bodies.flag(payload, "add_special_tokens", True)
            tokens = [facts.tokenizer.tokens(text, special) for text in texts]
            return bodies.Plan(model, [], None, {"answer": tokens})

        return await self._local(request, "tokenize", parse)

    async def decode(self, request: web.Request) -> web.Response:
        def parse(payload: dict[str, Any], _: web.Request) -> bodies.Plan:
            bodies.check_fields(payload, frozenset({"ids", "skip_special_tokens", "model"}))
            model, facts = self._text_model(bodies.model_field(payload), "any")
            rows, _nested = bodies.ids_of(payload.get("ids"))
            bodies.check_count(len(rows), "ids", self._max_inputs())
            skip = bodies.flag(payload, "skip_special_tokens", True)
            texts = [facts.tokenizer.decode(row, skip) for row in rows]
            return bodies.Plan(model, [], None, {"answer": texts})

        return await self._local(request, "decode", parse)

    async def _local(
        self,
        request: web.Request,
        route: str,
        parse: Callable[[dict[str, Any], web.Request], bodies.Plan],
    ) -> web.Response:
        """A route the tokenizer answers: read (keys, body), answer; counted as any other."""
        call = await read_call(request, self._reception, route, parse, like="{...}",
                               shape=tei_error)  # fmt: skip
        if isinstance(call, web.Response):
            return call
        return _json(call.body.options["answer"], call.request_id)

    async def info(self, request: web.Request) -> web.Response:
        """TEI's model info, of `?model=` (or the one model that serves these routes)."""
        request_id = request_id_of(request)[0]
        try:
            self._reception.authenticate(request.headers.get("Authorization"))
            model, facts = self._text_model(request.query.get("model"), "any")
        except BatchserveError as error:
            return error_response(error, request_id, shape=tei_error)
        if facts.labels is None:
            kind: dict[str, Any] = {"embedding": {"pooling": "mean"}}
        else:
            labels = {"id2label": {str(i): label for i, label in enumerate(facts.labels)},
                      "label2id": {label: i for i, label in enumerate(facts.labels)}}  # fmt: skip
            kind = {"reranker" if len(facts.labels) == 1 else "classifier": labels}
        body = {
            "model_id": model,
            "model_sha": None,
            "model_dtype": "float32",
            "model_type": kind,
            "max_concurrent_requests": self._max_inputs(),
            "max_input_length": facts.max_input_tokens,
            "max_batch_tokens": facts.max_input_tokens * self._max_inputs(),
            "max_batch_requests": None,
            "max_client_batch_size": self._max_inputs(),
            "auto_truncate": False,
            "tokenization_workers": 1,
            "version": self._version,
            "sha": None,
            "docker_label": None,
        }
        return json_response(200, body, {"X-Request-Id": request_id})


def _json(body: object, request_id: str) -> web.Response:
    """A 200 of any JSON value: TEI's answers are lists, not objects."""
    return web.Response(body=orjson.dumps(body), headers=_json_headers(request_id))


def _json_headers(request_id: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Request-Id": request_id}


async def _json_in_slices(
    request: web.Request, items: list[Any], request_id: str
) -> web.StreamResponse:
    """A 200 of a long JSON list, written `ANSWER_SLICE` items at a time (chunked), yielding
    to the event loop after each."""
    response = web.StreamResponse(headers=_json_headers(request_id))
    await response.prepare(request)
    for start in range(0, len(items), ANSWER_SLICE):
        piece = orjson.dumps(items[start : start + ANSWER_SLICE])
        await response.write((b"[" if start == 0 else b",") + piece[1:-1])
        await asyncio.sleep(0)
    await response.write(b"]")
    await response.write_eof()
    return response


def _documents(given: object) -> list[str]:
    """Cohere's and Jina's `documents`: strings, or objects with a "text"."""
    if not isinstance(given, list):
        raise InvalidInput('"documents" must be a list of strings or of {"text": ...}')
    texts = [d.get("text") if isinstance(d, dict) else d for d in given]
    if not all(isinstance(text, str) for text in texts):
        raise InvalidInput('"documents" must be a list of strings or of {"text": ...}')
    if not texts:
        raise InvalidInput('"documents" is empty')
    return texts  # type: ignore[return-value]


def _outputs(results: Sequence[Result]) -> list[Any]:
    return [result.output for result in results]


def _embed_answer(plan: bodies.Plan, results: list[Result], _: str) -> list[list[float]]:
    size, normalize = plan.options["size"], plan.options["normalize"]
    return [bodies.cut(vector, size, normalize) for vector in _outputs(results)]


def _rerank_answer(plan: bodies.Plan, results: list[Result], _: str) -> list[dict[str, Any]]:
    texts = plan.options["texts"]
    ranks = bodies.ranked(_outputs(results), plan.options["raw"])
    if plan.options["return_text"]:
        return [{"index": i, "score": s, "text": texts[i]} for i, s in ranks]
    return [{"index": i, "score": s} for i, s in ranks]


def _cohere_answer(plan: bodies.Plan, results: list[Result], request_id: str) -> dict[str, Any]:
    options = plan.options
    ranks = bodies.ranked(_outputs(results), raw=False)[: options["top_n"]]
    rows: list[dict[str, Any]] = []
    for index, score in ranks:
        row: dict[str, Any] = {"index": index, "relevance_score": score}
        if options["return_documents"]:
            row["document"] = {"text": options["texts"][index]}
        rows.append(row)
    return {
        "id": request_id,
        "model": options["model"],
        "results": rows,
        "meta": {"billed_units": {"search_units": 1}},
    }


def _predict_answer(plan: bodies.Plan, results: list[Result], _: str) -> list[Any]:
    labels: tuple[str, ...] = plan.options["labels"] or ()
    answers = []
    for logits in _outputs(results):
        scored = zip(labels, bodies.scores(logits, plan.options["raw"]), strict=True)
        answers.append(
            [{"label": label, "score": score} for label, score in
             sorted(scored, key=lambda pair: -pair[1])]
        )  # fmt: skip
    return answers if plan.options["listed"] else answers[0]
