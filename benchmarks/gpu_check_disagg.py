"""gpu_check section `disagg`: disaggregated serving on the device equals the colocated engine
token for token, in bf16, over each KV transport.

    per transport (grpc; nixl where it imports):
      prefill worker + decode worker, in this process on 127.0.0.1 port 0, both bf16 on
      ctx.device (the decode worker replays CUDA graphs), every prompt prefilled remotely
      (--min-remote-tokens 16): the KV goes prefill pool → wire → decode pool
      (gRPC: device → host bytes → device; NIXL: VRAM registered, device to device)
    colocated: one LLMEngine with the same config
    each prompt alone (the same batch shapes on both sides), greedy, 12 tokens: equal

The workers are the real services (prefill_service, decode_service), driven over gRPC like
the gateway drives them. Token-exact holds because both sides run the same kernels on the same
inputs (a prompt's prefill in one step on either side, then batch-1 decode steps).
"""
from __future__ import annotations

import asyncio
import random

from gpu_check import FAIL, PASS, log
from gpu_check_engine import engine_config, make_engine, model_folder

NEW_TOKENS, MIN_REMOTE = 12, 16
MODEL = "smollm2-135m"


def transports() -> list[str]:
    """grpc, and nixl where `nixl` imports (the GPU image may lack it)."""
    try:
        import nixl._api  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a broken install: grpc alone then
        return ["grpc"]
    return ["grpc", "nixl"]


async def _serve(config, transport: str, prompts: list[list[int]]) -> list[tuple[list[int], bool]]:
    """Each prompt through a fresh prefill + decode worker pair: (tokens, remote_prefill)."""
    import grpc

    from baton.sampling_params import SamplingParams
    from baton.worker.flags import ServerConfig
    from baton.worker.wire import sampling_params_to_proto
    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeServer
    from prefill_service.config import PrefillConfig
    from prefill_service.server import PrefillServer
    from protos import decode_pb2, decode_pb2_grpc

    params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                     ignore_eos=True))
    server = ServerConfig(host="127.0.0.1", port=0)
    prefill = await PrefillServer(PrefillConfig(engine=config, server=server,
                                                transport=transport)).start()
    decode = await DecodeServer(DecodeConfig(
        engine=config, server=server, transport=transport, prefill_address=prefill.address,
        min_remote_tokens=MIN_REMOTE)).start()
    out = []
    try:
        async with grpc.aio.insecure_channel(decode.address) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            for i, prompt in enumerate(prompts):
                tokens, remote = [], False
                req = decode_pb2.GenerateRequest(request_id=f"disagg-{transport}-{i}",
                                                 prompt_token_ids=prompt,
                                                 sampling_params=params)
                async for msg in stub.Generate(req, timeout=120):
                    if msg.HasField("tokens"):
                        tokens.extend(msg.tokens.token_ids)
                    else:
                        remote = msg.finished.timings.remote_prefill
                        if msg.finished.error:
                            raise RuntimeError(f"prompt {i}: {msg.finished.error}")
                out.append((tokens, remote))
    finally:
        await decode.stop(drain_s=0)
        await prefill.stop(drain_s=0)
    return out


def colocated(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone through one engine: its greedy tokens."""
    from baton.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"colocated-{i}", prompt, params)
        tokens = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
        outs.append(tokens)
    return outs


def section_disagg(ctx) -> tuple[str, str]:
    folder = model_folder(ctx, MODEL)
    blocks = 128 if ctx.dry_run else 1024
    config = engine_config(ctx, folder, blocks, dtype="bfloat16")
    rng = random.Random(7)
    engine = make_engine(ctx, folder, blocks, dtype="bfloat16")
    vocab = engine.vocab_size
    lengths = (17, 40) if ctx.dry_run else (17, 64, 300, 1000)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    want = colocated(engine, prompts)
    del engine
    results = {}
    for transport in transports():
        got = asyncio.run(_serve(config, transport, prompts))
        local = [len(p) for p, (_, remote) in zip(prompts, got) if not remote]
        diff = [len(p) for p, (tokens, _), w in zip(prompts, got, want) if tokens != w]
        results[transport] = {"equal": not diff, "local_prefills": local}
        log(f"{transport}: {len(prompts)} prompts ({', '.join(map(str, lengths))} tokens) "
            f"prefilled remotely, bf16 on {ctx.device}: "
            f"{'token-exact' if not diff else f'DIFFER for prompts of {diff} tokens'}"
            f"{f'; prefilled locally: {local}' if local else ''}")
        if diff or local:
            ctx.report["disagg"] = results
            why = f"tokens differ (prompts of {diff} tokens)" if diff else \
                f"prompts of {local} tokens were not prefilled remotely"
            return FAIL, f"{transport}: {why}"
    ctx.report["disagg"] = results
    return PASS, (f"disaggregated == colocated, bf16, token-exact over {' and '.join(results)} "
                  f"on {ctx.device}")
