"""Start-up autotune of a serving shape outside the shipped tables (`startup_tune.tune_serving_shape`), on the
interpreter: it tunes exactly the keys the state's decode path looks up, on scratch (the serving state keeps its
bytes), caches them on disk per GPU and Triton version, and a later start reads the cache instead of timing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightllm.linear_att import autotune, startup_tune, tuning
from lightllm.linear_att.autotune import ConfigTable, KernelConfig, TuneKey
from lightllm.linear_att.kda.algorithm import KDA
from unit_tests.linear_att import scenarios as sc

ONE_CONFIG = [KernelConfig(8, 1, 1)]


@pytest.fixture
def fresh_kda():
    """A KDA descriptor whose table holds the shipped entries only (what a fresh process starts with); calling it
    gives another one (a later start). The tests pass it to `tune_serving_shape`, so KDA's own table is untouched."""
    return lambda: dataclasses.replace(KDA)


def _native_state(lower_bound=None, backend="triton"):
    spec = sc.make_spec(
        "kda", num_k_heads=1, ratio=2, head_k_dim=16, head_v_dim=16, num_layers=1, lower_bound=lower_bound
    )
    return sc.make_state(spec, "native", max_requests=2, max_width=2, backend=backend), spec


def test_missing_shape_is_tuned_on_scratch_cached_and_read_back(tmp_path, fresh_kda, monkeypatch):
    state, spec = _native_state()
    before = {name: t.clone() for name, t in sc.state_tensors(state).items()}
    algo = fresh_kda()
    tuned = startup_tune.tune_serving_shape(
        state, spec, cache_dir=tmp_path, progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
    )
    key = autotune.make_key("serial", "cpu", torch.float32, torch.float32, 1, 2, 16, 16, 16, 2)
    assert tuned == [key]
    assert algo.lookup(key) == ONE_CONFIG[0]
    for name, t in sc.state_tensors(state).items():
        assert torch.equal(t, before[name]), f"tuning wrote the serving state's {name}"
    path = startup_tune.cache_path(tmp_path, "cpu")
    assert path.name == f"cpu__triton-{autotune.triton_version()}.json"
    assert ConfigTable.load(path).get(key) == ONE_CONFIG[0]

    # a later start: the cache answers, nothing is timed
    later = fresh_kda()
    assert later.table.get(key) is None

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached shape was tuned again")

    monkeypatch.setattr(tuning, "tune", no_timing)
    assert startup_tune.tune_serving_shape(state, spec, cache_dir=tmp_path, progress=False, algorithm=later) == []
    assert later.table.get(key) == ONE_CONFIG[0]


def test_the_gate_lower_bound_is_part_of_the_key(tmp_path, fresh_kda):
    state, spec = _native_state()
    algo = fresh_kda()
    startup_tune.tune_serving_shape(
        state, spec, cache_dir=tmp_path, progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
    )
    bounded, bounded_spec = _native_state(lower_bound=-5.0)
    tuned = startup_tune.tune_serving_shape(
        bounded, bounded_spec, cache_dir=tmp_path, progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
    )
    assert len(tuned) == 1 and tuned[0].lower_bound == "-5.0", "the bounded gate reused the softplus gate's entry"
    assert len(ConfigTable.load(startup_tune.cache_path(tmp_path, "cpu")).entries) == 2


def test_replay_needs_its_projection_only():
    """Replay tunes the verify of its projection; its standalone fold (prefill and export only) is left to the
    table's lookup."""
    spec = sc.make_spec("gdn", num_layers=1)
    for projection in ("inline", "precompute"):
        state = sc.make_state(spec, "replay", max_width=4, replay_capacity=8, projection=projection, backend="triton")
        keys = startup_tune.needed_keys(state, spec)
        assert [(k.family, k.projection, k.width, k.replay_capacity) for k in keys] == [("replay", projection, 4, 8)]


def test_torch_path_tunes_nothing(tmp_path, fresh_kda):
    state, spec = _native_state(backend="torch")
    algo = fresh_kda()
    assert startup_tune.tune_serving_shape(state, spec, cache_dir=tmp_path, progress=False, algorithm=algo) == []
    assert not any(tmp_path.iterdir())


def test_key_string_leaves_out_an_unset_lower_bound():
    """Keys of the shipped tables (written before the field existed) parse and match; a set bound round-trips."""
    args = ("serial", "cpu", torch.float32, torch.bfloat16, 16, 32, 128, 128, 128, 4)
    plain = autotune.make_key(*args)
    assert "lower_bound" not in plain.to_str() and TuneKey.from_str(plain.to_str()) == plain
    bounded = autotune.make_key(*args, lower_bound=-5.0)
    assert "lower_bound=-5.0" in bounded.to_str() and TuneKey.from_str(bounded.to_str()) == bounded
    assert bounded != plain


def test_an_unreadable_cache_is_ignored_and_rewritten(tmp_path, fresh_kda):
    path = startup_tune.cache_path(tmp_path, "cpu")
    path.write_text("{ not json")
    state, spec = _native_state()
    tuned = startup_tune.tune_serving_shape(
        state, spec, cache_dir=tmp_path, progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=fresh_kda()
    )
    assert len(tuned) == 1 and ConfigTable.load(path).get(tuned[0]) == ONE_CONFIG[0]
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "a temporary file was left behind"


def test_compact_tunes_its_own_kernel_unless_natives_tile_is_held(tmp_path, fresh_kda):
    """Compact mode needs the compact key: a shape the tables lack entirely is tuned by timing compact's own verify;
    a shape with native's tuned entry (what an untuned compact key borrows) is not tuned again. A compact entry
    does not stand in for native's."""
    spec = sc.make_spec("kda", num_k_heads=1, ratio=2, head_k_dim=16, head_v_dim=16, num_layers=1)
    compact = sc.make_state(spec, "compact", max_requests=2, max_width=2, backend="triton")
    algo = fresh_kda()
    tuned = startup_tune.tune_serving_shape(
        compact, spec, cache_dir=tmp_path / "a", progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
    )
    assert [k.family for k in tuned] == ["compact"] and algo.table.get(tuned[0]) == ONE_CONFIG[0]
    native, _ = _native_state()
    tuned_native = startup_tune.tune_serving_shape(
        native, spec, cache_dir=tmp_path / "a", progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
    )
    assert [k.family for k in tuned_native] == ["serial"], "compact's entry stood in for native's"

    algo = fresh_kda()
    startup_tune.tune_serving_shape(
        native, spec, cache_dir=tmp_path / "b", progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
    )
    assert (
        startup_tune.tune_serving_shape(
            compact, spec, cache_dir=tmp_path / "b", progress=False, num_rows=2, configs=ONE_CONFIG, algorithm=algo
        )
        == []
    )
