"""N batchserve replicas on loopback ports and Debian's nginx in front of them.

    python deploy/replicas.py --count 3 --port 8080 -- --devices sim:4

starts `python -m batchserve --port P ...` for P = 8001, 8002, ... with the flags after `--`,
then nginx on `--port` with `deploy/nginx/batchserve.conf` (its upstream servers and listen
port rewritten for these replicas), its pid, logs and temporary files in a private
directory. Ctrl-C or SIGTERM stops nginx, then drains every replica. The tests drive the
same `Replicas` object, so the file in deploy/ is the one they prove.

A tool beside the file it proves, not part of the server: it is not installed with
batchserve, and it starts each replica as `python -m batchserve`. `free_ports` and
`redis_server` start what replicas share for the tests and benchmarks that run them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

NGINX_CONF = Path(__file__).resolve().parent / "nginx/batchserve.conf"
_UPSTREAM_SERVER = re.compile(r"^(\s*)server 127\.0\.0\.1:\d+( .*;)$", re.M)
_LISTEN = re.compile(r"listen 127\.0\.0\.1:\d+;")
STOP_TIMEOUT_S = 60.0


def nginx_site(template: str, replica_ports: Sequence[int], port: int) -> str:
    """The site file with one upstream server line per replica and nginx on `port`."""
    match = _UPSTREAM_SERVER.search(template)
    if match is None or not _LISTEN.search(template):
        raise ValueError("the nginx file has no upstream server line or no listen line")
    indent, options = match.group(1), match.group(2)
    servers = "\n".join(f"{indent}server 127.0.0.1:{p}{options}" for p in replica_ports)
    first, last = match.start(), list(_UPSTREAM_SERVER.finditer(template))[-1].end()
    site = template[:first] + servers + template[last:]
    return _LISTEN.sub(f"listen 127.0.0.1:{port};", site)


def _main_conf(folder: Path, site: Path) -> str:
    """A whole nginx.conf that runs unprivileged in `folder` and includes the site."""
    temp = {name: folder / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    for path in temp.values():
        path.mkdir(exist_ok=True)
    if os.geteuid() == 0:
        # Started as root, nginx runs its workers as nobody: they must reach and write the
        # temp folders (a request body over its 16 KB buffer is written there), or every
        # such request, a Batch API upload among them, is answered 500.
        folder.chmod(0o711)
        for path in temp.values():
            os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    return f"""daemon off;
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} warn;
worker_processes 1;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {temp["body"]};
    proxy_temp_path {temp["proxy"]};
    fastcgi_temp_path {temp["fastcgi"]};
    uwsgi_temp_path {temp["uwsgi"]};
    scgi_temp_path {temp["scgi"]};
    include {site};
}}
"""


def free_ports(count: int) -> list[int]:
    """`count` loopback ports that were free just now, the kernel's choice."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@contextlib.contextmanager
def redis_server(port: int, folder: Path) -> Iterator[None]:
    """Debian's redis-server on loopback `port`, nothing saved, once it says it accepts
    connections; stopped on exit."""
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        if not any("Ready to accept connections" in line for line in process.stdout):
            raise RuntimeError("redis-server exited before accepting connections")
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


class Replicas:
    """The replicas and nginx: started together, each replica stopped and restarted alone."""

    def __init__(
        self,
        port: int,
        replica_ports: Sequence[int],
        replica_args: Sequence[str] = (),
        nginx: str = "nginx",
    ) -> None:
        self.port = port
        self.replica_ports = list(replica_ports)
        self._replica_args = list(replica_args)
        self._nginx_binary = nginx
        self._folder = Path(tempfile.mkdtemp(prefix="batchserve-replicas-"))
        self.replicas: list[subprocess.Popen[str] | None] = [None] * len(replica_ports)
        self._nginx: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for index in range(len(self.replica_ports)):
            self.start_replica(index)
        site = self._folder / "batchserve.conf"
        site.write_text(nginx_site(NGINX_CONF.read_text(), self.replica_ports, self.port))
        conf = self._folder / "nginx.conf"
        conf.write_text(_main_conf(self._folder, site))
        with (self._folder / "nginx.err").open("a") as stderr:
            self._nginx = subprocess.Popen(
                [self._nginx_binary, "-c", str(conf), "-p", str(self._folder)], stderr=stderr
            )
        self._wait_for_nginx()

    def start_replica(self, index: int) -> None:
        """Starts replica `index` and returns once it listens (its start-up line)."""
        command = [sys.executable, "-m", "batchserve", "--port", str(self.replica_ports[index]),
                   *self._replica_args]  # fmt: skip
        out, err = (self._folder / f"replica-{index}.{kind}" for kind in ("out", "err"))
        with out.open("a") as stdout, err.open("a") as stderr:
            start = stdout.tell()
            replica = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while "listening on" not in out.read_text()[start:]:
            if replica.poll() is not None or time.monotonic() > deadline:
                replica.kill()
                replica.wait()
                raise RuntimeError(f"replica {index} did not start: {err.read_text()[-2000:]}")
            time.sleep(0.05)
        self.replicas[index] = replica

    def stop_replica(self, index: int) -> int:
        """SIGTERM (a drain); returns its exit status."""
        replica = self.replicas[index]
        if replica is None:
            raise RuntimeError(f"replica {index} is not running")
        replica.send_signal(signal.SIGTERM)
        status = replica.wait(timeout=STOP_TIMEOUT_S)
        self.replicas[index] = None
        return status

    def close(self) -> None:
        """nginx first (no new requests), then every replica drains."""
        if self._nginx is not None:
            self._nginx.send_signal(signal.SIGQUIT)  # graceful: open requests finish
            try:
                self._nginx.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._nginx.kill()
                self._nginx.wait()
            self._nginx = None
        for index, replica in enumerate(self.replicas):
            if replica is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.stop_replica(index)
                if replica.poll() is None:
                    replica.kill()
                    replica.wait()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> Replicas:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _wait_for_nginx(self) -> None:
        """Until nginx accepts connections; its error log if it exits instead."""
        assert self._nginx is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._nginx.poll() is not None:
                reason = (self._folder / "nginx.err").read_text().strip()
                raise RuntimeError(f"nginx did not start: {reason}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.05)
        raise RuntimeError("nginx did not listen within 10 s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python deploy/replicas.py",
        description="Start N batchserve replicas on loopback and nginx in front of them.",
        epilog="Flags after -- go to every replica, e.g. -- --devices sim:4 --keys-file k.toml",
    )
    parser.add_argument("--count", type=int, default=3, help="replicas (default: 3)")
    parser.add_argument("--port", type=int, default=8080, help="nginx's port (default: 8080)")
    parser.add_argument(
        "--first-replica-port",
        type=int,
        default=8001,
        help="replica n listens on this + n (default: 8001)",
    )
    parser.add_argument("--nginx", default="nginx", help="the nginx binary (default: nginx)")
    parser.add_argument("replica_args", nargs=argparse.REMAINDER, help="-- then batchserve flags")
    args = parser.parse_args(argv)
    replica_args = args.replica_args[1:] if args.replica_args[:1] == ["--"] else args.replica_args
    if args.count < 1:
        parser.error("--count must be 1 or more")
    if shutil.which(args.nginx) is None:
        parser.error(f"{args.nginx} not found: install Debian's nginx (apt-get install nginx)")
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    replica_ports = [args.first_replica_port + n for n in range(args.count)]
    with Replicas(args.port, replica_ports, replica_args, args.nginx):
        print(f"nginx on http://127.0.0.1:{args.port} -> {args.count} replicas", flush=True)
        while not stop:
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
