"""The gateway's frozen configuration, built once from the command line in `__main__`.

    python -m gateway --model smollm2-135m --decode 127.0.0.1:50051 --prefill 127.0.0.1:50061 \
        --port 8000 --grpc-port 50050 --routing session --api-key SECRET

The API key may come from the environment instead: `BATON_API_KEY` is read here when
`--api-key` is not given (containers and Kubernetes Secrets set it; a flag would show the
key in `ps` and in the pod spec). The key is never printed or logged (`repr=False`).

Workers come from `--decode` / `--prefill` (comma-separated or repeated) and from
`--workers-file` (YAML or JSON: `{decode: [...], prefill: [...]}`, re-read periodically).
A `host:port` whose host is a name is resolved to its IPv4 (A) records every
`--dns-refresh-s`; each address is one worker (a Kubernetes headless Service works as is).
`--chat-template FILE|tokenizer` and `--tool-call-parser NAME`: gateway/chat_templates.py,
gateway/tool_parsers.py.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from enum import Enum

from baton.roles import API_KEY_ENV  # the key's environment variable (BATON_API_KEY)
from gateway.chat_templates import check_chat_template_option
from gateway.limits import RequestLimits
from gateway.tool_parsers import TOOL_PARSERS


__all__ = ["API_KEY_ENV", "GatewayConfig", "RouterConfig", "build_parser", "parse_args"]


class RoutingPolicy(str, Enum):
    """session: sticky sessions, KV overlap minus load for new ones; kv: KV overlap minus load
    for every request; round-robin: rotate over healthy workers (the baseline)."""

    SESSION = "session"
    KV = "kv"
    ROUND_ROBIN = "round-robin"


class PrefillModeChoice(str, Enum):
    AUTO = "auto"
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of gateway/router.py.

    overload_load: a worker whose fresh reported load is at or above this is overloaded: a
    session leaves it when a worker below it exists. stale_after_s: stats older than this are
    ignored (the worker counts as neither loaded nor overloaded). kv_weight / load_weight:
    score = kv_weight * (matched prefix blocks - the fewest any candidate matches) / (prompt
    blocks - that fewest) - load_weight * load.
    capacity_hint: requests a worker takes before the gateway's own count of requests it
    started since the last stats reads as load 1. session_ttl_s / max_sessions: bound the
    session table. sent_index_blocks: block hashes remembered per worker of what the gateway
    sent there.
    """

    policy: RoutingPolicy = RoutingPolicy.SESSION
    overload_load: float = 1.5
    stale_after_s: float = 3.0
    kv_weight: float = 1.0
    load_weight: float = 1.0
    capacity_hint: int = 32
    session_ttl_s: float = 3600.0
    max_sessions: int = 100_000
    sent_index_blocks: int = 200_000

    def __post_init__(self) -> None:
        if self.overload_load <= 0 or self.stale_after_s <= 0 or self.capacity_hint < 1:
            raise ValueError("overload_load, stale_after_s and capacity_hint must be positive")
        if self.max_sessions < 1 or self.sent_index_blocks < 0:
            raise ValueError("max_sessions must be >= 1 and sent_index_blocks >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs.

    model: the served model (registered name or folder); requests must name `served_model_name`
    (default: `model`). grpc_port None = no gRPC front (0 = any free port).
    first_token_timeout_s: a decode worker that sends nothing for this long after Generate is
    given up on (retried elsewhere, else 504). stream_idle_timeout_s: the same between
    messages once streaming (an error event then). max_attempts: workers tried per request
    before the first token. max_inflight: requests in the gateway at once (429 beyond).
    shutdown_grace_s: after SIGTERM, how long running requests may finish (new ones get
    503) before running streams are ended with an error event; the default matches the
    workers' default --drain-seconds.
    chat_template: a Jinja file replacing the tokenizer's template, "tokenizer" for the
    tokenizer's own, None for the default (gateway/chat_templates.py). tool_call_parser: how
    tool calls are read from the output when a request offers tools (gateway/tool_parsers.py).
    slo_ttft_ms: a TTFT SLO; a request whose predicted TTFT (the chosen workers' queues)
    exceeds it gets 429 slo_unattainable before any work (gateway/admission.py). None = off.
    prep_processes / prep_timeout_s: the processes that prepare requests (parse, template,
    tokenize, check schemas) off the event loop, and how long one request's preparation may
    take (then a 400 naming the field it was on; gateway/prep_pool.py). limits: what one
    request may carry (tools, schema bytes and depth; gateway/limits.py).
    """

    model: str = "smollm2-135m"
    served_model_name: str = ""
    decode: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    workers_file: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_host: str = "127.0.0.1"
    grpc_port: int | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: never in logs
    max_body_bytes: int = 8 << 20
    max_model_len: int | None = None
    block_size: int | None = None
    prefill_mode: PrefillModeChoice = PrefillModeChoice.AUTO
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    max_inflight: int = 1024
    max_attempts: int = 3
    poll_interval_s: float = 0.5
    rpc_timeout_s: float = 2.0
    dns_refresh_s: float = 5.0
    first_token_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 300.0
    shutdown_grace_s: float = 30.0
    access_log: bool = False
    log_level: str = "info"
    router: RouterConfig = field(default_factory=RouterConfig)
    slo_ttft_ms: float | None = None
    prep_processes: int = 2
    prep_timeout_s: float = 10.0
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", self.model)
        if not (self.decode or self.workers_file):
            raise ValueError("no decode workers: give --decode ADDR[,ADDR] or --workers-file")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.max_inflight < 1 or self.max_attempts < 1 or self.prep_processes < 1:
            raise ValueError("max_inflight, max_attempts and prep_processes must be >= 1")
        if min(self.poll_interval_s, self.rpc_timeout_s, self.dns_refresh_s,
               self.first_token_timeout_s, self.stream_idle_timeout_s,
               self.prep_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0")
        if self.slo_ttft_ms is not None and self.slo_ttft_ms <= 0:
            raise ValueError("slo_ttft_ms must be positive")
        for addr in (*self.decode, *self.prefill):
            split_host_port(addr)
        check_chat_template_option(self.chat_template)
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; known: "
                             f"{', '.join(sorted(TOOL_PARSERS))}")


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _addresses(values: list[str] | None) -> tuple[str, ...]:
    out: list[str] = []
    for value in values or []:
        out.extend(a.strip() for a in value.split(",") if a.strip())
    return tuple(dict.fromkeys(out))


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags, every one with its default in --help."""
    p = argparse.ArgumentParser(prog="baton gateway",
                                description="Baton gateway: OpenAI HTTP API + gRPC front.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registered name or HF folder")
    p.add_argument("--served-model-name", default="", help="name clients use (default --model)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--grpc-host", default="127.0.0.1", help="gRPC front bind address")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC front port (off if unset)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    _add_worker_args(p)
    _add_prompt_args(p)
    _add_limit_args(p)
    _add_request_limit_args(p)
    return p


def _add_worker_args(p: argparse.ArgumentParser) -> None:
    """Where the workers are and how requests are routed among them."""
    p.add_argument("--decode", action="append", help="decode worker(s) host:port[,host:port]")
    p.add_argument("--prefill", action="append", help="prefill worker(s) host:port[,...]")
    p.add_argument("--workers-file", default=None, help="YAML/JSON {decode: [...], prefill: [...]}")
    p.add_argument("--routing", choices=[r.value for r in RoutingPolicy], default="session",
                   help="session: a session's turns stick to one worker; kv: most cached "
                        "prefix; round-robin")
    p.add_argument("--prefill-mode", choices=[m.value for m in PrefillModeChoice],
                   default="auto", help="auto: the decode worker decides local or remote "
                                        "prefill; local / remote force one")
    p.add_argument("--poll-interval-s", type=float, default=0.5,
                   help="seconds between GetStats polls of each worker")
    p.add_argument("--dns-refresh-s", type=float, default=5.0,
                   help="seconds between re-resolving worker host names (Kubernetes)")
    p.add_argument("--overload-load", type=float, default=1.5,
                   help="a worker reporting this load or more takes no new session")


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    """How prompts are rendered and outputs parsed."""
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit (default: the model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block size for routing hashes (default: from worker stats)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template replacing the tokenizer's ('tokenizer': its own; "
                        "default: a shipped tool-aware one for SmolLM2, else the tokenizer's)")
    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="format of tool calls in the model's output")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """Bounds on requests, retries, waits and shutdown."""
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body (413 above)")
    p.add_argument("--max-inflight", type=int, default=1024,
                   help="requests in the gateway at once (429 beyond)")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="decode workers tried per request before its first token")
    p.add_argument("--first-token-timeout-s", type=float, default=600.0,
                   help="a request with no first token by then is retried elsewhere, else 504")
    p.add_argument("--stream-idle-timeout-s", type=float, default=300.0,
                   help="longest gap between messages once streaming (then an error event)")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="after SIGTERM: seconds running requests may finish (new ones: 503)")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="TTFT SLO: answer 429 slo_unattainable (Retry-After) at arrival when "
                        "the workers' queues make it unattainable (default: off)")


def _add_request_limit_args(p: argparse.ArgumentParser) -> None:
    """How requests are prepared off the event loop, and what one may carry."""
    d = RequestLimits()
    p.add_argument("--prep-processes", type=int, default=2,
                   help="processes that parse, template, tokenize and check requests "
                        "(the event loop only relays)")
    p.add_argument("--prep-timeout-s", type=float, default=10.0,
                   help="longest preparation of one request (then 400 naming the field)")
    p.add_argument("--max-tools", type=int, default=d.max_tools,
                   help="most tools one chat request may offer (400 above)")
    p.add_argument("--max-schema-bytes", type=int, default=d.max_schema_bytes,
                   help="largest JSON schema (response_format, a tool's parameters) in "
                        "bytes (400 above)")
    p.add_argument("--max-schema-depth", type=int, default=d.max_schema_depth,
                   help="deepest nesting of objects and arrays in a JSON schema (400 above)")


def parse_args(argv: list[str] | None = None,
               environ: dict[str, str] | None = None) -> GatewayConfig:
    """Command line (and $BATON_API_KEY from `environ`, default os.environ) → GatewayConfig;
    exits with a usage message on bad flags. The flag wins when given (`--api-key ''` turns
    the key off); surrounding whitespace is dropped (a Secret made from a file often ends in a
    newline); an empty key means none."""
    parser = build_parser()
    a = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    api_key = a.api_key if a.api_key is not None else env.get(API_KEY_ENV, "")
    try:
        return GatewayConfig(
            model=a.model, served_model_name=a.served_model_name,
            decode=_addresses(a.decode), prefill=_addresses(a.prefill),
            workers_file=a.workers_file, host=a.host, port=a.port, grpc_host=a.grpc_host,
            grpc_port=a.grpc_port, api_key=api_key.strip() or None,
            max_body_bytes=a.max_body_bytes,
            max_model_len=a.max_model_len, block_size=a.block_size,
            prefill_mode=PrefillModeChoice(a.prefill_mode), chat_template=a.chat_template,
            tool_call_parser=a.tool_call_parser, max_inflight=a.max_inflight,
            max_attempts=a.max_attempts, poll_interval_s=a.poll_interval_s,
            dns_refresh_s=a.dns_refresh_s, first_token_timeout_s=a.first_token_timeout_s,
            stream_idle_timeout_s=a.stream_idle_timeout_s,
            shutdown_grace_s=a.shutdown_grace_s, access_log=a.access_log,
            log_level=a.log_level, slo_ttft_ms=a.slo_ttft_ms,
            prep_processes=a.prep_processes, prep_timeout_s=a.prep_timeout_s,
            limits=RequestLimits(max_tools=a.max_tools, max_schema_bytes=a.max_schema_bytes,
                                 max_schema_depth=a.max_schema_depth),
            router=RouterConfig(policy=RoutingPolicy(a.routing), overload_load=a.overload_load,
                                stale_after_s=max(3.0, 6 * a.poll_interval_s)),
        )
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
