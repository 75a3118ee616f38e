"""The checkpoint served when no --model_dir is given: the trained demo model shipped in the package, or a tiny
random checkpoint of the same architecture while the package lacks its weights."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# the demo checkpoint's architecture: it has an MTP head, so every speculation mode works
DEMO_ARCH = "qwen3_5"


def random_demo_model_dir() -> str:
    """The cached tiny random checkpoint of the demo architecture (built on first use)."""
    from lightllm.tools.make_tiny_model import tiny_model_dir

    return str(tiny_model_dir(DEMO_ARCH))


def demo_model() -> tuple[str, str]:
    """(folder, served name) of the checkpoint served when no --model_dir is given: the trained demo model shipped
    in the package, or the tiny random one while the package lacks its weights."""
    from lightllm.tools.demo_model import SERVED_NAME, WEIGHTS_DIR, trained_model_dir

    trained = trained_model_dir()
    if trained is not None:
        return str(trained), SERVED_NAME
    logger.warning(
        "the trained demo model's weights are not in %s: serving a tiny random checkpoint instead (its output is "
        "gibberish; train one with `python -m lightllm.tools.train_demo_model`)",
        WEIGHTS_DIR,
    )
    return random_demo_model_dir(), SERVED_NAME


def demo_model_dir() -> str:
    """The folder of `demo_model()`."""
    return demo_model()[0]
