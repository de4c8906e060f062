"""protos/: committed stubs are fresh, messages round-trip, optional fields keep presence, and
the client works against an in-process fake server (no model, no Ray)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from engine.types import FinishReason
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc
from router.client import AsyncPdserveClient, PdserveClient, build_request

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
STUBS = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")
# Lines that name the generator's version: output from another grpcio-tools differs there.
VERSION_LINE = re.compile(r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*)$", re.M)


# ---------------------------------------------------------------- freshness


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to check the committed stubs")
    out = tmp_path_factory.mktemp("stubs")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    return out


def test_committed_descriptor_matches_proto(regenerated):
    """Version-independent: the committed stubs describe exactly what pdserve.proto says."""
    from grpc_tools import protoc
    from google.protobuf import descriptor_pb2

    out = regenerated / "pdserve.desc"
    assert protoc.main(["protoc", f"-I{PROTOS}", f"--descriptor_set_out={out}", "pdserve.proto"]) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    messages = list(fresh.message_type)   # --descriptor_set_out adds json_name; Python gencode omits it
    while messages:                        # (nested types too: a map field's entry is one)
        message = messages.pop()
        messages.extend(message.nested_type)
        for f in message.field:
            f.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert committed == fresh, "protos/ stubs are stale: run python scripts/gen_protos.py"


@pytest.mark.parametrize("name", STUBS)
def test_committed_stubs_are_fresh(regenerated, name):
    fresh, committed = (regenerated / name).read_text(), (PROTOS / name).read_text()
    if VERSION_LINE.findall(fresh) != VERSION_LINE.findall(committed):
        pytest.skip("installed grpcio-tools differs from the one that made the stubs; descriptor check still ran")
    assert committed == fresh, f"protos/{name} is stale: run python scripts/gen_protos.py"


def test_grpc_stub_imports_as_package():
    assert "from protos import pdserve_pb2 as" in (PROTOS / "pdserve_pb2_grpc.py").read_text()
    assert pb_grpc.pdserve__pb2 is pb


# ---------------------------------------------------------------- messages


def test_request_round_trip():
    req = build_request(chat=[("user", "hi")], request_id="r1", max_tokens=4, temperature=0.5, stop=["\n"],
                        stop_token_ids=[2], seed=11, ttft_ms=300, priority=1, skip_special_tokens=False)
    back = pb.GenerateRequest.FromString(req.SerializeToString())
    assert back == req and back.WhichOneof("prompt") == "chat"
    assert back.chat.messages[0].content == "hi" and list(back.sampling.stop) == ["\n"]


def test_response_round_trip():
    resp = pb.GenerateResponse(request_id="r", token_ids=[1, 2], text="é", finish_reason=pb.FINISH_REASON_STOP,
                               usage=pb.Usage(prompt_tokens=3, completion_tokens=2), logprobs=[-0.25, -1.5],
                               timings=pb.Timings(ttft_s=0.1, kv_transfer_bytes=1 << 40, prefill_worker_id="p0"))
    assert pb.GenerateResponse.FromString(resp.SerializeToString()) == resp


def test_optional_fields_keep_presence_across_the_wire():
    unset = pb.GenerateRequest.FromString(pb.GenerateRequest(text="x").SerializeToString())
    zero = pb.GenerateRequest.FromString(build_request(text="x", temperature=0.0, top_k=0, priority=0,
                                                       ignore_eos=False).SerializeToString())
    for name in ("temperature", "top_k", "ignore_eos"):
        assert not unset.sampling.HasField(name) and zero.sampling.HasField(name), name
    assert not unset.HasField("priority") and zero.HasField("priority")
    assert not unset.HasField("request_id") and not unset.HasField("ttft_ms")


def test_empty_prompt_still_selects_the_oneof():
    for req in (build_request(text=""), build_request(token_ids=[]), build_request(chat=[])):
        kind = req.WhichOneof("prompt")
        assert pb.GenerateRequest.FromString(req.SerializeToString()).WhichOneof("prompt") == kind
    assert pb.GenerateRequest().WhichOneof("prompt") is None


def test_build_request_rejects_what_cannot_be_expressed():
    with pytest.raises(TypeError):
        build_request(text="a", token_ids=[1])
    with pytest.raises(TypeError):
        build_request(text="a", temprature=0.5)


# ---------------------------------------------------------------- client against a fake server


class FakePdserve(pb_grpc.PdserveServicer):
    """Streams one message per prompt token id, echoing it; a prompt with id 0 streams until
    cancelled, so the test can check that leaving early cancels the call."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        if ids == [0]:
            context.add_callback(self.cancelled.set)  # runs when the RPC ends: here, only by cancel
            while context.is_active():
                yield pb.GenerateResponse(request_id=request.request_id, token_ids=[0], text="0")
            return
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            yield pb.GenerateResponse(
                request_id=request.request_id, token_ids=[t], text=str(t),
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)) if last else None,
                timings=pb.Timings(e2e_s=0.5) if last else None,
            )

    def ServerInfo(self, request, context):
        return pb.ServerInfoResponse(model="fake", max_model_len=64, mode=pb.SERVING_MODE_COLOCATED)


@pytest.fixture(scope="module")
def fake_server():
    servicer = FakePdserve()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_PdserveServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


def test_sync_client_collects_a_stream(fake_server):
    address, _ = fake_server
    with PdserveClient(address, timeout_s=10) as client:
        result = client.generate_text(token_ids=[4, 5, 6], request_id="abc")
        assert client.server_info().model == "fake"
    assert (result.request_id, result.token_ids, result.text) == ("abc", [4, 5, 6], "456")
    assert result.finish_reason is FinishReason.LENGTH and result.num_messages == 3
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 3)
    assert result.timings.e2e_s == 0.5


def test_leaving_the_stream_early_cancels_the_call(fake_server):
    address, servicer = fake_server
    servicer.cancelled.clear()
    with PdserveClient(address, timeout_s=10) as client:
        stream = client.generate(token_ids=[0])
        assert next(stream).text == "0"
        stream.close()
    assert servicer.cancelled.wait(5)


def test_async_client(fake_server):
    address, _ = fake_server

    async def main():
        async with AsyncPdserveClient(address, timeout_s=10) as client:
            info = await client.server_info()
            result = await client.generate_text(token_ids=[7, 8])
            return info, result

    info, result = asyncio.run(main())
    assert info.mode == pb.SERVING_MODE_COLOCATED
    assert result.token_ids == [7, 8] and result.text == "78" and result.finish_reason is FinishReason.LENGTH
