"""lm-evaluation-harness against a live batchserve: its `local-completions` model scores a
small local multiple-choice task (a yaml and a jsonl written here: nothing is downloaded) by
echo + logprobs over token ids, and each example's log-likelihoods equal those of its own
`hf` model on the same weights (the tiny Llama saved as a transformers folder, its tokenizer
beside it) within 1e-4.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from batchserve.config import Config
from batchserve.engine.core import Engine
from batchserve.models.specs import ModelSpec
from batchserve.server import create_app

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
from batchserve.models.causal_lm import CausalLM  # noqa: E402

TASK = "batchserve_tiny"
EXAMPLES = [
    {"question": "the cat sat on the", "choices": [" mat", " dog", " park"], "answer": 0},
    {"question": "a bird in the", "choices": [" hand", " bush is"], "answer": 0},
    {"question": "Say: hello", "choices": [" there", " again", " cat"], "answer": 0},
    {"question": "the dog ran to", "choices": [" the park", " two"], "answer": 0},
]


def write_task(folder: Path) -> None:
    data = folder / "examples.jsonl"
    data.write_text("".join(json.dumps(example) + "\n" for example in EXAMPLES))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )


def loglikelihoods(model: str, model_args: str, tasks: Path) -> list[float]:
    """Each (example, choice)'s log-likelihood as lm-eval's `model` scores it."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        batch_size=1,
        device="cpu",
    )
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return [float(resp[0][0]) for sample in samples for resp in sample["resps"]]


async def test_lm_eval_scores_the_same_through_batchserve_as_with_its_own_hf_model(
    tok: Any, tiny: Any, tmp_path: Path, aiohttp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    folder = tmp_path / "tiny-llama"
    tiny.save_pretrained(folder)
    tok.save_pretrained(folder)
    write_task(tmp_path)

    def load(device: str) -> CausalLM:
        return CausalLM(tiny, tok, device, kv_cache_bytes=2**20)

    spec = ModelSpec(name="llm", version="1", generator=load, devices="cpu")
    engine = Engine(Config(step_tokens=16, timeout_ms=600_000.0), models=[spec])
    server = await aiohttp_server(create_app(engine))
    url = server.make_url("/v1/completions")
    served = await asyncio.to_thread(  # lm-eval's client blocks: the server runs meanwhile
        loglikelihoods,
        "local-completions",
        f"model=llm,base_url={url},tokenizer={folder},tokenizer_backend=huggingface,"
        "num_concurrent=1,max_retries=1",
        tmp_path,
    )
    own = loglikelihoods("hf", f"pretrained={folder},dtype=float32", tmp_path)
    assert len(served) == sum(len(example["choices"]) for example in EXAMPLES)
    assert served == pytest.approx(own, abs=1e-4)
