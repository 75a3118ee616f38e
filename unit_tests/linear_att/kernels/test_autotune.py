"""autotune: key format, JSON round trip, lookup (exact, nearest width / replay_capacity / heads, default), each
algorithm's own table, pinning a configuration by argument. CPU only, no kernels."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lightllm.linear_att import autotune, tuning
from lightllm.linear_att.autotune import ConfigTable, KernelConfig, TuneKey, make_key
from lightllm.linear_att.gdn.algorithm import GDN
from lightllm.linear_att.kernels import launch
from lightllm.linear_att.registry import ALGORITHMS


def _key(family="serial", width=4, replay_capacity=0, projection="", state_dtype=torch.float32, gpu="NVIDIA H200"):
    return TuneKey(
        family,
        gpu,
        "3.6.0",
        autotune.dtype_name(state_dtype),
        "bfloat16",
        16,
        32,
        128,
        128,
        1,
        width,
        replay_capacity,
        projection,
    )


def test_key_string_round_trip_names_every_field():
    key = _key("replay", 4, 16, "precompute")
    text = key.to_str()
    for part in (
        "family=replay",
        "gpu=NVIDIA H200",
        "triton=3.6.0",
        "state_dtype=float32",
        "act_dtype=bfloat16",
        "num_k_heads=16",
        "num_v_heads=32",
        "head_k_dim=128",
        "head_v_dim=128",
        "gate_dim=1",
        "width=4",
        "replay_capacity=16",
        "projection=precompute",
    ):
        assert part in text
    assert TuneKey.from_str(text) == key


def test_make_key_on_cpu_and_unknown_family():
    key = make_key("replay", "cpu", torch.float32, torch.float16, 2, 4, 16, 16, 16, 2, 8, "inline")
    assert key.gpu == "cpu" and key.state_dtype == "float32" and key.act_dtype == "float16"
    assert key.triton == autotune.triton_version()
    with pytest.raises(ValueError, match="unknown kernel family"):
        make_key("nope", "cpu", torch.float32, torch.float32, 1, 1, 16, 16, 1, 1)


def test_table_json_round_trip(tmp_path):
    table = ConfigTable()
    table.put(_key(), KernelConfig(16, 2, 1))
    table.put(_key("replay", 4, 16, "inline"), KernelConfig(32, 4, 2))
    path = tmp_path / "tables" / "h200.json"
    table.save(path, extra={_key().to_str(): {"us": 12.5}})
    data = json.loads(path.read_text())
    assert data["version"] == autotune.TABLE_VERSION
    assert data["entries"][_key().to_str()] == {"block_v": 16, "num_warps": 2, "num_stages": 1, "us": 12.5}
    loaded = ConfigTable.load(path)
    assert loaded.entries == table.entries
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        ConfigTable.load(path)


def test_lookup_exact_then_nearest_width_then_default():
    table = ConfigTable()
    table.put(_key(width=1), KernelConfig(8, 1, 1))
    table.put(_key(width=4), KernelConfig(32, 4, 2))
    assert table.lookup(_key(width=4)) == KernelConfig(32, 4, 2)
    assert table.lookup(_key(width=3)) == KernelConfig(32, 4, 2)
    assert table.lookup(_key(width=2)) == KernelConfig(8, 1, 1)  # width 1 is nearer than width 4
    # another dtype, GPU or family never borrows an entry
    assert table.lookup(_key(width=4, state_dtype=torch.bfloat16)) == autotune.default_config(_key(width=4))
    assert table.lookup(_key(width=4, gpu="NVIDIA B200")) == autotune.default_config(_key(gpu="NVIDIA B200"))
    # a later put is seen by lookups that were already resolved
    table.put(_key(width=3), KernelConfig(64, 8, 3))
    assert table.lookup(_key(width=3)) == KernelConfig(64, 8, 3)


def test_lookup_borrows_across_head_counts_only_when_the_shape_has_no_entry():
    def heads(key, num_k_heads, num_v_heads):
        return dataclasses.replace(key, num_k_heads=num_k_heads, num_v_heads=num_v_heads)

    table = ConfigTable()
    table.put(_key(width=1), KernelConfig(64, 2, 1))  # 16 key / 32 value heads (Qwen3-Next TP1)
    table.put(_key(width=4), KernelConfig(32, 2, 1))
    table.put(heads(_key(width=4), 16, 64), KernelConfig(64, 4, 1))  # 64 value heads (Qwen3.5 TP1), W = 4 only
    # exact entries win; another head count borrows the nearest width of the nearest heads
    assert table.lookup(heads(_key(width=4), 16, 64)) == KernelConfig(64, 4, 1)
    assert table.lookup(heads(_key(width=1), 16, 64)) == KernelConfig(64, 2, 1)  # W = 1 exists only at 32 heads
    assert table.lookup(heads(_key(width=4), 8, 16)) == KernelConfig(32, 2, 1)  # nearer to 32 value heads than 64
    # the shape's own entries stay first at a width neither has exactly
    assert table.lookup(_key(width=3)) == KernelConfig(32, 2, 1)
    # replay decode never borrows a window tile, whatever the heads
    table.put(heads(_key("replay", 4, 16, "inline"), 16, 64), KernelConfig(64, 2, 1))
    w1 = heads(_key("replay", 1, 16, "inline"), 16, 64)
    assert table.lookup(w1) == autotune.default_config(w1)
    # head dims, gate width and dtypes must match
    other_dims = dataclasses.replace(_key(width=1), head_k_dim=64)
    assert table.lookup(other_dims) == autotune.default_config(other_dims)
    kda = dataclasses.replace(_key(width=1), gate_dim=128)
    assert table.lookup(kda) == autotune.default_config(kda)


def test_default_on_the_interpreter_tiles_v():
    key = make_key("serial", "cpu", torch.float32, torch.float32, 1, 1, 16, 16, 1, 1)
    assert autotune.default_config(key).block_v == 8
    gpu = _key()
    for family in autotune.FAMILIES:
        cfg = autotune.default_config(TuneKey(**{**gpu.__dict__, "family": family}))
        assert cfg.block_v >= 16 and cfg.num_warps >= 1


def test_a_pinned_config_is_an_argument_and_leaves_the_table_alone():
    key = make_key("serial", "cpu", torch.float32, torch.float32, 1, 1, 16, 16, 1, 1)
    shape = (torch.float32, torch.float32, 1, 1, 16, 16, 1, 1, "cpu")
    entries = dict(GDN.table.entries)
    before = launch.serial_config(None, GDN, *shape)
    assert before == GDN.lookup(key)
    pinned = KernelConfig(16, 1, 1)
    assert pinned != before
    assert launch.serial_config(pinned, GDN, *shape) == pinned
    assert launch.serial_config(None, GDN, *shape) == before
    assert GDN.table.entries == entries


def test_add_tables_merges_files_into_one_algorithms_table(tmp_path):
    key = make_key("replay_fold", "cpu", torch.float32, torch.float32, 1, 2, 16, 16, 1, 0, 8)
    table = ConfigTable()
    table.put(key, KernelConfig(4, 1, 1))
    path = tmp_path / "t.json"
    table.save(path)
    algo = dataclasses.replace(GDN)  # a descriptor of its own: its table starts from the shipped files
    assert algo.lookup(key) != KernelConfig(4, 1, 1)
    algo.add_tables([path])
    assert algo.lookup(key) == KernelConfig(4, 1, 1)
    assert GDN.lookup(key) != KernelConfig(4, 1, 1), "adding to one descriptor's table changed another's"


def test_candidates_respect_tensor_core_minimum():
    assert all(c.block_v >= 16 for c in autotune.candidates("replay"))
    assert any(c.block_v == 8 for c in autotune.candidates("serial"))


def test_tune_plumbing_on_the_interpreter(tmp_path):
    """The search runs every family on scratch buffers and returns one entry per key (one candidate here)."""
    case = tuning.TuneCase("gdn", 1, 2, 16, 16, torch.float32, torch.float32, width=2, replay_capacity=4)
    table, extra = tuning.tune([case], num_rows=2, device="cpu", log=lambda _: None, configs=[KernelConfig(16, 1, 1)])
    families = sorted(TuneKey.from_str(k).family + TuneKey.from_str(k).projection for k in table.entries)
    assert families == ["compact", "replay_fold", "replayinline", "replayprecompute", "serial"]
    assert all(info["us"] > 0 for info in extra.values())
    # compact mode verifies windows of 2 or more: a W = 1 case has no compact entry
    plain, _ = tuning.tune(
        [dataclasses.replace(case, width=1)],
        num_rows=2,
        device="cpu",
        log=lambda _: None,
        configs=[KernelConfig(16, 1, 1)],
    )
    assert "compact" not in {TuneKey.from_str(k).family for k in plain.entries} and plain.entries
    table.save(tmp_path / "t.json", extra)
    assert ConfigTable.load(tmp_path / "t.json").entries == table.entries


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_first_lookup_reads_the_shipped_tables(name):
    """A process that never loads a table (the server, the GPU checks) still launches with the tuned tiles: each
    algorithm reads its own shipped files on its first lookup, and a launch without an algorithm finds the one of
    its gate width."""
    import json

    path = ALGORITHMS[name].tuned_tables()[0]
    key_str, entry = next(iter(json.loads(path.read_text())["entries"].items()))
    key = TuneKey.from_str(key_str)
    fresh = dataclasses.replace(ALGORITHMS[name])
    assert fresh.lookup(key) == KernelConfig.from_dict(entry)
    assert launch.tuned(None, None, key.gate_dim, key.head_k_dim, key) == KernelConfig.from_dict(entry)
    # a pinned config wins over the table's entry, whichever comes first, and leaves the entry in place
    pinned = KernelConfig(8, 1, 1)
    assert pinned != KernelConfig.from_dict(entry)
    fresh = dataclasses.replace(ALGORITHMS[name])
    assert launch.tuned(pinned, fresh, key.gate_dim, key.head_k_dim, key) == pinned
    assert fresh.lookup(key) == KernelConfig.from_dict(entry)


def test_replay_window_widths_never_borrow_the_decode_tile():
    """W = 2 is nearer to W = 1 than to W = 4, but the replay decode (W = 1) is another kernel."""
    table = ConfigTable()
    args = ("cpu", torch.float32, torch.float32, 1, 2, 16, 16, 1)
    table.put(make_key("replay", *args, 1, 16, "precompute"), KernelConfig(64, 2, 1))
    table.put(make_key("replay", *args, 4, 16, "precompute"), KernelConfig(32, 4, 1))
    assert table.lookup(make_key("replay", *args, 2, 16, "precompute")) == KernelConfig(32, 4, 1)
    assert table.lookup(make_key("replay", *args, 1, 8, "precompute")) == KernelConfig(64, 2, 1)
    # the serial family is one kernel at every width: the nearest width wins
    table.put(make_key("serial", *args, 1), KernelConfig(64, 2, 1))
    table.put(make_key("serial", *args, 4), KernelConfig(32, 2, 1))
    assert table.lookup(make_key("serial", *args, 2)) == KernelConfig(64, 2, 1)


def test_compact_has_its_own_tile_and_borrows_natives_where_it_has_none():
    """Compact's tile is its own entry at its width; without one it is native's (the serial lookup, nearest width
    and all), never another width's compact tile; the launch wrapper asks for the family of its mode."""
    table = ConfigTable()
    args = ("cpu", torch.float32, torch.float32, 1, 2, 16, 16, 1)
    table.put(make_key("serial", *args, 2), KernelConfig(32, 2, 1))
    table.put(make_key("serial", *args, 4), KernelConfig(16, 1, 1))
    assert table.lookup(make_key("compact", *args, 4)) == KernelConfig(16, 1, 1)
    table.put(make_key("compact", *args, 4), KernelConfig(64, 4, 1))
    assert table.lookup(make_key("compact", *args, 4)) == KernelConfig(64, 4, 1)
    assert table.lookup(make_key("serial", *args, 4)) == KernelConfig(16, 1, 1), "native took compact's tile"
    assert table.lookup(make_key("compact", *args, 2)) == KernelConfig(32, 2, 1), "borrowed another width's"
    assert table.lookup(make_key("compact", *args, 3)) == KernelConfig(32, 2, 1)  # serial's nearest width
    algo = dataclasses.replace(GDN)
    algo.table.entries.clear()
    algo.table.update(table)
    shape = (torch.float32, torch.float32, 1, 2, 16, 16, 1, 4, "cpu")
    assert launch.serial_config(None, algo, *shape) == KernelConfig(16, 1, 1)
    assert launch.serial_config(None, algo, *shape, compact=True) == KernelConfig(64, 4, 1)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sweep_times_and_keys_entries_by_the_state_dtype_it_ran(state_dtype):
    """`test/benchmark/sweep_linear_att.py` (what fills the shipped tables) times the replay window at the state dtype
    asked for and keys the entry by it (tiny GDN shape on the interpreter; one config, one row pair)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "test", "benchmark"))
    import bench_linear_att as bench
    import sweep_linear_att as sweep

    cpu = torch.device("cpu")
    config = KernelConfig(8, 1, 1)
    key, times = sweep.sweep_cell(
        bench.TINY["tiny-gdn"],
        2,
        2,
        "replay",
        [config],
        4,
        cpu,
        bench.Timer(cpu, reps=1),
        lambda _: None,
        "inline",
        state_dtype,
    )
    assert key.state_dtype == autotune.dtype_name(state_dtype)
    assert (key.family, key.width, key.replay_capacity, key.projection, key.gpu) == ("replay", 2, 4, "inline", "cpu")
    assert list(times) == [config] and times[config] > 0


@pytest.mark.parametrize("family", ["serial", "compact", "replay"])
def test_sweep_times_every_config_of_a_family(family):
    """A sweep cell times each candidate it is given, not only the first (tiny KDA shape on the interpreter, W = 2,
    two rows, two configs); the key is the family's own."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "test", "benchmark"))
    import bench_linear_att as bench
    import sweep_linear_att as sweep

    cpu = torch.device("cpu")
    configs = [KernelConfig(8, 1, 1), KernelConfig(16, 2, 1)]
    errors = []
    key, times = sweep.sweep_cell(
        bench.TINY["tiny-kda"],
        2,
        2,
        family,
        configs,
        4,
        cpu,
        bench.Timer(cpu, reps=1),
        errors.append,
        "inline",
        torch.float32,
    )
    assert key.family == family and key.width == 2
    assert [line for line in errors if "Error" in line] == []
    assert list(times) == configs and all(t > 0 for t in times.values())


def test_sweep_saves_merge_into_the_existing_table(tmp_path):
    """A sweep saves after every shape: a retimed entry replaces the old one, every other entry (and its note)
    stays, and saving the same sweep again changes nothing."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "test", "benchmark"))
    import sweep_linear_att as sweep

    args = ("cpu", torch.float32, torch.bfloat16, 16, 32, 128, 128, 1)
    kept, retimed = make_key("serial", *args, 1), make_key("replay", *args, 4, 16, "inline")
    old = ConfigTable()
    old.put(kept, KernelConfig(32, 4, 1))
    old.put(retimed, KernelConfig(32, 2, 1))
    old.save(tmp_path / "gdn" / "tuned" / "h200.json", {kept.to_str(): {"us": 12.5, "rows": 256}})
    new = {"gdn": ConfigTable(), "kda": ConfigTable()}
    new["gdn"].put(retimed, KernelConfig(64, 2, 1))
    notes = {"gdn": {retimed.to_str(): {"us": 7.25, "rows": 128}}, "kda": {}}
    for _ in range(2):
        sweep.save_tables(new, notes, str(tmp_path))
        saved = ConfigTable.load(tmp_path / "gdn" / "tuned" / "h200.json")
        assert saved.get(kept) == KernelConfig(32, 4, 1) and saved.get(retimed) == KernelConfig(64, 2, 1)
    raw = json.loads((tmp_path / "gdn" / "tuned" / "h200.json").read_text())["entries"]
    assert raw[kept.to_str()]["us"] == 12.5 and raw[retimed.to_str()]["us"] == 7.25
    assert not (tmp_path / "kda").exists()  # nothing timed for KDA: no table written


def test_a_batch_too_small_for_the_gpu_gets_a_narrower_v_tile():
    """The tuned V tile is halved while the launch would fill at most half of the multiprocessors (132 on an
    H200): one row of 32 value heads goes from 64 to 32 columns, two rows keep 64; a lone small head goes to the
    floor of 16; no multiprocessor count (CPU) or a full grid keeps the tuned tile, capped at V."""
    from lightllm.linear_att.kernels.launch import filled_block_v

    assert filled_block_v(64, 128, 1 * 32, 132) == 32
    assert filled_block_v(64, 128, 2 * 32, 132) == 64
    assert filled_block_v(64, 128, 1 * 64, 132) == 64
    assert filled_block_v(64, 128, 1 * 4, 132) == 16
    assert filled_block_v(64, 128, 1 * 32, 0) == 64
    assert filled_block_v(128, 64, 1, 0) == 64


def test_sweep_configs_take_an_optional_stage_count():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "test", "benchmark"))
    import sweep_linear_att as sweep

    assert sweep.parse_configs("64x2,32x4x2") == [KernelConfig(64, 2, 1), KernelConfig(32, 4, 2)]
    with pytest.raises(ValueError, match="BVxWARPS"):
        sweep.parse_configs("64")
