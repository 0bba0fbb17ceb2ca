"""The layers compiled (`batchserve.models.layer_loop`), on the tiny Llama built from a seed:
the same tokens and log-probabilities as the uncompiled layers through a run of prefill
chunks, a cached shared prefix read as a cascade, and decodes of 1 to 4 rows; one graph
serves every step size, and a model loaded again; a compile that fails leaves the layers
uncompiled and says so.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from batchserve.models.generators import Made, Seq

from . import tiny_llama

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from batchserve.models import layer_loop  # noqa: E402
from batchserve.models.causal_lm import CausalLM  # noqa: E402

CLOSE = 1e-4
"""Compiled loops sum in another order: log-probabilities agree to about float32's
rounding, not bit for bit."""


def generator(tok: Any, compiled: bool, seed: int = 0) -> CausalLM:
    made = CausalLM(
        tiny_llama.model(len(tok), tok.eos_token_id, seed=seed), tok, "cpu",
        kv_cache_bytes=2**22, compiled=compiled,
    )  # fmt: skip
    made.warm_up()
    return made


def mixed_run(generator: CausalLM) -> list[list[tuple[int, float]]]:
    """Four chats of one system prompt and one of its own: the first fed in chunks of 40,
    the others joining as it decodes, attached to its cached blocks, fed in chunks of 7
    beside the decodes; then everyone decoding. Each sequence's tokens and their
    log-probabilities."""
    system = " ".join(tiny_llama.CORPUS * 12)
    prompts = [f"{system} {word}" for word in ("cat", "bird", "dog")] + ["the dog ran"]
    seqs = [
        Seq(f"s{i}", p, params={"ignore_eos": True, "logprobs": 0}, max_tokens=99)
        for i, p in enumerate(prompts)
    ]
    made: dict[str, list[tuple[int, float]]] = {seq.id: [] for seq in seqs}
    running: list[Seq] = []
    for seq in seqs:
        generator.attach(seq)
        seq.chunk = 40 if seq is seqs[0] else 7
        running.append(seq)
        while any(seq.chunk is not None for seq in running):
            for one, answer in zip(running, generator.step(running), strict=True):
                if answer.token_id is None:
                    continue
                one.chunk = None
                made[one.id].append(scored(one, answer))
    for _ in range(3):
        for seq, answer in zip(seqs, generator.step(seqs), strict=True):
            made[seq.id].append(scored(seq, answer))
    return [made[seq.id] for seq in seqs]


def scored(seq: Seq, answer: Made) -> tuple[int, float]:
    """The token made, now the sequence's, and its log-probability."""
    assert answer.token_id is not None
    assert answer.logprob is not None
    assert answer.logprob.logprob is not None
    seq.token_ids.append(answer.token_id)
    return answer.token_id, answer.logprob.logprob


def assert_same(answers: list[list[tuple[int, float]]], expected: Any) -> None:
    """The same tokens, and log-probabilities within CLOSE."""
    assert [[t for t, _ in seq] for seq in answers] == [[t for t, _ in seq] for seq in expected]
    for ours, theirs in zip(answers, expected, strict=True):
        for (_, mine), (_, reference) in zip(ours, theirs, strict=True):
            assert math.isclose(mine, reference, abs_tol=CLOSE), (mine, reference)


def test_compiled_layers_make_the_uncompiled_tokens_with_one_graph(tok):
    plain = generator(tok, compiled=False)
    compiled = generator(tok, compiled=True)
    assert compiled._loop.compiled
    assert not plain._loop.compiled
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    expected = mixed_run(plain)
    answers = mixed_run(compiled)
    # Steps of 1 to 47 tokens, decodes beside chunks, cascades: no graph compiled after the
    # warm-up's.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert_same(answers, expected)


def test_a_model_loaded_again_reuses_the_graph_with_its_own_weights(tok):
    """A new version of a model (new weights, the same shapes) compiles nothing: its
    weights and number are inputs of the graph, not constants (dynamo gives a function 8
    graphs, after which a ninth load would run uncompiled)."""
    generator(tok, compiled=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    other = generator(tok, compiled=True, seed=7)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    answers = mixed_run(other)
    expected = mixed_run(generator(tok, compiled=False, seed=7))
    assert answers != mixed_run(generator(tok, compiled=False))  # the weights differ
    assert_same(answers, expected)


def test_an_mlp_of_another_activation_runs_uncompiled_with_its_own(tok):
    """A Llama-shaped model whose MLP is not SiLU's is not compiled, and its layers use its
    own activation: greedy tokens as `generate` makes them with it."""
    from .test_causal_lm import assert_same_or_tied, reference

    model = tiny_llama.model(len(tok), tok.eos_token_id)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    made = CausalLM(model, tok, "cpu", kv_cache_bytes=2**22, compiled=True)
    assert not made._loop.compiled
    seq = Seq("g", tiny_llama.TEACHER_PROMPT, params={"ignore_eos": True}, max_tokens=8)
    for _ in range(8):
        seq.token_ids.append(made.step([seq])[0].token_id)  # type: ignore[arg-type]
    assert_same_or_tied(seq.token_ids, *reference(model, tok, tiny_llama.TEACHER_PROMPT, 8))


def test_a_compile_that_fails_leaves_the_layers_uncompiled(tok, monkeypatch, caplog):
    def no_compiler(*args: Any, **kwargs: Any) -> Any:
        def fails(*args: Any) -> Any:
            raise RuntimeError("no C++ compiler")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger=layer_loop.__name__.rsplit(".", 1)[0]):
        fallen = generator(tok, compiled=True)
    assert not fallen._loop.compiled
    assert any("compiling them failed" in r.getMessage() for r in caplog.records)
    assert mixed_run(fallen) == mixed_run(generator(tok, compiled=False))
