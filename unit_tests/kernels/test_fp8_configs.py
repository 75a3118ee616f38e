"""lightllm.kernels.fp8.configs: tuned table entries by (N, K, block, device, Triton version) and M bucket within one
power of two (or above every tuned bucket), else the heuristic; the warm-up's token counts cover every
configuration a token count can get."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from lightllm.kernels.fp8 import configs
from lightllm.kernels.fp8.configs import check_config, get_config, heuristic_config, shape_key, warmup_token_counts
from lightllm.kernels.tuned_tables import nearest_entry, write_entries

CPU = torch.device("cpu")
BLOCK = (128, 128)
TALL = {"BLOCK_M": 64, "BLOCK_N": 128, "GROUP_M": 16, "num_warps": 4, "num_stages": 4, "TMA": True}
WIDE = {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "TMA": False}


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs._table.cache_clear()
    configs.get_config.cache_clear()
    yield tmp_path
    configs._table.cache_clear()
    configs.get_config.cache_clear()


def test_tuned_buckets_apply_within_one_power_of_two_and_above(table_dir):
    write_entries(table_dir / "cpu.json", shape_key(2048, 4096, BLOCK), {4096: TALL, 8192: WIDE})
    assert get_config(4096, 2048, 4096, BLOCK, CPU) == TALL
    # 2049..4096 tokens share the 4096 bucket; 1025..2048 are one power of two below it
    assert get_config(1500, 2048, 4096, BLOCK, CPU) == TALL
    assert get_config(6000, 2048, 4096, BLOCK, CPU) == WIDE
    # above every tuned bucket: the largest tuned one
    assert get_config(100_000, 2048, 4096, BLOCK, CPU) == WIDE
    # decode sizes, another shape or another block: the heuristic (twin of the lookups above)
    assert get_config(64, 2048, 4096, BLOCK, CPU) == heuristic_config(64, BLOCK)
    assert get_config(4096, 2048, 2048, BLOCK, CPU) == heuristic_config(4096, BLOCK)
    assert get_config(4096, 2048, 4096, (64, 64), CPU) == heuristic_config(4096, (64, 64))


def test_an_untuned_n_borrows_the_nearest_tuned_n_of_its_k_and_block(table_dir):
    """A fused q|k|v (9216 = 8192 + 2 x 512) or a qkvz without its unquantized b|a (12288 beside a tuned 12352)
    takes the nearest tuned N's entries; N more than 2^0.5 away, another K, another block or N that is not whole
    blocks keeps the heuristic."""
    write_entries(table_dir / "cpu.json", shape_key(8192, 2048, BLOCK), {4096: TALL})
    write_entries(table_dir / "cpu.json", shape_key(12352, 2048, BLOCK), {4096: WIDE})
    write_entries(table_dir / "cpu.json", shape_key(8192, 4096, BLOCK), {4096: WIDE})
    assert get_config(4096, 9216, 2048, BLOCK, CPU) == TALL
    assert get_config(4096, 12288, 2048, BLOCK, CPU) == WIDE
    # 8192 * 2^0.5 = 11585: 11520 is nearer 12352 (and within its gap), 5632 is beyond 8192's
    assert get_config(4096, 11520, 2048, BLOCK, CPU) == WIDE
    assert get_config(4096, 5632, 2048, BLOCK, CPU) == heuristic_config(4096, BLOCK)
    assert get_config(4096, 9216, 1024, BLOCK, CPU) == heuristic_config(4096, BLOCK)
    assert get_config(4096, 9216, 2048, (64, 64), CPU) == heuristic_config(4096, (64, 64))
    assert get_config(4096, 9200, 2048, BLOCK, CPU) == heuristic_config(4096, BLOCK)


def test_other_triton_versions_are_ignored(table_dir):
    (table_dir / "cpu.json").write_text(json.dumps({"0.0.0": {shape_key(2048, 4096, BLOCK): {"4096": TALL}}}))
    assert get_config(4096, 2048, 4096, BLOCK, CPU) == heuristic_config(4096, BLOCK)


def test_a_broken_entry_is_refused(table_dir):
    write_entries(table_dir / "cpu.json", shape_key(2048, 4096, BLOCK), {4096: {"BLOCK_M": 64}})
    with pytest.raises(ValueError, match="needs exactly"):
        get_config(4096, 2048, 4096, BLOCK, CPU)


def test_write_entries_merges_buckets_keys_and_versions(tmp_path):
    path = tmp_path / "sub" / "dev.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"0.0.0": {"old": {"1": TALL}}}))
    write_entries(path, "a", {4096: TALL})
    write_entries(path, "a", {8192: WIDE})
    write_entries(path, "b", {1: WIDE})
    write_entries(path, "a", {4096: WIDE})
    table = json.loads(path.read_text())
    assert table["0.0.0"] == {"old": {"1": TALL}}
    assert table[triton.__version__] == {"a": {"4096": WIDE, "8192": WIDE}, "b": {"1": WIDE}}


def test_nearest_entry_rules():
    entries = {"16": "a", "64": "b"}
    assert nearest_entry(entries, 16) == "a" and nearest_entry(entries, 33) == "b"
    # a tie between 16 and 64 (32 tokens) takes the smaller bucket
    assert nearest_entry(entries, 32) == "a"
    assert nearest_entry(entries, 2, max_log2_gap=1) is None and nearest_entry(entries, 2) == "a"
    assert nearest_entry(entries, 10_000, max_log2_gap=1) == "b"
    assert nearest_entry({}, 5) is None


def test_warmup_counts_meet_every_configuration(table_dir):
    write_entries(table_dir / "cpu.json", shape_key(2048, 4096, BLOCK), {4096: TALL, 8192: WIDE})
    counts = warmup_token_counts(2048, 4096, BLOCK, CPU)
    warmed = [get_config(t, 2048, 4096, BLOCK, CPU) for t in counts]
    served = {
        json.dumps(get_config(t, 2048, 4096, BLOCK, CPU), sort_keys=True)
        for t in [*range(1, 300), *range(300, 40_000, 97)]
    }
    assert served == {json.dumps(c, sort_keys=True) for c in warmed}
    assert counts == (1, 17, 65, 1025, 4097) and TALL in warmed and WIDE in warmed


@pytest.mark.parametrize("m", [1, 16, 17, 64, 65, 4096])
def test_heuristic_configs_are_valid(m):
    config = check_config(heuristic_config(m, BLOCK))
    assert config["BLOCK_N"] <= BLOCK[0] and (config["BLOCK_M"] == 128) == (m > 64)
