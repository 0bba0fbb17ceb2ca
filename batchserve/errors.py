"""The errors a request can end with, and the one for a failed start-up.

BatchserveError            one request's failure; its class declares the HTTP status and
│                          the error code it is answered with
├── InvalidInput           the body or input is not what the API takes     (400)
│   └── Unprocessable      a field of the wrong type or value, on a route
│                          whose protocol answers that with 422 (TEI's)    (422)
├── OverTierBurst          a list of more inputs than the tier's burst     (400)
├── Unauthenticated        no API key, or one the server does not know     (401)
├── NotFound               no such request in the status store             (404)
├── ModelNotFound          no such model or version                        (404)
├── MethodNotAllowed       the path exists, the method does not            (405)
├── DuplicateRequestId     the X-Request-Id is already in flight           (409)
├── Conflict               the model version exists, or is still loading   (409)
├── InputTooLarge          body or input over --max-input-bytes           (413)
├── RateLimited            the tenant is over its tier's rate             (429)
├── ClientClosed           the client left first; counted, never sent      (499)
├── BackendError           the batch function raised or answered badly     (500)
├── Overloaded             the queue is full; carries a retry estimate     (503)
├── NotReady               starting, draining, failed or no healthy device (503)
│   └── StoreUnavailable   the --result-store cannot be reached            (503)
└── DeadlineExceeded       the request's deadline passed                   (504)
    ├── DeadlineTooShort   shorter than one batch call: it can never be met
    └── PrefillTooLong     a prompt whose prefill alone outlasts its deadline

StartupError               bad configuration or a backend that cannot load; the CLI
                           prints its one-line message and exits 1

The engine raises these to library callers as they are; `doors/wire.py` is the one place that
writes them to the wire (status, JSON body, headers such as Retry-After), and the metrics
count answers by the same status and code.
"""

from __future__ import annotations

from typing import ClassVar


class BatchserveError(Exception):
    """A failure that belongs to one request and becomes its response."""

    status: ClassVar[int]
    code: ClassVar[str]


class InvalidInput(BatchserveError):
    status, code = 400, "INVALID_INPUT"


class Unprocessable(InvalidInput):
    """Text Embeddings Inference answers a body it cannot read into its fields with 422;
    its clients are told so on its routes."""

    status, code = 422, "UNPROCESSABLE"


class Unauthenticated(BatchserveError):
    status, code = 401, "UNAUTHENTICATED"


class NotFound(BatchserveError):
    status, code = 404, "NOT_FOUND"


class ModelNotFound(BatchserveError):
    status, code = 404, "MODEL_NOT_FOUND"


class MethodNotAllowed(BatchserveError):
    status, code = 405, "METHOD_NOT_ALLOWED"

    def __init__(self, message: str, allowed: list[str]) -> None:
        super().__init__(message)
        self.allowed = allowed


class DuplicateRequestId(BatchserveError):
    status, code = 409, "DUPLICATE_REQUEST_ID"


class Conflict(BatchserveError):
    status, code = 409, "CONFLICT"


class InputTooLarge(BatchserveError):
    status, code = 413, "INPUT_TOO_LARGE"


class OverTierBurst(BatchserveError):
    """A list of inputs (OIP, embeddings) that the tier's bucket can never hold at once: a
    retry cannot succeed, so it is not a 429; the client splits the list. 400, as for any
    schema-valid body that breaks a rule JSON Schema cannot state (the OpenAPI document
    tells it in the field's description)."""

    status, code = 400, "OVER_TIER_BURST"


class RateLimited(BatchserveError):
    status, code = 429, "RATE_LIMITED"

    def __init__(self, message: str, retry_after_s: float, limit: float, reset_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.reset_s = reset_s


class ClientClosed(BatchserveError):
    """nginx's 499: what metrics and the access log call a request whose client left."""

    status, code = 499, "CLIENT_CLOSED"


class BackendError(BatchserveError):
    status, code = 500, "BACKEND_ERROR"


class Overloaded(BatchserveError):
    status, code = 503, "OVERLOADED"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(BatchserveError):
    status, code = 503, "NOT_READY"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreUnavailable(NotReady):
    """The shared result store (Redis, SQLite) failed a read or write; retry later."""

    code = "STORE_UNAVAILABLE"


class DeadlineExceeded(BatchserveError):
    status, code = 504, "DEADLINE_EXCEEDED"


class DeadlineTooShort(DeadlineExceeded):
    """The client's own deadline is shorter than one batch call on this server: the
    client's doing, never counted as shedding, and never retried."""

    code = "DEADLINE_TOO_SHORT"


class PrefillTooLong(DeadlineExceeded):
    """A generation whose prompt alone is predicted to prefill past its first-token
    deadline: it can never be met either, but is answered DEADLINE_EXCEEDED, as documented
    for generation; a Batch API line that gets it goes to the error file at once."""


class StartupError(Exception):
    """Start-up cannot go on; the message is one line that names the cause."""
