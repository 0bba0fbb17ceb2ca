"""What the OpenAI routes add around a generation: `n` choices, log probabilities, `echo`.

- `n` (1 to `MAX_N`): n generations of the same prompt, each its own sequence (its own stop,
  end and stream), the first computing the prompt and the others copying its rows in the
  device's cache (`Seq.fork_of`), so n choices cost one prefill. A `seed` is spread to one
  per choice, so that sampled choices differ yet repeat.
- Log probabilities: chat's `logprobs: true` with `top_logprobs` (0 to 20), completions'
  `logprobs` N (0 to 20), reported in OpenAI's shapes (chat: `content` entries with `bytes`;
  completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), whole or in each
  streamed chunk. They become vLLM's `logprobs` param, computed in the batched step.
- `echo` (completions): the prompt before the completion; with `logprobs`, the prompt's
  tokens' too (vLLM's `prompt_logprobs`; the first token has none), and `max_tokens: 0`
  makes nothing more: what evaluators score a text by. The first choice alone computes the
  prompt's log-probabilities (the others copy its rows, which a sequence that computes them
  cannot do) and every choice echoes them; with `max_tokens: 0` the n choices are one
  generation written n times, since nothing is sampled.

Everything here is checked before any generation starts: a bad value is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from aiohttp import web

from ..errors import BatchserveError, InvalidInput
from ..generation.request import Generation
from ..models.logprobs import TokenLogprob
from ..rules.sampling_params import MAX_LOGPROBS, SEED_RANGE
from .generation_answer import DONE, STREAM_HEADERS
from .wire import error_response, json_response

MAX_N = 16
"""The most choices one request may ask for."""
CHAT_FIELDS = ("n", "logprobs", "top_logprobs")
COMPLETION_FIELDS = ("n", "logprobs", "echo")
"""The body fields read here, by route."""
_SEED_STRIDE = 0x9E3779B97F4A7C15
"""Spreads a request's seed to its choices (an odd constant: no two choices share one)."""


class Choices(NamedTuple):
    """What a body asks of its choices: how many, how many alternatives each token's
    log-probability lists (None: no log-probabilities), and whether the prompt is echoed."""

    n: int = 1
    logprobs: int | None = None
    echo: bool = False


def read_choices(payload: Mapping[str, Any], *, chat: bool) -> Choices:
    """The body's `n`, `logprobs` (and chat's `top_logprobs`, completions' `echo`), checked."""
    n = _whole(payload.get("n"), "n", 1, MAX_N, default=None) or 1
    if not chat:
        logprobs = _whole(payload.get("logprobs"), "logprobs", 0, MAX_LOGPROBS, default=None)
        echo = payload.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise InvalidInput('"echo" must be true or false')
        return Choices(n, logprobs, bool(echo))
    wanted = payload.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidInput('"logprobs" must be true or false')
    top = _whole(payload.get("top_logprobs"), "top_logprobs", 0, MAX_LOGPROBS, default=None)
    if top is not None and not wanted:
        raise InvalidInput('"top_logprobs" needs "logprobs": true')
    return Choices(n, (top or 0) if wanted else None)


def _whole(value: object, name: str, least: int, most: int, *, default: int | None) -> int | None:
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidInput(f'"{name}" must be a whole number from {least} to {most}')
    return value


def choice_params(
    params: dict[str, Any], choices: Choices, index: int, prompt_ids: list[int] | None
) -> dict[str, Any]:
    """The generation params of choice `index`: the log-probabilities it asks for (the
    first choice, the prompt's too where echoed: an echoed prompt of token ids always, for
    its text), and its own seed."""
    own = dict(params)
    if choices.logprobs is not None:
        own["logprobs"] = choices.logprobs
    if index == 0 and choices.echo and (choices.logprobs is not None or prompt_ids is not None):
        own["prompt_logprobs"] = choices.logprobs or 0
    if index and own.get("seed") is not None:
        low, high = SEED_RANGE
        own["seed"] = (own["seed"] + index * _SEED_STRIDE - low) % (high - low + 1) + low
    return own


@contextlib.asynccontextmanager
async def all_choices(
    start: Callable[[int], contextlib.AbstractAsyncContextManager[Generation]], n: int
) -> AsyncIterator[list[Generation]]:
    """The n generations, started in order (`start(index)`); leaving cancels those left."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(start(index)) for index in range(n)]


class Shape(Protocol):
    """How a route writes its choices: whole, or each event as a chunk, then the closing
    chunk, or a failure's."""

    def whole(self, gens: list[Generation], outputs: list[str]) -> dict[str, Any]: ...

    def event(self, event: Event, gens: list[Generation]) -> bytes: ...

    def closing(self, gens: list[Generation]) -> bytes: ...

    def failure(self, error: BatchserveError) -> bytes: ...


async def answer_choices(
    request: web.Request,
    choosing: contextlib.AbstractAsyncContextManager[list[Generation]],
    request_id: str,
    *,
    stream: bool,
    shape: Shape,
    first_leads: bool = False,
) -> web.StreamResponse:
    """Runs the choices (`all_choices`) and answers, as `answer_generation` does one: the
    stream opens with the first piece of any choice (a refusal or a failure before it is an
    error answer), a failure after it is a chunk, then `data: [DONE]`; `first_leads`:
    `merged`'s."""
    headers = {"X-Request-Id": request_id}
    try:
        async with choosing as gens:
            if stream:
                return await _stream(request, merged(gens, first_leads=first_leads), gens,
                                     headers, shape)  # fmt: skip
            outputs = [await gen.result() for gen in gens]  # they run together meanwhile
    except BatchserveError as error:
        return error_response(error, request_id, openai_shape=True)
    return json_response(200, shape.whole(gens, outputs), headers)


async def _stream(
    request: web.Request,
    pieces: AsyncGenerator[Event, None],
    gens: list[Generation],
    headers: dict[str, str],
    shape: Shape,
) -> web.StreamResponse:
    async with contextlib.aclosing(pieces) as events:
        try:
            first = await anext(events)
        except BatchserveError as error:
            return error_response(error, headers["X-Request-Id"], openai_shape=True)
        response = web.StreamResponse(headers=STREAM_HEADERS | headers)
        await response.prepare(request)
        try:
            await response.write(shape.event(first, gens))
            async for event in events:
                await response.write(shape.event(event, gens))
            await response.write(shape.closing(gens) + DONE)
        except BatchserveError as error:
            await response.write(shape.failure(error) + DONE)
        await response.write_eof()
        return response


class Copies:
    """A shape that writes `n` choices from one generation: echo with `max_tokens: 0`, where
    nothing is sampled and every choice is the prompt and its log-probabilities."""

    def __init__(self, shape: Shape, n: int) -> None:
        self._shape, self._n = shape, n

    def whole(self, gens: list[Generation], outputs: list[str]) -> dict[str, Any]:
        return self._shape.whole(gens * self._n, outputs * self._n)

    def event(self, event: Event, gens: list[Generation]) -> bytes:
        copies = gens * self._n
        return b"".join(self._shape.event(event._replace(choice=i), copies) for i in range(self._n))

    def closing(self, gens: list[Generation]) -> bytes:
        return self._shape.closing(gens)

    def failure(self, error: BatchserveError) -> bytes:
        return self._shape.failure(error)


class Event(NamedTuple):
    """One choice's piece of text (None: it ended), with its tokens made by then."""

    choice: int
    text: str | None
    tokens: int


async def merged(
    gens: Sequence[Generation], *, first_leads: bool = False
) -> AsyncGenerator[Event, None]:
    """The pieces of every choice as they come, each choice's in order; a choice's failure
    raises here (the others are cancelled when the caller leaves). `first_leads`: the other
    choices' events wait for the first choice's first (an echo's other choices write the
    prompt's log-probabilities that the first computes: all there once it has a token)."""
    if len(gens) == 1:  # no task, no queue: the common case costs what it did
        gen = gens[0]
        async for text in gen.pieces():
            yield Event(0, text, gen.tokens_read)
        yield Event(0, None, len(gen.seq.tokens))
        return
    events: asyncio.Queue[Event | BaseException] = asyncio.Queue()

    async def read(index: int, gen: Generation) -> None:
        try:
            async for text in gen.pieces():
                events.put_nowait(Event(index, text, gen.tokens_read))
            events.put_nowait(Event(index, None, len(gen.seq.tokens)))
        except Exception as error:
            events.put_nowait(error)

    tasks = [asyncio.create_task(read(index, gen)) for index, gen in enumerate(gens)]
    try:
        ended = 0
        held: list[Event] | None = [] if first_leads else None
        while ended < len(gens):
            event = await events.get()
            if isinstance(event, BaseException):
                raise event
            ended += event.text is None
            if held is not None and event.choice:
                held.append(event)
                continue
            yield event
            for later in held or ():
                yield later
            held = None
    finally:
        for task in tasks:
            task.cancel()


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's `logprobs`: one `content` entry per token, with its bytes and its
    most likely alternatives."""
    return {
        "content": [
            {**_chat_entry(e.token, e.logprob), "top_logprobs": [
                _chat_entry(c.token, c.logprob) for c in e.top]}
            for e in entries
        ],
        "refusal": None,
    }  # fmt: skip


def _chat_entry(token: bytes, logprob: float | None) -> dict[str, Any]:
    return {"token": _text(token), "logprob": logprob, "bytes": list(token)}


def completion_logprobs(entries: Sequence[TokenLogprob | None], offset: int) -> dict[str, Any]:
    """A completion choice's `logprobs`: its tokens (the echoed prompt's first, whose own
    log-probability is None), their log-probabilities, the alternatives at each place and
    where each token's text starts in the choice's text, in characters from `offset` (a
    token inside a character starts where that character does)."""
    tokens, values, tops, offsets = [], [], [], []
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for entry in entries:
        if entry is None:  # not computed (a failed prefill): never in an answer
            continue
        tokens.append(_text(entry.token))
        values.append(entry.logprob)
        first = entry.logprob is None  # the prompt's first token: OpenAI writes null there
        tops.append(None if first else {_text(c.token): c.logprob for c in entry.top})
        offsets.append(offset)
        offset += len(decoder.decode(entry.token))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def _text(token: bytes) -> str:
    """A token's text; one whose bytes make no whole characters is written as OpenAI does,
    `bytes:` and the bytes escaped (its chat entry's `bytes` say them too)."""
    try:
        return token.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token)


def prompt_text(gen: Generation) -> str:
    """The prompt as given, or for token ids, the text of their bytes (from its
    log-probabilities' tokens, which a prompt of ids always asks for when echoed)."""
    if gen.seq.prompt_ids is None:
        return gen.seq.prompt
    joined = b"".join(e.token for e in gen.prompt_logprobs or () if e is not None)
    return joined.decode(errors="replace")
