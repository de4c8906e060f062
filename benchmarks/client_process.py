"""A benchmark's gRPC client in a process of its own, as a real client is.

Life cycle: ``ClientProcess(address)`` starts ``python -m benchmarks.client_process ADDRESS``
(it imports only the gRPC client: no torch, no Ray) and talks to it by JSON lines over its
stdin/stdout; ``generate`` sends one request and waits for the stamped tokens; ``close``
(or the context manager) ends it. A client sharing the router's process would take the GIL
from the router's loop at every message and add its waits to the router's overhead.

Stamps are ``time.perf_counter()`` of the client process: CLOCK_MONOTONIC on Linux, the same
clock in every process of the machine, so they subtract exactly from the router's own stamps.
"""

from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True)
class ClientRun:
    start: float               # perf_counter just before the call
    stamps: list[float]        # perf_counter at the message carrying each token
    token_ids: list[int]
    num_messages: int
    timings: bytes | None      # the final message's serialized pdserve.Timings, if any


class ClientProcess:
    def __init__(self, address: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.client_process", address],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        self._ask({"op": "health"})   # connected and warm before anything is timed

    def generate(self, prompt: list[int], max_tokens: int) -> ClientRun:
        reply = self._ask({"op": "generate", "prompt": prompt, "max_tokens": max_tokens})
        timings = base64.b64decode(reply["timings"]) if reply["timings"] is not None else None
        return ClientRun(reply["start"], reply["stamps"], reply["token_ids"], reply["num_messages"], timings)

    def health_round_trip_s(self, num_calls: int = 10, pause_s: float = 0.0) -> float:
        """Median of unary grpc.health.v1 ``Check`` calls: gRPC's floor (answered from memory).
        ``pause_s``: each call after that long idle, as a request after a pause arrives (the
        server's threads asleep: on this VM a call to an idle gRPC server costs ~1 ms more than
        one right after another, bare grpc.aio as much as the router)."""
        return self._ask({"op": "health", "num_calls": num_calls, "pause_s": pause_s})["median_s"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=10)

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ask(self, message: dict) -> dict:
        self._proc.stdin.write(json.dumps(message) + "\n")
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process ended (exit code {self._proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"client process: {reply['error']}")
        return reply


# ---------------------------------------------------------------- the child


def _generate(client, prompt: list[int], max_tokens: int) -> dict:
    stamps: list[float] = []
    ids: list[int] = []
    timings = None
    num_messages = 0
    start = time.perf_counter()
    for resp in client.generate(token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
        now = time.perf_counter()
        num_messages += 1
        stamps.extend([now] * len(resp.token_ids))
        ids.extend(resp.token_ids)
        if resp.HasField("timings"):
            timings = base64.b64encode(resp.timings.SerializeToString()).decode()
    return {"start": start, "stamps": stamps, "token_ids": ids, "num_messages": num_messages, "timings": timings}


def _health(check, request, num_calls: int, pause_s: float) -> dict:
    times = []
    for _ in range(num_calls):
        time.sleep(pause_s)
        start = time.perf_counter()
        check(request)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times)}


def main(address: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from router.client import PdserveClient

    with PdserveClient(address) as client, grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for line in sys.stdin:
            message = json.loads(line)
            try:
                if message["op"] == "generate":
                    reply = _generate(client, message["prompt"], message["max_tokens"])
                else:
                    reply = _health(check, health_pb2.HealthCheckRequest(), message.get("num_calls", 1),
                                    message.get("pause_s", 0.0))
            except grpc.RpcError as exc:
                reply = {"error": f"{exc.code().name}: {exc.details()}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
