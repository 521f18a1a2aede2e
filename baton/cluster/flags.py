"""The flags of `baton up`: its own (ClusterConfig) and every flag of every role it starts,
generated from the roles' configs (baton/flagspec.py), so `baton up --max-num-seqs 32
--tool-call-parser mistral --local-prefill-itl-budget-ms 80` reaches the children that take
each one. Then the checks made before anything starts: values that cannot work
(`bad_flags`, which builds every child's config from its command line) and fixed ports
already taken (`port_taken`).

    parse_up_args(argv) → Namespace: ClusterConfig's fields, every role flag (given or
                          the roles' shared default; None where roles differ), and
                          `given`: role flag dest → its command-line form, for plan.py
    A role flag named like one of ClusterConfig's (--model, --port, --host, --log-level,
    --kv-memory-fraction) is `baton up`'s own; plan.py passes its value on as it should.
"""
from __future__ import annotations

import argparse
import errno
import socket
from dataclasses import dataclass
from typing import NamedTuple

from baton.cluster.supervise import Backoff
from baton.flagspec import (
    FlagSpec,
    HelpFormatter,
    add_flags,
    argparse_kwargs,
    build,
    flag,
    specs,
)
from baton.gateway_config import GatewayConfig
from baton.worker.role_configs import DecodeConfig, PrefillConfig

# The configs of the roles `baton up` starts, by role name.
ROLE_CONFIGS = {"prefill": PrefillConfig, "decode": DecodeConfig, "gateway": GatewayConfig}


@dataclass(frozen=True)
class ClusterConfig:
    """`baton up`'s own settings (every other flag belongs to a role: --help lists them by
    config). Defaults are the configuration measured best for one host (BENCHMARKS.md)."""

    model: str = flag("smollm2-135m", "registered name or Hugging Face model folder (every "
                                      "role)")
    host: str = flag("127.0.0.1", "HTTP host of the gateway")
    port: int = flag(8000, "HTTP port of the gateway")
    num_prefill: int = flag(1, "prefill workers (disaggregated mode)")
    num_decode: int = flag(1, "decode workers")
    mode: str = flag("disaggregated", "colocated: no prefill workers, decode workers prefill "
                     "locally", choices=("disaggregated", "colocated"))
    pin: str = flag("share", "share: unpinned, each worker steps with the cores the others "
                    "leave idle (all of them alone, an even share when several are busy, "
                    "re-read every layer); split: prefill and decode workers on disjoint CPU "
                    "sets; none: the OS places them", choices=("share", "split", "none"))
    threads: int = flag(1, "torch threads per worker (with --pin share: when others are busy)")
    api_key: str | None = flag(
        None, "require 'Authorization: Bearer KEY' at the gateway (default: $BATON_API_KEY); "
              "handed to the gateway in its environment, never on its command line",
        repr=False)
    log_level: str = flag("WARNING", "workers' and gateway's log level")
    log_dir: str | None = flag(None, "one log file per process (default: a temp folder)")
    startup_timeout: float = flag(
        600.0, "seconds every child may take to become ready (at start, and after each "
               "restart: a restarted child with no READY by then is killed)")
    kv_memory_fraction: float = flag(
        0.5, "share of MemAvailable (less every worker's weights) the workers' KV pools take "
             "together, split evenly (unless --kv-cache-memory-bytes or --num-blocks); with "
             "--device cuda: of each GPU's free memory, split among the workers on it")
    kv_host_tier_fraction: float = flag(
        0.25, "share of MemAvailable (less the weights) the workers' host KV tiers take "
              "together, split evenly (unless --kv-host-tier-bytes; 0 = no host tier)")
    kv_store: str = flag("none", "mooncake: start a local mooncake_master and point every "
                         "worker at it (finished turns' KV blocks are loaded by the next "
                         "prefill anywhere); none: no store (unless --kv-store-url)",
                         choices=("none", "mooncake"))
    exit_on_child_failure: bool = flag(
        False, "stop the cluster when a child dies (CI) instead of restarting it")
    restart_delay_s: float = flag(1.0, "first restart delay; doubles per death in a row")
    restart_max_delay_s: float = flag(30.0, "cap of the restart delay")
    restart_reset_s: float = flag(
        60.0, "a child up this long starts its next backoff from the first delay")
    stop_timeout: float = flag(
        15.0, "seconds a child may take to stop (the gateway: after its grace)")


def role_flags() -> dict[str, dict[str, FlagSpec]]:
    """Role → its flags that `baton up` offers (dest → spec): cluster-wide ones not named
    like one of ClusterConfig's."""
    own = {s.dest for s in specs(ClusterConfig)}
    return {role: {s.dest: s for s in specs(cls) if s.flag.cluster and s.dest not in own}
            for role, cls in ROLE_CONFIGS.items()}


def build_parser() -> argparse.ArgumentParser:
    """`baton up`'s parser: ClusterConfig's flags, then each role's not yet added (default
    unset: only what is given is passed on)."""
    p = argparse.ArgumentParser(prog="baton up", description="Run a local Baton cluster.",
                                formatter_class=HelpFormatter)
    add_flags(p, ClusterConfig)
    seen: set[str] = set()
    for role, flags in role_flags().items():
        group = p.add_argument_group(f"{role} flags (passed to every {role} child)")
        for dest, s in flags.items():
            if dest in seen:
                continue
            seen.add(dest)
            kw = argparse_kwargs(s)
            roles = [r for r, f in role_flags().items() if dest in f]
            kw.update(default=argparse.SUPPRESS,
                      help=f"{s.flag.help} [{', '.join(roles)}; default: "
                           f"{_default_text(dest)}]")
            group.add_argument(s.option, *s.flag.aliases, **kw)
    return p


def _defaults(dest: str) -> list:
    return [f[dest].default for f in role_flags().values() if dest in f]


def _plain(value):
    return getattr(value, "value", value)  # an Enum's value


def _default_text(dest: str) -> str:
    values = {str(_plain(v)) for v in _defaults(dest)}
    return values.pop() if len(values) == 1 else "the role's"


def _cli_form(s: FlagSpec, value) -> list[str]:
    """How a parsed role flag is written on a child's command line."""
    if isinstance(value, bool):
        return [s.option if value else "--no-" + s.option[2:]]
    if isinstance(value, list):  # a repeatable flag
        return [x for v in value for x in (s.option, v)]
    if isinstance(value, tuple):  # a comma-separated one (e.g. RATE,RATE)
        return [s.option, ",".join(map(str, value))]
    return [s.option, "none" if value is None else str(value)]  # None came from "none"


def parse_up_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`baton up`'s flags → a Namespace (see the module docstring)."""
    a = build_parser().parse_args(argv)
    a.given = {}
    for flags in role_flags().values():
        for dest, s in flags.items():
            if dest in vars(a) and dest not in a.given:
                a.given[dest] = _cli_form(s, getattr(a, dest))
    for flags in role_flags().values():
        for dest in flags:
            if dest not in a.given:
                values = {_plain(v) for v in _defaults(dest)}
                setattr(a, dest, values.pop() if len(values) == 1 else None)
    return a


def role_argv(a: argparse.Namespace, role: str) -> list[str]:
    """The role flags given to `baton up` that `role` takes, in its command-line form."""
    flags = role_flags()[role]
    return [x for dest, form in a.given.items() if dest in flags for x in form]


class FixedPort(NamedTuple):
    """A port `baton up` was told to use: where it is bound, what it is, the flag that sets it."""

    host: str
    port: int
    what: str
    flag: str


def fixed_ports(a: argparse.Namespace) -> list[FixedPort]:
    """Every non-zero port a child will bind (workers bind port 0 on first start)."""
    out = [FixedPort(a.host, a.port, "the gateway's HTTP port", "--port")]
    if a.grpc_port is not None:  # the gateway's gRPC front binds its default 127.0.0.1
        out.append(FixedPort("127.0.0.1", a.grpc_port, "the gateway's gRPC front", "--grpc-port"))
    return [p for p in out if p.port != 0]


def port_taken(a: argparse.Namespace) -> str | None:
    """The one-line error for the first fixed port already in use, or None when all are free.
    Binds each one as the gateway will (SO_REUSEADDR, so a TIME_WAIT leftover is no conflict)."""
    for p in fixed_ports(a):
        family = socket.AF_INET6 if ":" in p.host else socket.AF_INET
        try:
            socket.create_server((p.host, p.port), family=family).close()
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            return f"port {p.port} on {p.host} {why} ({p.what}); choose another with {p.flag}"
    return None


def backoff(a: argparse.Namespace) -> Backoff:
    """The restart policy the --restart-* flags give (ValueError when they cannot work)."""
    return Backoff(a.restart_delay_s, a.restart_max_delay_s, a.restart_reset_s)


def bad_flags(a: argparse.Namespace, children: dict[str, list[str]] | None = None) -> str | None:
    """What is wrong with the flags (one line), or None. `children`: role → a command line
    plan.py built for it, each parsed and built into its config here (a bad value of any
    role's flag fails before anything starts)."""
    if a.num_decode < 1 or (a.mode == "disaggregated" and a.num_prefill < 1):
        return "need --num-decode >= 1 (and --num-prefill >= 1 when disaggregated)"
    if not 0 < a.kv_memory_fraction <= 1 or not 0 <= a.kv_host_tier_fraction < 1:
        return "--kv-memory-fraction must be in (0, 1] and --kv-host-tier-fraction in [0, 1)"
    try:
        backoff(a)
    except ValueError as e:
        return f"--restart-delay-s / --restart-max-delay-s / --restart-reset-s: {e}"
    for role, argv in (children or {}).items():
        p = argparse.ArgumentParser(prog=role, add_help=False, exit_on_error=False)
        add_flags(p, ROLE_CONFIGS[role])
        try:
            build(ROLE_CONFIGS[role], p.parse_args(argv))
        except (ValueError, argparse.ArgumentError) as e:
            return f"{role}: {e}"
    return None
