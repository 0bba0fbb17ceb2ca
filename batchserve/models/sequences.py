"""What a real generator holds for each sequence on its device, apart from the cache's rows:
the ids it feeds, how many are in the cache, its text so far, and the keys that name its whole
blocks in the prefix cache (`kv_cache.py`). `causal_lm.CausalLM` keeps one `Sequences`."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import Detokenizer
from .generators import Seq
from .grammar import Matcher
from .kv_cache import BLOCK, block_keys, root_key

LOOKUPS_KEPT = 256
"""Waiting sequences whose ids and block keys are kept between the scheduler's questions."""


@dataclass(slots=True, eq=False)
class Held:
    """One sequence: the ids to feed (prompt, then what it made), how many are in the cache,
    its text so far, and the keys of its whole blocks (chained from `root`, its rows'
    identity and cache key)."""

    ids: list[int]
    fed: int
    text: Detokenizer
    root: bytes
    keys: list[bytes] = field(default_factory=list)
    prompt: int = 0
    """How many of `ids` are the prompt's."""
    matcher: Matcher | None = None
    """Its place in its grammar, if it has one: the step masks its logits by it."""

    def usable(self) -> list[bytes]:
        """Keys of the blocks that may come from the cache: never the one holding the last
        id, which is fed so that the sequence has logits."""
        return self.keys[: (len(self.ids) - 1) // BLOCK]

    def fed_keys(self) -> list[bytes]:
        """Keys of every whole block fed so far (those of made ids added as they fill)."""
        whole = self.fed // BLOCK
        if len(self.keys) < whole:
            parent = self.keys[-1] if self.keys else self.root
            self.keys += block_keys(parent, self.ids[len(self.keys) * BLOCK : whole * BLOCK])
        return self.keys


class Sequences:
    """The sequences a device holds, and those the scheduler asked about while they wait."""

    def __init__(self, tokenizer: Any, encode: Callable[[str], list[int]], identity: str) -> None:
        self._tokenizer = tokenizer
        self._encode = encode
        self._identity = identity
        """What the rows depend on besides the tokens: part of every block's key."""
        self._held: dict[str, Held] = {}
        self._asked: OrderedDict[str, Held] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, seq: Seq) -> Held:
        """The sequence's state, made on first sight unless it was attached: after a release
        it is recomputed from its prompt and the ids it made, and its text goes on where it
        left off."""
        held = self._held.get(seq.id)
        if held is None:
            held = self._held[seq.id] = self._new(seq)
        return held

    def ask(self, seq: Seq) -> Held:
        """A waiting sequence's state, kept (a bounded few) for the next question."""
        held = self._asked[seq.id] = self._asked_before(seq)
        while len(self._asked) > LOOKUPS_KEPT:
            self._asked.popitem(last=False)
        return held

    def take(self, seq: Seq) -> Held:
        """A sequence admitted: its state from now on."""
        held = self._held[seq.id] = self._asked_before(seq)
        return held

    def running(self, seq_id: str) -> Held | None:
        """An admitted sequence's state (None: not on this device now)."""
        return self._held.get(seq_id)

    def sibling(self, seq: Seq, held: Held) -> tuple[Held, int] | None:
        """The sibling one of `n` choices copies its prompt's rows from, if it runs on this
        device with the same prompt and cache key, and how many tokens it would copy (all
        but the choice's own last, which is fed for its logits)."""
        sibling = self._held.get(seq.fork_of) if seq.fork_of else None
        if sibling is None or sibling.root != held.root:
            return None
        tokens = min(held.prompt, len(held.ids) - 1)
        if sibling.prompt < tokens or sibling.ids[:tokens] != held.ids[:tokens]:
            return None
        return sibling, tokens

    def drop(self, seq_id: str) -> None:
        self._held.pop(seq_id, None)
        self._asked.pop(seq_id, None)

    def _asked_before(self, seq: Seq) -> Held:
        """The state made at an earlier question, unless the sequence ran (on another
        device) and made tokens since, or its cache key changed (its blocks' keys with it)."""
        held = self._asked.pop(seq.id, None)
        if (
            held is None
            or len(held.text.made) != len(seq.token_ids)
            or held.root != root_key(self._identity, seq.cache_key)
        ):
            return self._new(seq)
        return held

    def _new(self, seq: Seq) -> Held:
        made = list(seq.token_ids)
        text = Detokenizer(self._tokenizer, made, sum(map(len, seq.tokens)))
        prompt = self._encode(seq.prompt) if seq.prompt_ids is None else list(seq.prompt_ids)
        ids = prompt + made
        root = root_key(self._identity, seq.cache_key)
        matcher = None if seq.grammar is None else seq.grammar.matcher(made)
        return Held(ids, 0, text, root, block_keys(root, ids), len(prompt), matcher)
