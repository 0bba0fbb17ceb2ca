"""Attention over the paged cache (`kv_cache.PagedKV`), with cascade attention for
sequences that share a cached prefix, decoding or feeding a prefill chunk.

Each decoding sequence attends to all of its rows. Read the plain way, every sequence's rows
are gathered into one padded tensor a layer and attended in one call: at a long context that
gather and the reads of each sequence's own copy are most of the step. Sequences holding the
same cached blocks (a shared system prompt) hold the very same rows, so a group of them
attends to that prefix once, all their queries against one copy of its keys and values (a
view of the cache where its rows run in order), and each to its own rows after it; the two
parts are merged exactly by their log-sum-exp (softmax over the union of the keys). Which
sequences form a group, over how many blocks, is chosen where it saves more rows than its
extra calls cost (`MIN_SAVED_ROWS`); the rest are read the plain way. Prefill chunks after
a shared cached prefix (the chats of one system prompt, each feeding its own turn) are grouped
the same way: every chunk's queries against the prefix in one call, and against their own rows
in one more (the chunks padded to the longest), merged alike; otherwise a chunk reads its own
rows alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from .kv_cache import BLOCK

log = logging.getLogger(__name__)

MIN_SAVED_ROWS = 512
"""Rows a group must save (its members but one, times its shared prefix) to be read as a
cascade: below about this many its extra calls and smaller products cost what they save
(measured on SmolLM2's shapes, one CPU core)."""


@dataclass(frozen=True, slots=True)
class Padded:
    """Sequences' rows padded to the longest, and the mask that hides the padding."""

    count: int
    gather: Any
    mask: Any


@dataclass(frozen=True, slots=True)
class Group:
    """Sequences that share their first `prefix` rows (a slice where they run in order, else
    an index tensor), and each one's rows after them."""

    prefix: Any
    suffix: Padded


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How the decoding sequences' rows are read this step: `order` (indices into the list
    given) is the order their queries must come in: each group's, then the rest's."""

    order: list[int]
    groups: list[Group]
    rest: Padded | None


def shared_groups(rows: list[list[int]]) -> list[tuple[list[int], int]]:
    """Groups of sequences (indices into `rows`) and the rows of the prefix each group
    shares, chosen to save the most rows read. Sequences share a block where they hold the
    same rows (a row is held by one block or one sequence), so the blocks' first rows name
    them; sorted by those, a run of sequences shares the least of its neighbours' common
    prefixes, and a run is split where its parts save more than the whole."""
    heads = [row[: (len(row) - 1) // BLOCK * BLOCK : BLOCK] for row in rows]
    ranked = sorted(range(len(rows)), key=lambda i: heads[i])
    common = [_common(heads[a], heads[b]) for a, b in pairwise(ranked)]

    def best(lo: int, hi: int) -> tuple[int, list[tuple[list[int], int]]]:
        if hi - lo < 2:
            return 0, []
        least = min(common[lo : hi - 1])
        saved, start = 0, lo
        groups: list[tuple[list[int], int]] = []
        for cut in [j + 1 for j in range(lo, hi - 1) if common[j] == least] + [hi]:
            part_saved, part = best(start, cut)
            saved, groups, start = saved + part_saved, groups + part, cut
        whole = (hi - lo - 1) * least * BLOCK
        if least and whole >= MIN_SAVED_ROWS and whole >= saved:
            return whole, [(ranked[lo:hi], least * BLOCK)]
        return saved, groups

    return best(0, len(rows))[1]


def decode_plan(torch: Any, device: str, dtype: Any, rows: list[list[int]]) -> DecodePlan:
    """The reading plan for decoding sequences holding `rows` (the step's own row last)."""
    chosen = shared_groups(rows)
    groups, grouped = [], set()
    for members, shared in chosen:
        prefix = _prefix(torch, device, rows[members[0]][:shared])
        suffix = _padded(torch, device, [rows[i][shared:] for i in members], dtype)
        groups.append(Group(prefix, suffix))
        grouped.update(members)
    ungrouped = [i for i in range(len(rows)) if i not in grouped]
    order = [i for members, _ in chosen for i in members] + ungrouped
    rest = _padded(torch, device, [rows[i] for i in ungrouped], None) if ungrouped else None
    return DecodePlan(order, groups, rest)


def attend_decode(
    torch: Any, q: Any, keys: Any, values: Any, plan: DecodePlan, kv_heads: int, scale: float
) -> Any:
    """Attention of the decoding sequences' queries (`q`: `[count, heads, head_dim]`, in the
    plan's order) over one layer's cache rows: `[count, heads * head_dim]`."""
    outputs, start = [], 0
    for group in plan.groups:
        count = group.suffix.count
        outputs.append(_cascade(torch, q[start : start + count], keys, values, group, scale))
        start += count
    if plan.rest is not None:
        rest = plan.rest
        count, length = rest.count, rest.mask.shape[-1]
        # index_select, not keys[gather]: a plain copy of whole rows, about 10x faster.
        k_all = keys.index_select(0, rest.gather).view(count, length, kv_heads, -1)
        v_all = values.index_select(0, rest.gather).view(count, length, kv_heads, -1)
        # Each KV head's group of query heads as that head's rows of queries: no copy of K
        # and V for every query head (GQA), 3x faster at a long context.
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[start:].view(count, kv_heads, -1, q.shape[-1]),
                k_all.transpose(1, 2),
                v_all.transpose(1, 2),
                attn_mask=rest.mask,
                scale=scale,
            )
        )
    joined = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return joined.reshape(q.shape[0], -1)


@dataclass(frozen=True, slots=True)
class PrefillView:
    """How a prefill chunk of `chunk` tokens reads its sequence's rows: after its first chunk,
    all of them gathered (`gather`: those cached before it and its own) under `mask`, which
    lets its token i see the `fed + i + 1` first; a first chunk (`gather` None) attends to its
    own fresh keys, causally, so the kernel skips the hidden half and nothing is gathered."""

    chunk: int
    gather: Any = None
    mask: Any = None


def prefill_view(torch: Any, device: str, dtype: Any, rows: list[int], fed: int) -> PrefillView:
    """The view of a chunk whose sequence holds `rows` (the chunk's own last), `fed` of them
    computed before it. The mask is added to the scores (0 or -inf, in `dtype`): made once a
    step, not converted from booleans by the kernel in every layer."""
    chunk = len(rows) - fed
    if fed == 0:
        return PrefillView(chunk)
    shown = torch.ones(chunk, len(rows), dtype=torch.bool, device=device).tril(fed)
    return PrefillView(chunk, torch.tensor(rows, device=device), _added(torch, shown, dtype))


@dataclass(frozen=True, slots=True)
class PaddedChunks:
    """A group's chunks padded to the `longest`: `gather` picks the padded rows from the
    chunks' (a chunk's last repeated), `kept` the real rows back out of the padded ones.
    Where every chunk is its sequence's first after the prefix, each reads its fresh rows
    causally (`keys` None); else each reads its rows after the prefix from the layer's cache
    (`keys`: their indices, padded to the `widest` alike) under `mask`, added to the scores
    (`[chunks, 1, longest, widest]`: query i of a chunk that computed `fed` rows before it
    sees the first `fed + i + 1`, a padded query what its chunk's last sees)."""

    longest: int
    gather: Any
    kept: Any
    widest: int = 0
    keys: Any = None
    mask: Any = None


@dataclass(frozen=True, slots=True)
class PrefillGroup:
    """Chunks that share a cached prefix (`prefix`: its rows) and attend to it once."""

    prefix: Any
    padded: PaddedChunks
    """How its chunks' own rows are read, in one call (`_chunks_together`)."""

    @property
    def tokens(self) -> int:
        """Its chunks' tokens, all together."""
        return int(self.padded.kept.shape[0])


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """How the step's prefill chunks read their rows. `order` (indices into the list given)
    is the order their tokens must come in: each group's chunks, then the rest's. A group
    attends to its prefix once, all its chunks' queries together, and to their own rows in
    one more call; `views` are what each of the rest reads, in `order`."""

    order: list[int]
    groups: list[PrefillGroup]
    views: list[PrefillView]


def prefill_plan(
    torch: Any, device: str, dtype: Any, rows: list[list[int]], fed: list[int]
) -> PrefillPlan:
    """The reading plan for prefill chunks whose sequences hold `rows` (each chunk's own
    last), `fed` of them computed before it. Chunks whose computed rows share cached blocks
    (the chats of one system prompt, each feeding its own turn) are grouped as decoding
    sequences are (`shared_groups`: whole blocks before each chunk's first token)."""
    chosen = shared_groups([row[: done + 1] for row, done in zip(rows, fed, strict=True)])
    order = [i for members, _ in chosen for i in members]
    grouped = set(order)
    rest = [i for i in range(len(rows)) if i not in grouped]
    groups = []
    for members, shared in chosen:
        owns = [rows[i][shared:] for i in members]
        padded = _padded_chunks(torch, device, dtype, owns, [fed[i] - shared for i in members])
        groups.append(PrefillGroup(_prefix(torch, device, rows[members[0]][:shared]), padded))
    views = [prefill_view(torch, device, dtype, rows[i], fed[i]) for i in rest]
    return PrefillPlan(order + rest, groups, views)


def _padded_chunks(
    torch: Any, device: str, dtype: Any, owns: list[list[int]], fed: list[int]
) -> PaddedChunks:
    """The padding that reads a group's chunks' own rows (`owns`: each sequence's rows after
    the prefix, `fed` of them computed before its chunk) in one call: made once a step, not
    a layer."""
    chunks = [len(own) - done for own, done in zip(owns, fed, strict=True)]
    longest = max(chunks)
    gather: list[int] = []
    kept: list[int] = []
    start = 0
    for index, chunk in enumerate(chunks):
        gather += [start + min(i, chunk - 1) for i in range(longest)]
        kept += range(index * longest, index * longest + chunk)
        start += chunk
    rows, back = torch.tensor(gather, device=device), torch.tensor(kept, device=device)
    if not any(fed):
        return PaddedChunks(longest, rows, back)
    widest = max(map(len, owns))
    keys = [own[min(j, len(own) - 1)] for own in owns for j in range(widest)]
    last_seen = [
        [done + min(i, chunk - 1) for i in range(longest)]
        for done, chunk in zip(fed, chunks, strict=True)
    ]
    seen = torch.tensor(last_seen, device=device)[..., None]
    shown = torch.arange(widest, device=device) <= seen
    mask = _added(torch, shown, dtype)[:, None]
    return PaddedChunks(longest, rows, back, widest, torch.tensor(keys, device=device), mask)


def attend_prefill(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    keys: Any,
    values: Any,
    plan: PrefillPlan,
    scale: float,
) -> list[Any]:
    """Each prefill chunk's attention (`q`, `k`, `v`: the chunks' fresh rows, in the plan's
    order; `keys`, `values`: one layer's cache, the fresh rows already in it): a
    `[tokens, heads * head_dim]` tensor for each group, then one for each other chunk."""
    outputs, start = [], 0
    for group in plan.groups:
        span = slice(start, start + group.tokens)
        outputs.append(
            _prefill_cascade(torch, q[span], k[span], v[span], keys, values, group, scale)
        )
        start = span.stop
    for view in plan.views:
        span = slice(start, start + view.chunk)
        k_seq, v_seq = _chunk_rows(k, v, keys, values, view, span)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[span].transpose(0, 1)[None],
            k_seq.transpose(0, 1)[None],
            v_seq.transpose(0, 1)[None],
            attn_mask=view.mask,
            is_causal=view.gather is None,
            scale=scale,
            enable_gqa=True,
        )
        outputs.append(out[0].transpose(0, 1).reshape(view.chunk, -1))
        start += view.chunk
    return outputs


def _chunk_rows(k: Any, v: Any, keys: Any, values: Any, view: PrefillView, span: slice) -> Any:
    """The keys and values a chunk reads (`view`): its fresh rows (`span` of `k`, `v`) for a
    first chunk, else its rows gathered from the layer's cache."""
    if view.gather is None:
        return k[span], v[span]
    return keys.index_select(0, view.gather), values.index_select(0, view.gather)


def _prefill_cascade(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    keys: Any,
    values: Any,
    group: PrefillGroup,
    scale: float,
) -> Any:
    """One group of prefill chunks: all their queries against the shared prefix in one
    call, each chunk's against its own rows after it in one more, merged by log-sum-exp."""
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    per_kv = heads // kv_heads
    k_prefix, v_prefix = _rows(keys, group.prefix), _rows(values, group.prefix)
    # Every query of the group as its KV head's rows: [1, kv_heads, tokens * per_kv, head_dim].
    shared_q = q.view(tokens, kv_heads, per_kv, head_dim).transpose(0, 1)
    out_prefix, lse_prefix = attend_with_lse(
        torch,
        shared_q.reshape(1, kv_heads, tokens * per_kv, head_dim),
        k_prefix.transpose(0, 1)[None],
        v_prefix.transpose(0, 1)[None],
        None,
        scale,
    )
    out_prefix = out_prefix[0].view(kv_heads, tokens, per_kv, head_dim).transpose(0, 1)
    lse_prefix = lse_prefix[0].view(kv_heads, tokens, per_kv).transpose(0, 1)
    out_own, lse_own = _chunks_together(
        torch, q, (k, v), (keys, values), group.padded, per_kv, scale
    )
    out_own = out_own.view(tokens, kv_heads, per_kv, head_dim)
    lse_own = lse_own.view(tokens, kv_heads, per_kv)
    weight = torch.sigmoid(lse_prefix - lse_own)[..., None]
    merged = torch.lerp(out_own.float(), out_prefix.float(), weight)
    return merged.to(q.dtype).reshape(tokens, -1)


def _chunks_together(
    torch: Any,
    q: Any,
    fresh: tuple[Any, Any],
    cache: tuple[Any, Any],
    padded: PaddedChunks,
    per_kv: int,
    scale: float,
) -> tuple[Any, Any]:
    """The own part of a group of chunks after their prefix (the chats of one system prompt
    feeding their turns), in one call over the chunks padded (`padded`), not one call a
    chunk (16 chats' turns: 15 calls a layer to 1): each chunk's queries against its fresh
    rows causally where all are first chunks, else against its rows read from the layer's
    `cache` under the padding's mask. A padded row repeats its chunk's last, which no real
    query sees; padded queries' answers are dropped. `[tokens, heads, head_dim]` and the
    log-sum-exp `[tokens, heads]`."""
    _, heads, head_dim = q.shape

    def chunks(x: Any, rows: Any, length: int) -> Any:  # [chunks, its heads, length, head_dim]
        return x.index_select(0, rows).view(-1, length, x.shape[1], head_dim).transpose(1, 2)

    longest = padded.longest
    if padded.keys is None:
        (k, v), rows, length = fresh, padded.gather, longest
    else:
        (k, v), rows, length = cache, padded.keys, padded.widest
    out, lse = attend_with_lse(
        torch,
        chunks(q, padded.gather, longest),
        chunks(k, rows, length).repeat_interleave(per_kv, dim=1),
        chunks(v, rows, length).repeat_interleave(per_kv, dim=1),
        padded.mask,
        scale,
        causal=padded.keys is None,
    )
    out = out.transpose(1, 2).reshape(-1, heads, head_dim).index_select(0, padded.kept)
    return out, lse.transpose(1, 2).reshape(-1, heads).index_select(0, padded.kept)


def attend_with_lse(
    torch: Any, q: Any, k: Any, v: Any, mask: Any, scale: float, *, causal: bool = False
) -> Any:
    """Attention and the log-sum-exp of its scores (`[batch, heads, queries]`, float32):
    torch's fused CPU kernel, which returns it, on the CPU; the same in plain operations
    elsewhere. `mask` is added to the scores (0, or -inf where hidden), or None; `causal`:
    query i sees keys 0 to i (queries and keys of one length)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=mask, scale=scale
        )
        return out, lse
    if causal:
        shown = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = _added(torch, shown, torch.float32)
    return plain_attend_with_lse(torch, q, k, v, mask, scale)


def plain_attend_with_lse(torch: Any, q: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
    """`attend_with_lse` in plain operations, in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul((scores - lse[..., None]).exp(), v.float())
    return out.to(q.dtype), lse


def _cascade(torch: Any, q: Any, keys: Any, values: Any, group: Group, scale: float) -> Any:
    """One group's attention: all its queries against the shared prefix at once, each
    against its own rows, merged by the two parts' log-sum-exp."""
    count, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    per_kv = heads // kv_heads
    grouped = q.view(count, kv_heads, per_kv, head_dim)
    k_prefix, v_prefix = _rows(keys, group.prefix), _rows(values, group.prefix)
    # The group's queries as each KV head's rows: [1, kv_heads, count * per_kv, head_dim].
    shared_q = grouped.transpose(0, 1).reshape(1, kv_heads, count * per_kv, head_dim)
    out_prefix, lse_prefix = attend_with_lse(
        torch, shared_q, k_prefix.transpose(0, 1)[None], v_prefix.transpose(0, 1)[None], None, scale
    )
    out_prefix = out_prefix[0].view(kv_heads, count, per_kv, head_dim).transpose(0, 1)
    lse_prefix = lse_prefix[0].view(kv_heads, count, per_kv).transpose(0, 1)
    suffix = group.suffix
    length = suffix.mask.shape[-1]
    k_own = keys.index_select(0, suffix.gather).view(count, length, kv_heads, head_dim)
    v_own = values.index_select(0, suffix.gather).view(count, length, kv_heads, head_dim)
    out_own, lse_own = attend_with_lse(
        torch, grouped, k_own.transpose(1, 2), v_own.transpose(1, 2), suffix.mask, scale
    )
    # softmax over both parts' keys = each part's, weighted by its share of the exp-sum.
    weight = torch.sigmoid(lse_prefix - lse_own)[..., None]
    merged = torch.lerp(out_own.float(), out_prefix.float(), weight)
    return merged.to(q.dtype)


def _padded(torch: Any, device: str, rows: list[list[int]], dtype: Any) -> Padded:
    """Rows padded to the longest (with row 0) and the mask hiding the padding: boolean
    (`dtype` None), or added to the scores in `dtype` (0 shown, -inf hidden)."""
    length = max(map(len, rows))
    gather = [row for one in rows for row in one + [0] * (length - len(one))]
    lengths = torch.tensor([len(one) for one in rows], device=device)
    shown = (torch.arange(length, device=device)[None] < lengths[:, None])[:, None, None, :]
    mask = shown if dtype is None else _added(torch, shown, dtype)
    return Padded(len(rows), torch.tensor(gather, device=device), mask)


def _added(torch: Any, shown: Any, dtype: Any) -> Any:
    """A boolean mask as one added to the scores, in `dtype`: 0 where shown, -inf where
    hidden."""
    hidden = torch.zeros(shown.shape, dtype=dtype, device=shown.device)
    return hidden.masked_fill_(~shown, float("-inf"))


def _prefix(torch: Any, device: str, rows: list[int]) -> Any:
    """A shared prefix's rows: a slice where they run in order (read as a view), else an
    index tensor (copied)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _rows(cache: Any, rows: Any) -> Any:
    """A layer's cache rows: a view for a slice, a copy for an index tensor."""
    return cache[rows] if isinstance(rows, slice) else cache.index_select(0, rows)


def _common(a: list[int], b: list[int]) -> int:
    """How many leading items `a` and `b` have in common."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def avoid_cudnn_attention(torch: Any, device: str) -> None:
    """On CUDA, turn torch's cuDNN attention backend off, for the whole process: it builds a
    graph for each new shape, and a decode's shapes change every step (one more cached row),
    so on an H200 each layer's call took about 2 ms of the CPU for 13 us of the GPU's: 60 ms
    of a 75 ms step at 64 rows. The flash and memory-efficient kernels serve instead."""
    if device.startswith("cuda") and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention is off in this process: a graph a shape costs each step")
