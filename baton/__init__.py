"""Baton: disaggregated prefill/decode LLM serving for AI-agent traffic.

The engine library both workers share. Offline use::

    from baton import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""
from baton.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import baton` stays light (the gateway imports baton's small pieces only).
    if name == "LLM":
        from baton.llm import LLM
        return LLM
    raise AttributeError(name)
