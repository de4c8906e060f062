"""From per-request outcomes to vLLM's serving numbers, goodput and SLO attainment; JSON in and out.

Latency statistics cover completed requests only (TPOT: those with >= 2 tokens; ITL: every gap
of every completed request), in milliseconds, percentiles by linear interpolation (numpy's
default). Throughputs divide by the run's duration (first send to last completion).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from deploy.bench.backends import FAILED, REJECTED, RequestOutcome

RESULT_VERSION = 1
PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")   # --goodput keys, as in vLLM
DEFINITIONS = {
    "goodput": "completed requests meeting every SLO / duration (req/s)",
    "slo_attainment": "completed requests meeting every SLO / all submitted (failed and rejected count as misses)",
}


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({("median" if p == 50 else f"p{p}"): percentile(ms, p) for p in PERCENTILES})
    return out


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {spec!r}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"SLO {name} must be > 0 ms, got {value}")
        slos[name] = ms
    return slos


def is_good(o: RequestOutcome, slos_ms: Mapping[str, float]) -> bool:
    """Completed and within every given SLO (a TPOT target cannot be missed below two tokens)."""
    if not o.ok:
        return False
    measured = {"ttft": o.ttft_s, "tpot": o.tpot_s, "e2el": o.e2e_s}
    return all(measured[k] is None or measured[k] * 1000.0 <= ms for k, ms in slos_ms.items())


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float, slos_ms: Mapping[str, float] | None = None,
              *, num_not_sent: int = 0) -> dict[str, Any]:
    slos_ms = dict(slos_ms or {})
    done = [o for o in outcomes if o.ok]
    n_in = sum(o.prompt_len for o in done)
    n_out = sum(o.output_len for o in done)
    dur = duration_s if duration_s > 0 else math.nan
    good = sum(is_good(o, slos_ms) for o in outcomes)
    submitted = len(outcomes)
    summary: dict[str, Any] = {
        "submitted": submitted, "completed": len(done),
        "failed": sum(o.status == FAILED for o in outcomes),
        "rejected": sum(o.status == REJECTED for o in outcomes),
        "not_sent": num_not_sent, "duration_s": duration_s,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(done) / dur, "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
        "slos_ms": slos_ms, "good": good,
        "goodput": good / dur if slos_ms else None,
        "slo_attainment": good / submitted if slos_ms and submitted else None,
    }
    series = {
        "ttft": [o.ttft_s for o in done if o.ttft_s is not None],
        "tpot": [t for o in done if (t := o.tpot_s) is not None],
        "itl": [g for o in done for g in o.itls],
        "e2el": [o.e2e_s for o in done if o.e2e_s is not None],
    }
    for name, values in series.items():
        for stat, v in stats_ms(values).items():
            summary[f"{stat}_{name}_ms"] = v
    return summary


_SECTIONS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def format_table(summary: Mapping[str, Any], *, title: str = "Serving Benchmark Result") -> str:
    """vLLM's result table, with rejections, goodput and attainment added."""
    rows: list[str] = [f"{' ' + title + ' ':=^50}"]

    def line(label: str, value: Any, fmt: str = ".2f") -> None:
        rows.append(f"{label:<40} {value:{fmt if isinstance(value, float) else ''}}")

    line("Successful requests:", summary["completed"])
    line("Failed requests:", summary["failed"])
    line("Rejected requests:", summary["rejected"])
    if summary.get("not_sent"):
        line("Not sent (--max-duration-s):", summary["not_sent"])
    line("Benchmark duration (s):", summary["duration_s"])
    line("Total input tokens:", summary["total_input_tokens"])
    line("Total generated tokens:", summary["total_output_tokens"])
    line("Request throughput (req/s):", summary["request_throughput"])
    if summary.get("goodput") is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in summary["slos_ms"].items())
        line("Request goodput (req/s):", summary["goodput"])
        line("SLO attainment (good/submitted):", summary["slo_attainment"], ".3f")
        rows.append(f"  SLOs: {slos}")
        rows.append(f"  goodput = {DEFINITIONS['goodput']}")
        rows.append(f"  attainment = {DEFINITIONS['slo_attainment']}")
    line("Output token throughput (tok/s):", summary["output_throughput"])
    line("Total Token throughput (tok/s):", summary["total_token_throughput"])
    for key, short, long in _SECTIONS:
        rows.append(f"{long:-^50}")
        line(f"Mean {short} (ms):", summary[f"mean_{key}_ms"])
        line(f"Median {short} (ms):", summary[f"median_{key}_ms"])
        for p in PERCENTILES[1:]:
            line(f"P{p} {short} (ms):", summary[f"p{p}_{key}_ms"])
    rows.append("=" * 50)
    return "\n".join(rows)


def format_sweep(runs: Sequence[Mapping[str, Any]]) -> str:
    """One line per rate: the numbers a sweep is read for."""
    head = f"{'rate':>8} {'done':>5} {'fail':>5} {'rej':>5} {'req/s':>7} {'goodput':>8} {'attain':>7} " \
           f"{'p99 TTFT':>9} {'p99 TPOT':>9}"
    rows = [head]
    for run in runs:
        s = run["summary"]
        gp = "-" if s["goodput"] is None else f"{s['goodput']:.2f}"
        att = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.3f}"
        rows.append(f"{run['request_rate']:>8g} {s['completed']:>5} {s['failed']:>5} {s['rejected']:>5} "
                    f"{s['request_throughput']:>7.2f} {gp:>8} {att:>7} "
                    f"{s['p99_ttft_ms']:>9.1f} {s['p99_tpot_ms']:>9.1f}")
    return "\n".join(rows)


def result_document(label: str, config: Mapping[str, Any], server: Mapping[str, Any],
                    runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"version": RESULT_VERSION, "label": label, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": dict(config), "server": dict(server), "definitions": DEFINITIONS, "runs": list(runs)}


def run_record(request_rate: float, burstiness: float, summary: Mapping[str, Any],
               outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    return {"request_rate": request_rate, "burstiness": burstiness, "summary": dict(summary),
            "outcomes": [asdict(o) for o in outcomes]}


def save_result(doc: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # JSON has no inf/NaN: "inf" rates and empty statistics become strings/null.
    path.write_text(json.dumps(_jsonable(doc), indent=1))
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    for run in doc.get("runs", []):
        run["request_rate"] = float(run["request_rate"])
        s = run["summary"]
        for k, v in s.items():
            if v is None and k.endswith("_ms"):
                s[k] = math.nan
    return doc


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        if math.isnan(x):
            return None
        return "inf" if math.isinf(x) else x
    if isinstance(x, Mapping):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
