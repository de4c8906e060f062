"""``pdserve bench``: argument parsing and the run's life cycle.

  pdserve bench [run options]             benchmark one server (or one it launches) at 1+ rates
  pdserve bench plot A.json B.json --out DIR   plot saved results side by side

Life cycle of a run: optionally launch a cluster in-process (``--launch``, torn down after) ->
connect the backend and ask the server what it serves -> make the seeded requests (and separate
warm-up ones, seed + 1) -> check them against the server's vocabulary and length limit -> warm up
-> for each rate: run, summarize, print -> save JSON, write plots. Targets must be loopback
addresses unless ``--allow-remote``: a benchmark floods its target, so aiming it elsewhere is a
deliberate act.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import socket
import sys
from typing import Any
from urllib.parse import urlsplit

import grpc

from deploy import security_args
from deploy.bench import report
from deploy.bench.backends import FAILED, FLAVORS, GrpcBackend, OpenAIBackend, ServerUnreachable
from deploy.bench.dataset import DATASETS, DEFAULT_VOCAB, make_requests, with_text
from deploy.bench.runner import WarmUpFailed, run_rate, warm_up
from deploy.start_failure import WorkerStartError, first_line
from router.channel import ClientSecurity

logger = logging.getLogger("pdserve.bench")


class BenchConfigError(ValueError):
    """The requests do not fit the server (vocabulary, context length): exit 2, no traceback."""
RANDOM_MODEL_VOCAB_LOW = 3   # the tiny random Llama's ids 0-2 are pad/bos/eos


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(t) for t in text.split(",") if t.strip()]


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description="Open-loop serving benchmark (vLLM conventions). "
                                "`pdserve bench plot FILES --out DIR` plots saved results.")
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    t.add_argument("--address", default="127.0.0.1:50051", help="pdserve router host:port (grpc)")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server (openai)")
    t.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions (needs --tokenizer)")
    t.add_argument("--openai-flavor", choices=FLAVORS, default="vllm", help="how EOS is ignored; see backends.py")
    t.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every OpenAI request")
    t.add_argument("--api-key", default=None)
    t.add_argument("--model", default=None, help="model name sent to an OpenAI server; model to serve with --launch")
    t.add_argument("--tokenizer", default=None, help="tokenizer dir: send prompts as text (OpenAI)")
    t.add_argument("--allow-remote", action="store_true", help="allow a non-loopback target")
    security_args.add_client_args(p)  # grpc backend
    la = p.add_argument_group("launch a cluster in-process (grpc)")
    la.add_argument("--launch", choices=("disaggregated", "colocated"), default=None)
    la.add_argument("--random-model", action="store_true", help="tiny random Llama (tests, CI)")
    la.add_argument("--num-prefill", type=int, default=None, help="default 1 (disaggregated); colocated has none")
    la.add_argument("--num-decode", type=int, default=1)
    la.add_argument("--cpus-per-worker", type=float, default=1.0)
    la.add_argument("--threads-per-worker", type=int, default=None)
    la.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker")
    la.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    la.add_argument("--kv-transport", default=None, help="force shm / torch_dist / object_store")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=DATASETS, default="random")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=64)
    d.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1 -+ r)")
    d.add_argument("--vocab-low", type=int, default=None, help=f"default {DEFAULT_VOCAB[0]}")
    d.add_argument("--vocab-high", type=int, default=None, help=f"exclusive; default {DEFAULT_VOCAB[1]}")
    d.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("traffic")
    r.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s; inf sends all at once")
    r.add_argument("--request-rates", type=_rates, default=None, help="sweep, e.g. 0.5,1,2,4")
    r.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    r.add_argument("--max-concurrency", type=int, default=None)
    r.add_argument("--num-warmups", type=int, default=2, help="uncounted requests sent first, all at once")
    r.add_argument("--max-duration-s", type=float, default=600.0, help="per rate: stop sending, cancel the rest")
    r.add_argument("--request-timeout-s", type=float, default=None)
    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    o.add_argument("--send-slo", action="store_true", help="grpc: pass the ttft/tpot SLOs as request hints")
    o.add_argument("--label", default=None, help="name of this system in plots")
    o.add_argument("--save-result", default=None, metavar="PATH.json")
    o.add_argument("--plot-dir", default=None)
    return p


def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench plot", description="Plot saved results side by side.")
    p.add_argument("results", nargs="+", help="JSON files from --save-result")
    p.add_argument("--out", required=True, help="directory for the PNGs")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "plot":
        return _plot_main(plot_parser().parse_args(argv[1:]))
    if argv and argv[0] == "run":
        argv = argv[1:]
    parser = run_parser()
    args = parser.parse_args(argv)
    try:
        slos = report.parse_goodput(args.goodput)
        _check_args(args)
    except (OSError, ValueError) as exc:   # a value no run could use, a file that cannot be read
        from deploy.cli import said

        parser.error(said(exc, args))
    try:
        return _run_main(args, slos)
    except (WorkerStartError, ServerUnreachable, WarmUpFailed) as exc:   # no worker, no server, not a server we can drive
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:   # an unreadable file (a token, a certificate): the user's to fix
        from deploy.cli import said

        parser.error(said(exc, args))
    except grpc.RpcError as exc:   # the server is not there, or refused us (a wrong token)
        target = args.address if args.backend == "grpc" else args.base_url
        hint = security_args.connection_hint(exc.details(), args) if exc.code() is grpc.StatusCode.UNAVAILABLE else ""
        print(f"pdserve bench: error: {target}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1


def _plot_main(args: argparse.Namespace) -> int:
    from deploy.bench.plots import plot_results

    docs = [report.load_result(path) for path in args.results]
    for path in plot_results(docs, args.out):
        print(f"wrote {path}")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.backend == "openai" and not args.launch and not args.tokenizer and (
            args.openai_flavor == "transformers" or "chat" in args.endpoint):
        raise ValueError("chat completions and transformers serve take text prompts: pass --tokenizer DIR")
    if args.num_prompts < 1 or args.num_warmups < 0:
        raise ValueError("--num-prompts must be >= 1 and --num-warmups >= 0")
    if args.input_len < 1 or args.output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1, got {args.input_len} and {args.output_len}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.max_duration_s > 0:   # NaN too
        raise ValueError(f"--max-duration-s must be > 0, got {args.max_duration_s}")
    if args.request_timeout_s is not None and not args.request_timeout_s > 0:
        raise ValueError(f"--request-timeout-s must be > 0, got {args.request_timeout_s}")
    if args.backend == "grpc" or args.launch:   # the TLS files and the token, read and checked now, not at the first call
        ClientSecurity.of(**security_args.client_kwargs(args))
    if args.launch:
        return
    if args.backend == "openai":
        _check_base_url(args.base_url)
    host = _host_of(args.address) if args.backend == "grpc" else urlsplit(args.base_url).hostname
    if not args.allow_remote and not is_loopback(host):
        raise ValueError(f"{host!r} is not a loopback address; pass --allow-remote to benchmark it")


def _check_base_url(base_url: str) -> None:
    """An http(s) URL with a host and, if any, a port in range; nothing around it (urlsplit
    drops leading spaces, the HTTP client does not)."""
    problem = None
    try:
        url = urlsplit(base_url)
        url.port   # noqa: B018 - raises for a port out of range
    except ValueError as exc:   # "Invalid IPv6 URL", "Port out of range 0-65535"
        problem = str(exc)
    else:
        if url.scheme not in ("http", "https") or not url.hostname or base_url != base_url.strip():
            problem = "not an http(s) URL"
    if problem:
        raise ValueError(f"--base-url must be an http(s) URL such as http://127.0.0.1:8000, got {base_url!r} ({problem})")


def _host_of(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def cluster_config(args: argparse.Namespace):
    from deploy.cli import prefill_count
    from deploy.launcher import ClusterConfig
    from engine.config import EngineConfig

    common = {} if args.num_kv_blocks is None else {"num_kv_blocks": args.num_kv_blocks}
    budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    return ClusterConfig(
        mode=args.launch, num_prefill=prefill_count(args.launch, args.num_prefill), num_decode=args.num_decode, model=args.model,
        random_model={"seed": 0} if args.random_model else None,
        prefill_engine=EngineConfig(**{"max_num_batched_tokens": 512, **budget, **common}),
        decode_engine=EngineConfig(**budget, **common),
        cpus_per_worker=args.cpus_per_worker, threads_per_worker=args.threads_per_worker,
        host="127.0.0.1", port=0, kv_transport=args.kv_transport)


def _run_main(args: argparse.Namespace, slos: dict[str, float]) -> int:
    cluster = None
    if args.launch:
        from deploy.launcher import ClusterThread

        args.backend = "grpc"
        cluster = ClusterThread(cluster_config(args))
        try:
            port = cluster.start()
        except BaseException:
            cluster.stop()
            raise
        args.address = f"127.0.0.1:{port}"
        logger.info("launched a %s cluster on %s", args.launch, args.address)
    try:
        doc = asyncio.run(_bench(args, slos))
    except BenchConfigError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if cluster is not None:
            cluster.stop()
    if args.save_result:
        print(f"saved {report.save_result(doc, args.save_result)}")
    if args.plot_dir:
        from deploy.bench.plots import plot_results

        for path in plot_results([report.load_result(args.save_result)] if args.save_result else [doc],
                                 args.plot_dir):
            print(f"wrote {path}")
    return _exit_status(doc["runs"])


def _exit_status(runs: list[dict[str, Any]]) -> int:
    """0 when some request was served and every other one sent was refused by admission (429 /
    RESOURCE_EXHAUSTED: what overload is meant to get); else 1, with a line saying why, so a
    script sees a failed request (an error, a cut stream, a timeout) without reading the table."""
    def total(key: str) -> int:
        return sum(run["summary"][key] for run in runs)

    if total("failed"):
        first = next(o["error"] for run in runs for o in run["outcomes"] if o["status"] == FAILED)
        print(f"pdserve bench: error: {total('failed')} of {total('submitted')} requests failed, "
              f"the first with: {first_line(first)}", file=sys.stderr)
        return 1
    if not total("completed"):
        print(f"pdserve bench: error: none of {total('submitted')} requests was served "
              f"({total('rejected')} refused by admission)", file=sys.stderr)
        return 1
    return 0


def make_backend(args: argparse.Namespace, slos: dict[str, float]):
    if args.backend == "grpc":
        hints = {"ttft_ms": slos.get("ttft"), "tpot_ms": slos.get("tpot")} if args.send_slo else {}
        return GrpcBackend(args.address, timeout_s=args.request_timeout_s,
                           client_options=security_args.client_kwargs(args), **hints)
    return OpenAIBackend(args.base_url, endpoint=args.endpoint, model=args.model, flavor=args.openai_flavor,
                         extra_body=args.extra_body, timeout_s=args.request_timeout_s, api_key=args.api_key)


def resolve_vocab(args: argparse.Namespace, server: dict[str, Any]) -> tuple[int, int]:
    """The id range: explicit flags win; a launched random model defaults to its whole vocabulary.
    Ids the server cannot embed are an error here, not thousands of INVALID_ARGUMENTs later."""
    vocab_size = server.get("vocab_size")
    default = (RANDOM_MODEL_VOCAB_LOW, vocab_size) if args.random_model and vocab_size else DEFAULT_VOCAB
    low = default[0] if args.vocab_low is None else args.vocab_low
    high = default[1] if args.vocab_high is None else args.vocab_high
    if vocab_size and high > vocab_size:
        raise BenchConfigError(f"token ids up to {high - 1} exceed the server's vocabulary ({vocab_size}): "
                         "pass --vocab-high")
    return low, high


async def _bench(args: argparse.Namespace, slos: dict[str, float]) -> dict[str, Any]:
    backend = make_backend(args, slos)
    server = await backend.start()
    try:
        vocab = resolve_vocab(args, server)
        lengths = dict(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio, vocab=vocab)
        requests = make_requests(args.dataset, args.num_prompts, seed=args.seed, **lengths)
        warmups = make_requests(args.dataset, args.num_warmups, seed=args.seed + 1, **lengths)
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
            requests, warmups = with_text(requests, tokenizer), with_text(warmups, tokenizer)
        _check_lengths(requests + warmups, server)
        await warm_up(backend, warmups, max_duration_s=args.max_duration_s)
        runs = []
        for rate in args.request_rates or [args.request_rate]:
            result = await run_rate(backend, requests, rate, burstiness=args.burstiness, seed=args.seed,
                                    max_concurrency=args.max_concurrency, max_duration_s=args.max_duration_s)
            summary = report.summarize(result.outcomes, result.duration_s, slos, num_not_sent=result.num_not_sent)
            print(f"\nrequest rate {rate:g} req/s, burstiness {args.burstiness:g}, {len(requests)} prompts")
            print(report.format_table(summary))
            runs.append(report.run_record(rate, args.burstiness, summary, result.outcomes))
    finally:
        await backend.close()
    if len(runs) > 1:
        print("\n" + report.format_sweep(runs))
    label = args.label or (f"pdserve-{server['mode']}" if args.backend == "grpc" else server["mode"])
    config = {k: v for k, v in vars(args).items() if k != "api_key"}   # results get shared; keys must not
    return report.result_document(label, config, server, runs)


def _check_lengths(requests, server: dict[str, Any]) -> None:
    limit = server.get("max_model_len")
    longest = max((r.prompt_len + r.output_len for r in requests), default=0)
    if limit and longest > limit:
        raise BenchConfigError(f"a request needs {longest} tokens of context but the server allows {limit}: "
                         "lower --input-len/--output-len/--range-ratio")


if __name__ == "__main__":
    sys.exit(main())
