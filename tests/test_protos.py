"""The committed stubs in protos/ match their .proto files, import, and keep the contracts."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from protos.generate import REPO_ROOT, proto_files

PROTOS_DIR = REPO_ROOT / "protos"
STEMS = [Path(p).stem for p in proto_files()]
STUBS = [f"{stem}{suffix}" for stem in STEMS for suffix in ("_pb2", "_pb2_grpc")]


def test_committed_stubs_are_fresh(tmp_path):
    # In a subprocess: grpc_tools' bundled protobuf/abseil crash next to NIXL's in one process.
    run = subprocess.run([sys.executable, "-m", "protos.generate", "--out", str(tmp_path)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    written = [Path(line) for line in run.stdout.split()]
    assert written, "no .proto files found"
    stale = [
        p.name for p in written
        if not (PROTOS_DIR / p.name).is_file() or (PROTOS_DIR / p.name).read_bytes() != p.read_bytes()
    ]
    assert not stale, f"stale or missing stubs {stale}: run `python -m protos.generate`"
    generated = {p.name for p in written}
    leftovers = sorted(
        p.name for p in PROTOS_DIR.iterdir()
        if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")) and p.name not in generated
    )
    assert not leftovers, f"stubs without a .proto: {leftovers}"


@pytest.mark.parametrize("name", STUBS)
def test_stub_imports(name):
    importlib.import_module(f"protos.{name}")


def test_protos_imports_nothing_of_ours():
    ours = {"baton", "kernels", "gateway", "prefill_service", "decode_service", "tests"}
    for path in PROTOS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {(node.module or "").split(".")[0]}
            else:
                continue
            assert not roots & ours, f"{path.name} imports {roots & ours}"


def test_package_is_baton_v1_and_no_string_maps():
    from protos import common_pb2, decode_pb2, prefill_pb2, transfer_pb2

    for mod in (common_pb2, decode_pb2, prefill_pb2, transfer_pb2):
        assert mod.DESCRIPTOR.package == "baton.v1"
        for msg in mod.DESCRIPTOR.message_types_by_name.values():
            for field in msg.fields:
                assert not (field.message_type and field.message_type.GetOptions().map_entry), (
                    f"{msg.name}.{field.name} is a map"
                )


def test_services_and_streaming_shapes():
    from protos import decode_pb2, prefill_pb2, transfer_pb2

    def methods(mod, service):
        svc = mod.DESCRIPTOR.services_by_name[service]
        return {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}

    assert methods(prefill_pb2, "PrefillService") == {
        "Handshake": (False, False), "Prefill": (False, False), "Abort": (False, False),
        "ReleaseBlocks": (False, False), "GetStats": (False, False),
        "EndSession": (False, False),
    }
    assert methods(decode_pb2, "DecodeService") == {
        "Generate": (False, True), "Abort": (False, False), "GetStats": (False, False),
        "EndSession": (False, False),
    }
    assert methods(transfer_pb2, "KVTransfer") == {"PushBlocks": (True, False),
                                                   "PullBlocks": (False, True)}


def test_round_trip_of_the_hand_over_messages():
    from protos import common_pb2, decode_pb2, prefill_pb2, transfer_pb2

    req = prefill_pb2.PrefillRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3, 50_000],
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, logprobs=2),
        num_cached_on_decode=16,
        dst_block_ids=[7, 3],
        transfer_id="r1/0",
        endpoint=transfer_pb2.TransferEndpoint(
            layout_hash=2**64 - 1,
            block_bytes=4096,
            num_blocks=100,
            grpc=transfer_pb2.GrpcEndpoint(address="127.0.0.1:5"),
        ),
        lease_seconds=30.0,
    )
    back = prefill_pb2.PrefillRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.endpoint.WhichOneof("transport") == "grpc"
    assert back.sampling_params.HasField("max_tokens") and not back.sampling_params.HasField("seed")
    assert back.endpoint.layout_hash == 2**64 - 1

    fin = decode_pb2.GenerateResponse(finished=decode_pb2.Finished(
        finish_reason=common_pb2.FINISH_REASON_STOP, stop_token_id=2,
        usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=1, cached_tokens=0),
    ))
    assert fin.WhichOneof("kind") == "finished"
    assert fin.finished.WhichOneof("stop_reason") == "stop_token_id"


def test_token_logprobs_round_trip_keeps_rank_and_top():
    from baton.outputs import TokenLogprob
    from baton.worker.wire import logprob_from_proto, logprob_to_proto

    lp = TokenLogprob(token_id=7, logprob=-1.25, top={3: -0.5, 7: -1.25}, rank=2)
    p = logprob_to_proto(lp)
    assert [t.token_id for t in p.top] == [3, 7]  # most likely first
    assert logprob_from_proto(p) == lp


@pytest.mark.parametrize("params", [
    dict(),
    dict(max_tokens=None, seed=None, logprobs=None, skip_special_tokens=True),
    dict(n=3, temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, seed=2**64 - 1,
         max_tokens=9, min_tokens=2, stop=["\n", "END"], stop_token_ids=[2, 7],
         ignore_eos=True, logprobs=0, include_stop_str_in_output=True,
         skip_special_tokens=False, presence_penalty=-1.5, frequency_penalty=2.0,
         repetition_penalty=1.25, logit_bias={50_000: -100.0, 3: 0.5, 0: 100.0}),
])
def test_sampling_params_round_trip_is_exact(params):
    from baton.sampling_params import SamplingParams
    from baton.worker.wire import sampling_params_from_proto, sampling_params_to_proto
    from protos import common_pb2

    sp = SamplingParams(**params)
    wire = common_pb2.SamplingParams.FromString(sampling_params_to_proto(sp).SerializeToString())
    assert sampling_params_from_proto(wire) == sp


def test_sampling_params_proto_zero_values_read_as_off():
    from baton.worker.wire import sampling_params_from_proto
    from protos import common_pb2

    sp = sampling_params_from_proto(common_pb2.SamplingParams())
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty,
            sp.logit_bias) == (0.0, 0.0, 1.0, {})
    assert not sp.has_penalties
    with pytest.raises(ValueError, match="logit_bias"):
        sampling_params_from_proto(common_pb2.SamplingParams(
            logit_bias=[common_pb2.TokenBias(token_id=5, bias=101.0)]))
    twice = [common_pb2.TokenBias(token_id=5, bias=1.0)] * 2
    with pytest.raises(ValueError, match="twice"):
        sampling_params_from_proto(common_pb2.SamplingParams(logit_bias=twice))
    with pytest.raises(ValueError, match="presence_penalty"):
        sampling_params_from_proto(common_pb2.SamplingParams(presence_penalty=2.5))
