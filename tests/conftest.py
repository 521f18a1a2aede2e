"""Test-wide setup: Triton's CPU interpreter, loopback-only UCX, small thread counts.

These must be set before triton, torch or nixl are imported anywhere, so they live at the
top of the root conftest.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Workers (in-process or child) pick their torch threads from it (baton/threads.py): the
# same count in every test, whatever the machine's load.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

from kernels import gemv as _gemv  # noqa: E402

_gemv.gemv_available()  # build the native GEMV (once per machine) before a test starts a worker

from tests.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Folder of a tiny random Llama (GQA 4:2, untied embeddings) with a BPE tokenizer."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_llama_d32(tmp_path_factory):
    """Folder of a tiny random Llama with head_dim 32 (GQA 2:1): on a CPU with AMX its bf16
    prefill attention takes the AMX item (kernels/cpu_prefill.py), which head_dim 16 does not."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama_d32"), arch="llama_d32")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Folder of a tiny random Qwen2 (q/k/v bias, tied embeddings, GQA 4:1)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """Folder of a tiny random Qwen3 (q/k RMS norm, explicit head_dim, GQA 3:1)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3")
