"""The router process's garbage-collection policy for serving: start-up's heap frozen out of
every collection, and the young generation collected every 50,000 allocations instead of 700.

Frozen start-up heap. By the time the router serves, its process holds a few hundred thousand
to millions of objects that live as long as it does: Ray, grpc, protobuf, opentelemetry,
prometheus, the tokenizer. A full (generation 2) collection scans every tracked object:
240-460 ms on a 2-core machine, during which no stream moves and a pending admission decision
waits (benchmarks/results/router_scale.txt). ``gc.freeze()`` moves them to the permanent
generation, which collections skip.

Thresholds. Serving allocates a few container objects per streamed token (deltas, events,
futures) that reference counting frees at once; the cyclic collector's default of a
generation-0 pass every 700 net allocations still ran ~14 passes a second, a full collection
every few seconds, and one admission decision in twenty had a collection inside it (the
decision p99 was the collector's). At 50,000 (the figure many Python servers use) the same
work is scanned in ~70x fewer passes, most short-lived objects are gone before a pass sees
them, and older generations follow at Python's own ratios (10, 10). Reference counting frees
as always; only cyclic garbage waits longer (at most one generation-0 interval of it).

Life cycle: ``apply_serving_gc_policy`` is called once, by the process's entry point
(``deploy.cli``'s serve), after the cluster has started and before it serves. Not from library
code: a process that starts many clusters (the test suite) would pin each one's garbage.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000   # net container allocations between generation-0 passes (Python: 700)


def apply_serving_gc_policy(thresholds: bool = True) -> int:
    """Collect start-up's garbage (freed, not frozen), freeze what is left and, with
    ``thresholds``, raise the generation-0 threshold; returns how many objects are now out of
    the collector's scans."""
    gc.collect()
    gc.freeze()
    if thresholds:
        _, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
    return gc.get_freeze_count()
