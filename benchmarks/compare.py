"""Before / after: the same sweep points and server CPU per request, on an older revision
and on this tree, interleaved so that the machine's drift hits both alike.

A change that must not cost speed is measured against the revision before it in one run,
rather than against numbers from another day. The older revision is checked out into a
temporary git worktree; each side runs its own `python -m batchserve` and load generator
(pinned as in sweep.py). Medians over repeats.

    python benchmarks/compare.py --before 9714e81 --repeats 3
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
POINTS = [("ADAPTIVE_4", 200), ("ADAPTIVE_4", 3000), ("ADAPTIVE_4", 3500),
          ("ADAPTIVE_1", 900), ("ADAPTIVE_1", 980)]  # fmt: skip


def load(root: Path, name: str) -> ModuleType:
    """benchmarks/NAME.py of the tree at `root`, with that tree's own sibling imports."""
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        path = root / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"{name}_{abs(hash(root))}", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.pop(0)
        for sibling in ("sweep", "plots", "overhead"):
            sys.modules.pop(sibling, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the git revision to compare with")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every point and CPU run, each side (medians)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=8.0,
        help="length of each point and CPU run, seconds (3 or more)",
    )
    args = parser.parse_args()
    if args.seconds < 3:
        parser.error("--seconds must be 3 or more: each point's first second is warm-up")
    with tempfile.TemporaryDirectory() as scratch:
        before = Path(scratch) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(before), args.before],
                       cwd=ROOT, check=True)  # fmt: skip
        try:
            compare({"before": before, "after": ROOT}, args.repeats, args.seconds)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT)


def compare(trees: dict[str, Path], repeats: int, seconds: float) -> None:
    sweeps = {side: load(root, "sweep") for side, root in trees.items()}
    overheads = {side: load(root, "overhead") for side, root in trees.items()}
    for root in trees.values():
        (root / "benchmarks/results").mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    cpu: dict[str, list[float]] = {side: [] for side in trees}
    total = repeats * len(POINTS) * len(trees)
    for seed in range(1, repeats + 1):
        for name, rate in POINTS:
            for side, sweep in sweeps.items():
                result = sweep.run_point(getattr(sweep, name), rate,
                                         max(seconds, 2000 / rate), seed)  # fmt: skip
                runs.setdefault((side, name, rate), []).append(result)
                done = sum(map(len, runs.values()))
                success, p99 = result["success"], result["p99_ms"]
                print(f"[{done}/{total}] {side} {name} {rate} rps: success {success:.2%},"
                      f" p99 {p99} ms", flush=True)  # fmt: skip
        for side, overhead in overheads.items():
            cpu[side].append(overhead.run(overhead.SERVERS["metrics on"], 3000, seconds, seed))
            print(f"{side}: {cpu[side][-1]:.1f} us of server CPU per request", flush=True)

    def median(side: str, name: str, rate: int, key: str) -> float:
        return statistics.median(float(r[key]) for r in runs[(side, name, rate)])

    print("\n| point | before p50 / p99 ms | after p50 / p99 ms | success before / after |")
    print("|---|---|---|---|")
    for name, rate in POINTS:
        cells = [f"{median(s, name, rate, 'p50_ms'):.0f} / {median(s, name, rate, 'p99_ms'):.0f}"
                 for s in trees]  # fmt: skip
        success = " / ".join(f"{median(s, name, rate, 'success'):.2%}" for s in trees)
        print(f"| {name} {rate} rps | {cells[0]} | {cells[1]} | {success} |")
    b, a = (statistics.median(cpu[side]) for side in trees)
    print(f"\nserver CPU per request at 3000 rps, metrics on: before {b:.1f} us, after {a:.1f} us"
          f" (after / before {a / b:.3f}); runs: {cpu}")  # fmt: skip


if __name__ == "__main__":
    main()
