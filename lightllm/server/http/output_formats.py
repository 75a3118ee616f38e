"""The schemas of what a request asks its output to be: OpenAI's `response_format` (text, json_object, json_schema,
and vLLM's structural_tag) and vLLM's `structured_outputs`. `structured.py` compiles them into grammars."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from lightllm.server.http.chat_messages import FUNCTION_NAME
from lightllm.server.http.schema_base import RequestError, StrictModel, Text

# at most this many structures / triggers of a structural tag, and choices of structured_outputs.choice
MAX_STRUCTURES = 128
MAX_CHOICES = 256


class JsonSchemaFormat(StrictModel):
    name: str = Field("response", pattern=FUNCTION_NAME)
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TagStructure(StrictModel):
    model_config = ConfigDict(extra="forbid")

    begin: Text = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    end: Text


# a trigger: text (or a special token, written as its name) that starts a structure
Trigger = Annotated[Text, Field(min_length=1)]


class StructuralTag(StrictModel):
    """vLLM's structural tag: free text in which a structure, once the text reaches one of the triggers its begin
    starts with, is written as its begin, a JSON value of its schema and its end (tool calls inside prose)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[Trigger] = Field(min_length=1, max_length=MAX_STRUCTURES)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # with type structural_tag (vLLM's)
    structures: list[TagStructure] | None = Field(None, min_length=1, max_length=MAX_STRUCTURES)
    triggers: list[Trigger] | None = Field(None, min_length=1, max_length=MAX_STRUCTURES)

    @property
    def constrains(self) -> bool:
        return self.type != "text"

    def check(self) -> None:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise RequestError("response_format.json_schema", "response_format.json_schema: a schema is required")
        if self.type == "structural_tag" and (self.structures is None or self.triggers is None):
            raise RequestError("response_format", "response_format: a structural_tag needs structures and triggers")

    def structural_tag(self) -> StructuralTag:
        return StructuralTag(structures=self.structures, triggers=self.triggers)


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (both routes): exactly one constraint on the generated text. Keys it does not
    know (vLLM's `whitespace_pattern`, `disable_additional_properties`, ...) are refused: ignoring part of a
    constraint would serve output the client did not ask for."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | Text | None = Field(
        None, alias="json", description="a JSON schema the output must follow (an object, or its JSON text)"
    )
    json_object: bool | None = Field(None, description="true: any JSON object")
    regex: Text | None = Field(None, min_length=1, description="a regular expression the whole output must match")
    choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES, description="the output is exactly one of these strings"
    )
    grammar: Text | None = Field(None, min_length=1, description="a Lark grammar (llguidance's dialect)")
    structural_tag: dict[str, Any] | Text | None = Field(
        None,
        description="vLLM's: {type: structural_tag, structures: [{begin, schema, end}], triggers: [...]} (an object, or "
        "its JSON text): free text whose structures are constrained once a trigger starts them",
    )

    def kinds(self) -> list[str]:
        """The constraints given (their wire names)."""
        given = {
            "json": self.json_ is not None,
            "json_object": bool(self.json_object),
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
            "structural_tag": self.structural_tag is not None,
        }
        return [k for k, v in given.items() if v]
