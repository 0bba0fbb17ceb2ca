"""Incremental detokenization: text is given out only in whole characters.

A byte-level tokenizer's token can end inside a character ("日" is three tokens of SmolLM2's),
so decoding token by token writes U+FFFD where a character spans tokens. Instead each step
decodes every token made so far and gives out what is new, holding it back while it ends in
an incomplete character; the last token (the end, or `max_tokens`) gives out the rest but an
incomplete character at the very end: a sequence cut inside a character (a Japanese answer
stopped by `max_tokens`) has its token counted, but its broken bytes are never sent as U+FFFD.
The pieces then add up to exactly `tokenizer.decode` of all the ids made, less that
incomplete end, since decoding a longer run of ids only adds text at the end. A sequence's
ids are a few hundred: the decode of them all costs tens of microseconds a step, far below
the model's forward pass.
"""

from __future__ import annotations

from typing import Any

INCOMPLETE = "\ufffd"
"""What a decode writes for bytes that do not make a whole character (yet)."""


class Detokenizer:
    """One sequence's text so far: the ids it made and how much of their text went out."""

    def __init__(self, tokenizer: Any, made: list[int], given_chars: int) -> None:
        self._tokenizer = tokenizer
        self.made = made
        self._given = given_chars

    def __repr__(self) -> str:
        return f"<Detokenizer tokens={len(self.made)} given={self._given}>"

    def push(self, token_id: int, *, last: bool) -> str:
        """The whole characters that `token_id` completes (all that is left, if `last`)."""
        self.made.append(token_id)
        text = self.text()
        if not text.endswith(INCOMPLETE):
            return self._give(text)
        return self.flush() if last else ""

    def flush(self) -> str:
        """What was held back, at the end of the sequence, less an incomplete character."""
        return self._give(self.text().rstrip(INCOMPLETE))

    def _give(self, text: str) -> str:
        piece = text[self._given :]
        self._given = max(self._given, len(text))
        return piece

    def text(self) -> str:
        decoded: str = self._tokenizer.decode(self.made, skip_special_tokens=True)
        return decoded
