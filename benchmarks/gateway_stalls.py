"""Does one request stall the gateway? A running stream's chunk gaps and /health latency while
hostile requests are prepared (issue 27, item 2).

    python benchmarks/gateway_stalls.py                         # smollm2-135m's tokenizer
    python benchmarks/gateway_stalls.py -- --max-tools 5000 --max-schema-bytes 16777216 \
        --max-schema-depth 100 --prep-timeout-s 5               # flags after -- go to the gateway

The gateway runs as its own process (`python -m gateway`) in front of a fake decode worker
(tests/gateway/fake_decode.py) that emits one token every --pace seconds. One stream runs;
/health is polled every 50 ms; a chat request whose response_format schema is `oneOf` nested
16 deep (about 3 MB) is sent, then one offering 1,500 tools (tests/gateway/hostile.py).
Prints the stream's median and largest chunk gap against issue 27's bound (2 x median +
100 ms), /health's median and largest latency, and each hostile request's status, `param`
and time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gateway_overhead import child_env, start, start_gateway, stop  # noqa: E402
from tests.gateway.hostile import deep_one_of_body, many_tools_body, measure  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the served model (its tokenizer)")
    p.add_argument("--pace", type=float, default=0.05, help="seconds between streamed tokens")
    p.add_argument("gateway_flags", nargs="*", help="extra gateway flags (after --)")
    args = p.parse_args()
    env = child_env()
    procs = []
    try:
        proc, decode = start([sys.executable, "-m", "tests.gateway.fake_decode", "--tokens",
                              "100000", "--token-delay-s", str(args.pace)], env)
        procs.append(proc)
        proc, port = start_gateway(args.model, decode, env, *args.gateway_flags)
        procs.append(proc)
        hostile = [("deep oneOf", deep_one_of_body(args.model)),
                   ("1,500 tools", many_tools_body(args.model))]
        import uvloop
        stalls = uvloop.run(measure(f"http://127.0.0.1:{port}", args.model, hostile,
                                    settle_s=1.0))
        print(stalls.summary())
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
