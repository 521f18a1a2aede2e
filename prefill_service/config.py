"""The prefill worker's command line: generated from its frozen config
(baton/worker/role_configs.py PrefillConfig), built once in `main`."""
from __future__ import annotations

import argparse

from baton.flagspec import parser_for
from baton.worker.flags import parse_role
from baton.worker.role_configs import PREFILL_PORT as DEFAULT_PORT
from baton.worker.role_configs import PrefillConfig

__all__ = ["DEFAULT_PORT", "PrefillConfig", "build_parser", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    """The prefill worker's flags (engine, server, role, then its own)."""
    return parser_for(PrefillConfig, "baton serve-prefill",
                      "Baton prefill worker (gRPC PrefillService).")


def parse_args(argv: list[str] | None = None) -> PrefillConfig:
    """Command line → PrefillConfig; exits with a usage message on bad flags."""
    return parse_role(PrefillConfig, build_parser(), argv)
