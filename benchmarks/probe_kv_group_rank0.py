"""KV group probe: a double failure. A member is SIGKILLed (decode-1); once its replacement is up
the group forms again, and rank 0 (prefill-0), which hosts the forming's rendezvous store, is
SIGKILLed right after it answered the router's address call, as the joins go out. Prints each
member's join (how long it took to fail), the forming, a request a second while the group is down
(served over another transport meanwhile), and how long until the group is up again.

    RAY_AUTH_MODE=disabled .venv/bin/python benchmarks/probe_kv_group_rank0.py

Tiny random Llama, 1 prefill + 2 decode workers, torch_dist (gloo) forced, no warm spares.
Measured (session 33): with torch's own rendezvous the survivors' joins failed after 50-71 s and
the group was back 72-77 s after the first kill; with rank 0 hosting the store before the joins
(kvtransfer/group_store.py) they fail after 6-11 s and the group is back in 25 s (18 s after rank
0's kill: its replacement's cold start and the router's back-off).
"""
import asyncio, os, signal, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray, torch
torch.set_num_threads(1)
from tests.test_cluster_e2e import start_cluster, address
from router.client import PdserveClient
import router.kv_group as kvg

def main() -> None:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    c = start_cluster("disaggregated", kv_transport="torch_dist", num_decode=2)
    reg, group = c.cluster.registry, c.cluster.kv_group
    print("members", [w.worker_id for w in reg.all], "up", reg.dist_ready, flush=True)
    killed = {}
    real_form = group._form

    real_call = kvg.call

    async def call_then_kill(worker, method, *args, **kw):
        t = time.monotonic()
        try:
            out = await real_call(worker, method, *args, **kw)
        except Exception as exc:
            if method == "join_kv_group":
                print(f"  join of {worker.worker_id} failed after {time.monotonic() - t:.1f} s: {str(exc)[:200]}", flush=True)
            raise
        if method == "join_kv_group":
            print(f"  join of {worker.worker_id} ok after {time.monotonic() - t:.1f} s", flush=True)
        if method == "kv_group_address" and "rank0" not in killed and killed.get("armed"):
            os.kill(worker.pid, signal.SIGKILL)   # the joins go out next, to a dead rank 0's address
            killed["rank0"] = time.monotonic()
            print(f"killed rank 0 ({worker.worker_id}) right after it hosted the store, as the joins go out", flush=True)
        return out
    kvg.call = call_then_kill

    async def form_and_kill_rank0():
        t = time.monotonic()
        try:
            await real_form()
            print(f"  forming ok in {time.monotonic() - t:.1f} s", flush=True)
        except Exception as exc:
            print(f"  forming failed after {time.monotonic() - t:.1f} s: {str(exc)[:150]}", flush=True)
            raise
    group._form = form_and_kill_rank0
    killed["armed"] = True
    victim = reg.get("decode-1")
    t0 = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    print("killed decode-1", flush=True)
    with PdserveClient(address(c), timeout_s=120) as client:
        while True:
            time.sleep(1.0)
            elapsed = time.monotonic() - t0
            try:
                r = client.generate_text(token_ids=list(range(5, 40)), max_tokens=4, ignore_eos=True)
                served = f"served via {r.timings.kv_handoff}/{getattr(r.timings, 'kv_transport', '?')}"
            except Exception as exc:
                served = f"failed {str(exc)[:80]}"
            print(f"t={elapsed:5.1f}s group_up={reg.dist_ready} formed={group.num_formed} alive={[w.alive for w in reg.all]} {served}", flush=True)
            if reg.dist_ready and "rank0" in killed:
                print(f"GROUP UP again {elapsed:.1f} s after the first kill, {time.monotonic() - killed['rank0']:.1f} s after rank 0's", flush=True)
                break
            if elapsed > 240:
                print("gave up"); break
    c.stop(); ray.shutdown()


if __name__ == "__main__":
    main()
