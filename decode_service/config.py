"""The decode worker's command line: generated from its frozen config
(baton/worker/role_configs.py DecodeConfig), built once in `main`."""
from __future__ import annotations

import argparse

from baton.flagspec import parser_for
from baton.worker.flags import parse_role
from baton.worker.role_configs import DECODE_PORT as DEFAULT_PORT
from baton.worker.role_configs import DecodeConfig

__all__ = ["DEFAULT_PORT", "DecodeConfig", "build_parser", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    """The decode worker's flags (engine, server, role, then its own)."""
    return parser_for(DecodeConfig, "baton serve-decode",
                      "Baton decode worker (gRPC DecodeService).")


def parse_args(argv: list[str] | None = None) -> DecodeConfig:
    """Command line → DecodeConfig; exits with a usage message on bad flags."""
    return parse_role(DecodeConfig, build_parser(), argv)
