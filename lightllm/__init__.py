"""lightllm: an inference server for hybrid linear-attention LLMs (Qwen3-Next, Qwen3.5, Kimi-Linear).

`from lightllm import LLM, SamplingParams, StructuredOutputsParams` gives the offline API; both names are imported on first use so that
`import lightllm` stays free of heavy imports and side effects.
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]
# kept equal to setup.py's version; served by GET /version
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from lightllm.server.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from lightllm.engine.sampling_params import SamplingParams, StructuredOutputsParams

        return SamplingParams if name == "SamplingParams" else StructuredOutputsParams
    raise AttributeError(f"module 'lightllm' has no attribute {name!r}")
