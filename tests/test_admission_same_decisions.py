"""The admission decision, made cheaper, decides exactly as before: random clusters (16 x 48
workers among them, decode workers full or not, prefix hits, decode workers prefilling, no
timings yet, workers down) and random requests through ``Admission.decide`` and through the
frozen e219ab3 decision (``tests/admission_reference.py``): the same action, cause, detail and
prediction, every float bit for bit. No Ray."""

from __future__ import annotations

import collections
import dataclasses
import random

from engine.errors import WorkerFailedError
from engine.types import SLOTarget
from router.admission import Admission, Cause
from router.registry import WorkerState
from tests.admission_reference import reference_decide
from tests.test_admission_scale import NOW, make_cluster, request


def scenario(rng: random.Random) -> Admission:
    """``make_cluster``'s random cluster, then perturbed: what the rules branch on."""
    num_prefill = rng.choice((0, 1, 3, 16))
    num_decode = rng.choice((2, 5, 48)) if num_prefill in (0, 16) else rng.choice((1, 4))
    admission = make_cluster(rng, num_prefill, num_decode, rng.choice((0, 3, 20)), rng.random() < 0.6,
                             identical=rng.random() < 0.25)
    full = rng.random() < 0.3   # every decode worker out of KV room: the queued requests' case
    for w in admission.registry.all:
        r = rng.random()
        if r < 0.04:
            w.stats = None
        elif r < 0.08:
            w.state = WorkerState.RESTARTING
        elif r < 0.12:
            w.stats = dataclasses.replace(w.stats, num_waiting_tokens=rng.choice((10, 5000)))
        elif full and w.role == "decode":
            w.stats = dataclasses.replace(w.stats, num_free_blocks=rng.choice((0, 2)))
        if rng.random() < 0.04:
            admission.models.pop(w.worker_id, None)   # no step timings yet
        if w.role == "decode" and rng.random() < 0.3:   # prefilled here before (conditional disaggregation)
            w.begin_prefill(rng.choice((16, 300, 3000)), now=NOW - rng.choice((0.5, 20.0, 200.0)))
            w.num_prefill_tokens = rng.choice((0, w.num_prefill_tokens))
    if rng.random() < 0.2:   # the prefill side misses TTFT: decode workers prefilling are the candidates
        for w in admission.registry.prefill:
            w.num_prefill_tokens = 50_000
    if rng.random() < 0.2:   # every request decoding is close to its TPOT target: a prefill there pushes it over
        for w in admission.registry.decode:
            w.num_prefill_tokens = 0   # (prompts queued behind them would put them past it already)
            for progress in w.decoding.values():
                progress.tpot_target_s, progress.first_token_s, progress.num_tokens = 0.03, NOW - 1.0, 40
    if rng.random() < 0.3:
        admission.ttft_overhead_s = rng.choice((0.003, 0.05))
        admission.ttft_correction = rng.choice((0.9, 1.7))
        admission.tpot_correction = rng.choice((0.6, 1.3))
        admission.ttft_margin.share = rng.choice((0.5, 0.8, 1.0))
    admission.enabled = rng.random() > 0.05
    return admission


def outcome(decide, admission: Admission, *args, **kwargs):
    try:
        return decide(admission, *args, **kwargs)
    except WorkerFailedError as exc:   # no decode worker alive
        return str(exc)


def test_the_decisions_are_those_of_the_frozen_reference():
    rng = random.Random(12)
    causes = collections.Counter()
    for trial in range(250):
        admission = scenario(rng)
        for _ in range(3):
            spec = request(rng, admission)
            if rng.random() < 0.3:   # long enough to stall the requests decoding where it prefills
                spec = dataclasses.replace(spec, prompt_token_ids=spec.prompt_token_ids * (4000 // len(spec.prompt_token_ids)))
            if rng.random() < 0.08:  # a TPOT target no step meets, the request alone included
                spec = dataclasses.replace(spec, slo=SLOTarget(spec.slo.ttft_s, 0.0005))
            kwargs = dict(now=NOW + rng.choice((0.0, 3.0)), waited_s=rng.choice((0.0, 0.0, 0.15, 0.7)),
                          best_effort=rng.random() < 0.1)
            got = outcome(Admission.decide, admission, spec, **kwargs)
            assert got == outcome(reference_decide, admission, spec, **kwargs), f"trial {trial}"
            causes[getattr(got, "cause", None)] += 1
    assert set(Cause) <= set(causes), f"a rule went unexercised: {causes}"
