"""The asyncio client: `AsyncClient`, over httpx.AsyncClient; the same calls and rules as
`Client`'s (`_common.py`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from ._common import (
    Generated,
    Inference,
    Status,
    _answer,
    _base,
    _Deadlines,
    _embeddings,
    _generate_body,
    _generated,
    _inference,
    _need,
    _poll_path,
    _SseReader,
    _status,
    _without_none,
)


class AsyncClient:
    """The same calls as `Client`, awaited; `stream` is an async iterator."""

    def __init__(
        self,
        url: str | None = None,
        *,
        uds: str | None = None,
        api_key: str | None = None,
        timeout: float = 30.0,
        seed: int | None = None,
    ) -> None:
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        transport = httpx.AsyncHTTPTransport(uds=uds) if uds else None
        self._http = httpx.AsyncClient(
            base_url=_base(url, uds), headers=headers, transport=transport, timeout=None
        )
        self._deadlines = _Deadlines(timeout, seed)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def infer(
        self,
        input: str,
        *,
        model: str | None = None,
        version: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Inference:
        body = {"input": input, "model": model, "version": version}
        return _inference(await self._send("POST", "/api/inference", body, timeout, request_id))

    async def submit(
        self,
        input: str,
        *,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> str:
        answer = await self._send("POST", "/api/requests", {"input": input, "model": model},
                                  timeout, request_id)  # fmt: skip
        return str(_need(answer, "request_id", "", 202))

    async def poll(
        self, request_id: str, *, wait: float = 0.0, timeout: float | None = None
    ) -> Status:
        """As `Client.poll`."""
        answer = await self._send("GET", _poll_path(request_id, wait), None, timeout, None)
        return _status(answer, request_id)

    async def embed(
        self, inputs: list[str], *, model: str | None = None, timeout: float | None = None
    ) -> list[list[float]]:
        answer = await self._send("POST", "/v1/embeddings", {"input": inputs, "model": model},
                                  timeout, None)  # fmt: skip
        return _embeddings(answer)

    async def generate(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> Generated:
        body = _generate_body(prompt, max_tokens, False, fields)
        return _generated(await self._send("POST", "/api/generate", body, timeout, None))

    async def stream(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> AsyncIterator[str]:
        attempts = self._deadlines.attempts(timeout, None)
        body = _generate_body(prompt, max_tokens, True, fields)
        while True:
            try:
                async with self._http.stream(
                    "POST", "/api/generate", json=body, headers=attempts.headers(),
                    timeout=attempts.time_left(),
                ) as response:  # fmt: skip
                    error_body = await response.aread() if response.status_code >= 300 else b""
                    wait = attempts.check(response.status_code, error_body)
                    if wait is None:
                        reader = _SseReader(attempts.request_id)
                        async for line in response.aiter_lines():
                            if (token := reader.line(line)) is not None:
                                yield token
                        return
            except httpx.ConnectError as cause:
                wait = attempts.refused(cause)
            except httpx.TimeoutException:
                attempts.time_left()
                raise
            await asyncio.sleep(wait)

    async def _send(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout: float | None,
        request_id: str | None,
    ) -> dict[str, Any]:
        attempts = self._deadlines.attempts(timeout, request_id)
        attempts.submitting = (method, path) == ("POST", "/api/requests")
        content = None if body is None else orjson.dumps(_without_none(body))
        while True:
            try:
                response = await self._http.request(
                    method, path, content=content, headers=attempts.headers(),
                    timeout=attempts.time_left(),
                )  # fmt: skip
                wait = attempts.check(response.status_code, response.content)
                if wait is None:
                    return _answer(response.content, attempts.request_id)
            except httpx.TimeoutException:
                attempts.time_left()  # raises DeadlineExceeded
                raise
            except httpx.TransportError as cause:
                wait = attempts.refused(cause)
            await asyncio.sleep(wait)
