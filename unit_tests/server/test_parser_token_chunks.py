"""The streaming parsers fed the way serving feeds them: each family's output, tokenized by its tiny checkpoint's
tokenizer (markers such as `<tool_call>`, `</think>` and Kimi's section tokens are single tokens there), cut into
engine deltas of 1 to 8 tokens (speculation's windows), rendered by the route's `SequenceOutput`; the parse of the
deltas equals the parse of the whole text, with literal markers in prose, reasoning ending mid-delta (or the prompt
opening it), calls split across deltas and streams ending anywhere (an EOS token inside a call, in the last
window's tokens, or the length limit)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.engine.messages import Finished, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.http.parsers import OutputParser, ParsedOutput, ReasoningParser
from lightllm.server.model_info import read_model_info
from lightllm.server.output import SequenceOutput
from lightllm.server.tokenizer import Tokenizer
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.server.test_output_parsers import FORMATS, outputs

# format -> (checkpoint family, whether the route skips special tokens: Kimi's markers are special tokens)
FAMILIES = {
    "qwen3_json": ("qwen3_next", True),
    "qwen3_json_string": ("qwen3_next", True),
    "qwen3_xml": ("qwen3_5", True),
    "kimi": ("kimi_linear", False),
    "kimi_singular": ("kimi_linear", False),
}
_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(arch: str) -> Tokenizer:
    if arch not in _TOKENIZERS:
        _TOKENIZERS[arch] = Tokenizer(read_model_info(str(tiny_model_dir(arch))))
    return _TOKENIZERS[arch]


def _streamed(
    parser: OutputParser,
    tok: Tokenizer,
    skip: bool,
    ids: list[int],
    sizes: list[int],
    eos: bool = False,
    hides_eos: bool = True,
) -> ParsedOutput:
    """Deltas of `sizes` tokens, then of 8 (a window never delivers more) until the ids are spent, rendered as the
    route renders a sequence; `eos`: the last delta ends with the model's EOS token (the request stops on it).
    `hides_eos=False`: a sequence output that renders the EOS token (the twin's)."""
    out = SequenceOutput(tok, SamplingParams(skip_special_tokens=skip), tok.eos_token_ids if hides_eos else ())
    ids = ids + [tok.eos_token_ids[0]] * eos
    deltas, i = [], 0
    for size in sizes + [8] * ((len(ids) + 7) // 8):
        if i >= len(ids):
            break
        deltas.append(parser.feed(out.on_tokens(TokenChunk("r", ids[i : i + size])).text))
        i += size
    finish = Finished("r", "stop" if eos else "length", stop_token_id=tok.eos_token_ids[0] if eos else None)
    deltas += [parser.feed(out.on_finished(finish).text), parser.finish()]
    return ParsedOutput.merge(deltas)


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_token_deltas_parse_like_the_whole_text(fmt, data):
    arch, skip = FAMILIES[fmt]
    tok = _tokenizer(arch)
    text, _ = data.draw(outputs(fmt))
    ids = tok.encode_rendered(text)
    whole_text = tok.decode(ids, skip_special_tokens=skip)
    assert whole_text == text
    sizes = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=len(ids) + 1))
    # the prompt may have opened the reasoning block (Qwen3.5's template with thinking on)
    thinking, eos = data.draw(st.booleans()), data.draw(st.booleans())
    make, _ = FORMATS[fmt]
    whole = OutputParser(ReasoningParser(thinking), make()).parse(whole_text)
    assert _streamed(OutputParser(ReasoningParser(thinking), make()), tok, skip, ids, sizes, eos) == whole


def test_markers_are_single_tokens():
    """The premise of the test above: a delta boundary can fall between a marker and its call but not inside it."""
    for fmt, marker in [("qwen3_json", "<tool_call>"), ("qwen3_xml", "</think>"), ("kimi", "<|tool_call_begin|>")]:
        tok = _tokenizer(FAMILIES[fmt][0])
        assert len(tok.encode_rendered(marker)) == 1, (fmt, marker)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_lost_delta_changes_the_parse(fmt):
    """Twin: the comparison above sees every token (a call's tokens with one dropped parse otherwise)."""
    arch, skip = FAMILIES[fmt]
    tok = _tokenizer(arch)
    make, render = FORMATS[fmt]
    text = "Sure. " + render([("get_weather", {"city": "Paris", "days": 3})])
    ids = tok.encode_rendered(text)
    whole = OutputParser(ReasoningParser(False), make()).parse(text)
    assert len(whole.tool_calls) == 1
    kept = ids[: len(ids) // 2] + ids[len(ids) // 2 + 1 :]
    lossy = _streamed(OutputParser(ReasoningParser(False), make()), tok, skip, kept, [2])
    assert lossy != whole


def test_an_eos_rendered_as_text_changes_the_parse():
    """Twin of the EOS case: Kimi's route keeps special tokens (its tool-call markers are special), so an EOS token
    the output did not hide would reach the parser as text (`<|im_end|>` after the call)."""
    tok = _tokenizer("kimi_linear")
    make, render = FORMATS["kimi"]
    text = "Sure. " + render([("get_weather", {"city": "Paris", "days": 3})])
    ids = tok.encode_rendered(text)
    whole = OutputParser(ReasoningParser(False), make()).parse(text)
    assert _streamed(OutputParser(ReasoningParser(False), make()), tok, False, ids, [3], eos=True) == whole
    unhidden = _streamed(OutputParser(ReasoningParser(False), make()), tok, False, ids, [3], eos=True, hides_eos=False)
    assert unhidden != whole
