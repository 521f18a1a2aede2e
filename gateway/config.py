"""The gateway's command line, generated from its frozen config (baton/gateway_config.py),
built once in `__main__`.

    python -m gateway --model smollm2-135m --decode 127.0.0.1:50051 --prefill 127.0.0.1:50061 \
        --port 8000 --grpc-port 50050 --routing session

The API key may come from the environment instead: `BATON_API_KEY` is read here when
`--api-key` is not given (containers and Kubernetes Secrets set it, and `baton up` passes it
so; a flag would show the key in `ps` and in the pod spec). The key is never printed or
logged (`repr=False`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from baton.flagspec import build, parser_for
from baton.gateway_config import (
    API_KEY_ENV,
    CorsConfig,
    GatewayConfig,
    PrefillModeChoice,
    RouterConfig,
    RoutingPolicy,
    split_host_port,
)

__all__ = ["API_KEY_ENV", "CorsConfig", "GatewayConfig", "PrefillModeChoice", "RouterConfig",
           "RoutingPolicy", "build_parser", "parse_args", "split_host_port"]


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags, every one with its default in --help."""
    return parser_for(GatewayConfig, "baton gateway",
                      "Baton gateway: OpenAI HTTP API + gRPC front.")


def parse_args(argv: list[str] | None = None,
               environ: dict[str, str] | None = None) -> GatewayConfig:
    """Command line (and $BATON_API_KEY from `environ`, default os.environ) → GatewayConfig;
    exits with a usage message on bad flags. The flag wins when given (`--api-key ''` turns
    the key off); surrounding whitespace is dropped (a Secret made from a file often ends in a
    newline); an empty key means none. Stats count as stale after 6 polls (at least 3 s)."""
    parser = build_parser()
    a = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    api_key = a.api_key if a.api_key is not None else env.get(API_KEY_ENV, "")
    try:
        config = build(GatewayConfig, a, api_key=api_key.strip() or None)
        router = dataclasses.replace(config.router,
                                     stale_after_s=max(3.0, 6 * config.poll_interval_s))
        return dataclasses.replace(config, router=router)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
