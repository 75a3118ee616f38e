"""engine/grammar.py: the mask of every window position equals that of a fresh matcher fed the drafts before it,
a refused draft is masked out at its own position, the matcher ends each step where it began and advances only
over emitted tokens, and a grammar that starts after a token (a reasoning block's end) leaves the positions up to
it free."""

from __future__ import annotations

import pytest
import torch

from lightllm.engine.grammar import GrammarBackend, mask_windows
from lightllm.engine.request import Request
from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.grammar_vocab import load_grammar_vocabulary
from lightllm.server.http.structured import json_schema_grammar
from lightllm.tools.make_tiny_model import tiny_model_dir

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
VOCAB = 512


def grammar_setup():
    """(a grammar backend of VOCAB rows, the tiny checkpoint's folder, its tokenizer)."""
    model_dir = str(tiny_model_dir("qwen3_next"))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    return GrammarBackend(VOCAB, load_grammar_vocabulary), model_dir, hf


@pytest.fixture(scope="module")
def setup():
    return grammar_setup()


def _request(backend, model_dir, hf, start_token=None) -> Request:
    grammar = json_schema_grammar(SCHEMA)
    req = Request("r", [1, 2], SamplingParams(grammar=grammar, grammar_start_token=start_token), frozenset(), 64)
    req.grammar = backend.matcher(grammar, start_token, model_dir, [hf.eos_token_id])
    return req


def _reference_mask(backend, model_dir, hf, prefix: list[int]) -> torch.Tensor:
    """Allowed tokens after `prefix`, from a fresh matcher (bool [V])."""
    fresh = _request(backend, model_dir, hf).grammar.matcher
    assert fresh.consume_tokens(prefix)
    # one bit per token, little-endian: read without the engine's unpacking
    raw = fresh.compute_bitmask()
    return torch.tensor([bool(raw[t // 8] >> (t % 8) & 1) for t in range(VOCAB)])


def _masked(req: Request, drafts: list[int], rows_before: int = 2) -> torch.Tensor:
    """mask_windows over a batch where the window starts at row `rows_before` (other rows unconstrained)."""
    logits = torch.randn(rows_before + len(drafts) + 1, VOCAB)
    free = Request("free", [3], SamplingParams(), frozenset(), 8)
    windows = [(free, 0, rows_before, []), (req, rows_before, len(drafts) + 1, drafts)]
    masked = mask_windows(windows, logits)
    assert torch.equal(masked[:rows_before], logits[:rows_before])
    kept = torch.isfinite(masked[rows_before:])
    assert torch.equal(masked[rows_before:][kept], logits[rows_before:][kept])
    return kept


def test_each_draft_position_has_its_own_mask(setup):
    backend, model_dir, hf = setup
    text = hf.encode('{"n": 1234}')
    req = _request(backend, model_dir, hf)
    assert req.grammar.advance(text[:1]) is None
    drafts = text[1:5]
    kept = _masked(req, drafts)
    for j in range(len(drafts) + 1):
        assert torch.equal(kept[j], _reference_mask(backend, model_dir, hf, text[: 1 + j])), j
    # rolled back: the next step starts from the emitted token only
    assert req.grammar.matcher.validate_tokens(text[1:]) == len(text) - 1


def test_refused_draft_is_masked_at_its_position(setup):
    backend, model_dir, hf = setup
    text = hf.encode('{"n": 1234}')
    (bad,) = hf.encode("@")
    req = _request(backend, model_dir, hf)
    drafts = [text[0], bad, text[2]]
    kept = _masked(req, drafts)
    assert kept[1].any() and not kept[1][bad]
    assert torch.equal(kept[1], _reference_mask(backend, model_dir, hf, text[:1]))
    # twin: the same draft where the grammar allows it is kept
    assert kept[0][text[0]]
    assert req.grammar.matcher.validate_tokens(text) == len(text)
    # an emitted token the grammar refuses is reported (it would be a masking bug)
    assert "left the grammar" in req.grammar.advance([bad])


def test_finished_grammar_allows_only_eos(setup):
    backend, model_dir, hf = setup
    req = _request(backend, model_dir, hf)
    assert req.grammar.advance(hf.encode('{"n": 7}')) is None
    kept = _masked(req, [])
    assert kept[0].nonzero().flatten().tolist() == [hf.eos_token_id]


def test_grammar_starts_after_its_token(setup):
    backend, model_dir, hf = setup
    (think_end,) = hf.encode("</think>")
    text = hf.encode('{"n": 5}')
    req = _request(backend, model_dir, hf, start_token=think_end)
    free_tokens = hf.encode("hmm ok")
    assert req.grammar.advance(free_tokens) is None and not req.grammar.active
    # a window whose drafts close the reasoning: free up to and including the token, constrained after it
    drafts = [free_tokens[0], think_end, text[0]]
    kept = _masked(req, drafts)
    # free but for the stop token: an output that ended in its reasoning would never reach the grammar
    for j in (0, 1):
        assert kept[j].sum() == VOCAB - 1 and not kept[j][hf.eos_token_id], j
    assert torch.equal(kept[2], _reference_mask(backend, model_dir, hf, []))
    assert torch.equal(kept[3], _reference_mask(backend, model_dir, hf, text[:1]))
    assert not req.grammar.active
    # a window of the reasoning that does not close it: every position free but for the stop token
    kept = _masked(req, free_tokens)
    assert (kept.sum(dim=1) == VOCAB - 1).all() and not kept[:, hf.eos_token_id].any()
    # the emitted tokens switch it on; from then on every position is constrained
    assert req.grammar.advance([free_tokens[0], think_end]) is None and req.grammar.active
    assert torch.equal(_masked(req, [])[0], _reference_mask(backend, model_dir, hf, []))


@pytest.mark.parametrize("stops", [(0,), (31,), (32, 63), (VOCAB - 1,)], ids=str)
def test_holding_the_stop_clears_exactly_its_bits(setup, stops):
    """Bits 0 and 31 of a word (31 is the int32 sign), two words, the last token: only those bits are cleared, in
    only the rows asked for."""
    backend, model_dir, hf = setup
    grammar = backend.matcher(json_schema_grammar(SCHEMA), 5, model_dir, list(stops))
    words = (VOCAB + 31) // 32
    bitmask = torch.full((4, words), -1, dtype=torch.int32)
    grammar.hold_stop(bitmask, 1, 2)
    bits = [[bool(int(bitmask[r, t // 32]) >> (t % 32) & 1) for t in range(VOCAB)] for r in range(4)]
    for r in range(4):
        cleared = [t for t in range(VOCAB) if not bits[r][t]]
        assert cleared == (sorted(stops) if r in (1, 2) else []), r


def test_preloaded_vocabulary_is_the_one_requests_use(setup):
    _, model_dir, hf = setup
    loads = []

    def counted(*args):
        loads.append(args)
        return load_grammar_vocabulary(*args)

    backend = GrammarBackend(VOCAB, counted)
    backend.preload(model_dir, [hf.eos_token_id])
    assert loads == [(model_dir, VOCAB, (hf.eos_token_id,))] and backend._executor is not None
    req = _request(backend, model_dir, hf)
    assert len(loads) == 1 and req.grammar.executor is backend._executor
    # twin: another EOS set is another vocabulary, built on first use
    backend.matcher(json_schema_grammar(SCHEMA), None, model_dir, [hf.eos_token_id, 0])
    assert len(loads) == 2


def test_a_vocabulary_that_cannot_be_built_fails_each_request_at_once(setup, tmp_path):
    _, model_dir, hf = setup
    loads = []

    def counted(*args):
        loads.append(args)
        return load_grammar_vocabulary(*args)

    backend = GrammarBackend(VOCAB, counted)
    for _ in range(2):
        with pytest.raises(ValueError, match="could not be built: .*tokenizer.json or tiktoken.model"):
            backend.matcher(json_schema_grammar(SCHEMA), None, str(tmp_path), [hf.eos_token_id])
    assert len(loads) == 1
    # twin: another folder still builds
    assert backend.matcher(json_schema_grammar(SCHEMA), None, model_dir, [hf.eos_token_id]) is not None


def test_an_engine_without_a_vocabulary_loader_refuses_grammars(setup):
    _, model_dir, hf = setup
    with pytest.raises(ValueError, match="vocabulary loader"):
        GrammarBackend(VOCAB).matcher(json_schema_grammar(SCHEMA), None, model_dir, [hf.eos_token_id])


def test_a_grammar_that_does_not_compile_is_an_error(setup):
    from concurrent.futures import wait

    backend, model_dir, hf = setup
    bad = backend.matcher('{"grammars": [{"json_schema": {"type": "objectx"}}]}', None, model_dir, [hf.eos_token_id])
    good = backend.matcher(json_schema_grammar(SCHEMA), None, model_dir, [hf.eos_token_id])
    for g in (bad, good):
        wait([g._matcher], timeout=30)
    assert bad.ready and "grammar" in bad.compile_error()
    # twin: a grammar that compiles has no error, and its matcher is the compiled one
    assert good.ready and good.compile_error() is None and good.matcher.is_error() is False


def test_reused_host_bitmask_leaves_no_mask_of_an_earlier_step(setup):
    """The host bitmask is reused from step to step: a row constrained at one step and free at the next (another
    batch layout in the same row bucket) is not masked by the stale bits."""
    backend, model_dir, hf = setup
    req = _request(backend, model_dir, hf)
    free = Request("free", [3], SamplingParams(), frozenset(), 8)
    logits = torch.randn(3, VOCAB)
    first = mask_windows([(req, 0, 1, []), (free, 1, 1, []), (free, 2, 1, [])], logits)
    assert torch.isinf(first[0]).any()
    buffers = req.grammar.host_masks
    taken = buffers.last
    second = mask_windows([(free, 0, 1, []), (free, 1, 1, []), (req, 2, 1, [])], logits)
    assert buffers.last is taken, "the same buffer serves the next step of the bucket"
    assert torch.equal(second[:2], logits[:2])
    assert torch.equal(torch.isfinite(second[2]), _reference_mask(backend, model_dir, hf, []))
    # twin: the row the grammar masks at the second step is masked
    assert not torch.equal(second[2], logits[2])


def test_requests_compile_their_own_matchers(setup):
    """Each request owns a matcher compiled for it in the background (copies of one compiled matcher share its
    lexer's lock in llguidance, which serialises their masks on the pool). Each advances alone, and a request's
    mask equals a fresh compile's whatever the others consumed."""
    backend = GrammarBackend(VOCAB, load_grammar_vocabulary)
    _, model_dir, hf = setup
    text = hf.encode('{"n": 12}')
    first, second = _request(backend, model_dir, hf), _request(backend, model_dir, hf)
    assert first.grammar.matcher is not second.grammar.matcher
    assert first.grammar.advance(text[:3]) is None
    assert torch.equal(_masked(second, [])[0], _reference_mask(backend, model_dir, hf, []))
    assert torch.equal(_masked(first, [])[0], _reference_mask(backend, model_dir, hf, text[:3]))
    third = _request(backend, model_dir, hf)
    assert third.grammar.matcher.validate_tokens(text) == len(text)
    # twin: the two states differ, so equal masks above are not two copies of one mask
    assert not torch.equal(
        _reference_mask(backend, model_dir, hf, []), _reference_mask(backend, model_dir, hf, text[:3])
    )


@pytest.mark.parametrize("cores,threads", [(1, 1), (2, 1), (16, 6), (64, 8)])
def test_the_mask_pool_leaves_most_cores_to_the_step(monkeypatch, cores, threads):
    from lightllm.engine import grammar as grammar_module

    monkeypatch.setattr(grammar_module.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert grammar_module.mask_threads() == threads
