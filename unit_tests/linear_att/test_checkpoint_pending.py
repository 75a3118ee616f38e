"""Checkpoints taken while accepted tokens are still pending (compact: an unmerged window; replay: history records,
cursor > 0) are the canonical state: compact's equals native's current state bit for bit; replay's equals what
the request itself continues from (its in-place fold) bit for bit and native's to float rounding (the fold applies
projected history records, another operation order). The conv window is native's bit for bit in both."""

from __future__ import annotations

import pytest
import torch

from lightllm.linear_att import ops
from lightllm.linear_att.bundles import ReplayBuffers
from unit_tests.linear_att import scenarios as sc

MODES = ("native", "compact", "replay")


def _states(algo: str):
    """The same prompts, verify widths, accepted counts and rejected inputs in every mode."""
    spec = sc.make_spec(algo, num_layers=2)
    params = sc.make_params(spec, seed=41)
    streams = sc.make_streams(spec, 2, 200, seed=42)
    out = {}
    for mode in MODES:
        st = sc.make_state(spec, mode, max_width=4, replay_capacity=8)
        _, slots = sc.run_mtp(st, spec, params, streams, prompt_lens=[6, 3], num_rounds=5, max_width=4, seed=43)
        out[mode] = (st, torch.tensor(slots, dtype=torch.int32))
    return out


@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_checkpoint_with_pending_tokens_is_the_canonical_state(algo):
    states = _states(algo)
    native_st, slots = states["native"]
    compact_st, _ = states["compact"]
    replay_st, _ = states["replay"]
    assert (compact_st.pending[slots.long()] > 0).all(), "compact should have accepted tokens pending"
    assert (replay_st.cursor[slots.long()] > 0).all(), "replay should have history pending"
    want = native_st.export_checkpoint(slots)
    compact = compact_st.export_checkpoint(slots)
    replay = replay_st.export_checkpoint(slots)
    assert torch.equal(compact.ssm.view(torch.uint8), want.ssm.view(torch.uint8))
    for ckpt in (compact, replay):
        assert torch.equal(ckpt.conv.view(torch.uint8), want.conv.view(torch.uint8))
    torch.testing.assert_close(replay.ssm, want.ssm, rtol=1e-5, atol=1e-6)
    # what the request continues from: its pending history folded in place
    st = replay_st
    buffers = ReplayBuffers(st.ssm, st.hist_k, st.hist_u, st.hist_g, st.cursor, st.parity)
    ops.replay_fold(buffers, slots, backend=st.backend)
    assert torch.equal(replay.ssm.view(torch.uint8), st.ssm[:, slots.long()].view(torch.uint8))


@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_teeth_the_pending_tokens_matter(algo):
    """Teeth: the stored canonical SSM without the pending tokens is not the state (the comparison above would
    catch an export that skipped them)."""
    states = _states(algo)
    native_st, slots = states["native"]
    want = native_st.export_checkpoint(slots).ssm
    for mode in ("compact", "replay"):
        raw = states[mode][0].ssm[:, slots.long()]
        assert (raw - want).abs().max() > 1e-3, f"{mode}: pending tokens made no difference"
