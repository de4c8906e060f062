"""KV hand-off speed per transport between two Ray actors, next to a plain memcpy.

The payload is the KV of one 512-token prompt in SmolLM2-135M's layout (30 layers, 3 KV heads,
head dim 64, block size 16, float32: 46,080 bytes/token, 32 blocks, 23.6 MB), moved from
shuffled source blocks of a prefill-like actor into shuffled reserved blocks of a decode-like
actor whose cache lives in /dev/shm. For each transport, right before its own runs, the
sending actor times ``dst.copy_(src)`` of the same bytes, so each ratio compares numbers
taken in the same minute of a shared 2-core machine.

Time of one transfer, from monotonic stamps taken inside the actors (one clock per host):
sequential transports (shm, object_store: send, then hand the handle over, then receive)
count send time + receive time; torch_dist (receive and send run together) counts from the
later start to the later end. Ray's control-plane calls are excluded: every transport needs
the same ones. The first transfer (mapping the file, warming buffers) is reported apart.

Run: ``python benchmarks/bench_kvtransfer.py [--repeats 20]``; writes
benchmarks/results/kvtransfer.txt.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_run  # noqa: E402

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import ray  # noqa: E402
import torch  # noqa: E402

from engine.types import KVLayout  # noqa: E402
from kvtransfer.peer import KVPeer  # noqa: E402
from kvtransfer.rendezvous import rendezvous_address  # noqa: E402

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
NUM_TOKENS = 512
POOL_BLOCKS = 128
TRANSPORTS = ("shm", "torch_dist", "object_store")


def transfer(prefill, decode, req_id: str, transport: str, src_ids, dst_ids) -> float:
    """One hand-off in the documented call order; seconds it took inside the actors."""
    handle = ray.get(decode.new_handle.remote(req_id, dst_ids, NUM_TOKENS, transport))
    handle = ray.get(prefill.bind.remote(handle, src_ids))
    if transport == "torch_dist":
        received = decode.receive.remote(handle)
        (_, s0, s1), (_, r0, r1) = ray.get([prefill.send.remote(handle), received])
        return max(s1, r1) - max(s0, r0)
    sent, s0, s1 = ray.get(prefill.send.remote(handle))
    _, r0, r1 = ray.get(decode.receive.remote(sent.handle))
    return (s1 - s0) + (r1 - r0)


def check_landed(prefill, decode, src_ids, dst_ids) -> None:
    src, dst = ray.get([prefill.snapshot.remote(), decode.snapshot.remote()])
    if not torch.equal(src[:, :, src_ids], dst[:, :, dst_ids]):
        raise AssertionError("transferred KV differs from the source")


def bench(prefill, decode, transport: str, repeats: int, rng: random.Random) -> dict:
    num_blocks = -(-NUM_TOKENS // LAYOUT.block_size)
    num_bytes = num_blocks * LAYOUT.bytes_per_block
    memcpy = statistics.median(ray.get(prefill.memcpy_seconds.remote(num_bytes, repeats + 2))[2:])
    ray.get(decode.write_blocks.remote(list(range(POOL_BLOCKS)), torch.zeros(LAYOUT.cache_shape(POOL_BLOCKS))))
    times = []
    for i in range(repeats + 1):
        src_ids = rng.sample(range(POOL_BLOCKS), num_blocks)
        dst_ids = rng.sample(range(POOL_BLOCKS), num_blocks)
        times.append(transfer(prefill, decode, f"{transport}-{i}", transport, src_ids, dst_ids))
    check_landed(prefill, decode, src_ids, dst_ids)
    median = statistics.median(times[1:])
    return {"transport": transport, "bytes": num_bytes, "first_s": times[0], "median_s": median,
            "gbps": num_bytes / median / 1e9, "memcpy_s": memcpy, "memcpy_gbps": num_bytes / memcpy / 1e9}


def report(rows: list[dict], repeats: int) -> str:
    lines = [
        f"KV of a {NUM_TOKENS}-token prompt, SmolLM2-135M layout ({LAYOUT.num_layers} layers, "
        f"{LAYOUT.num_kv_heads} kv heads, head dim {LAYOUT.head_dim}, block {LAYOUT.block_size}, "
        f"{LAYOUT.dtype}): {rows[0]['bytes']:,} bytes, shuffled blocks",
        f"two Ray actors, 1 torch thread each, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"ray {ray.__version__}; median of {repeats} after 1 cold run",
        "",
        f"{'transport':<14}{'ms':>8}{'GB/s':>8}{'memcpy ms':>11}{'memcpy GB/s':>13}{'vs memcpy':>11}{'cold ms':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['transport']:<14}{r['median_s'] * 1e3:>8.2f}{r['gbps']:>8.2f}{r['memcpy_s'] * 1e3:>11.2f}"
            f"{r['memcpy_gbps']:>13.2f}{r['memcpy_s'] / r['median_s']:>10.0%}{r['first_s'] * 1e3:>9.2f}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kvtransfer.txt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    peer = ray.remote(num_cpus=1)(KVPeer)
    shm_path = f"/dev/shm/pdserve-bench-kv-{os.getpid()}"
    prefill, decode = peer.remote(LAYOUT, POOL_BLOCKS), peer.remote(LAYOUT, POOL_BLOCKS, shm_path=shm_path)
    try:
        ray.get(prefill.write_blocks.remote(list(range(POOL_BLOCKS)), torch.randn(LAYOUT.cache_shape(POOL_BLOCKS))))
        address = rendezvous_address()
        ray.get([prefill.join_group.remote(address, 2, 0), decode.join_group.remote(address, 2, 1)])
        rng = random.Random(0)
        rows = [bench(prefill, decode, t, args.repeats, rng) for t in TRANSPORTS]
    finally:
        ray.get([prefill.close.remote(), decode.close.remote()])
        ray.shutdown()
    text = report(rows, args.repeats)
    write_run(args.out, text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
