"""What bytes a tokenizer's tokens stand for: the most a prompt token can stand for (so a
prompt too long by its bytes alone is refused before it is tokenized), and each token's own
bytes (what log-probabilities report beside a token's text, since a byte-level token may be
part of a character)."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from typing import Any


def token_bytes_bound(tokenizer: Any) -> int | None:
    """The most prompt bytes one token stands for, from the vocabulary, so that a prompt too
    long by its bytes alone is refused before it is tokenized; None where a normalizer may
    shrink text first (or the tokenizer is not a fast one). A byte-level token's characters
    are its bytes; any other token's text is at least as long as what it stands for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    setup = json.loads(backend.to_str())
    if setup.get("normalizer") is not None:
        return None
    byte_level = (setup.get("decoder") or {}).get("type") == "ByteLevel"
    added = set(tokenizer.get_added_vocab())
    sizes = (
        len(token) if byte_level and token not in added else len(token.encode())
        for token in tokenizer.get_vocab()
    )
    return max(sizes, default=None)


def byte_decoder(tokenizer: Any) -> Callable[[int], bytes]:
    """A token id's bytes: a byte-level BPE token's characters each stand for one byte
    (GPT-2's table); a SentencePiece token writes "▁" for a space and <0xNN> for a byte;
    an added (special) token is its text. Cached per id (the vocabulary bounds it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None
    if backend is not None:
        decoder = (json.loads(backend.to_str()).get("decoder") or {}).get("type")
    added = set(tokenizer.get_added_vocab())
    table = {char: byte for byte, char in _bytes_to_unicode().items()}

    @cache
    def bytes_of(token_id: int) -> bytes:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if piece in added:
            return piece.encode()
        if decoder == "ByteLevel" and all(char in table for char in piece):
            return bytes(table[char] for char in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    return bytes_of


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}
