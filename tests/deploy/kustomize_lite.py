"""A small kustomize for the subset deploy/k8s uses, so manifests are rendered and validated
even where no kustomize binary exists; where `kubectl kustomize` exists the tests check that
both render the same objects.

Supported kustomization fields: namespace, resources (files and folders), patches
(strategic-merge patch files named by `path`, matched by kind and name), replicas, images. Anything else is
an error, so a new kustomize feature in deploy/k8s is noticed here, not silently ignored.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "patches", "replicas", "images"}
# Kinds without a namespace; kustomize's `namespace:` renames Namespace objects instead.
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole",
                  "ClusterRoleBinding"}
# Strategic merge patch keys of the lists deploy/k8s patches (Kubernetes' patchMergeKey).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "tolerations": None}


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def build(folder: Path) -> list[dict]:
    """Render the kustomization in `folder` into a list of objects."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{folder}: kustomize fields not supported here: {sorted(unknown)}")
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        docs += build(path) if path.is_dir() else load_docs(path)
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{folder}: only `path:` patches are supported, got {patch}")
        for doc in load_docs(folder / patch["path"]):
            merge(find(docs, doc["kind"], doc["metadata"]["name"]), doc)
    for rep in spec.get("replicas", []):
        find(docs, None, rep["name"])["spec"]["replicas"] = rep["count"]
    for image in spec.get("images", []):
        set_image(docs, image)
    if "namespace" in spec:
        set_namespace(docs, spec["namespace"])
    return docs


def set_namespace(docs: list[dict], namespace: str) -> None:
    for doc in docs:
        if doc["kind"] == "Namespace":
            doc["metadata"]["name"] = namespace
        elif doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = namespace


def find(docs: list[dict], kind: str | None, name: str) -> dict:
    hits = [d for d in docs if d["metadata"]["name"] == name and kind in (None, d["kind"])
            and (kind or d["kind"] in ("Deployment", "StatefulSet", "ReplicaSet"))]
    if len(hits) != 1:
        raise ValueError(f"patch target {kind}/{name}: {len(hits)} matches")
    return hits[0]


def merge(base: dict, patch: dict) -> None:
    """Strategic merge: maps merge, lists with a merge key merge by it, others replace."""
    for key, value in patch.items():
        if isinstance(key, str) and key.startswith("$"):
            raise ValueError(f"patch directive {key} not supported")
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        elif isinstance(value, list) and MERGE_KEYS.get(key) and isinstance(base.get(key), list):
            mk = MERGE_KEYS[key]
            by_key = {item[mk]: item for item in base[key]}
            for item in value:
                if item[mk] in by_key:
                    merge(by_key[item[mk]], item)
                else:
                    base[key].append(copy.deepcopy(item))
        else:
            base[key] = copy.deepcopy(value)


def set_image(docs: list[dict], image: dict) -> None:
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            name = c["image"].split("@")[0].rsplit(":", 1)[0]
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image['newTag']}"
