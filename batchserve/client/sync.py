"""The blocking client: `Client`, over httpx.Client; the rules it follows are `_common.py`'s."""

from __future__ import annotations

import time
from collections.abc import Iterator
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


class Client:
    """Blocking client. `url` like "http://127.0.0.1:8000", or `uds` a Unix socket path;
    `timeout` is each call's default deadline in seconds; `api_key` is sent as a Bearer
    token."""

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
        transport = httpx.HTTPTransport(uds=uds) if uds else None
        self._http = httpx.Client(
            base_url=_base(url, uds), headers=headers, transport=transport, timeout=None
        )
        self._deadlines = _Deadlines(timeout, seed)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def infer(
        self,
        input: str,
        *,
        model: str | None = None,
        version: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> Inference:
        body = {"input": input, "model": model, "version": version}
        answer = self._send("POST", "/api/inference", body, timeout, request_id)
        return _inference(answer)

    def submit(
        self,
        input: str,
        *,
        model: str | None = None,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues the input and returns its request id at once; `poll` it."""
        answer = self._send("POST", "/api/requests", {"input": input, "model": model}, timeout,
                            request_id)  # fmt: skip
        return str(_need(answer, "request_id", "", 202))

    def poll(self, request_id: str, *, wait: float = 0.0, timeout: float | None = None) -> Status:
        """The request's status; `wait` (seconds, below the call's timeout) lets the server
        hold the poll until the request ends, for at most that long."""
        return _status(self._send("GET", _poll_path(request_id, wait), None, timeout, None),
                       request_id)  # fmt: skip

    def embed(
        self, inputs: list[str], *, model: str | None = None, timeout: float | None = None
    ) -> list[list[float]]:
        body = {"input": inputs, "model": model}
        return _embeddings(self._send("POST", "/v1/embeddings", body, timeout, None))

    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> Generated:
        """The whole text; `fields` are the body's others (model, stop, params, ...)."""
        body = _generate_body(prompt, max_tokens, False, fields)
        return _generated(self._send("POST", "/api/generate", body, timeout, None))

    def stream(
        self,
        prompt: str,
        *,
        max_tokens: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> Iterator[str]:
        """Each token's text as it is generated; retried only before the stream opens."""
        attempts = self._deadlines.attempts(timeout, None)
        body = _generate_body(prompt, max_tokens, True, fields)
        while True:
            try:
                with self._http.stream(
                    "POST", "/api/generate", json=body, headers=attempts.headers(),
                    timeout=attempts.time_left(),
                ) as response:  # fmt: skip
                    wait = attempts.check(response.status_code, response.read()
                                          if response.status_code >= 300 else b"")  # fmt: skip
                    if wait is None:
                        reader = _SseReader(attempts.request_id)
                        for line in response.iter_lines():
                            if (token := reader.line(line)) is not None:
                                yield token
                        return
            except httpx.ConnectError as cause:
                wait = attempts.refused(cause)
            except httpx.TimeoutException:
                attempts.time_left()
                raise
            time.sleep(wait)

    def _send(
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
                response = self._http.request(
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
            time.sleep(wait)
