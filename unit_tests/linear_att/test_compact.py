"""Compact mode (`CompactState`, `ops.compact_verify` / `ops.compact_commit`) equals native mode bitwise."""

from __future__ import annotations

import pytest
import torch

from unit_tests.linear_att import scenarios as sc


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_state", "bf16_state"])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.float16], ids=["fp32_act", "fp16_act"])
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_compact_equals_native_bitwise(algo, act_dtype, state_dtype):
    spec = sc.make_spec(algo, ratio=2, num_layers=2)
    params = sc.make_params(spec, seed=4)
    streams = sc.make_streams(spec, 3, 200, seed=5)
    runs, states = {}, {}
    for mode in ("native", "compact"):
        st = sc.make_state(spec, mode, max_width=4, state_dtype=state_dtype, act_dtype=act_dtype)
        runs[mode], slots = sc.run_mtp(
            st, spec, params, streams, prompt_lens=[7, 1, 12], num_rounds=20, max_width=4, act_dtype=act_dtype
        )
        states[mode] = st.export_checkpoint(torch.tensor(slots, dtype=torch.int32))
    for layer in range(spec.num_layers):
        for req in range(3):
            assert torch.equal(runs["native"].stacked(layer, req), runs["compact"].stacked(layer, req)), (
                f"outputs differ: layer {layer} request {req}"
            )
    assert torch.equal(states["native"].ssm, states["compact"].ssm), "canonical states differ"
    assert torch.equal(states["native"].conv, states["compact"].conv), "conv windows differ"


# lazy commit: `accept` leaves the accepted tokens pending; the next verify, a prefill chunk or export merges them
LAZY_BACKENDS = ["torch", "triton"]


def _lazy_pair(algo, backend, state_dtype=torch.bfloat16):
    """Native and compact states of one spec (grouped heads, HV/H = 2) with three prefilled requests."""
    spec = sc.make_spec(algo, num_k_heads=1, ratio=2, head_k_dim=16, head_v_dim=16, num_layers=2)
    params = sc.make_params(spec, seed=21)
    streams = sc.make_streams(spec, 3, 120, seed=22)
    pair = {}
    for mode in ("native", "compact"):
        st = sc.make_state(spec, mode, max_requests=3, max_width=4, state_dtype=state_dtype, backend=backend)
        slots = [st.alloc() for _ in range(3)]
        run = sc.new_run(spec, 3)
        sc.prefill(st, spec, params, streams, slots, [5, 1, 8], run)
        pair[mode] = (st, run)
    return spec, params, streams, slots, pair


def _lazy_round(spec, params, streams, slots, pair, r, choose_gen, seed):
    """One verify + accept round on both states with the same widths, accepted counts and fresh rejected inputs."""
    widths, accepted = sc.choose_round(choose_gen, len(slots), r, 4, "random")
    for st, run in pair.values():
        sc.verify_round(
            st, spec, params, streams, slots, widths, accepted, run, torch.Generator().manual_seed(seed + r)
        )
        sc.poison_dead(st)
    return widths, accepted


def _merge_pending(compact, spec, params, streams, slots, run):
    """Merge the pending tokens of `slots` into the live state through the public path: a prefill chunk of no
    tokens (prefill merges before the chunk kernel reads the state, all layers, and `finish_prefill` clears
    pending; no token is added)."""
    sc.prefill(compact, spec, params, streams, slots, [0] * len(slots), run)


def _native_current(native, slots) -> torch.Tensor:
    sl = torch.tensor(slots)
    return native.ssm[:, sl, native.ssm_index[sl].long()]


@pytest.mark.parametrize("backend", LAZY_BACKENDS)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_lazy_commit_settles_to_native_state_bitwise(algo, backend):
    """Many MTP rounds (random accepted counts, all-accept and accept-only-the-first rounds, padding rows): the
    outputs equal native's every round, and the state after an empty prefill chunk merged the pending tokens in
    place (every 3rd round, so most verifies merge pending tokens themselves) and the exported state (every round)
    equal native's current state byte for byte."""
    spec, params, streams, slots, pair = _lazy_pair(algo, backend)
    native, (compact, compact_run) = pair["native"][0], pair["compact"]
    choose_gen = torch.Generator().manual_seed(23)
    num_rounds = 24 if backend == "torch" else 9
    saw_pending = False
    for r in range(num_rounds):
        _lazy_round(spec, params, streams, slots, pair, r, choose_gen, seed=100)
        saw_pending |= bool((compact.pending[slots] > 0).any())
        want = _native_current(native, slots)
        exported = compact.export_checkpoint(torch.tensor(slots, dtype=torch.int32)).ssm
        assert torch.equal(exported.view(torch.uint8), want.view(torch.uint8)), f"round {r}: export != native"
        if r % 3 == 2:
            _merge_pending(compact, spec, params, streams, slots, compact_run)
            assert (compact.pending[slots] == 0).all(), "the merge left tokens pending"
            got = compact.ssm[:, slots]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"round {r}: merged state != native"
    assert saw_pending, "no round left accepted tokens pending: the lazy path was not exercised"
    runs = {mode: run for mode, (_, run) in pair.items()}
    for layer in range(spec.num_layers):
        for req in range(len(slots)):
            assert torch.equal(runs["native"].stacked(layer, req), runs["compact"].stacked(layer, req)), (
                f"outputs differ: layer {layer} request {req}"
            )


def _pending_after_rounds(algo, backend, num_rounds=3):
    """Run until every request has accepted tokens pending (an all-accept round last); returns the scenario (spec,
    params, streams), the slots and the pair."""
    spec, params, streams, slots, pair = _lazy_pair(algo, backend)
    choose_gen = torch.Generator().manual_seed(31)
    for r in range(num_rounds):
        _lazy_round(spec, params, streams, slots, pair, r, choose_gen, seed=200)
    widths = [4] * len(slots)
    for st, run in pair.values():
        gen = torch.Generator().manual_seed(300)
        sc.verify_round(st, spec, params, streams, slots, widths, [4, 2, 3], run, gen)
        sc.poison_dead(st)
    compact = pair["compact"][0]
    assert compact.pending[slots].tolist() == [4, 2, 3]
    return (spec, params, streams), slots, pair


@pytest.mark.parametrize("backend", LAZY_BACKENDS)
@pytest.mark.parametrize("algo", ["gdn", "kda"])
def test_export_with_pending_tokens_merges_into_the_copy_only(algo, backend):
    _, slots, pair = _pending_after_rounds(algo, backend)
    native, compact = pair["native"][0], pair["compact"][0]
    before = {name: t.clone() for name, t in sc.state_tensors(compact).items()}
    ckpt = compact.export_checkpoint(torch.tensor(slots, dtype=torch.int32))
    want = _native_current(native, slots)
    assert torch.equal(ckpt.ssm.view(torch.uint8), want.view(torch.uint8)), "export is not the merged state"
    assert not torch.equal(compact.ssm[:, slots].view(torch.uint8), want.view(torch.uint8)), (
        "the live state already held the merge: nothing was pending"
    )
    for name, t in sc.state_tensors(compact).items():
        assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), f"export changed {name}"


# every record on the torch path; one on the (slow) interpreter, which shares the merge helper for all of them
TEETH = [("torch", r) for r in ("win_k", "win_u", "win_g")] + [("triton", "win_u")]


@pytest.mark.parametrize(("backend", "record"), TEETH, ids=[f"{b}-{r}" for b, r in TEETH])
def test_teeth_a_perturbed_pending_record_breaks_equality(record, backend):
    """Teeth: change one element of the last pending token of one slot's current window buffer; the merged state
    (export, and the in-place merge of an empty prefill chunk) must then differ from native's."""
    scenario, slots, pair = _pending_after_rounds("kda", backend)
    native, (compact, compact_run) = pair["native"][0], pair["compact"]
    slot = slots[1]
    last = int(compact.pending[slot]) - 1
    t = getattr(compact, record)[1, slot, int(compact.parity[slot]), last]
    t.view(-1)[0] += 0.5
    want = _native_current(native, slots)
    sl = torch.tensor(slots, dtype=torch.int32)
    assert not torch.equal(compact.export_checkpoint(sl).ssm[1, 1], want[1, 1]), "export missed the perturbation"
    _merge_pending(compact, *scenario, slots, compact_run)
    assert not torch.equal(compact.ssm[1, slot], want[1, 1]), "the merge missed the perturbation"
    assert torch.equal(compact.ssm[0, slots].view(torch.uint8), want[0].view(torch.uint8)), "layer 0 was not merged"
