"""The gateway's frozen configuration, its flags declared on the fields (baton/flagspec.py).

It lives in baton/ so that `baton up` can offer every gateway flag without importing the
gateway; gateway/config.py builds the gateway's parser from it and reads the API key from
the environment. Nothing here imports torch.

Workers come from `--decode` / `--prefill` (comma-separated or repeated) and from
`--workers-file` (YAML or JSON: `{decode: [...], prefill: [...]}`, re-read within 0.2 s of
a change and every `--dns-refresh-s`; `baton up` hands its workers to the gateway this way).
A `host:port` whose host is a name is resolved to its IPv4 (A) records every
`--dns-refresh-s`; each address is one worker (a Kubernetes headless Service works as is).
`--chat-template FILE|tokenizer` and `--tool-call-parser NAME`: gateway/chat_templates.py,
gateway/tool_parsers.py. `--allowed-origins` and its siblings: CORS for browser clients
(CorsConfig, vLLM's flags).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from baton.flagspec import flag
from baton.request_limits import RequestLimits
from baton.roles import API_KEY_ENV  # the key's environment variable when --api-key is absent
# gateway/tool_parsers.py's TOOL_PARSERS names (a test keeps the two equal).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


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

    policy: how a decode worker is picked (--routing). overload_load: a worker whose fresh
    reported load is at or above this is overloaded: a session leaves it when a worker below
    it exists. stale_after_s: stats older than this are ignored (the worker counts as neither
    loaded nor overloaded; parse_args sets it to 6 polls, at least 3 s). kv_weight /
    load_weight: score = kv_weight * (matched prefix blocks - the fewest any candidate
    matches) / (prompt blocks - that fewest) - load_weight * load.
    capacity_hint: requests a worker takes before the gateway's own count of requests it
    started since the last stats reads as load 1. session_ttl_s / max_sessions: bound the
    session table. sent_index_blocks: block hashes remembered per worker of what the gateway
    sent there.
    """

    policy: RoutingPolicy = flag(
        RoutingPolicy.SESSION, "session: a session's turns stick to one worker; kv: most "
        "cached prefix; round-robin", name="--routing")
    overload_load: float = flag(1.5, "a worker reporting this load or more takes no new "
                                     "session")
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


def string_list(text: str) -> tuple[str, ...]:
    """A flag's list: a JSON list, as vLLM takes `--allowed-origins '["https://a.b"]'`, or
    comma-separated (`https://a.b,https://c.d`); ValueError for JSON that is no string list."""
    if text.lstrip().startswith("["):
        values = json.loads(text)
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"expected a JSON list of strings, got {text!r}")
        return tuple(values)
    return tuple(v.strip() for v in text.split(",") if v.strip())


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin requests from browsers (Starlette's CORSMiddleware, outside the API-key
    check so a preflight, which carries no key, is answered; vLLM's flags and defaults).
    allowed_origins / allowed_methods / allowed_headers: what a page may call from and with
    ("*": any); allow_credentials: browsers may send cookies and credentials."""

    allowed_origins: tuple[str, ...] = flag(
        ("*",), "origins browser pages may call the API from, comma-separated or a JSON list "
                "('*': any; default: *)", parse=string_list)
    allowed_methods: tuple[str, ...] = flag(
        ("*",), "HTTP methods allowed cross-origin (default: *)", parse=string_list)
    allowed_headers: tuple[str, ...] = flag(
        ("*",), "request headers allowed cross-origin (default: *)", parse=string_list)
    allow_credentials: bool = flag(False, "allow cross-origin requests with credentials")


def split_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' → (host, port); ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def default_served_name(model: str) -> str:
    """The id clients name a model by when --served-model-name is not given: a folder's own
    name (not its absolute path), else the registered name as given."""
    return model.rstrip("/").rsplit("/", 1)[-1] if "/" in model else model


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs (each flag's help says what it does).

    model: the served model (registered name or folder); requests must name
    `served_model_name` (default: the folder's name, or the registered name). grpc_port None =
    no gRPC front (0 = any free port). first_token_timeout_s: a decode worker that sends
    nothing for this long after Generate is given up on (retried elsewhere, else 504).
    stream_idle_timeout_s: the same between messages once streaming (an error event then).
    max_attempts: workers tried per request before the first token. max_inflight: requests in
    the gateway at once (429 beyond). shutdown_grace_s: after SIGTERM, how long running
    requests may finish (new ones get 503) before running streams are ended with an error
    event; the default matches the workers' default --drain-seconds.
    chat_template: a Jinja file replacing the tokenizer's template, "tokenizer" for the
    tokenizer's own, None for the default (gateway/chat_templates.py). tool_call_parser: how
    tool calls are read from the output when a request offers tools (gateway/tool_parsers.py).
    slo_ttft_ms: a TTFT SLO; a request whose predicted TTFT exceeds it gets 429
    slo_unattainable before any work (gateway/admission.py). None = off.
    prep_processes / prep_timeout_s: the processes that prepare requests (parse, template,
    tokenize, check schemas) off the event loop, and how long one request's preparation may
    take (then a 400 naming the field it was on; gateway/prep_pool.py). limits: what one
    request may carry (n, tools, schema bytes and depth; baton/request_limits.py). cors:
    browser access (CorsConfig). return_tokens_as_token_ids: logprobs name tokens by id
    (`token_id:N`), for clients that map them back to ids without the tokenizer.
    """

    model: str = flag("smollm2-135m", "registered name or Hugging Face model folder")
    served_model_name: str = flag(
        "", "the model id clients send and /v1/models lists (default: the folder's name, "
            "or the registered name)")
    decode: tuple[str, ...] = flag((), "decode worker(s) host:port[,host:port]",
                                   cluster=False)
    prefill: tuple[str, ...] = flag((), "prefill worker(s) host:port[,...]", cluster=False)
    workers_file: str | None = flag(None, "YAML/JSON {decode: [...], prefill: [...]}",
                                    cluster=False)
    host: str = flag("127.0.0.1", "HTTP bind address", cluster=False)
    port: int = flag(8000, "HTTP port", cluster=False)
    grpc_host: str = flag("127.0.0.1", "gRPC front bind address")
    grpc_port: int | None = flag(None, "gRPC front port (off if unset)")
    api_key: str | None = flag(
        None, f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, which keeps "
              "the key out of ps)", repr=False, cluster=False)
    max_body_bytes: int = flag(8 << 20, "largest request body (413 above)")
    max_model_len: int | None = flag(
        None, "context limit (default: the model's max_position_embeddings)")
    block_size: int | None = flag(
        None, "KV block size for routing hashes (default: from worker stats)")
    prefill_mode: PrefillModeChoice = flag(
        PrefillModeChoice.AUTO, "auto: the decode worker decides local or remote prefill; "
                                "local / remote force one")
    chat_template: str | None = flag(
        None, "Jinja chat template replacing the tokenizer's ('tokenizer': its own; default: "
              "a shipped tool-aware one for SmolLM2, else the tokenizer's)", metavar="FILE")
    tool_call_parser: str = flag("hermes", "format of tool calls in the model's output",
                                 choices=TOOL_CALL_PARSERS)
    max_inflight: int = flag(1024, "requests in the gateway at once (429 beyond)")
    max_attempts: int = flag(3, "decode workers tried per request before its first token")
    poll_interval_s: float = flag(0.5, "seconds between GetStats polls of each worker")
    rpc_timeout_s: float = 2.0
    dns_refresh_s: float = flag(
        5.0, "seconds between re-resolving worker host names (Kubernetes)")
    first_token_timeout_s: float = flag(
        600.0, "a request with no first token by then is retried elsewhere, else 504")
    stream_idle_timeout_s: float = flag(
        300.0, "longest gap between messages once streaming (then an error event)")
    shutdown_grace_s: float = flag(
        30.0, "after SIGTERM: seconds running requests may finish (new ones: 503)")
    access_log: bool = flag(False, "log every HTTP request")
    return_tokens_as_token_ids: bool = flag(
        False, "logprobs name each token \"token_id:N\" (vLLM's flag; a request's own "
               "return_tokens_as_token_ids wins)")
    log_level: str = flag("info", "debug, info, warning or error")
    router: RouterConfig = field(default_factory=RouterConfig)
    slo_ttft_ms: float | None = flag(
        None, "TTFT SLO: answer 429 slo_unattainable (Retry-After) at arrival when the "
              "workers' queues make it unattainable (default: off)")
    prep_processes: int = flag(
        2, "processes that parse, template, tokenize and check requests (the event loop only "
           "relays)")
    prep_timeout_s: float = flag(
        10.0, "longest preparation of one request (then 400 naming the field)")
    limits: RequestLimits = field(default_factory=RequestLimits)
    cors: CorsConfig = field(default_factory=CorsConfig)

    def __post_init__(self) -> None:
        if not self.served_model_name:
            object.__setattr__(self, "served_model_name", default_served_name(self.model))
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
        if self.chat_template not in (None, "tokenizer") and \
                not Path(self.chat_template).expanduser().is_file():
            raise ValueError(f"--chat-template {self.chat_template}: no such file")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}; known: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
