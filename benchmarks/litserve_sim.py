"""The peer: LitServe serving the simulated model, for `peers.py`.

The same contract as batchserve's simulated backend: a batch call takes 100 ms whatever its
size (1 to `--max-batch-size` inputs) and answers each input reversed; D workers
(`--workers`, LitServe's `workers_per_device` on one cpu "device") each run one batch at a
time. LitServe's own defaults otherwise (one API server process per worker, FastAPI on
uvicorn), with its access log off as batchserve's is at WARNING. Prints one line on stdout
once /health answers, which is what `servers.start_server` waits for (and refuses to start
if the port is already taken, so that a server left from an earlier run cannot answer that
/health in its place); LitServe's own output goes to stderr.

    taskset -c 0 python benchmarks/litserve_sim.py --port 8765 --workers 4
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

import litserve as ls

CALL_S = 0.1


class SimulatedModel(ls.LitAPI):  # type: ignore[misc]
    """100 ms per batch call, each input reversed; the answer names its batch's size."""

    def setup(self, device: str) -> None:
        del device

    def decode_request(self, request: dict[str, str]) -> str:
        return request["input"]

    def predict(self, inputs: list[str]) -> list[tuple[str, int]]:
        time.sleep(CALL_S)
        return [(text[::-1], len(inputs)) for text in inputs]

    def encode_response(self, output: tuple[str, int]) -> dict[str, object]:
        return {"output": output[0], "batch_size": output[1]}


def port_is_free(port: int) -> bool:
    """Whether no server listens on `port`. Bound as servers bind (SO_REUSEADDR), so that a
    port left in TIME_WAIT by an earlier run counts as free."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def announce_when_healthy(port: int, stdout: int) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                break
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    os.write(stdout, f"litserve on http://127.0.0.1:{port}\n".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765, help="port to listen on, at 127.0.0.1")
    parser.add_argument("--workers", type=int, default=4, help="simulated devices (D)")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=100,
        help="LitServe's max_batch_size: inputs a batch call",
    )
    parser.add_argument(
        "--batch-timeout-ms",
        type=float,
        default=10.0,
        help="LitServe's batch_timeout: how long a worker waits to fill a batch",
    )
    parser.add_argument(
        "--api-servers",
        type=int,
        default=None,
        help="LitServe's num_api_servers (default: its own, one per worker)",
    )
    args = parser.parse_args()
    if not port_is_free(args.port):
        parser.error(f"port {args.port} is taken (a server left from an earlier run?)")
    # stdout carries only the start-up line; LitServe logs to stdout, so it gets stderr.
    start_line = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(
        target=announce_when_healthy, args=(args.port, start_line), daemon=True
    ).start()
    api = SimulatedModel(
        max_batch_size=args.max_batch_size,
        batch_timeout=args.batch_timeout_ms / 1e3,
        api_path="/api/inference",
    )
    server = ls.LitServer(api, accelerator="cpu", devices=1, workers_per_device=args.workers)
    server.run(
        host="127.0.0.1",
        port=args.port,
        num_api_servers=args.api_servers,
        log_level="warning",
        generate_client_file=False,
    )


if __name__ == "__main__":
    main()
