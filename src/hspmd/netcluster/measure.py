"""Throughput of one TCP stream, measured with plain sockets (no torch: it starts in ms).

Run inside the namespaces by the executor (``hspmd.netcluster.run``)::

    python -m hspmd.netcluster.measure serve HOST PORT NBYTES REPEATS   # prints "ready"
    python -m hspmd.netcluster.measure send HOST PORT NBYTES REPEATS    # prints JSON

The sender times each of ``REPEATS`` transfers of ``NBYTES`` from its first byte to the
receiver's one-byte acknowledgement of the last, and prints the best and the median rate in
bytes per second (``{"best_Bps": ..., "median_Bps": ..., "nbytes": ..., "seconds": [...]}``).
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

CHUNK = 1 << 20


def serve(host: str, port: int, nbytes: int, repeats: int) -> None:
    with socket.create_server((host, port)) as server:
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            view = memoryview(bytearray(CHUNK))
            for _ in range(repeats):
                left = nbytes
                while left:
                    got = conn.recv_into(view, min(left, CHUNK))
                    if not got:
                        raise ConnectionError(f"sender closed with {left} bytes to go")
                    left -= got
                conn.sendall(b"k")


def send(host: str, port: int, nbytes: int, repeats: int) -> dict[str, object]:
    payload = memoryview(bytes(CHUNK))
    seconds = []
    with socket.create_connection((host, port), timeout=120) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats):
            start = time.perf_counter()
            left = nbytes
            while left:
                step = min(left, CHUNK)
                conn.sendall(payload[:step])
                left -= step
            if conn.recv(1) != b"k":
                raise ConnectionError("receiver closed before acknowledging")
            seconds.append(time.perf_counter() - start)
    return {
        "nbytes": nbytes,
        "seconds": seconds,
        "best_Bps": nbytes / min(seconds),
        "median_Bps": nbytes / statistics.median(seconds),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 5 or argv[0] not in ("serve", "send"):
        print("usage: python -m hspmd.netcluster.measure serve|send HOST PORT NBYTES REPEATS")
        return 2
    mode, host, port, nbytes, repeats = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    if mode == "serve":
        serve(host, port, nbytes, repeats)
    else:
        print(json.dumps(send(host, port, nbytes, repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
