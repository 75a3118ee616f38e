"""Request fields of vLLM's and OpenAI's APIs beyond the ones this server implements. The request models ignore
unknown keys (clients send plenty that change nothing: `user`, `metadata`, `store`, ...), so a field that would change
the output must not pass unnoticed: each one here is refused with a 400 naming it unless it holds its neutral value,
and vLLM's older `guided_*` fields are read as the `structured_outputs` they were renamed to."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# vLLM's guided_* field: the structured_outputs key it became
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}

_LOGIT_BIAS = "ban or force tokens with logit_bias"
# field: (the values that ask for nothing beside null, why it is refused and what to send instead)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "applies to beam search, which is not supported"),
    "guided_whitespace_pattern": ((), "not supported: JSON output allows the whitespace JSON allows"),
    "logits_processors": (([],), f"not supported; {_LOGIT_BIAS} or constrain the output with structured_outputs"),
    "kv_transfer_params": ((), "not supported: this server's prefill/decode hand-off is its own (--run_mode)"),
    "vllm_xargs": (({},), "not supported"),
    "documents": (([],), "not supported; put the documents in a message"),
    "mm_processor_kwargs": (({},), "not supported: the models served here take text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "prompt_embeds": ((), "not supported: a prompt is text or token ids"),
    "web_search_options": ((), "web search is not supported"),
    "audio": ((), "not supported: the models served here take and write text only"),
    "modalities": ((["text"],), "only text output is supported"),
    "repetition_detection": ((), "not supported; use repetition_penalty"),
    "logprob_token_ids": ((), "not supported; logprobs / top_logprobs return the most likely tokens"),
    "watermarking": ((False,), "not supported"),
    "structural_tag": ((), "send it as structured_outputs.structural_tag or a response_format of that type"),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type-strict: a JSON 0 is no false, a true no 1
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


def refused_field(data: dict) -> tuple[str, str] | None:
    """(field, message) for the first field of `data` that asks for something this server does not do."""
    for name, (neutral, why) in REFUSED.items():
        if name in data and not _neutral(data[name], neutral):
            return name, f"{name}: {why}"
    given = [name for name in GUIDED if data.get(name) is not None]
    if given and data.get("structured_outputs") is not None:
        return given[0], f"{given[0]}: vLLM's older spelling of structured_outputs; send one of them"
    if len(given) > 1:
        return given[1], f"{given[1]}: give one of {', '.join(given)} (or structured_outputs)"
    return None


def guided_field(data: dict) -> str | None:
    """The one guided_* field `read_guided` moves, if any."""
    given = [name for name in GUIDED if data.get(name) is not None]
    return given[0] if len(given) == 1 and data.get("structured_outputs") is None else None


def renamed_errors(exc: ValidationError, title: str, guided: str) -> ValidationError:
    """`exc` with its structured_outputs.<key> locations named after the guided_* field they came from."""
    errors = []
    for error in exc.errors():
        loc = error["loc"]
        if loc[:2] == ("structured_outputs", GUIDED[guided]):
            loc = (guided, *loc[2:])
        errors.append({"type": error["type"], "loc": loc, "input": error["input"], "ctx": error.get("ctx", {})})
    return ValidationError.from_exception_data(title, errors)


def read_guided(data: dict) -> dict:
    """`data` with a guided_* field moved into structured_outputs (after `refused_field` found no conflict)."""
    given = [name for name in GUIDED if data.get(name) is not None]
    if len(given) != 1 or data.get("structured_outputs") is not None:
        return data
    rest = {k: v for k, v in data.items() if k not in GUIDED}
    return {**rest, "structured_outputs": {GUIDED[given[0]]: data[given[0]]}}
