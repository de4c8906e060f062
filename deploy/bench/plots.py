"""PNG plots of one or more saved results (one labelled line per system):

  attainment_vs_rate.png   SLO attainment (good / submitted) against request rate
  goodput_vs_rate.png      goodput (good req/s) against request rate, with throughput dashed
  ttft_cdf.png, tpot_cdf.png  latency CDFs, one panel per label, one line per rate

Attainment and goodput need SLOs (``--goodput``); runs without them are left out of those two.
An ``inf`` rate is drawn right of the largest finite one and ticked "inf".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deploy.bench.backends import OutcomeDict

logger = logging.getLogger(__name__)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")   # files only: never a display
    import matplotlib.pyplot as plt

    return plt


def unique_labels(docs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each document's label, made unique with a counter where two files share one."""
    seen: dict[str, int] = {}
    labels = []
    for doc in docs:
        base = str(doc.get("label") or "run")
        seen[base] = seen.get(base, 0) + 1
        labels.append(base if seen[base] == 1 else f"{base} ({seen[base]})")
    return labels


def _x_positions(docs: Sequence[Mapping[str, Any]]) -> tuple[float, list[float], list[str]]:
    rates = {run["request_rate"] for d in docs for run in d["runs"]}
    finite = sorted(r for r in rates if not math.isinf(r))
    inf_x = (finite[-1] * 1.25 + 1.0) if finite else 1.0
    ticks = finite + ([inf_x] if any(math.isinf(r) for r in rates) else [])
    return inf_x, ticks, [f"{r:g}" for r in finite] + (["inf"] if len(ticks) > len(finite) else [])


def _rate_plot(plt, docs, labels, key: str, ylabel: str, path: Path, *, dashed: str | None = None) -> Path | None:
    with_slo = [(d, lab) for d, lab in zip(docs, labels) if any(r["summary"].get(key) is not None for r in d["runs"])]
    if not with_slo:
        logger.info("no run has SLOs (--goodput): skipping %s", path.name)
        return None
    inf_x, ticks, tick_labels = _x_positions([d for d, _ in with_slo])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for doc, label in with_slo:
        runs = sorted(doc["runs"], key=lambda r: r["request_rate"])
        xs = [inf_x if math.isinf(r["request_rate"]) else r["request_rate"] for r in runs]
        line, = ax.plot(xs, [r["summary"][key] for r in runs], marker="o", label=label)
        if dashed:
            ax.plot(xs, [r["summary"][dashed] for r in runs], linestyle="--", color=line.get_color(),
                    alpha=0.6, label=f"{label} ({dashed.replace('_', ' ')})")
    ax.set_xticks(ticks, tick_labels)
    ax.set_ylim(0, 1.05 if key == "slo_attainment" else None)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    slos = with_slo[0][0]["runs"][0]["summary"].get("slos_ms") or {}
    ax.set_title("SLO: " + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf_plot(plt, docs, labels, metric: str, path: Path) -> Path:
    fig, axes = plt.subplots(1, len(docs), figsize=(5.0 * len(docs), 4.0), squeeze=False, sharey=True)
    for ax, doc, label in zip(axes[0], docs, labels):
        largest = 0.0
        for run in sorted(doc["runs"], key=lambda r: r["request_rate"]):
            values = sorted(v for o in run["outcomes"] if (v := _latency_ms(o, metric)) is not None)
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=f"{run['request_rate']:g} req/s")
                largest = max(largest, values[-1])
        slo = (doc["runs"][0]["summary"].get("slos_ms") or {}).get(metric) if doc["runs"] else None
        if slo and slo <= 2 * largest:   # a far-away SLO line would squash every curve into the left edge
            ax.axvline(slo, color="grey", linestyle=":", label=f"SLO {slo:g} ms")
        ax.set_title(label, fontsize="small")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel("fraction of completed requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_ms(o: OutcomeDict, metric: str) -> float | None:
    if o["status"] != "ok":
        return None
    if metric == "ttft":
        return None if o["ttft_s"] is None else o["ttft_s"] * 1000.0
    n, ttft, e2e = o["output_len"], o["ttft_s"], o["e2e_s"]
    if n < 2 or ttft is None or e2e is None:
        return None
    return (e2e - ttft) / (n - 1) * 1000.0


def plot_results(docs: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write every plot for these result documents (``report.load_result``) into ``out_dir``."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = unique_labels(docs)
    written = [
        _rate_plot(plt, docs, labels, "slo_attainment", "SLO attainment (good / submitted)",
                   out / "attainment_vs_rate.png"),
        _rate_plot(plt, docs, labels, "goodput", "goodput (good req/s)", out / "goodput_vs_rate.png",
                   dashed="request_throughput"),
        _cdf_plot(plt, docs, labels, "ttft", out / "ttft_cdf.png"),
        _cdf_plot(plt, docs, labels, "tpot", out / "tpot_cdf.png"),
    ]
    return [p for p in written if p is not None]
