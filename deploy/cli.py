"""The ``pdserve`` command: ``serve`` a cluster, ``generate`` / ``chat`` against it, ``demo``
the engine in-process, ``bench`` a server.

``serve`` life cycle: start Ray (embedded and bound to loopback, or ``--address``), the workers
and the router; print where it listens; on Ctrl-C (SIGINT) or SIGTERM drain (health says
NOT_SERVING, new requests are refused with UNAVAILABLE, live ones may finish for up to
``--drain-timeout``; a second signal ends the drain), then stop the router, shut every worker down (each unlinks its /dev/shm pool; one that hangs is killed after
``--stop-timeout``) and leave Ray, then exit 0. A signal during start-up cancels the start,
tears down what was started, and exits 128 + the signal number. A value no cluster could serve
with, a file that cannot be read or a port that cannot be had is a usage error (exit 2, before
Ray starts), said with the flag the user typed (``said``: a config's field as its flag).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import faulthandler
import io
import logging
import math
import os
import signal
import sys

from deploy import embedded_ray_env, security_args
from deploy.start_failure import RayUnreachableError, WorkerStartError, first_line
from engine.errors import ConfigError
from kvtransfer.select import TRANSPORTS
from router import event_loop
from router.event_loop import LoopKind
from router.openai_api.tool_parsers import PARSERS

DEFAULT_ADDRESS = "127.0.0.1:50051"
logger = logging.getLogger("pdserve")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from deploy.bench.cli import main as bench_main

        try:
            return bench_main(argv[1:])
        except KeyboardInterrupt:   # Ctrl-C mid-run: the shell's status, no traceback
            print("pdserve bench: interrupted", file=sys.stderr)
            return 128 + signal.SIGINT
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command == "serve" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":   # a native crash of the router names its Python stack (Ray's C++ handler is off here: deploy.ray_init)
        with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):   # stderr no file (called in-process)
            faulthandler.enable()
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C before serve's own handlers are in place (imports)
        return 128 + signal.SIGINT
    except (OSError, ValueError) as exc:   # a file that cannot be read, a value no run could use: the user's
        logger.debug("usage error", exc_info=True)
        print(f"pdserve {args.command}: error: {said(exc, args)}", file=sys.stderr)
        return 2


def said(exc: BaseException, args: argparse.Namespace | None = None) -> str:
    """A usage error in the user's words: the file and why it cannot be read, a config's error
    with the flags of ``args``' command for its fields, or the message."""
    if isinstance(exc, ConfigError):
        return exc.said(lambda field: flag_of(field, args))
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, OSError) and exc.strerror:   # ours name the flag there; no "[Errno 98]" before it
        return exc.strerror
    return str(exc)


# Config fields set by a flag of another name (the field carries its unit, or a word of its own);
# every other field's flag is its own name (--num-decode sets num_decode). Fields set from a flag in another unit (ttft_s
# from --ttft-ms, kv_cache_bytes from --kv-cache-gib) are not here: cluster_config checks those
# flags in their own unit, so that the value said is the one typed.
FIELD_DESTS = {"worker_stall_timeout_s": "worker_stall_timeout", "drain_timeout_s": "drain_timeout",
               "stop_timeout_s": "stop_timeout", "max_tokens": "default_max_tokens",
               "otlp_endpoint": "otlp_traces_endpoint"}


def flag_of(field: str, args: argparse.Namespace | None) -> str:
    """The flag of ``args``' command that sets config field ``field``; the field's name where none does."""
    dest = FIELD_DESTS.get(field, field)
    return "--" + dest.replace("_", "-") if hasattr(args, dest) else field


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub.add_parser("serve", help="start a cluster and its gRPC router"))
    for name, help_text in (("generate", "stream one completion"), ("chat", "interactive chat")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("prompt", nargs="?" if name == "chat" else None, help="the prompt")
        p.add_argument("--address", default=DEFAULT_ADDRESS)
        p.add_argument("--max-tokens", type=int, default=None)
        p.add_argument("--temperature", type=float, default=None)
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument("--top-k", type=int, default=None)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--min-p", type=float, default=None)
        p.add_argument("--min-tokens", type=int, default=None)
        p.add_argument("--repetition-penalty", type=float, default=None)
        p.add_argument("--frequency-penalty", type=float, default=None)
        p.add_argument("--presence-penalty", type=float, default=None)
        p.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
        security_args.add_client_args(p)
        p.set_defaults(run=_run_generate if name == "generate" else _run_chat)
    demo = sub.add_parser("demo", help="run the engine in-process on a short demo workload")
    demo.add_argument("--model", default=None)
    demo.add_argument("--num-requests", type=int, default=8)
    demo.set_defaults(run=_run_demo)
    sub.add_parser("bench", help="benchmark a server (see pdserve bench --help)")
    return parser


def _serve_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-prefill", type=int, default=None,
                   help="prefill workers (default 1; colocated mode has none: its decode workers prefill)")
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000,
                   help="the OpenAI-compatible HTTP API's port (0: any free port); --no-http turns it off")
    p.add_argument("--http-host", default=None, help="the HTTP API's bind address (default: --host)")
    p.add_argument("--no-http", action="store_true", help="serve gRPC only, no OpenAI-compatible HTTP API")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the HTTP API (/v1/models; requests must name it) and in gRPC's "
                        "ServerInfo (default: SmolLM2-135M-Instruct for the embedded model, else the "
                        "--model file's stem or directory's name)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve chat's tool_choice \"auto\" (OpenAI's default with tools): needs --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, choices=tuple(PARSERS),
                   help="the model's tool-call syntax, found in its replies for tool_choice \"auto\": hermes "
                        "(<tool_call>{...}</tool_call>: Hermes, Qwen 2.5/3), llama3_json (Llama 3.1+ JSON calls), "
                        "mistral ([TOOL_CALLS]...), pythonic ([f(x=1)]: Llama 3.2/4)")
    p.add_argument("--otlp-traces-endpoint", default=None,
                   help="export OpenTelemetry traces (router and workers) over OTLP/HTTP to this endpoint, "
                        "e.g. http://127.0.0.1:4318 (default: tracing off, no cost)")
    p.add_argument("--metrics-port", type=int, default=9400)
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="the metrics port's bind address, separate from --host (default: loopback only)")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting one ('auto' on a ray up head)")
    p.add_argument("--kv-transport", choices=tuple(TRANSPORTS), default=None)
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, or auto: cuda when the Ray cluster has GPUs (one per worker, or a share)")
    p.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPU share of each worker (default: one each if enough, else an even split)")
    p.add_argument("--dtype", default="auto",
                   help="weights and KV cache: auto (bfloat16 on a GPU, float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly (by default a GPU replays them as CUDA graphs)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step; longer prompts are prefilled in chunks "
                        "(default: 512 on CPU, 8192 on a GPU)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn prefix caching off (on by default: requests sharing a prompt prefix share its KV)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV pool per worker")
    p.add_argument("--threads-per-worker", type=int, default=None)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--ttft-ms", type=float, default=None, help="default TTFT target")
    p.add_argument("--tpot-ms", type=float, default=None, help="default TPOT target")
    p.add_argument("--default-max-tokens", type=int, default=128)
    p.add_argument("--no-admission", action="store_true",
                   help="admit every request on the least loaded pair (no SLO predictions, no rejections)")
    p.add_argument("--no-conditional-disagg", action="store_true",
                   help="never prefill on a decode worker, even when the prefill side would miss TTFT")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times one request may move to another worker after its worker died (0: fail it)")
    p.add_argument("--max-worker-restarts", type=int, default=None,
                   help="replacements per worker slot before it stays down (default: no limit, with backoff)")
    p.add_argument("--worker-stall-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a worker whose engine step runs this long, or that answers no heartbeat this long, "
                        "is hung: killed and replaced, its requests migrated (default 60; 0: never)")
    p.add_argument("--no-standby", action="store_true",
                   help="no warm spare workers: a dead worker is replaced by a cold start (a new process, ~10 s)")
    # Tests and CI: serve a tiny random-weight Llama (no tokenizer: token_ids prompts only).
    p.add_argument("--random-model", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT / SIGTERM, live requests may finish this long while new ones are refused "
                        "(UNAVAILABLE / HTTP 503) and health says NOT_SERVING; a second signal stops at once "
                        "(default 30; 0: cut them)")
    p.add_argument("--stop-timeout", type=float, default=30.0,
                   help="seconds a graceful stop may take before hanging workers are killed")
    p.add_argument("--event-loop", choices=[k.value for k in LoopKind], default=None,
                   help="the router's event loop: auto (uvloop when installed; the default, or $PDSERVE_EVENT_LOOP), "
                        "uvloop, asyncio")
    security_args.add_server_args(p)
    _limit_flags(p.add_argument_group("request limits (reported in ServerInfo.limits)"))
    p.set_defaults(run=_run_serve)


def _limit_flags(g) -> None:
    import dataclasses

    from router.limits import ServerLimits

    for f in dataclasses.fields(ServerLimits):
        help_text, flag = f.metadata["help"], "--" + f.name.replace("_", "-")
        help_text = f"{help_text} (default {_plain(f.default)})" if help_text else f"(default {_plain(f.default)})"
        if isinstance(f.default, enum.Enum):
            g.add_argument(flag, choices=[m.value for m in type(f.default)], default=f.default.value, help=help_text)
        else:
            g.add_argument(flag, type=type(f.default), default=f.default, help=help_text)


def _plain(value):
    return value.value if isinstance(value, enum.Enum) else value


def server_limits(args: argparse.Namespace):
    import dataclasses

    from router.limits import ServerLimits

    def value(f):
        given = getattr(args, f.name)
        return type(f.default)(given) if isinstance(f.default, enum.Enum) else given

    return ServerLimits(**{f.name: value(f) for f in dataclasses.fields(ServerLimits)})


def cluster_config(args: argparse.Namespace):
    from deploy.launcher import ClusterConfig
    from engine.config import EngineConfig, GraphMode
    from engine.tracing import TracingConfig

    if args.enable_auto_tool_choice and args.tool_call_parser is None:   # vLLM's rule: both or "auto" stays off
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's call syntax)")

    for dest in ("kv_cache_gib", "ttft_ms", "tpot_ms"):   # converted below (int(inf) would be a traceback)
        value = getattr(args, dest)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError.on(dest, f"must be a finite number > 0, got {value}")

    def engine() -> EngineConfig:
        return EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                            dtype=args.dtype, device=args.device, enable_prefix_caching=not args.no_prefix_cache,
                            decode_graphs=GraphMode.EAGER if args.enforce_eager else GraphMode.AUTO)

    defaults = {"max_tokens": args.default_max_tokens}
    limits = server_limits(args)
    if limits != type(limits)():   # only what differs from ServerDefaults' own default
        defaults["limits"] = limits
    if args.ttft_ms is not None:
        defaults["ttft_s"] = args.ttft_ms / 1000
    if args.tpot_ms is not None:
        defaults["tpot_s"] = args.tpot_ms / 1000
    return ClusterConfig(
        mode=args.mode, num_prefill=prefill_count(args.mode, args.num_prefill), num_decode=args.num_decode, model=args.model,
        prefill_engine=engine(), decode_engine=engine(), cpus_per_worker=args.cpus_per_worker,
        gpus_per_worker=args.gpus_per_worker,
        threads_per_worker=args.threads_per_worker, address=args.address, host=args.host, port=args.port,
        kv_transport=args.kv_transport, metrics_port=args.metrics_port, defaults=defaults,
        admission=not args.no_admission, conditional_disagg=not args.no_conditional_disagg,
        migration_limit=args.migration_limit, max_worker_restarts=args.max_worker_restarts,
        drain_timeout_s=args.drain_timeout,
        worker_stall_timeout_s=args.worker_stall_timeout,
        standby_workers=not args.no_standby,
        random_model={"seed": 0} if args.random_model else None,
        security=security_args.server_security(args), metrics_host=args.metrics_host,
        stop_timeout_s=args.stop_timeout,
        http_port=None if args.no_http else args.http_port, http_host=args.http_host,
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        tracing=TracingConfig(otlp_endpoint=args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None,
        event_loop=args.event_loop,
    )


def prefill_count(mode: str, requested: int | None) -> int:
    """The prefill workers of a ``mode`` cluster given ``--num-prefill`` ``requested`` (None: left
    out); an explicit count that cannot take effect is refused, not ignored (vLLM's rule). One rule
    for `pdserve serve` and `pdserve bench --launch`."""
    if mode != "colocated":
        return 1 if requested is None else requested
    if requested:
        raise ConfigError.on("num_prefill", f"{requested}: colocated mode has no prefill workers "
                                            "(its decode workers prefill); leave it out")
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    embedded_ray_env.prepare(args.address)   # before cluster_config imports ray
    try:
        config = cluster_config(args)
    except ValueError as exc:   # a value no cluster could serve with: a usage error, as argparse's own
        print(f"pdserve serve: error: {said(exc, args)}", file=sys.stderr)
        return 2
    try:
        code = event_loop.run(_serve(config), config.event_loop)
    except (WorkerStartError, RayUnreachableError) as exc:   # printed after the stop: the worker's log (its traceback) comes first
        print(f"pdserve serve: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    from deploy import ray_init   # here: Ray only where a cluster ran

    if ray_init.abandoned():   # Ray's GCS stopped answering: its shutdown at exit would wait a minute
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


async def _serve(config) -> int:
    """Start, serve until SIGINT / SIGTERM, stop. A signal during start-up cancels the start
    (the half-started cluster is torn down) and exits 128 + the signal's number."""
    from deploy.launcher import Cluster
    from router.gc_policy import apply_serving_gc_policy

    cluster = Cluster(config)
    starting = asyncio.ensure_future(cluster.start())
    stop, again = asyncio.Event(), asyncio.Event()   # the first signal; a second one (ends a drain)
    signals: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        starting.cancel()  # a no-op once started
        (again if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        try:
            port = await starting
        except asyncio.CancelledError:
            if not signals:
                raise
            logger.warning("%s during start-up: stopping the start", signals[0].name)
            return 128 + signals[0]
        except Exception as exc:
            await asyncio.sleep(0.1)   # a signal that came while the start held the loop (ray.init) is handled now
            if not signals:
                raise
            # A signal to the whole process group reaches Ray's own processes mid-start too, and the
            # start fails of it: the signal is what the operator asked for, not an error to report.
            logger.warning("%s during start-up: the start stopped (%s)", signals[0].name, first_line(exc))
            return 128 + signals[0]
        frozen = apply_serving_gc_policy()   # start-up heap out of the scans, fewer young passes
        logger.info("%d start-up objects frozen out of garbage collection", frozen)
        print(f"pdserve ready: gRPC on {config.host}:{port}"
              + (f", OpenAI API on http{'s' if cluster.http.security.tls else ''}://"
                 f"{config.http_host or config.host}:{cluster.http_port}/v1" if cluster.http else "")
              + (f", metrics on http://{config.metrics_host}:{cluster.metrics_port}/metrics" if cluster.metrics_port else "")
              + f" ({config.mode}). Ctrl-C stops.", flush=True)
        await stop.wait()
        await _drain(cluster, config.drain_timeout_s, signals, again)
    finally:
        await cluster.stop()
    return 0


def _again(first: signal.Signals) -> str:
    """How to end the drain, in the words of the signal that began it: under systemd, Docker or
    Kubernetes it is SIGTERM and no terminal is there for a Ctrl-C (either signal ends it)."""
    return "Ctrl-C again" if first == signal.SIGINT else f"a second {first.name}"


async def _drain(cluster, timeout_s: float, signals: list, again: asyncio.Event) -> None:
    """Live requests may finish (up to ``timeout_s``) while new ones are refused; a second
    signal stops at once."""
    live = len(cluster.servicer.core.live) if timeout_s else 0
    if not live:
        print(f"pdserve: {signals[0].name}, shutting down", flush=True)
        # health NOT_SERVING and new requests refused through the stop all the same (found by a
        # probe: health said SERVING until the server was gone)
        await cluster.drain(0)
        return
    print(f"pdserve: {signals[0].name}, draining {live} live request(s) for up to {timeout_s:.0f} s "
          f"(new ones are refused; {_again(signals[0])} stops now)", flush=True)
    drain, second = asyncio.ensure_future(cluster.drain(timeout_s)), asyncio.ensure_future(again.wait())
    await asyncio.wait([drain, second], return_when=asyncio.FIRST_COMPLETED)
    second.cancel()
    if not drain.done():
        drain.cancel()
        print(f"pdserve: {signals[-1].name} again, stopping now", flush=True)
        return
    left = drain.result()
    print(f"pdserve: shutting down ({left} request(s) still live, cut)" if left else "pdserve: drained, shutting down",
          flush=True)


def _request_kwargs(args: argparse.Namespace) -> dict:
    keys = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "min_tokens", "repetition_penalty",
            "frequency_penalty", "presence_penalty")
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _run_generate(args: argparse.Namespace) -> int:
    messages = None if args.raw else [{"role": "user", "content": args.prompt}]
    _stream_to_terminal(args, args.prompt if args.raw else None, messages)
    return 0


def _stream_to_terminal(args, text, messages) -> str:
    import grpc

    from router.client import PdserveClient

    out = []
    with PdserveClient(args.address, **security_args.client_kwargs(args)) as client:
        try:
            for resp in client.generate(text=text, chat=messages, **_request_kwargs(args)):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                out.append(resp.text)
        except grpc.RpcError as exc:
            hint = security_args.connection_hint(exc.details(), args) if exc.code() is grpc.StatusCode.UNAVAILABLE else ""
            print(f"\npdserve: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
            raise SystemExit(1)
    print()
    return "".join(out)


def _run_chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = []
    first = args.prompt
    while True:
        try:
            line = first if first else input("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        first = None
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        history.append({"role": "assistant", "content": _stream_to_terminal(args, None, history)})


def _run_demo(args: argparse.Namespace) -> int:
    from deploy.demo import run_demo

    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")   # main: a usage error
    return run_demo(args.model, args.num_requests)


if __name__ == "__main__":
    raise SystemExit(main())
