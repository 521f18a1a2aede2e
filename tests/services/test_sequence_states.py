"""The decode sequence's state machine and the remote-prefill outcomes, without servers."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from baton.sampling_params import SamplingParams
from decode_service.remote_prefill import RemoteOutcome, RemotePrefill
from decode_service.sequence import DecodeSequence, IllegalTransition, SeqState

S = SeqState
LEGAL = {
    (S.NEW, S.ADMITTING), (S.NEW, S.FINISHED),
    (S.ADMITTING, S.LOCAL), (S.ADMITTING, S.REMOTE_KV), (S.ADMITTING, S.FINISHED),
    (S.REMOTE_KV, S.RUNNING), (S.REMOTE_KV, S.LOCAL), (S.REMOTE_KV, S.FINISHED),
    (S.LOCAL, S.RUNNING), (S.LOCAL, S.FINISHED),
    (S.RUNNING, S.FINISHED),
}
# a shortest way from NEW to each state
PATH = {S.NEW: [], S.ADMITTING: [S.ADMITTING], S.LOCAL: [S.ADMITTING, S.LOCAL],
        S.REMOTE_KV: [S.ADMITTING, S.REMOTE_KV], S.RUNNING: [S.ADMITTING, S.LOCAL, S.RUNNING],
        S.FINISHED: [S.FINISHED]}


def sequence_in(state: SeqState) -> DecodeSequence:
    seq = DecodeSequence(0, "r", [5, 6], SamplingParams(), asyncio.Event(), None, None, None)
    for step in PATH[state]:
        seq._to(step)
    assert seq.state is state
    return seq


@pytest.mark.parametrize("src", list(S))
@pytest.mark.parametrize("dst", list(S))
def test_transitions(src, dst):
    seq = sequence_in(src)
    if (src, dst) in LEGAL:
        seq._to(dst)
        assert seq.state is dst
    else:
        with pytest.raises(IllegalTransition, match=f"{src.name} → {dst.name}"):
            seq._to(dst)
        assert seq.state is src


def test_settled_once_no_transfer_can_write():
    """settled: the engine alone owns the blocks (ADMITTING: the add may land; REMOTE_KV:
    a prefill worker writes into them)."""
    for state in S:
        assert sequence_in(state).settled.is_set() == (state in (S.LOCAL, S.RUNNING,
                                                                 S.FINISHED)), state
    seq = sequence_in(S.REMOTE_KV)
    seq._to(S.LOCAL)  # recomputed after a failed remote prefill
    assert seq.settled.is_set()


def test_end_unadmitted_gives_one_final_output():
    seq = sequence_in(S.NEW)
    seq.end_unadmitted("error", "boom")
    out = seq.q.get_nowait()
    assert seq.state is S.FINISHED and seq.error == "boom"
    assert out.finished and out.finish_reason == "error" and out.error == "boom"
    assert out.num_prompt_tokens == 2 and out.request_id == "r"


@pytest.mark.parametrize("aborted, may_land, outcome", [
    (False, False, RemoteOutcome.FAILED),
    (False, True, RemoteOutcome.FAILED_WRITES_MAY_LAND),
    (True, False, RemoteOutcome.ABORTED),
    (True, True, RemoteOutcome.ABORTED_WRITES_MAY_LAND),
])
def test_failure_outcomes(aborted, may_land, outcome):
    got = RemoteOutcome.failure(aborted=aborted, writes_may_land=may_land)
    assert got is outcome and got.aborted == aborted and got.writes_may_land == may_land


def test_ok_and_rejected_never_let_writes_land():
    for outcome in (RemoteOutcome.OK, RemoteOutcome.REJECTED):
        assert not outcome.writes_may_land and not outcome.aborted


@pytest.mark.parametrize("refuses, stopped, may_land", [
    (True, False, False),   # gRPC / in-process: forget() refuses late chunks
    (False, False, True),   # NIXL, prefill worker silent: a one-sided write may land
    (False, True, False),   # NIXL, prefill worker confirmed it stopped
    (True, True, False),
])
def test_writes_may_land_comes_from_the_receiver(refuses, stopped, may_land):
    rp = RemotePrefill.__new__(RemotePrefill)
    rp.receiver = SimpleNamespace(refuses_late_writes=refuses)
    for aborted in (False, True):
        result = rp._failed("x", stopped=stopped, aborted=aborted)
        assert result.outcome.writes_may_land == may_land
        assert result.outcome.aborted == aborted and not result.ok and result.error == "x"


def test_receivers_say_whether_they_refuse_late_writes():
    from baton.transfer.grpc import GrpcReceiver
    from baton.transfer.inproc import InprocReceiver
    from baton.transfer.nixl import NixlReceiver

    assert GrpcReceiver.refuses_late_writes and InprocReceiver.refuses_late_writes
    assert not NixlReceiver.refuses_late_writes
