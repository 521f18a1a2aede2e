"""Our top-level `kernels` package must not be mistaken for Hugging Face's `kernels`.

transformers probes for an optional package imported as `kernels` and accepts it only at
versions in [0.18.2, 0.19.0); the `baton` distribution (version 0.1.0) or, when baton is not
installed, our package itself (no `__version__`) falls outside that range. Each import order
runs in a fresh interpreter, so the probe really happens with our package on the path.
"""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys
{first}
{second}
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils.import_utils import is_kernels_available

assert kernels.__file__.startswith(sys.argv[1]), kernels.__file__
assert callable(kernels.paged_decode_attention)
assert not is_kernels_available(), "transformers took Baton's kernels/ for Hugging Face's package"
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).eval()
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3]])).logits
assert logits.shape == (1, 3, 64)
print("ok")
"""


def test_transformers_imports_next_to_our_kernels():
    # Both import orders, each in a fresh interpreter; run side by side (each spends ~8 s importing).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # import as production does: no interpreter
    orders = {"kernels first": ("import kernels", "import transformers"),
              "transformers first": ("import transformers", "import kernels")}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _SCRIPT.format(first=first, second=second), str(REPO)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, (first, second) in orders.items()
    }
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0 and stdout.strip().endswith("ok"), f"{name}:\n{stderr[-3000:]}"
