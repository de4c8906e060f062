"""The router process's garbage collection: what start-up made is kept out of every collection.

By the time the router serves, its process holds a few hundred thousand to millions of
objects that live as long as it does: Ray, grpc, protobuf, opentelemetry, prometheus, the
tokenizer and, through the worker actor classes Ray needs to start workers, torch and
transformers. A full (generation 2) collection scans every tracked object: 240-460 ms on a
2-core machine, during which no stream moves and a pending admission decision waits
(benchmarks/results/router_scale.txt). ``gc.freeze()`` moves them to the permanent
generation, which collections skip; the cyclic collector still runs as before for what
serving allocates, and reference counting frees as always.

Life cycle: ``freeze_startup_heap`` is called once, by the process's entry point
(``deploy.cli``'s serve), after the cluster has started and before it serves. Not from library
code: a process that starts many clusters (the test suite) would pin each one's garbage.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect start-up's garbage (freed, not frozen), then freeze what is left; returns how
    many objects are now out of the collector's scans."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
