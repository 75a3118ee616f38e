from setuptools import find_packages, setup

setup(
    name="lightllm",
    version="0.1.0",
    description="Inference server for hybrid linear-attention LLMs (Gated DeltaNet, Kimi Delta Attention)",
    packages=find_packages(include=["lightllm", "lightllm.*"]),
    # the trained demo checkpoint (served without --model_dir) ships with the package
    package_data={"lightllm": ["**/*.json", "**/*.md", "tools/demo_model/weights/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11,<=2.14.1",
        "triton>=3.6,<3.7",
        "numpy<2.4",
        "transformers>=5.17,<6",
        "safetensors",
        "tokenizers",
        # Kimi-Linear's tiktoken.model tokenizer
        "tiktoken",
        "fla-core==0.6.0",
        "einops",
        "fastapi",
        "uvicorn",
        "pyzmq",
        "rpyc",
        "pydantic>=2",
        "prometheus-client",
        "msgspec",
        "tqdm",
        "jinja2",
        # constrained decoding (structured output, forced tool calls)
        "llguidance==1.9.1",
        # the benchmark clients (lightllm.tools.bench_serving)
        "httpx",
    ],
    extras_require={
        # the NIXL transport of prefill/decode disaggregation (--pd_transport nixl)
        "nixl": ["nixl-cu13"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "openai", "httpx", "ruff", "nixl-cu13"],
    },
)
