"""Calling a batchserve server from Python: `Client` (blocking) and `AsyncClient`.

Both send each call with a stable `X-Request-Id` and the time left before the caller's
deadline as `X-Request-Timeout-Ms`, so the server never works past it. An answer 503 or 429
(and a replica that refuses the connection) is retried after the server's Retry-After with
jitter, but never past the deadline: when the wait would cross it, the call raises
`DeadlineExceeded` at once. Every error answer raises a `ServerError` subclass carrying the
server's status, code, message and request id; a success answer without a field the call
needs (a proxy's page, say) raises `UnexpectedAnswer`, and fields an older server may not send
(an answer's model, version, latency, batch size) are None when absent.

    from batchserve.client import Client
    with Client("http://127.0.0.1:8000") as client:     # or Client(uds="/run/batchserve.sock")
        print(client.infer("hello").output)              # olleh

The retry rules live in `_common.py`'s `_Attempts`, which does no I/O; the two clients
(`sync.py`, `aio.py`) only send. The
client needs httpx, which the server does not: `pip install 'batchserve[client]'`.
"""

from ._common import (
    FIRST_BACKOFF_S,
    JITTER,
    RETRIED,
    BackendError,
    DeadlineExceeded,
    Generated,
    Inference,
    InvalidRequest,
    RateLimited,
    ServerError,
    Status,
    Unauthenticated,
    Unavailable,
    UnexpectedAnswer,
)
from ._common import _Attempts as _Attempts  # its retry rules are tested as they are
from .aio import AsyncClient
from .sync import Client

__all__ = [
    "FIRST_BACKOFF_S",
    "JITTER",
    "RETRIED",
    "AsyncClient",
    "BackendError",
    "Client",
    "DeadlineExceeded",
    "Generated",
    "Inference",
    "InvalidRequest",
    "RateLimited",
    "ServerError",
    "Status",
    "Unauthenticated",
    "Unavailable",
    "UnexpectedAnswer",
]
