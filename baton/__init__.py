"""Baton: disaggregated prefill/decode LLM serving for AI-agent traffic.

The engine library both workers share. Offline use::

    from baton import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""
import functools
import subprocess
from pathlib import Path

from baton.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__", "source_commit"]


@functools.lru_cache(maxsize=1)
def source_commit() -> str | None:
    """The git commit (short hash) this code was loaded from, or None when it does not run
    from a git checkout (an installed package) or git is missing or slow."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=2, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def __getattr__(name: str):
    # Lazy: `import baton` stays light (the gateway imports baton's small pieces only).
    if name == "LLM":
        from baton.llm import LLM
        return LLM
    raise AttributeError(name)
