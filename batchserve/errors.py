"""The errors a request can end with, and the one for a failed start-up.

BatchserveError            one request's failure; server.py maps each to an HTTP answer
├── InvalidInput           the body is not what the API takes              (400)
├── DuplicateRequestId     the X-Request-Id is already in flight           (409)
├── Unauthenticated        no API key, or one the server does not know     (401)
├── NotFound               no such request in the status store             (404)
├── InputTooLarge          body or input over --max-input-bytes           (413)
├── RateLimited            the tenant is over its tier's rate             (429)
├── BackendError           the batch function raised or answered badly     (500)
├── Overloaded             the queue is full; carries a retry estimate     (503)
├── NotReady               starting, draining or shut down                 (503)
└── DeadlineExceeded       the request's deadline passed                   (504)

StartupError               bad configuration or a backend that cannot load; the CLI
                           prints its one-line message and exits 1
"""

from __future__ import annotations


class BatchserveError(Exception):
    """A failure that belongs to one request and becomes its response."""


class InvalidInput(BatchserveError):
    pass


class DuplicateRequestId(BatchserveError):
    pass


class Unauthenticated(BatchserveError):
    pass


class NotFound(BatchserveError):
    pass


class RateLimited(BatchserveError):
    def __init__(self, message: str, retry_after_s: float, limit: float, reset_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit
        self.reset_s = reset_s


class InputTooLarge(BatchserveError):
    pass


class BackendError(BatchserveError):
    pass


class Overloaded(BatchserveError):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(BatchserveError):
    pass


class DeadlineExceeded(BatchserveError):
    pass


class StartupError(Exception):
    """Start-up cannot go on; the message is one line that names the cause."""
