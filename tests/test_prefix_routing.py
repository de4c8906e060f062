"""Prefix-aware routing, without Ray: the router's per-worker index of prompt block hashes
(computed with the engine's own torch-free function), and admission weighing the expected
cached prefix against load when it predicts TTFT and picks a pair."""

from __future__ import annotations

import subprocess
import sys

from engine.kv_manager import KVCacheManager
from engine.types import KVEvent, KVEventKind, RequestSpec, SamplingParams, SLOTarget
from router.admission import Action, Admission
from router.prefix_index import PrefixIndex, prompt_hashes
from router.registry import WorkerHandle, WorkerRegistry
from tests.test_admission import decode_steps, prefill_steps, stats

SYSTEM = tuple(range(100, 164))   # 4 blocks of 16


def prompt(tail: int, n: int = 20) -> tuple[int, ...]:
    return SYSTEM + tuple(range(1000 + tail, 1000 + tail + n))


def test_router_hashes_are_the_engines():
    kv = KVCacheManager(16, 16, enable_prefix_caching=True)
    tokens = prompt(0)
    kv.find_cached("r", tokens)
    assert prompt_hashes(tokens, 16) == kv._chains["r"].hashes


def test_router_computes_hashes_without_torch():
    code = "import sys, router.prefix_index as p; p.prompt_hashes(list(range(40)), 16); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_index_matches_leading_blocks_and_evicts_least_recent_tails():
    index = PrefixIndex(16, enabled=True)
    assert index.expected_hit(prompt(0)) == 0
    index.record(prompt(0))
    assert index.expected_hit(prompt(0)) == 80, "84 tokens: 5 full blocks, the last token always computed"
    assert index.expected_hit(prompt(7)) == 64, "the shared system prompt"
    assert index.expected_hit(tuple(range(5, 90))) == 0
    index.record(tuple(range(500, 596)), capacity_blocks=8)    # 6 more blocks: 11 > 8
    assert len(index) == 8
    assert index.expected_hit(prompt(0)) == 32, "the older prompt lost its tail blocks first"
    assert PrefixIndex(16, enabled=False).expected_hit(prompt(0)) == 0


def test_a_replaced_worker_starts_with_an_empty_index():
    w = WorkerHandle("d0", "decode", None, "n", "cpu", prefix=PrefixIndex(16, enabled=True))
    w.placed_prompt(prompt(0))
    w.replace(None, {"node_id": "n", "device": "cpu"})
    assert w.prefix.enabled and w.prefix.expected_hit(prompt(0)) == 0


def two_prefill_cluster(conditional: bool = False, timings: bool = True) -> tuple[Admission, list[WorkerHandle]]:
    registry = WorkerRegistry()
    workers = []
    for i in range(2):
        p = WorkerHandle(f"p{i}", "prefill", None, "n", "cpu", stats(f"p{i}", "prefill", prefill_steps()) if timings
                         else None, prefix=PrefixIndex(16, enabled=True))
        registry.add(p)
        workers.append(p)
    d = WorkerHandle("d0", "decode", None, "n", "cpu", stats("d0", "decode", decode_steps(), running=1) if timings
                     else None, prefix=PrefixIndex(16, enabled=True))
    registry.add(d)
    workers.append(d)
    admission = Admission(registry, conditional=conditional)
    for w in registry.all:
        admission.observe_stats(w)
    return admission, workers


def spec(tokens, ttft=None, tpot=None) -> RequestSpec:
    return RequestSpec("r", tokens, SamplingParams(max_tokens=16), SLOTarget(ttft, tpot))


def test_cached_prefix_lowers_predicted_ttft_and_wins_the_pair():
    admission, (p0, p1, d0) = two_prefill_cluster()
    p1.placed_prompt(prompt(0))
    p1.num_prefill_tokens = 40          # a little busier than p0, but holds 64 of the 84 tokens
    cold = admission.predict(spec(prompt(5)), p0, d0)
    warm = admission.predict(spec(prompt(5)), p1, d0)
    assert warm.cached_tokens == 64 and warm.tokens_to_prefill == 20
    assert warm.ttft_s < cold.ttft_s
    decision = admission.decide(spec(prompt(5), ttft=0.5, tpot=0.05))
    assert decision.action is Action.ADMIT and decision.prediction.prefill is p1
    p1.num_prefill_tokens = 4000        # the hit no longer pays for the queue
    assert admission.decide(spec(prompt(5), ttft=0.5, tpot=0.05)).prediction.prefill is p0


def test_best_effort_weighs_the_hit_against_queued_tokens():
    admission, (p0, p1, d0) = two_prefill_cluster(timings=False)
    p1.placed_prompt(prompt(0))
    p1.num_prefill_tokens = 30
    assert admission.decide(spec(prompt(5))).prediction.prefill is p1
    p1.num_prefill_tokens = 100
    assert admission.decide(spec(prompt(5))).prediction.prefill is p0


def test_decode_worker_holding_all_but_the_last_block_skips_the_prefill_worker():
    admission, (p0, p1, d0) = two_prefill_cluster(conditional=True)
    turn = prompt(0)
    d0.placed_prompt(turn)
    again = turn + (7, 8, 9)             # a retry with a few more tokens: 80 of 87 cached there
    decision = admission.decide(spec(again, ttft=0.5, tpot=0.05))
    assert decision.action is Action.ADMIT and decision.prediction.prefill is None
    assert decision.prediction.tokens_to_prefill == 7
    longer = turn + tuple(range(2000, 2040))
    assert admission.decide(spec(longer, ttft=0.5, tpot=0.05)).prediction.prefill is not None


def events(seqs_kinds_hashes) -> list[KVEvent]:
    return [KVEvent(seq, KVEventKind(kind), h) for seq, kind, h in seqs_kinds_hashes]


def test_index_applies_events_in_order_skips_repeats_and_starts_over_after_a_gap():
    index = PrefixIndex(16, enabled=True)
    h = prompt_hashes(prompt(0), 16)                      # 5 full blocks
    index.apply(events([(1, "stored", h[0]), (2, "stored", h[1]), (3, "stored", h[2])]))
    assert index.expected_hit(prompt(0)) == 48
    index.apply(events([(2, "stored", h[1]), (3, "stored", h[2]), (4, "removed", h[1])]))
    assert index.expected_hit(prompt(0)) == 16, "2 and 3 repeated (skipped); the second block was removed"
    index.apply(events([(4, "removed", h[1])]))
    assert index.num_gaps == 0
    index.record(prompt(0))                               # a placement: all 5 blocks guessed
    assert index.expected_hit(prompt(0)) == 80
    index.apply(events([(7, "stored", h[0])]))             # 5 and 6 lost: a removal may be among them
    assert index.num_gaps == 1 and index.expected_hit(prompt(0)) == 16, "started over from what it was told"
    disabled = PrefixIndex(16, enabled=False)
    disabled.apply(events([(1, "stored", h[0])]))
    assert disabled.expected_hit(prompt(0)) == 0


def test_a_prefix_the_worker_evicted_is_not_routed_to():
    """p1's index learns the system prompt from its (real) pool's stored events and wins the
    pair; the pool evicts it under pressure, the removed events reach the index, and the pair
    goes to the less busy p0. An old actor's events never touch its replacement's index."""
    admission, (p0, p1, d0) = two_prefill_cluster()
    kv = KVCacheManager(8, 16, enable_prefix_caching=True)     # p1's pool: 8 blocks of 16
    kv.admit("a", prompt(0), [], len(prompt(0)))
    kv.cache_computed("a", prompt(0), len(prompt(0)))
    kv.free("a")
    p1.observe_kv_events(kv.pool.take_events(), p1.generation)
    p1.num_prefill_tokens = 40
    assert admission.decide(spec(prompt(5), ttft=0.5, tpot=0.05)).prediction.prefill is p1
    kv.allocate_slots("other", 8 * 16)                         # every block: the prefix is evicted
    kv.free("other")
    assert kv.find_cached("probe", prompt(5)) == []
    p1.observe_kv_events(kv.pool.take_events(), p1.generation)
    assert p1.prefix.expected_hit(prompt(5)) == 0
    assert admission.decide(spec(prompt(5), ttft=0.5, tpot=0.05)).prediction.prefill is p0
    old = p1.generation
    p1.replace(None, {"node_id": "n", "device": "cpu"})
    p1.observe_kv_events(events([(1, "stored", prompt_hashes(prompt(0), 16)[0])]), old)
    assert len(p1.prefix) == 0, "a late report of the dead actor"


def plp_spec(tokens, num_generated: int = 0) -> RequestSpec:
    """A request asking for its prompt's logprobs: the engine computes its whole prompt."""
    return RequestSpec("r", tokens, SamplingParams(max_tokens=16, prompt_logprobs=1), num_generated=num_generated)


def test_prompt_logprobs_expect_no_hit_where_the_prompt_is_computed():
    """A request with prompt logprobs reads nothing from the cache where it is prefilled (the
    engine's rule: every prompt position's logits are needed): no expected hit there, so a busier
    worker holding its prefix does not win it, and a decode worker holding all of it but a block
    does not prefill it itself (it would compute the whole prompt between its decode steps). The
    decode side of a hand-off still shares the blocks it holds (fewer bytes moved)."""
    admission, (p0, p1, d0) = two_prefill_cluster(timings=False)
    p1.placed_prompt(prompt(0))
    p1.num_prefill_tokens = 30
    assert admission.decide(spec(prompt(5))).prediction.prefill is p1, "the plain request takes the hit"
    chosen = admission.decide(plp_spec(prompt(5))).prediction
    assert chosen.prefill is p0 and chosen.cached_tokens == 0
    migrated = admission.decide(plp_spec(prompt(5), num_generated=3)).prediction
    assert migrated.prefill is p1, "a migrated request owes none: it reads the cache"
    admission, (p0, p1, d0) = two_prefill_cluster(conditional=True)
    turn = prompt(0)
    d0.placed_prompt(turn)
    again = turn + (7, 8, 9)
    assert admission.decide(spec(again, ttft=0.5, tpot=0.05)).prediction.prefill is None
    pair = admission.decide(RequestSpec("r", again, SamplingParams(max_tokens=16, prompt_logprobs=0),
                                        SLOTarget(0.5, 0.05))).prediction
    assert pair.prefill is not None and pair.cached_tokens == 0, "prefilled on a prefill worker, whole"
    assert pair.decode is d0 and pair.decode_cached_tokens == 80, "the decode side's blocks still shared"


def test_colocated_best_effort_weighs_the_hit_against_queued_tokens():
    """Colocated (no prefill workers), no SLO targets: the least queued work wins, the prefix
    expected cached counted against the worker's queue as on the prefill side. A worker holding
    the prefix once took every request sharing it whatever its queue, so a burst sharing one
    system prompt all went to one worker while the other idled."""
    registry = WorkerRegistry()
    d0, d1 = (WorkerHandle(f"d{i}", "decode", None, "n", "cpu", stats(f"d{i}", "decode", decode_steps()),
                           prefix=PrefixIndex(16, enabled=True)) for i in range(2))
    for w in (d0, d1):
        registry.add(w)
    admission = Admission(registry)
    d0.placed_prompt(prompt(0))
    assert admission.decide(spec(prompt(5))).prediction.decode is d0, "an idle worker holding the prefix"
    d0.num_prefill_tokens = 100          # queued: more than the 64 tokens the hit saves
    chosen = admission.decide(spec(prompt(5))).prediction
    assert chosen.prefill is None and chosen.decode is d1 and chosen.cached_tokens == 0
    d0.num_prefill_tokens = 40
    assert admission.decide(spec(prompt(5))).prediction.decode is d0, "the hit outweighs a shorter queue"
