"""Triton's binary tensor extension of the Open Inference Protocol (tritonclient's default),
read and written: a body of an `Inference-Header-Content-Length`-byte JSON header, then each
binary tensor's bytes, a BYTES element being a 4-byte little-endian length and that many
bytes. `doors/oip.py` reads every inference body through `read_with_binary` and answers
with `binary_response` when the request asks for binary output.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..engine.requests import MAX_INPUTS_PER_CALL
from ..errors import InvalidInput
from .wire import json_object, read_bytes, read_json

HEADER_LENGTH = "Inference-Header-Content-Length"


def binary_response(
    head: dict[str, Any], output: dict[str, Any], texts: list[str], headers: dict[str, str]
) -> web.Response:
    """The answer `head` (whose `output` tensor holds `texts`) with that output's data in
    binary: the JSON header, then the strings packed."""
    blob = b"".join(_packed(text.encode()) for text in texts)
    output["parameters"] = {"binary_data_size": len(blob)}
    header = orjson.dumps(head)
    headers |= {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return web.Response(body=header + blob, headers=headers)


def _packed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


async def read_with_binary(request: web.BaseRequest, limit: int, like: str) -> dict[str, Any]:
    """The body's JSON object; with the binary extension, its JSON header, each binary
    input's strings put in its "data" as if they had been sent as JSON."""
    declared = request.headers.get(HEADER_LENGTH)
    if declared is None:
        return await read_json(request, limit, like)
    body = await read_bytes(request, limit)
    # isdigit() alone takes "²" and digits past int()'s limit: ASCII, and no longer than
    # any body's length can be written.
    if not (declared.isascii() and declared.isdigit() and len(declared) <= 12) or int(
        declared
    ) > len(body):
        raise InvalidInput(f"{HEADER_LENGTH} must be a length within the body")
    offset = int(declared)
    payload = json_object(body[:offset], like)
    inputs = payload.get("inputs")
    for tensor in inputs if isinstance(inputs, list) else []:
        parameters = tensor.get("parameters") if isinstance(tensor, dict) else None
        size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
        if size is None:
            continue
        if type(size) is not int or not 0 <= size <= len(body) - offset:
            raise InvalidInput('"binary_data_size" must be a length within the body')
        if "data" in tensor:
            raise InvalidInput('an input has both "data" and "binary_data_size"')
        if tensor.get("datatype") == "BYTES":  # others are refused by their datatype
            tensor["data"] = _unpacked(body[offset : offset + size])
        offset += size
    if offset != len(body):
        raise InvalidInput(f"the body has {len(body) - offset} bytes past its tensors' data")
    return payload


def _unpacked(blob: bytes) -> list[str]:
    """BYTES elements: each a 4-byte little-endian length, then that many UTF-8 bytes."""
    texts: list[str] = []
    at = 0
    while at < len(blob) and len(texts) <= MAX_INPUTS_PER_CALL:
        size = int.from_bytes(blob[at : at + 4], "little")
        if at + 4 + size > len(blob):
            raise InvalidInput("binary BYTES data ends inside an element")
        try:
            texts.append(blob[at + 4 : at + 4 + size].decode())
        except UnicodeDecodeError:
            raise InvalidInput(f"string {len(texts)} of the input is not UTF-8") from None
        at += 4 + size
    return texts
