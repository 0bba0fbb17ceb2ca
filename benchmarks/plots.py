"""PNG plots of a sweep: latency and throughput against offered load, and batch sizes.

`sweep.py` calls `write_plots` at its end; to redraw from a saved sweep without rerunning it:

    python benchmarks/plots.py benchmarks/results/sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

Point = dict[str, Any]


def _median(point: Point, key: str) -> float:
    return statistics.median(float(run[key]) for run in point["runs"])


def _by_setup(points: list[Point], devices: int) -> dict[str, list[Point]]:
    setups: dict[str, list[Point]] = {}
    for point in points:
        if point["devices"] == devices:
            setups.setdefault(point["setup"], []).append(point)
    return setups


def write_plots(points: list[Point], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    device_counts = sorted({int(p["devices"]) for p in points if p["devices"] in (1, 4)})
    figure, axes = plt.subplots(1, len(device_counts), figsize=(6 * len(device_counts), 4.5))
    for axis, devices in zip(list(figure.axes), device_counts, strict=True):
        for name, series in _by_setup(points, devices).items():
            rates = [p["rate"] for p in series]
            (line,) = axis.plot(rates, [_median(p, "p50_ms") for p in series], "o-",
                                label=f"{name} p50")  # fmt: skip
            axis.plot(rates, [_median(p, "p99_ms") for p in series], "s--",
                      color=line.get_color(), label=f"{name} p99")  # fmt: skip
        axis.set(title=f"D={devices}: latency (medians of runs)", xlabel="offered requests/s",
                 ylabel="ms (log)", yscale="log")  # fmt: skip
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    written.append(_save(figure, folder / "latency_vs_load.png"))
    del axes

    figure, axis = plt.subplots(figsize=(7, 5))
    top = max(float(p["rate"]) for p in points)
    axis.plot([0, top], [0, top], color="#bbb", label="offered = answered")
    for devices in sorted({int(p["devices"]) for p in points}):
        for name, series in _by_setup(points, devices).items():
            label = f"{name}, D={devices}" if devices else name
            axis.plot([p["rate"] for p in series], [_median(p, "achieved_rps") for p in series],
                      "o-", label=label)  # fmt: skip
    axis.set(title="throughput: 200 answers/s against offered load", xlabel="offered requests/s",
             ylabel="answered 200/s")  # fmt: skip
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    written.append(_save(figure, folder / "throughput_vs_load.png"))

    adaptive = [p for p in points if p["setup"] == "adaptive" and p["devices"] == 4]
    if adaptive:
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for point in adaptive:
            counts: Counter[int] = Counter()
            for run in point["runs"]:
                counts.update({int(size): n for size, n in run["batch_sizes"].items()})
            total = sum(counts.values())
            sizes = sorted(counts)
            axis.plot(sizes, [counts[s] / total for s in sizes], ".-",
                      label=f"{point['rate']} rps")  # fmt: skip
        axis.set(title="adaptive, D=4: batch size each request rode in", xlabel="batch size",
                 ylabel="share of requests", xscale="log")  # fmt: skip
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
        written.append(_save(figure, folder / "batch_sizes.png"))
    return written


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_json", type=Path, help="a saved sweep, as sweep.py writes it")
    parser.add_argument(
        "--plots",
        type=Path,
        default=Path(__file__).parent / "results/plots",
        help="where the PNGs go (benchmarks/plots holds the committed ones)",
    )
    args = parser.parse_args()
    for path in write_plots(json.loads(args.sweep_json.read_text()), args.plots):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
