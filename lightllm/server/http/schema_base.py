"""What every request schema of the front-end stands on: strict pydantic models, text that is valid Unicode, bounded
integers, and the error that names the field a request cannot be served for."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from lightllm.engine.sampling_params import MAX_INT


class RequestError(ValueError):
    """A request that passed the schema but cannot be served; `field` names the offending field."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


def check_text(value: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (`"\\ud800"`); it has no UTF-8 form, so no tokenizer can read it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone UTF-16 surrogate (not valid Unicode text)") from None
    return value


Text = Annotated[str, AfterValidator(check_text)]
Int = Annotated[int, Field(ge=0, le=MAX_INT)]
# vLLM's cache_salt: a secret a tenant's requests share (`lightllm.cache.prefix.namespace`); a 256-bit one in base64
# is 43 characters
CacheSalt = Annotated[
    Text,
    Field(
        min_length=1,
        max_length=1024,
        description="vLLM's: only requests with the same salt share cached prefixes (keep it secret and unguessable)",
    ),
]


class StrictModel(BaseModel):
    """Strict types, unknown fields ignored, no NaN or infinity; an explicit null in an optional field is the field
    left out."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_takes_the_default(cls, data):
        """OpenAI's API marks the fields that have defaults nullable, and clients send `"n": null` or `"stream":
        null` for "not set": such a null takes the field's default. A required field's null stays an error."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, field in cls.model_fields.items() if not field.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}
