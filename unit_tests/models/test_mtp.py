"""MTP drafting vs transformers' MTP module, and verify steps with forced partial acceptance.

The reference chain runs transformers' MTP layer over the whole accepted sequence: row t pairs the main
model's final hidden h_t with token t+1; a chained step appends the head's own output and its draft."""

from __future__ import annotations

import pytest
import torch

from unit_tests.helpers.hf_oracle import torch_paths
from unit_tests.models.conftest import MTP_CASES
from unit_tests.models.drive import decode, make_runner, prefill, verify
from unit_tests.models.test_parity import assert_logits, max_rel, prompt


@torch.no_grad()
def hf_draft_chain(oracle, ids: list[int], next_token: int, steps: int) -> torch.Tensor:
    """Draft logits [steps, V] of transformers' MTP head after `ids` + `next_token`, chained greedily."""
    mtp = oracle._mtp_model()
    hidden = oracle.hidden_states(ids)[0]
    tokens = ids[1:] + [next_token]
    logits = []
    with torch_paths():
        for _ in range(steps):
            tok = torch.tensor([tokens])
            pos = torch.arange(len(tokens))[None]
            embeds = mtp.embed_tokens(tok)
            masks = mtp.create_masks_for_mtp_layer(0, embeds, None, pos)
            rope = mtp.rotary_emb(embeds, position_ids=pos)
            out = mtp.layers[0](embeds, hidden[None], rope, masks.get("attention_mask"), pos, None)[0]
            logits.append(mtp.shared_head(out[-1]).float())
            hidden = torch.cat([hidden, out[-1:]])
            tokens.append(int(logits[-1].argmax()))
    return torch.stack(logits)


@pytest.mark.parametrize("case", MTP_CASES)
def test_chained_draft_logits_match_transformers(tiny, case):
    model_dir, oracle = tiny(case)
    ids = prompt(21, 23)
    runner = make_runner(model_dir, mtp_step=3)
    h = runner.add_request()
    nxt = int(prefill(runner, h, ids, chunk=9).argmax())
    drafts, logits = runner.draft_with_logits([h], torch.tensor([nxt]), 3)
    expected = hf_draft_chain(oracle, ids, nxt, 3)
    for s in range(3):
        assert_logits(f"{case} draft step {s}", logits[0, s], expected[s])
    assert drafts[0].tolist() == expected.argmax(-1).tolist()


@pytest.mark.parametrize("accept", [1, 2, 4], ids=lambda a: f"accept{a}")
@pytest.mark.parametrize("case", MTP_CASES)
def test_draft_after_partial_acceptance_matches_transformers(tiny, case, accept):
    """After a W=4 verify keeps `accept` tokens, the next drafts equal transformers' on the accepted text."""
    model_dir, oracle = tiny(case)
    ids = prompt(22, 15)
    runner = make_runner(model_dir, mtp_step=3)
    h = runner.add_request()
    nxt = int(prefill(runner, h, ids).argmax())
    window = [nxt] + runner.draft([h], torch.tensor([nxt]), 3)[0].tolist()
    logits = verify(runner, h, window)
    runner.accept([h], [accept])
    bonus = int(logits[accept - 1].argmax())
    _, got = runner.draft_with_logits([h], torch.tensor([bonus]), 2)
    expected = hf_draft_chain(oracle, ids + window[:accept], bonus, 2)
    for s in range(2):
        assert_logits(f"{case} accept={accept} draft step {s}", got[0, s], expected[s])


@pytest.mark.parametrize("mode", ["native", "compact", "replay"])
@pytest.mark.parametrize("width,accept", [(2, 1), (4, 2), (4, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("case", ["qwen3_next-hv4", "qwen3_5_moe-hv4"])
def test_verify_with_partial_acceptance_equals_plain_decode(tiny, case, width, accept, mode):
    """Verify `[next, drafts]` of width W, keep `accept` < W tokens: the following steps' logits equal those of
    a runner that decoded only the accepted tokens one at a time."""
    model_dir, oracle = tiny(case)
    ids, tail = prompt(23, 17), prompt(24, 5)
    spec = make_runner(model_dir, mode=mode, mtp_step=width - 1, replay_capacity=4)
    plain = make_runner(model_dir)
    hs, hp = spec.add_request(), plain.add_request()
    nxt = int(prefill(spec, hs, ids).argmax())
    prefill(plain, hp, ids)
    drafts = spec.draft([hs], torch.tensor([nxt]), width - 1)[0].tolist()
    window = [nxt] + drafts
    # make sure the rejected part differs from what the model would say (forced partial acceptance)
    window[accept] = (window[accept] + 1) % 470
    got = verify(spec, hs, window)
    spec.accept([hs], [accept])
    for i, tok in enumerate(window[:accept]):
        assert_logits(f"{case}/{mode} verify row {i}", got[i], decode(plain, hp, tok))
    last = None
    for tok in tail:
        last = decode(spec, hs, tok)
        assert_logits(f"{case}/{mode} after accept", last, decode(plain, hp, tok))
    assert spec.num_tokens(hs) == plain.num_tokens(hp) == len(ids) + accept + len(tail)
    expected = oracle.prefill_logits(ids + window[:accept] + tail)[0, -1]
    assert_logits(f"{case}/{mode} vs transformers", last, expected)


@pytest.mark.parametrize("break_row", [None, 1], ids=["batched", "teeth-shifted-hidden"])
def test_pairs_committed_for_many_rows_at_once_draft_as_transformers(tiny, break_row):
    """The prefix cache's publishes commit every row's pending pairs in one pass of the head (rows of different
    lengths and cached counts, one of them with nothing pending): the drafts after it equal transformers' chain
    for each row. Twin: one row's pending hidden states shifted by one row must change its drafts."""
    case = MTP_CASES[0]
    model_dir, oracle = tiny(case)
    runner = make_runner(model_dir, mtp_step=2)
    prompts = [prompt(40, 19), prompt(41, 6), prompt(42, 1), prompt(43, 12)]
    handles = [runner.add_request() for _ in prompts]
    reqs = [runner._requests[h] for h in handles]
    # the first row commits its first chunks' pairs alone: the rows then start from different cached counts
    prefill(runner, handles[0], prompts[0][:10], chunk=5)
    runner.drafter.commit_known_pairs(handles[:1], reqs[:1])
    assert reqs[0].mtp_len == 9 and sum(n for _, _, n in reqs[0].mtp_hidden) == 1
    nexts = [int(prefill(runner, handles[0], prompts[0][10:], chunk=4).argmax())]
    nexts += [int(prefill(runner, h, ids, chunk=5).argmax()) for h, ids in zip(handles[1:], prompts[1:])]
    runner.drafter.commit_known_pairs(handles, reqs)
    assert [r.mtp_len for r in reqs] == [18, 5, 0, 11]
    assert all(sum(n for _, _, n in r.mtp_hidden) == 1 and not r.mtp_next_ids for r in reqs)
    if break_row is not None:
        src, start, n = reqs[break_row].mtp_hidden[0]
        reqs[break_row].mtp_hidden = [(src, start - 1, n)]
    _, logits = runner.draft_with_logits(handles, torch.tensor(nexts), 2)
    for i, (ids, nxt) in enumerate(zip(prompts, nexts)):
        expected = hf_draft_chain(oracle, ids, nxt, 2)
        if i == break_row:
            assert max_rel(logits[i, 0], expected[0]) > 1e-2, "a shifted hidden row must change the draft"
            continue
        for s in range(2):
            assert_logits(f"row {i} draft step {s}", logits[i, s], expected[s])
