"""The sampling defaults a model ships in its `generation_config.json`: what a request gets for a sampling field it
leaves out (`--generation_config`). A request's own value always wins; fields the file does not set keep OpenAI's
defaults (temperature 1, no top-p / top-k / min-p filter, no repetition penalty, a chat answer as long as the context
allows). As in vLLM, only the values are read: `do_sample` is not, so a file that sets a temperature gets it sampled
with. The file's `max_new_tokens` is the length of a chat answer whose request sets no `max_tokens` (clipped to the
room its prompt leaves, see `lightllm.server.output.default_length`) and the offline `LLM`'s default `max_tokens`;
a completion request keeps OpenAI's 16."""

from __future__ import annotations

import os

from lightllm.engine.sampling_params import SamplingParams, SamplingParamsError
from lightllm.server.checkpoint_check import read_json

# the generation_config.json keys taken, each with the SamplingParams field it sets
SAMPLING_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# what `--generation_config` accepts besides a folder
GENERATION_CONFIG_SOURCES = ("auto", "none")
GENERATION_CONFIG = "generation_config.json"


def read_sampling_defaults(source: str, model_dir: str) -> dict[str, float | int]:
    """The defaults `source` names, keyed by SamplingParams field: `auto` the checkpoint's file (none when it has no
    file), `none` nothing, else a folder's file (which must exist). ValueError naming the file and key when a value is
    out of the range a request may ask for."""
    if source == "none":
        return {}
    if source != "auto" and not os.path.isdir(source):
        # vLLM spells "none" as "vllm": a value that is no folder is most likely such a word
        choices = ", ".join(GENERATION_CONFIG_SOURCES)
        raise ValueError(
            f"--generation_config {source}: not a folder; give {choices} or a folder with {GENERATION_CONFIG}"
        )
    path = os.path.join(model_dir if source == "auto" else source, GENERATION_CONFIG)
    if not os.path.isfile(path):
        if source == "auto":
            return {}
        raise ValueError(f"--generation_config {source}: no {GENERATION_CONFIG} in that folder")
    raw = read_json(path)
    taken = {key: raw[key] for key in SAMPLING_DEFAULT_FIELDS if raw.get(key) is not None}
    for key, value in taken.items():
        # a bool is an int to Python, and JSON's true would pass as 1
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {key} must be a number, found {value!r}; {_WAY_OUT}")
    defaults = {SAMPLING_DEFAULT_FIELDS[key]: value for key, value in taken.items()}
    try:
        SamplingParams(**defaults)
    except SamplingParamsError as exc:
        # name the file's key where it differs from the field it sets
        key = next(k for k, f in SAMPLING_DEFAULT_FIELDS.items() if f == exc.field)
        source = "" if key == exc.field else f" (from {key})"
        raise ValueError(f"{path}: {exc}{source}; {_WAY_OUT}") from None
    return defaults


_WAY_OUT = "fix the file, or start with --generation_config none to ignore it"
