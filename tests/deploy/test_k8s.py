"""deploy/k8s: every overlay renders (kustomize, or tests/deploy/kustomize_lite.py where no
kustomize binary exists) into objects that validate against the Kubernetes schemas offline
(kubernetes-validate, strict), and that fit together: selectors, headless Services the
gateway resolves, gRPC probes on the served ports, drain budgets, GPU requests, and flags the
real argument parsers accept. A deliberately broken manifest must fail the same check."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kustomize_lite import build

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
# The oldest Kubernetes these manifests target (native gRPC probes are GA from 1.27) and the
# newest schema kubernetes-validate bundles.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
VALIDATE_CLI = Path(sys.executable).with_name("kubernetes-validate")


def validate(docs: list[dict]) -> None:
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


KV_STORE = "baton-kv-store"  # the Mooncake master: not a Baton role (test_kv_store_master)


def baton_deployments(docs: list[dict]) -> dict[str, dict]:
    """The gateway's and the workers' Deployments (the KV store master left out)."""
    return {n: d for n, d in by_kind(docs, "Deployment").items() if n != KV_STORE}


def kubectl_kustomize(folder: Path) -> list[dict] | None:
    if shutil.which("kubectl") is None:
        return None
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, build(K8S / "overlays" / request.param)


def test_overlays_exist():
    assert {"small", "gpu"} <= set(OVERLAYS)


def test_base_files_validate():
    docs = [d for p in sorted((K8S / "base").glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]
    assert {d["kind"] for d in docs} == {"Namespace", "ConfigMap", "Service", "Deployment",
                                         "PodDisruptionBudget", "PersistentVolumeClaim"}
    validate(docs)


def test_overlay_validates(overlay):
    validate(overlay[1])


def test_overlay_matches_kubectl_kustomize(overlay):
    name, docs = overlay
    rendered = kubectl_kustomize(K8S / "overlays" / name)
    if rendered is None:
        pytest.skip("kubectl not installed: rendered with kustomize_lite only")
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(docs, key=key)


def test_broken_manifest_fails_validation(tmp_path):
    """The check bites: a wrong type, an unknown field and a missing probe port all fail,
    in-process and through the command line CI could call."""
    deploy = by_kind(build(K8S / "overlays" / "small"), "Deployment")["baton-decode"]
    breakages = [
        lambda d: d["spec"].__setitem__("replicas", "two"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("readinessProbe",
                                                                             {"grpc": {}}),
        lambda d: d["spec"]["template"]["spec"].__setitem__("terminationGracePeriod", 90),
    ]
    for i, breakage in enumerate(breakages):
        broken = yaml.safe_load(yaml.safe_dump(deploy))
        breakage(broken)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[0], strict=True)
        path = tmp_path / f"broken{i}.yaml"
        path.write_text(yaml.safe_dump(broken))
        cli = subprocess.run([str(VALIDATE_CLI), "--strict", "--quiet", str(path)],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode != 0, cli.stdout + cli.stderr
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(deploy))
    cli = subprocess.run([str(VALIDATE_CLI), "--strict", "--quiet", str(good)],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr


def test_workers_are_discoverable_and_probed(overlay):
    _, docs = overlay
    services, deployments = by_kind(docs, "Service"), baton_deployments(docs)
    assert set(deployments) == {"baton-gateway", "baton-prefill", "baton-decode"}
    for name, dep in deployments.items():
        template = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= \
            template["metadata"]["labels"].items()
        svc = services[name]
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for sp in svc["spec"]["ports"]:
            assert ports[sp["targetPort"]] == sp["port"], (name, sp)
        assert dep["spec"]["replicas"] >= 1
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        assert not template["spec"]["enableServiceLinks"]  # no BATON_* env from Services
        for c in template["spec"]["initContainers"] + template["spec"]["containers"]:
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, c["name"])
        if name == "baton-gateway":
            assert svc["spec"].get("clusterIP") != "None"
            assert container["readinessProbe"]["httpGet"]["path"] == "/health"
            assert container["livenessProbe"]["grpc"]["port"] == ports["grpc"]
            continue
        assert svc["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == ports["grpc"], (name, probe)


def test_gateway_resolves_the_headless_services(overlay):
    _, docs = overlay
    services = by_kind(docs, "Service")
    gateway = by_kind(docs, "Deployment")["baton-gateway"]
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    for flag, service in (("--decode", "baton-decode"), ("--prefill", "baton-prefill")):
        [value] = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
        host, port = value.rsplit(":", 1)
        assert host == service and services[host]["spec"]["clusterIP"] == "None"
        assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}
    assert any(a.startswith("--dns-refresh-s=") for a in args)


def test_decode_has_a_disruption_budget(overlay):
    _, docs = overlay
    pdb = by_kind(docs, "PodDisruptionBudget")["baton-decode"]
    decode = by_kind(docs, "Deployment")["baton-decode"]
    assert pdb["spec"]["selector"] == decode["spec"]["selector"]
    assert pdb["spec"]["maxUnavailable"] < decode["spec"]["replicas"]


def test_grace_period_covers_prestop_and_drain(overlay):
    _, docs = overlay
    config = by_kind(docs, "ConfigMap")["baton-config"]["data"]
    drains = {}
    for name, dep in baton_deployments(docs).items():
        pod = dep["spec"]["template"]["spec"]
        container = pod["containers"][0]
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        [drain] = [float(expand(arg, config, container).split("=", 1)[1])
                   for arg in container["args"]
                   if arg.startswith(("--drain-seconds=", "--shutdown-grace-s="))]
        assert pod["terminationGracePeriodSeconds"] >= int(command[1]) + drain + 5, name
        drains[name] = drain
    # the gateway lets streams run as long as decode drains them, not shorter
    assert drains["baton-gateway"] >= drains["baton-decode"]


def test_gpu_requests(overlay):
    name, docs = overlay
    for dep_name, dep in baton_deployments(docs).items():
        res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
        gpus = res["requests"].get("nvidia.com/gpu")
        if name == "gpu" and dep_name != "baton-gateway":
            assert gpus == "1" and res["limits"]["nvidia.com/gpu"] == "1"
        else:
            assert gpus is None and "nvidia.com/gpu" not in res.get("limits", {})


def expand(arg: str, config: dict[str, str], container: dict) -> str:
    """Kubernetes' $(VAR) expansion from the ConfigMap; POD_IP stands in as 10.0.0.7."""
    env = dict(config)
    for e in container.get("env", []):
        if "secretKeyRef" in e["valueFrom"]:
            continue  # a secret is read by the process, never expanded into its arguments
        assert e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        env["POD_IP"] = "10.0.0.7"

    def sub(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not defined"
        return env[m.group(1)]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def test_args_parse_with_the_real_parsers(overlay):
    """Every flag a pod passes exists and holds a valid value (the services' own parsers)."""
    from decode_service.config import parse_args as decode_args
    from gateway.config import parse_args as gateway_args
    from prefill_service.config import parse_args as prefill_args

    name, docs = overlay
    config = by_kind(docs, "ConfigMap")["baton-config"]["data"]
    parsers = {"serve-decode": decode_args, "serve-prefill": prefill_args,
               "gateway": gateway_args, "prepare-model": None}
    for dep in baton_deployments(docs).values():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["initContainers"] + pod["containers"]:
            assert all(ref["configMapRef"]["name"] == "baton-config" for ref in c["envFrom"])
            args = [expand(a, config, c) for a in c["args"]]
            parser = parsers[args[0]]
            if parser is None:
                assert args[1] == config["BATON_MODEL"]
                continue
            parsed = parser(args[1:])
            if args[0] != "gateway":
                assert parsed.server.advertise_address == f"10.0.0.7:{parsed.server.port}"
                assert parsed.server.host == "0.0.0.0"
                assert parsed.transport == config["BATON_TRANSPORT"]
                # the GPU overlay reserves a GPU per worker: the worker must compute on it
                assert parsed.engine.device == ("cuda" if name == "gpu" else "cpu")


def test_namespace_is_stated_once(overlay):
    """The base's kustomize `namespace:` puts every object in `baton` and a Namespace object
    creates it, so `kubectl apply -k` needs no -n; no overlay or manifest names another."""
    _, docs = overlay
    [ns] = by_kind(docs, "Namespace").values()
    assert ns["metadata"]["name"] == "baton"
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "baton", (d["kind"], d["metadata"]["name"])
    stated = [p.relative_to(K8S) for p in K8S.rglob("*.yaml")
              if re.search(r"^\s*namespace:", p.read_text(), re.M)]
    assert stated == [Path("base/kustomization.yaml")]


def test_gateway_reads_the_api_key_from_an_optional_secret(overlay):
    from gateway.config import API_KEY_ENV

    _, docs = overlay
    for name, dep in by_kind(docs, "Deployment").items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container.get("env", [])}
        if name != "baton-gateway":
            assert API_KEY_ENV not in env, name  # workers never see it
            continue
        ref = env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "baton-api-key", "key": "api-key", "optional": True}
        assert not any("api-key" in a for a in container["args"])  # not a flag


def test_model_cache_is_one_shared_claim(overlay):
    """Every pod mounts the same ReadWriteMany claim at the cache dir: the model is converted
    once for the cluster (registry.py makes concurrent converters safe), not per pod."""
    _, docs = overlay
    [claim] = by_kind(docs, "PersistentVolumeClaim").values()
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    config = by_kind(docs, "ConfigMap")["baton-config"]["data"]
    for name, dep in baton_deployments(docs).items():
        pod = dep["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim":
                                          {"claimName": claim["metadata"]["name"]}}, name
        assert not any("emptyDir" in v for v in volumes.values()), name
        for c in pod["initContainers"] + pod["containers"]:
            assert {"name": "model-cache", "mountPath": config["BATON_CACHE_DIR"]} in \
                c["volumeMounts"], (name, c["name"])


def test_kv_store_master(overlay):
    """One Mooncake master behind a ClusterIP Service; both worker roles dial it through
    BATON_KV_STORE_URL, and their parsers accept the URL (and "none", which turns it off)."""
    from decode_service.config import parse_args as decode_args
    from prefill_service.config import parse_args as prefill_args

    _, docs = overlay
    svc, dep = by_kind(docs, "Service")[KV_STORE], by_kind(docs, "Deployment")[KV_STORE]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["replicas"] == 1
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["mooncake_master"]
    [port] = [p["port"] for p in svc["spec"]["ports"] if p["name"] == "rpc"]
    assert f"--rpc_port={port}" in container["args"]
    assert container["readinessProbe"]["tcpSocket"]["port"] == "rpc"
    config = by_kind(docs, "ConfigMap")["baton-config"]["data"]
    assert config["BATON_KV_STORE_URL"] == f"mooncake://{KV_STORE}:{port}"
    for name, parse in (("baton-prefill", prefill_args), ("baton-decode", decode_args)):
        c = by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]["containers"][0]
        args = [expand(a, config, c) for a in c["args"]]
        assert parse(args[1:]).engine.cache.kv_store_url == config["BATON_KV_STORE_URL"]
        off = [a for a in args[1:] if not a.startswith("--kv-store-url=")]
        assert parse([*off, "--kv-store-url=none"]).engine.cache.kv_store_url is None
