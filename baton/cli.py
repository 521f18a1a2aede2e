"""The `baton` command.

    baton prepare-model [MODEL]       convert/cache a registered model (e.g. smollm2-135m)
    baton generate --prompt TEXT      offline generation on one in-process engine
    baton serve-prefill [ARGS]        = python -m prefill_service ARGS
    baton serve-decode  [ARGS]        = python -m decode_service ARGS
    baton gateway       [ARGS]        = python -m gateway ARGS
    baton up            [ARGS]        local cluster: gateway + prefill + decode processes
    baton bench         [ARGS]        replay agent traffic against a gateway
    baton --version

Roles run as their own processes (exactly as in a container or a pod), so `baton` never
imports a service package: it execs `python -m <role>`.
"""
from __future__ import annotations

import argparse
import os
import sys

from baton.roles import ROLE_MODULES

# `baton COMMAND` -> the role it execs (see baton/roles.py for the module of each).
ROLE_COMMANDS = {"serve-prefill": "prefill", "serve-decode": "decode", "gateway": "gateway"}


def _prepare_model(argv: list[str]) -> int:
    from baton.models.registry import resolve_model

    p = argparse.ArgumentParser(prog="baton prepare-model")
    p.add_argument("model", nargs="?", default="smollm2-135m")
    args = p.parse_args(argv)
    print(resolve_model(args.model))
    return 0


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="baton generate", description="Offline generation.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registered name or HF folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and KV dtype (bf16/fp16 are slow on CPUs without them)")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (None: OMP_NUM_THREADS, else the CPUs this process may "
                        "run on less those busy now)")
    return p


def _generate(argv: list[str]) -> int:
    from transformers import AutoTokenizer

    from baton import LLM, SamplingParams
    from baton.models.registry import resolve_model
    from baton.threads import set_torch_threads

    args = _generate_parser().parse_args(argv)
    set_torch_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    prompts = args.prompt
    if args.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                 tokenize=False, add_generation_prompt=True)
                   for t in prompts]
    # A KV pool for exactly this batch (every prompt + its tokens), not the 2 GiB default.
    block_size = 16
    need = sum(-(-(len(tokenizer.encode(t)) + args.max_tokens) // block_size) for t in prompts)
    llm = LLM(args.model, dtype=args.dtype, block_size=block_size, num_blocks=need + 1,
              max_model_len=(need + 1) * block_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    for out in llm.generate(prompts, params):
        print(f"--- {out.finish_reason} ({len(out.output_token_ids)} tokens)")
        print(out.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`baton COMMAND ARGS` (see the module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ["prepare-model", "generate", *ROLE_COMMANDS, "up", "bench"]
    if argv and argv[0] in ("-V", "--version"):
        from baton import __version__
        print(f"baton {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in commands:
        print(f"baton: unknown command {argv[0]!r}; one of: {', '.join(commands)} "
              f"(baton --help)", file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ROLE_COMMANDS:
        module = ROLE_MODULES[ROLE_COMMANDS[cmd]]
        os.execv(sys.executable, [sys.executable, "-m", module, *rest])
    if cmd == "prepare-model":
        return _prepare_model(rest)
    if cmd == "generate":
        return _generate(rest)
    if cmd == "up":
        from baton.cluster.up import main as up_main
        return up_main(rest)
    from baton.bench.cli import main as bench_main
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
