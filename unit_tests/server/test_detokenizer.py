"""Incremental detokenization never splits UTF-8; stop strings are matched across token boundaries."""

from __future__ import annotations

import pytest

from lightllm.engine.messages import Finished, TokenChunk
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.detokenizer import IncrementalDetokenizer, StopMatcher
from lightllm.server.output import SequenceOutput
from lightllm.server.tokenizer import Tokenizer, direct_decoder

TEXT = "héllo 你好, wörld 😀🎉 ok ✓ 日本語テキスト"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    _, info = load_server_args([])
    return Tokenizer(info)


def test_tokens_split_multibyte_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.decode([i]) for i in ids]
    # the fixture is only meaningful if some single tokens are partial characters
    assert any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_token_by_token(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


@pytest.mark.parametrize("step", [2, 3, 5], ids=["by2", "by3", "by5"])
def test_incremental_detokenizer_in_chunks(tokenizer, step):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(ids[i : i + step]) for i in range(0, len(ids), step)) + detok.flush()
    assert text == TEXT


def test_incremental_detokenizer_flushes_invalid_bytes(tokenizer):
    # a lone lead byte of a 3-byte character never completes: flush reports it as a replacement character
    ids = tokenizer.encode("ab")
    lead = tokenizer.encode("你")[0]
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.push(ids) + detok.push([lead])
    assert text == "ab"
    assert detok.flush() == tokenizer.decode([lead])


def test_stop_matcher_holds_back_possible_prefix():
    m = StopMatcher(["STOP"])
    assert m.feed("hello ST") == "hello "
    assert m.feed("O") == ""
    assert m.feed("x") == "STOx"
    assert m.feed("STOP and more") == ""
    assert m.matched == "STOP"
    assert m.feed("x") == "" and m.flush() == ""


def test_stop_matcher_releases_non_matching_prefix_on_flush():
    m = StopMatcher(["STOP", "\n\n"])
    assert m.feed("abc ST") == "abc "
    assert m.flush() == "ST"


def test_stop_matcher_can_end_the_text_with_the_stop_string():
    m = StopMatcher(["STOP"], include_stop=True)
    assert m.feed("hello ST") == "hello "
    assert m.feed("OP and more") == "STOP" and m.matched == "STOP"
    assert m.flush() == ""


def test_stop_matcher_first_occurrence_wins():
    m = StopMatcher(["b", "cd"])
    assert m.feed("acdb") == "a"
    assert m.matched == "cd"


def test_sequence_output_stop_string_truncates_tokens_and_text(tokenizer):
    ids = tokenizer.encode("one two three four")
    out = SequenceOutput(tokenizer, SamplingParams(stop=["thr"]), eos_token_ids=())
    delta = out.on_tokens(TokenChunk("r", ids))
    assert out.text == "one two " and delta.finish_reason == "stop" and out.stop_string_hit
    # tokens up to the one completing the stop string are kept
    assert tokenizer.decode(out.token_ids).startswith("one two thr")
    assert out.on_finished(Finished("r", "abort")).text == "" and out.finish_reason == "stop"


def test_stop_matcher_without_matching_still_holds_a_possible_start():
    m = StopMatcher(["STOP"])
    # a whole stop string while matching is off passes; the tail that could begin one is held
    assert m.feed("a STOP b ST", match=False) == "a STOP b "
    assert m.matched is None
    # completed once matching is on
    assert m.feed("OP c") == "" and m.matched == "STOP"


@pytest.mark.parametrize("min_tokens", [0, 2, 3, 6, 7])
def test_sequence_output_matches_stop_strings_after_min_tokens(tokenizer, min_tokens):
    """A stop string completed by one of the first min_tokens output tokens does not stop the sequence; one
    completed by a later token does, as a stop token could first be sampled there (min_tokens 0 is the twin: the
    first occurrence stops)."""
    ids = [tokenizer.encode(w)[0] for w in ["x", " a", " b", " a", " b", " c", " a", " b", " d"]]
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    out = SequenceOutput(tokenizer, SamplingParams(stop=["a b"], min_tokens=min_tokens), eos_token_ids=())
    out.on_tokens(TokenChunk("r", ids))
    # "a b" is completed by tokens 3, 5 and 8 (1-based); the first after min_tokens stops
    ends = [i + 1 for i, text in enumerate(pieces) if text.endswith("a b")]
    assert ends == [3, 5, 8]
    end = next(e for e in ends if e > min_tokens)
    assert len(out.token_ids) == end and out.stop_string_hit
    assert out.text == pieces[end - 1][: pieces[end - 1].rfind("a b")]


@pytest.mark.parametrize("min_tokens", [0, 3])
@pytest.mark.parametrize("then", ["token", "finish"])
def test_a_stop_string_completed_before_min_tokens_never_matches(tokenizer, min_tokens, then):
    """The stop string "a b" completed by the third token, within min_tokens 3, and held back as the start of
    "a b c": neither a fourth token nor the finish matches it later, and the text is whole. min_tokens 0 is the
    twin: the third token stops the sequence, its text cut before "a b"."""
    ids = [tokenizer.encode(w)[0] for w in ["x", " a", " b", " z"]]
    out = SequenceOutput(tokenizer, SamplingParams(stop=["a b", "a b c"], min_tokens=min_tokens), eos_token_ids=())
    out.on_tokens(TokenChunk("r", ids[:3]))
    if then == "token":
        out.on_tokens(TokenChunk("r", ids[3:]))
    out.on_finished(Finished("r", "length"))
    if min_tokens:
        sent = ids if then == "token" else ids[:3]
        assert (out.text, out.token_ids, out.finish_reason) == (tokenizer.decode(sent), sent, "length")
    else:
        assert (out.text, out.token_ids, out.finish_reason) == ("x ", ids[:3], "stop")


def test_sequence_output_hides_eos_but_reports_it(tokenizer):
    ids = tokenizer.encode("hi there")
    eos = tokenizer.eos_token_ids[0]
    out = SequenceOutput(tokenizer, SamplingParams(), eos_token_ids=(eos,))
    out.on_tokens(TokenChunk("r", ids + [eos]))
    out.on_finished(Finished("r", "stop", stop_token_id=eos))
    assert out.text == "hi there" and out.token_ids[-1] == eos and out.finish_reason == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_in_the_output_only_when_asked_for(tokenizer, include):
    """include_stop_str_in_output renders the stop token that ended the sequence, as a stop string is kept (twin:
    the default hides it); either way the token is reported."""
    ids = [tokenizer.encode(w)[0] for w in ["x", " a", " b"]]
    params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
    out = SequenceOutput(tokenizer, params, eos_token_ids=())
    out.on_tokens(TokenChunk("r", ids))
    out.on_finished(Finished("r", "stop", stop_token_id=ids[-1]))
    assert (out.text, out.token_ids, out.finish_reason) == ("x a b" if include else "x a", ids, "stop")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers_decode(tokenizer, skip_special_tokens):
    """`Tokenizer.decode` (the Rust tokenizer called directly) gives transformers' text for random id runs, special
    ids included; a tokenizer that cleans up spaces goes through transformers (twin: with the clean-up forced on,
    transformers' own text differs where the fast path's would)."""
    import random

    rng = random.Random(7)
    specials = sorted(tokenizer.hf.added_tokens_decoder)
    assert tokenizer._fast_decode is not None, "the demo checkpoint's tokenizer takes the fast path"
    runs = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    runs += [run[:3] + [rng.choice(specials)] + run[3:] for run in runs[:50]]
    for ids in runs:
        expected = tokenizer.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) == expected, ids


def test_decode_with_space_clean_up_is_transformers_own():
    _, info = load_server_args([])
    tok = Tokenizer(info)
    ids = tok.encode("a , b . c ' d")
    tok.hf.clean_up_tokenization_spaces = True
    tok.hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    cleaned = tok.hf.decode(ids)
    assert cleaned != tok.decode(ids), "the twin must see the clean-up change the text"
    tok._fast_decode = direct_decoder(tok.hf)
    assert tok._fast_decode is None and tok.decode(ids) == cleaned
