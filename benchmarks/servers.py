"""Starting and stopping the server under test, for every benchmark: pinned to core 0, so the
load (pinned to core 1) never shares its core. Nothing here needs matplotlib."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 8765
"""Where every benchmark's server under test listens."""


def repository_env() -> dict[str, str]:
    """This environment for a child that imports the repository: its root first on
    PYTHONPATH, what the caller had there kept (packages placed there, not installed)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def start_server(
    command: list[str], log_name: str = "server.log", *, pinned: bool = True
) -> subprocess.Popen[str]:
    """`command` on core 0 (unless not `pinned`), once it has printed its start-up line;
    stderr to results/."""
    log = ROOT / "benchmarks/results" / log_name
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as stderr:
        server = subprocess.Popen(
            ["taskset", "-c", "0", *command] if pinned else command,
            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
        )  # fmt: skip
    assert server.stdout is not None
    if not server.stdout.readline():  # the start-up line says it is listening
        raise RuntimeError(f"the server did not start: {' '.join(command)}")
    return server


def stop_server(server: subprocess.Popen[str]) -> None:
    """SIGTERM (a drain), a kill if it has not exited within a minute; then a kill for any
    process it left behind in its group (LitServe's workers outlive their parent)."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)


def run_loadgen(rate: float, seconds: float, seed: int, load_args: tuple[str, ...] = ()) -> dict:
    """loadgen.py on core 1 against the server on PORT, for `seconds`: its JSON summary."""
    load = subprocess.run(
        ["taskset", "-c", "1", sys.executable, "benchmarks/loadgen.py",
         "--url", f"http://127.0.0.1:{PORT}", "--rate", str(rate),
         "--seconds", str(seconds), "--seed", str(seed), *load_args],
        cwd=ROOT, capture_output=True, text=True, timeout=seconds + 120, check=True,
    )  # fmt: skip
    return dict(json.loads(load.stdout))
