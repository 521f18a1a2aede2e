"""The `baton` command.

    baton prepare-model [MODEL]       convert/cache a registered model (e.g. smollm2-135m)
    baton generate --prompt TEXT      offline generation on one in-process engine
    baton serve-prefill [ARGS]        = python -m prefill_service ARGS
    baton serve-decode  [ARGS]        = python -m decode_service ARGS
    baton gateway       [ARGS]        = python -m gateway ARGS
    baton up            [ARGS]        local cluster: gateway + prefill + decode processes
    baton bench         [ARGS]        replay agent traffic against a gateway

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


def _generate(argv: list[str]) -> int:
    from baton import LLM, SamplingParams

    p = argparse.ArgumentParser(prog="baton generate", description="Offline generation.")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype)
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                     tokenize=False, add_generation_prompt=True)
                   for t in prompts]
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
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help")
              else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
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
