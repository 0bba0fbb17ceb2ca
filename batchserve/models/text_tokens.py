"""A Hugging Face `tokenizer.json` as the text models use it (MiniLM, the cross-encoder).

One plain tokenizer counts, tokenizes and decodes for the doors, on the event loop; one per
truncation direction encodes batches on the device's thread, padded to the batch's longest
input and cut at the model's length (longest first, for pairs). Each is its own object, so
no call changes a setting another thread's call reads.
"""

from __future__ import annotations

from typing import Any

from .retrieval import Item

DIRECTIONS = ("right", "left")


class TextTokens:
    def __init__(self, tokenizers: Any, path: str, max_tokens: int, pad_id: int) -> None:
        self.max_tokens = max_tokens
        self.plain = tokenizers.Tokenizer.from_file(path)
        self.plain.no_truncation()
        self.plain.no_padding()
        self._batch: dict[str, Any] = {}
        pad_token = self.plain.id_to_token(pad_id) or "[PAD]"
        for direction in DIRECTIONS:
            tokenizer = tokenizers.Tokenizer.from_file(path)
            tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)
            tokenizer.enable_truncation(max_length=max_tokens, direction=direction)
            self._batch[direction] = tokenizer

    def encode_batch(self, items: list[Item], direction: str = "right") -> list[Any]:
        """The batch's encodings (ids, attention mask, type ids), padded to its longest."""
        return self._batch[direction].encode_batch(items)  # type: ignore[no-any-return]

    def count(self, item: Item) -> int:
        if isinstance(item, str):
            return len(self.plain.encode(item).ids)
        return len(self.plain.encode(*item).ids)

    def count_cut(self, item: Item) -> int:
        """Its tokens as a batch runs them: cut at the model's length."""
        return min(self.count(item), self.max_tokens)

    def tokens(self, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
        encoding = self.plain.encode(text, add_special_tokens=add_special_tokens)
        special = encoding.special_tokens_mask
        return [
            {
                "id": token_id,
                "text": token,
                "special": bool(is_special),
                "start": None if is_special else start,
                "stop": None if is_special else stop,
            }
            for token_id, token, is_special, (start, stop) in zip(
                encoding.ids, encoding.tokens, special, encoding.offsets, strict=True
            )
        ]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.plain.decode(ids, skip_special_tokens=skip_special_tokens))
