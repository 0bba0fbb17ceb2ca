"""A real generator's weights (`batchserve.models.weights`): a GGUF file is dequantised once and
its converted copy kept, so that the next start loads the copy; a changed file, a partial or a
damaged copy is converted again; each phase logs one line. On a tiny Llama written as a GGUF
file by `tiny_llama.write_gguf`, read by the same transformers code as SmolLM2's."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from batchserve.models import weights
from batchserve.models.generators import GeneratorSettings, Seq

from . import tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

READ = "reading and dequantising"
LOADED_COPY = "loading the converted copy"
TEXT = "Say: the café 日本"
LOGGER = "batchserve.models"


@pytest.fixture
def gguf_file(tmp_path: Path, tok: Any, tiny: Any) -> Path:
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    tiny_llama.write_gguf(path, tok, tiny)
    return path


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> Any:
    caplog.set_level(logging.INFO, logger=LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]


def load(path: Path, cache: Path | str, dtype: Any = None) -> tuple[Any, Any]:
    return weights.load_pretrained(
        transformers, str(path.parent), path.name, dtype=dtype or torch.float32, cache=str(cache)
    )


def assert_same_weights(model: Any, expected: Any) -> None:
    ours, theirs = model.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def count(lines: list[str], what: str) -> int:
    return sum(line.startswith(what) for line in lines)


def test_a_second_load_reads_the_kept_copy_not_the_gguf_file(gguf_file, tmp_path, tok, tiny, lines):
    cache = tmp_path / "cache"
    first_tok, first = load(gguf_file, cache, torch.bfloat16)
    second_tok, second = load(gguf_file, cache)
    assert count(lines(), READ) == 1
    assert count(lines(), LOADED_COPY) == 1
    assert all(re.search(r": \d+\.\d s$", line) for line in lines()), lines()
    # The first asked for bfloat16, yet the copy holds what the file held: float32.
    assert first.dtype == torch.bfloat16
    assert_same_weights(second, tiny)
    assert first_tok.encode(TEXT) == second_tok.encode(TEXT) == tok.encode(TEXT)
    (copy,) = cache.iterdir()
    assert copy.name.startswith("tiny-")
    assert (copy / weights.COMPLETE).is_file()


def test_a_changed_file_is_converted_again(gguf_file, tmp_path, lines):
    cache = tmp_path / "cache"
    load(gguf_file, cache)
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load(gguf_file, cache)
    assert count(lines(), READ) == 2
    assert len(list(cache.iterdir())) == 2


def test_a_copy_without_its_marker_is_removed_and_converted_again(gguf_file, tmp_path, tiny, lines):
    cache = tmp_path / "cache"
    copy = weights.copy_folder(cache, gguf_file, transformers.__version__)
    copy.mkdir(parents=True)
    (copy / "model.safetensors").write_bytes(b"half a file")
    _, model = load(gguf_file, cache)
    assert count(lines(), READ) == 1
    assert count(lines(), LOADED_COPY) == 0
    assert_same_weights(model, tiny)
    _, model = load(gguf_file, cache)
    assert count(lines(), LOADED_COPY) == 1
    assert_same_weights(model, tiny)


def test_a_damaged_copy_is_converted_again(gguf_file, tmp_path, tiny, lines):
    cache = tmp_path / "cache"
    load(gguf_file, cache)
    (copy,) = cache.iterdir()
    checkpoint = copy / "model.safetensors"
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])
    _, model = load(gguf_file, cache)
    assert_same_weights(model, tiny)
    assert count(lines(), READ) == 2
    assert any("does not load" in line for line in lines())
    _, model = load(gguf_file, cache)
    assert count(lines(), READ) == 2
    assert_same_weights(model, tiny)


def test_a_cache_that_cannot_be_written_only_warns(gguf_file, tmp_path, tiny, lines):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    _, model = load(gguf_file, not_a_folder)
    assert_same_weights(model, tiny)
    assert any(line.startswith("could not keep a converted copy") for line in lines())


def test_off_keeps_nothing_and_the_default_is_the_xdg_cache(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights.cache_root(None) == tmp_path / "xdg" / "batchserve"
    assert weights.cache_root(weights.OFF) is None
    load(gguf_file, weights.OFF)
    assert list(tmp_path.iterdir()) == [gguf_file.parent]
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert weights.cache_root(None) == Path.home() / ".cache" / "batchserve"


def test_loading_holds_the_one_lock_across_device_threads(gguf_file, tmp_path, monkeypatch):
    """Two device threads never import transformers' lazy modules or convert at once."""
    held: list[bool] = []
    real = weights._from_pretrained

    def spy(*args: Any, **options: Any) -> Any:
        held.append(weights._LOADING.locked())
        return real(*args, **options)

    monkeypatch.setattr(weights, "_from_pretrained", spy)
    load(gguf_file, tmp_path / "cache")
    load(gguf_file, tmp_path / "cache")
    assert held == [True, True]


def test_causal_lm_loads_a_gguf_file_through_its_copy_and_warms_up(gguf_file, tmp_path, lines):
    from batchserve.models.causal_lm import load as load_causal_lm

    settings = GeneratorSettings(model_path=str(gguf_file), weights_cache=str(tmp_path / "c"))

    def greedy(generator: Any) -> list[int | None]:
        seq = Seq(id="s", prompt=tiny_llama.TEACHER_PROMPT, params={"ignore_eos": True})
        made = []
        for _ in range(4):
            token = generator.step([seq])[0].token_id
            seq.token_ids.append(token)
            made.append(token)
        return made

    first = load_causal_lm("cpu", settings)
    second = load_causal_lm("cpu", settings)
    assert first.cache.free == first.cache.capacity  # the warm-up's row was released
    assert greedy(first) == greedy(second)
    steps = "warm-up steps on cpu, compiling the layers"  # compiled by default on a CPU
    for what in (READ, LOADED_COPY, "moving the model to cpu", steps):
        assert any(line.startswith(what) for line in lines()), (what, lines())
