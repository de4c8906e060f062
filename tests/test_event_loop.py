"""router.event_loop: which loop the router runs on (uvloop when installed, asyncio's on request),
and that a coroutine runs to completion on it; the clusters' end-to-end tests run on it."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from deploy import cli
from router import event_loop
from router.event_loop import LoopKind


def test_auto_picks_uvloop_when_installed(monkeypatch):
    monkeypatch.delenv(event_loop.ENV_VAR, raising=False)
    assert event_loop.resolve() is LoopKind.UVLOOP
    assert event_loop.resolve("auto") is LoopKind.UVLOOP


def test_the_environment_and_the_argument_choose(monkeypatch):
    monkeypatch.setenv(event_loop.ENV_VAR, "asyncio")
    assert event_loop.resolve() is LoopKind.ASYNCIO
    assert event_loop.resolve("uvloop") is LoopKind.UVLOOP   # the argument wins


def test_an_unknown_loop_is_named(monkeypatch):
    monkeypatch.setenv(event_loop.ENV_VAR, "trio")
    with pytest.raises(ValueError, match="'trio' is not one of auto, uvloop, asyncio"):
        event_loop.resolve()


@pytest.mark.parametrize("kind, uv", [("uvloop", True), ("asyncio", False)])
def test_the_loop_made_and_run(kind, uv):
    loop = event_loop.new_event_loop(kind)
    try:
        assert isinstance(loop, uvloop.Loop) is uv
    finally:
        loop.close()

    async def which() -> bool:
        await asyncio.sleep(0)
        return isinstance(asyncio.get_running_loop(), uvloop.Loop)

    assert event_loop.run(which(), kind) is uv


def test_a_cluster_thread_takes_the_environment_unless_its_config_names_a_loop(monkeypatch):
    from deploy.launcher import ClusterConfig, ClusterThread

    monkeypatch.setenv(event_loop.ENV_VAR, "asyncio")
    for config, uv in ((ClusterConfig(random_model={"seed": 0}), False),
                       (ClusterConfig(random_model={"seed": 0}, event_loop="uvloop"), True)):
        thread = ClusterThread(config)   # not started: only its loop is made
        try:
            assert isinstance(thread.loop, uvloop.Loop) is uv
        finally:
            thread.loop.close()


def test_serve_flag_reaches_the_cluster_config():
    parser = cli._parser()
    config = cli.cluster_config(parser.parse_args(["serve", "--random-model", "--event-loop", "asyncio"]))
    assert config.event_loop == "asyncio"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--event-loop", "trio"])
