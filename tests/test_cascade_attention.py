"""Cascade attention (`models/attention.py`): decoding sequences that share cached prefix rows
attend to them once, merged with their own rows by log-sum-exp, and so do prefill chunks that
feed their own tokens after such a prefix. It must equal each sequence
attending to all its rows alone (random tensors, shared and unshared mixes, GQA groups), choose
the groups that save rows, and leave the tiny Llama's greedy tokens as they are without
sharing (caching off).
"""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.models import attention
from batchserve.models.generators import Seq
from batchserve.models.kv_cache import BLOCK

from . import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models import causal_lm  # noqa: E402
from batchserve.models.causal_lm import CausalLM  # noqa: E402


def runs(*lengths: int, start: int = 0) -> list[list[int]]:
    """Rows for blocks held one after another from `start`, one list per length."""
    out = []
    for length in lengths:
        out.append(list(range(start, start + length)))
        start += length
    return out


def expected(q: Any, keys: Any, values: Any, rows: list[list[int]], scale: float) -> Any:
    """Each sequence's attention over all its rows alone (`[count, heads * head_dim]`)."""
    outs = []
    for index, own in enumerate(rows):
        k = keys[own].transpose(0, 1)  # [kv_heads, rows, head_dim]
        v = values[own].transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q[index][:, None], k, v, scale=scale, enable_gqa=True
        )
        outs.append(out.reshape(-1))
    return torch.stack(outs)


def layouts() -> list[list[list[int]]]:
    """Rows of decoding sequences: a prefix of 40 blocks shared by three (in order: a view),
    and by two beside two sharing 36 blocks in rows out of order (a copy), sequences sharing
    nothing, one sharing a single block with the first, and odd suffix lengths."""
    shared, other, own = runs(40 * BLOCK, start=1000)[0], runs(36 * BLOCK, start=2000)[0], 3000
    scattered = other[BLOCK:] + other[:BLOCK]
    suffixes = runs(1, 7, 33, 2, 5, 40, 64, 3, start=own)
    return [
        [shared + suffixes[0], shared + suffixes[1], shared + suffixes[2]],
        [
            suffixes[3],
            scattered + suffixes[4],
            shared + suffixes[0],
            scattered + suffixes[5],
            suffixes[6],
            shared[:BLOCK] + suffixes[7],
            shared + suffixes[1],
        ],
    ]


@pytest.mark.parametrize("rows", layouts())
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (3, 1)])
def test_cascade_attention_equals_each_sequence_attending_alone(rows, heads, kv_heads):
    torch.manual_seed(0)
    head_dim, scale = 16, 0.25
    keys = torch.randn(4000, kv_heads, head_dim)
    values = torch.randn(4000, kv_heads, head_dim)
    q = torch.randn(len(rows), heads, head_dim)
    plan = attention.decode_plan(torch, "cpu", torch.float32, rows)
    assert plan.groups, "the layout is meant to share a prefix that pays"
    got = attention.attend_decode(torch, q[plan.order], keys, values, plan, kv_heads, scale)
    want = expected(q, keys, values, rows, scale)[plan.order]
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_cascade_attention_in_bfloat16_is_as_close_as_the_plain_read():
    torch.manual_seed(2)
    rows = layouts()[1]
    keys, values = torch.randn(2, 4000, 2, 64).bfloat16()
    q = torch.randn(len(rows), 6, 64).bfloat16()
    plan = attention.decode_plan(torch, "cpu", torch.bfloat16, rows)
    plain = attention.DecodePlan(
        list(range(len(rows))), [], attention._padded(torch, "cpu", rows, None)
    )
    exact = expected(q.float(), keys.float(), values.float(), rows, 0.125)
    got = attention.attend_decode(torch, q[plan.order], keys, values, plan, 2, 0.125)
    read = attention.attend_decode(torch, q, keys, values, plain, 2, 0.125)
    assert got.dtype == torch.bfloat16
    error = (got.float() - exact[plan.order]).abs().max()
    assert error <= 2 * (read.float() - exact).abs().max()


def test_the_plain_log_sum_exp_attention_equals_the_fused_kernel():
    torch.manual_seed(1)
    q = torch.randn(3, 2, 4, 16)
    k, v = torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    mask = torch.zeros(3, 1, 1, 9)
    mask[1, ..., 5:] = float("-inf")
    fused = attention.attend_with_lse(torch, q, k, v, mask, 0.3)
    plain = attention.plain_attend_with_lse(torch, q, k, v, mask, 0.3)
    for a, b in zip(fused, plain, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_groups_share_the_deepest_prefix_that_saves_rows():
    long, short = 20 * BLOCK, 2 * BLOCK
    base = list(range(long))
    rows = [
        [*base, 5000],
        [*list(range(100, 100 + long)), 5001],  # shares nothing
        [*base, 5002, 5003],
        [*base[:short], 5004],  # only the first two blocks: not worth the three's 20
        [*base, 5005],
    ]
    assert attention.shared_groups(rows) == [([0, 2, 4], long)]
    # Two sequences sharing two blocks save too few rows to pay for the extra calls; two
    # sharing 20 as well.
    assert attention.shared_groups([[*base, 1], [*base, 2]]) == []
    assert attention.shared_groups([[*base[:short], 1], [*base[:short], 2]]) == []
    # The whole block holding the last row is never shared (it is the step's own).
    assert attention.shared_groups([base, base, base]) == [([0, 1, 2], long - BLOCK)]


def decode(generator: CausalLM, prompts: list[str], steps: int) -> list[list[int]]:
    """Each prompt prefilled alone (so later ones adopt cached blocks), then all decoded
    together, greedy."""
    seqs = [
        Seq(f"s{i}", p, params={"ignore_eos": True}, max_tokens=99) for i, p in enumerate(prompts)
    ]
    for seq in seqs:
        generator.attach(seq)
        seq.token_ids.append(generator.step([seq])[0].token_id)  # type: ignore[arg-type]
    for _ in range(steps):
        for seq, made in zip(seqs, generator.step(seqs), strict=True):
            seq.token_ids.append(made.token_id)  # type: ignore[arg-type]
    return [seq.token_ids for seq in seqs]


def test_greedy_tokens_with_a_shared_prefix_read_once_equal_caching_off(tok, tiny, monkeypatch):
    system = " ".join(tiny_llama.CORPUS * 12)
    assert 3 * len(tok.encode(system)) > attention.MIN_SAVED_ROWS + 3 * BLOCK
    prompts = [f"{system} {word}" for word in ("cat", "bird", "dog", "park")]
    prompts.append("the dog ran to the park")  # shares nothing: read the plain way beside
    cascades = []
    real = attention._cascade

    def counted(*args: Any) -> Any:
        cascades.append(args[-2].suffix.count)
        return real(*args)

    answers = {}
    for caching in (True, False):
        generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=2**22, prefix_caching=caching)
        monkeypatch.setattr(attention, "_cascade", counted)
        answers[caching] = decode(generator, prompts, 6)
        assert bool(cascades) == caching
        cascades.clear()
    assert answers[True] == answers[False]


def chunk_layouts() -> list[tuple[list[list[int]], list[int]]]:
    """Prefill chunks' rows and how many of each were computed before the chunk: three
    chats of one cached system prompt (40 blocks, in order), two feeding their turn's first
    chunk and one a later chunk of its turn; two sharing 36 blocks held out of order; a new
    sequence's first chunk and a later chunk sharing nothing."""
    shared, other = runs(40 * BLOCK, start=1000)[0], runs(36 * BLOCK, start=2000)[0]
    scattered = other[BLOCK:] + other[:BLOCK]
    turns = runs(17, 30 + 12, 5, 9, 3, 40 + 12, start=3000)
    plain = runs(11, start=200)[0]
    rows = [
        shared + turns[0],
        plain,
        scattered + turns[3],
        shared + turns[1],
        runs(40, start=100)[0] + turns[5][40:],
        shared + turns[2],
        scattered + turns[4],
    ]
    fed = [len(shared), 0, len(other), len(shared) + 30, 40, len(shared), len(other)]
    firsts = (rows[:1] + rows[5:6], [fed[0], fed[5]])  # turns of 17 and 5 after the prompt
    return [(rows, fed), (rows[:1] + rows[3:4] + rows[5:6], [fed[0], fed[3], fed[5]]), firsts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", chunk_layouts())
def test_prefill_chunks_equal_attending_to_every_row_under_a_causal_mask(dtype, layout):
    """Chunks sharing a cached prefix attend to it once as a group, merged with their own
    rows; a first chunk alone reads its fresh keys causally (nothing gathered, no mask); a
    later one gathers its rows under the step's additive mask: all give what each token
    attending to its sequence's rows up to itself gives."""
    rows, fed = layout
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    keys = torch.randn(4000, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(4000, kv_heads, dim, generator=gen).to(dtype)
    plan = attention.prefill_plan(torch, "cpu", dtype, rows, fed)
    assert plan.groups, "the layout is meant to share a prefix that pays"
    fresh = [row for i in plan.order for row in rows[i][fed[i] :]]
    q = torch.randn(len(fresh), heads, dim, generator=gen).to(dtype)
    got = torch.cat(
        attention.attend_prefill(torch, q, keys[fresh], values[fresh], keys, values, plan, scale)
    )
    offset = 0
    for i in plan.order:
        for token in range(len(rows[i]) - fed[i]):
            seen = rows[i][: fed[i] + token + 1]
            want = expected(q[offset][None].float(), keys.float(), values.float(), [seen], scale)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[offset][None].float(), want, atol=tolerance, rtol=0)
            offset += 1
    index = 0
    for group in plan.groups:  # its own rows in one call: causal where all are first chunks
        prefix = group.prefix
        shared = prefix.stop - prefix.start if isinstance(prefix, slice) else len(prefix)
        members, tokens = [], 0
        while tokens < group.tokens:
            members.append(plan.order[index])
            tokens, index = tokens + len(rows[members[-1]]) - fed[members[-1]], index + 1
        later = any(fed[i] > shared for i in members)
        assert (group.padded.keys is not None) == later
        assert (group.padded.mask is not None) == later
    for i, view in zip(plan.order[index:], plan.views, strict=True):
        if fed[i] == 0:  # a first chunk alone
            assert view.gather is None
            assert view.mask is None


def test_chats_feeding_their_turns_after_a_cached_system_prompt_read_it_once(
    tok, tiny, monkeypatch
):
    """The cold wave of chats sharing a system prompt: once the first has computed it, the
    others feed their turns together, reading the prompt once as a group; their greedy
    tokens equal caching off's."""
    system = " ".join(tiny_llama.CORPUS * 12)
    prompts = [f"{system} {word} {word}" for word in ("cat", "bird", "dog", "park")]
    groups = []
    real = attention._prefill_cascade

    def counted(*args: Any) -> Any:
        groups.append(len(args[-2].padded.gather) // args[-2].padded.longest)
        return real(*args)

    monkeypatch.setattr(attention, "_prefill_cascade", counted)
    answers = {}
    for caching in (True, False):
        generator = CausalLM(tiny, tok, "cpu", kv_cache_bytes=2**22, prefix_caching=caching)
        seqs = [
            Seq(f"s{i}", p, params={"ignore_eos": True}, max_tokens=9)
            for i, p in enumerate(prompts)
        ]
        generator.attach(seqs[0])
        first = generator.step(seqs[:1])[0].token_id
        for seq in seqs[1:]:  # with caching on, they adopt the blocks the first computed
            generator.attach(seq)
        made = [first] + [m.token_id for m in generator.step(seqs[1:])]
        for seq, token in zip(seqs, made, strict=True):
            seq.token_ids.append(token)  # type: ignore[arg-type]
        for _ in range(4):
            for seq, m in zip(seqs, generator.step(seqs), strict=True):
                seq.token_ids.append(m.token_id)  # type: ignore[arg-type]
        answers[caching] = [seq.token_ids for seq in seqs]
        assert groups == ([3] * tiny.config.num_hidden_layers if caching else [])
        groups.clear()
    assert answers[True] == answers[False]


@pytest.fixture
def cudnn_attention_restored() -> Any:
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.mark.usefixtures("cudnn_attention_restored")
def test_cudnn_attention_is_turned_off_for_a_cuda_device_only():
    """cuDNN's attention builds a graph for each new shape, and decode shapes change every
    step (tests/test_cuda.py and benchmarks/gpu_check.sh run the model on a GPU)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    attention.avoid_cudnn_attention(torch, "cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    attention.avoid_cudnn_attention(torch, "cuda:0")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_causal_lm_asks_to_avoid_cudnn_attention_on_its_device(monkeypatch, tok):
    asked: list[str] = []
    monkeypatch.setattr(causal_lm, "avoid_cudnn_attention", lambda _, device: asked.append(device))
    CausalLM(tiny_llama.model(len(tok), tok.eos_token_id), tok, "cpu", kv_cache_bytes=1 << 20)
    assert asked == ["cpu"]
