"""The bytes that request bodies still arriving may hold: over every connection, and from any
one client address, so that a few clients trickling bodies cannot take it all.

`connections.py` charges each body that its head did not bring whole, for its Content-Length
(the body limit when chunked), once its request passed the key check, and frees it at the
body's last byte or its connection's end.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

from ..errors import Overloaded

IPV6_PREFIX = 64
"""An IPv6 client is bounded by its /64: one host commonly holds a whole /64."""
RETRY_AFTER_S = 1.0


def client_address(peername: object) -> str | None:
    """The address a connection's bodies count against: the peer's IPv4 address (an
    IPv4-mapped IPv6 one too), or its IPv6 /64; None for a Unix socket, which has none (its
    file's permissions bound who connects)."""
    if not isinstance(peername, tuple) or not peername:
        return None
    try:
        address = ipaddress.ip_address(peername[0])
    except ValueError:
        return str(peername[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_PREFIX), strict=False))
    return str(address)


class BodyBudget:
    """Bytes held by unfinished bodies, in all (`held`) and by client address."""

    def __init__(self, limit: Callable[[], int], per_address: Callable[[], int]) -> None:
        self._limit = limit
        self._per_address = per_address
        self.held = 0
        self.by_address: dict[str, int] = {}
        """An address with no body arriving has no entry: as many as connections, at most."""

    def __repr__(self) -> str:
        return f"<BodyBudget held={self.held} limit={self._limit()} by_address={self.by_address}>"

    def reserve(self, address: str | None, size: int) -> Overloaded | None:
        """Takes `size` bytes for a body from `address`; or, taking nothing, why not."""
        if self.held + size > self._limit():
            return Overloaded(
                "the server holds as many unfinished request bodies as it may; send again",
                retry_after_s=RETRY_AFTER_S,
            )
        if address is not None:
            mine = self.by_address.get(address, 0)
            if mine + size > self._per_address():
                return Overloaded(
                    "this client address holds as many unfinished request bodies as one"
                    " address may; send again once one of them has arrived",
                    retry_after_s=RETRY_AFTER_S,
                )
            self.by_address[address] = mine + size
        self.held += size
        return None

    def release(self, address: str | None, size: int) -> None:
        if not size:
            return
        self.held -= size
        if address is not None:
            left = self.by_address[address] - size
            if left:
                self.by_address[address] = left
            else:
                del self.by_address[address]
