"""Shared fixtures: one thread per test process, a tiny random Llama, HF greedy references."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
import sys
from pathlib import Path

import pytest

# Tests decide Ray's auth explicitly: local test clusters run without token auth.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Each test module starts its own Ray from this process, which by then runs gRPC threads (earlier
# modules' servers and channels): Ray forks its GCS and raylet, and gRPC's fork handlers run in
# that fork ("Other threads are currently calling into gRPC, skipping fork() handlers"). Nothing
# here uses gRPC in a forked child (every child execs), so they are switched off (read when grpc
# is first imported). CI saw a module's Ray start time out now and then, its GCS silent.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

torch.set_num_threads(1)


def require_kernel(ready: bool, reason: str) -> None:
    """A C++ CPU kernel's tests: skipped where it cannot run, but a failure under CI, which must
    build and run every kernel."""
    if not ready:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_model():
    from engine.model_loader import random_model

    return random_model(seed=0)


def byte_level_tokenizer():
    """A real Hugging Face fast tokenizer for the tiny random model: byte-level BPE without merges,
    token id 3 + b for byte b (as ``ByteTokenizer`` encodes), 0-2 pad / BOS / EOS. What
    structured output needs on the workers (llguidance reads a fast tokenizer's vocabulary), with
    a chat template that shows tools (``TOOL_CHAT_TEMPLATE``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [b for b in range(256) if b not in printable]   # GPT-2's byte-to-character table
    chars = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chars[b]: 3 + b for b in range(256)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    out.chat_template = TOOL_CHAT_TEMPLATE
    return out


# A chat template that shows tools, earlier tool calls and the call a tool message answers, as
# tool-use templates do (one character a token: short, so prompts fit the tiny model).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}T{% for t in tools %}:{{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role[0] }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny random model (``tiny_model``'s weights, a fresh copy: engines patch theirs) saved
    as a Hugging Face directory with ``byte_level_tokenizer``: a source workers load like any other."""
    from engine.model_loader import random_model

    path = tmp_path_factory.mktemp("tiny-llama-bytes")
    random_model(seed=0).model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """Hugging Face ``generate`` greedy reference (EOS ignored unless given)."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def greedy_workload(model, seed: int, num: int, prompt_len: tuple[int, int], output_len: tuple[int, int]):
    """Seeded random prompts (ids in [3, 512)), output lengths and their HF greedy references:
    (prompts, max_tokens, refs). Draws: every prompt (length, then ids), then every output length."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(*prompt_len))] for _ in range(num)]
    max_tokens = [rng.randint(*output_len) for _ in prompts]
    return prompts, max_tokens, [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]


@pytest.fixture(scope="session")
def hf_reference(tiny_model):
    """A deep copy keeps the reference on transformers' own attention (the engine swaps it)."""
    ref = copy.deepcopy(tiny_model.model)
    ref.config._attn_implementation = "sdpa"
    return ref


def assert_no_leaks(engine) -> None:
    """Every lifecycle test ends here: no request left, every block free."""
    s = engine.scheduler
    assert s.num_unfinished == 0 and not s.requests and not s.held, "requests left in the engine"
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks, "KV blocks leaked"
    assert not engine.kv.block_tables


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance per test module (modules that need a different Ray, e.g. two
    nodes, start their own)."""
    import ray

    from deploy.ray_init import shutdown_ray

    # Each Ray ends waiting for its processes (GCS, raylet, workers) to exit: the next module's
    # start then does not share the 2 cores with the last one's teardown.
    if ray.is_initialized():
        shutdown_ray()
    try:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    except Exception as exc:   # noqa: BLE001 - Ray's own start timed out (its raylet never registered)
        # Seen in 3 of 6 CI runs (each time one module's fixture, before any pdserve code ran):
        # Ray's start, not ours, so it gets one more try (a failure of the second fails the module).
        warnings.warn(f"local Ray did not start ({exc}); starting it again")
        shutdown_ray()
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    shutdown_ray()


def cluster_leaks(cluster_thread) -> dict:
    """Leak check across the cluster: per worker, requests left and blocks not free; and the
    router's own per-request state (request ids, awaited first tokens, stream registrations...)."""
    import time

    from deploy.launcher import holds_anything, router_holds

    deadline = time.monotonic() + 10
    while True:  # aborts run right after the client sees its status: give them a moment
        reports = cluster_thread.run(cluster_thread.cluster.leak_reports())
        leaks = {w: r for w, r in reports.items() if holds_anything(r)}
        held = cluster_thread.run(_router_holds(cluster_thread.cluster, router_holds))
        if held:
            leaks["router"] = held
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.1)


async def _router_holds(cluster, router_holds):
    return router_holds(cluster)   # read on the cluster's own loop, as its handlers change it


PROMTOOL_INSTALL = "apt-get install -y --no-install-recommends prometheus (scripts/install.sh does it)"


def require_tool(name: str) -> str:
    """``name``'s path (Debian's prometheus package: promtool, prometheus); a missing one fails
    under CI (it is part of the test contract), skips locally."""
    import shutil

    path = shutil.which(name)
    if path is None:
        msg = f"{name} not on PATH (install: {PROMTOOL_INSTALL})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def require_promtool() -> str:
    return require_tool("promtool")


class ByteTokenizer:
    """A tokenizer for the tiny random model (which has none): one token per UTF-8 byte, ids
    3.. so they stay inside its vocabulary; a chat renders ``role: content`` lines. Enough to
    drive the router's text and chat paths in tests."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=True,
                            continue_final_message=False, **kwargs):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation)
        if continue_final_message:
            text = text.removesuffix("\n")
        return self.encode(text + ("assistant: " if add_generation_prompt else ""))

    def convert_ids_to_tokens(self, ids):
        """Like Hugging Face's: one id gives one piece, a list a list."""
        return f"<{ids}>" if isinstance(ids, int) else [f"<{t}>" for t in ids]


@contextlib.contextmanager
def router_on_a_thread(orchestrator, limits, max_model_len: int) -> Iterator[RouterOnAThread]:
    """A real gRPC servicer over a fake orchestrator, served from its own event loop thread (the
    test's thread stays free to be the client); stopped on exit."""
    from router.convert import ServerDefaults
    from router.server import PdserveServicer, ServerInfo, start_server

    servicer = PdserveServicer(orchestrator, ByteTokenizer(),
                               ServerDefaults(max_model_len=max_model_len, vocab_size=300, limits=limits),
                               ServerInfo("fake", "colocated", 16))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(start_server(servicer, "127.0.0.1", 0), loop).result(10)
    try:
        yield RouterOnAThread(servicer, loop, port)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@dataclass
class RouterOnAThread:
    servicer: object
    loop: asyncio.AbstractEventLoop
    port: int


OUTCOMES = ("finished_stop", "finished_length", "aborted", "error", "rejected", "invalid")


def request_outcomes(cluster) -> dict[str, float]:
    """``pdserve_requests_total`` by outcome, from a started cluster's router metrics."""
    registry = cluster.cluster.metrics.registry
    return {o: registry.get_sample_value("pdserve_requests_total", {"outcome": o}) or 0.0 for o in OUTCOMES}


def outcomes_since(cluster, before: dict[str, float]) -> dict[str, float]:
    """The outcomes counted since ``before`` (``request_outcomes``), those that moved only."""
    after = request_outcomes(cluster)
    return {o: after[o] - before[o] for o in OUTCOMES if after[o] != before[o]}
