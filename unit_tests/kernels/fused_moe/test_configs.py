"""get_config: tuned table entries by (shape, dtype, device, Triton version) and batch bucket, else the heuristic."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from lightllm.kernels.fused_moe import configs
from lightllm.kernels.fused_moe.configs import batch_bucket, check_config, get_config, heuristic_config, shape_key

TUNED = {
    "BLOCK_M": 32,
    "gate_up": {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    "down": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
}


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs._table.cache_clear()
    configs.get_config.cache_clear()
    yield tmp_path
    configs._table.cache_clear()
    configs.get_config.cache_clear()


def write_table(path, version: str, key: str, buckets: dict) -> None:
    (path / "cpu.json").write_text(json.dumps({version: {key: buckets}}))


def test_batch_bucket():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 64, 65, 300)] == [1, 1, 2, 4, 64, 128, 512]


@pytest.mark.parametrize("num_tokens", [1, 37, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True])
def test_heuristic_configs_are_valid(num_tokens, dtype, fp8):
    config = check_config(heuristic_config(num_tokens, 256, 512, 2048, 8, dtype, fp8))
    assert config["gate_up"]["BLOCK_N"] <= 128 and config["down"]["BLOCK_K"] <= 512


def test_prefill_batches_take_tall_blocks_and_fp8_the_narrower_tiles():
    """Past `PREFILL_ROWS_PER_EXPERT` rows per expert the heuristic takes 128-row blocks; block-FP8 experts get
    narrower column tiles than bf16 ones (the wide ones spill with FP8's scaled steps); below it nothing depends
    on FP8. Tiles stay within tiny matrices."""
    rows = configs.PREFILL_ROWS_PER_EXPERT
    tokens = (rows + 1) * 256 // 8 + 32  # just past the bound at 256 experts, top-8
    bf16 = heuristic_config(tokens, 256, 512, 2048, 8, torch.bfloat16)
    fp8 = heuristic_config(tokens, 256, 512, 2048, 8, torch.bfloat16, fp8=True)
    assert bf16["BLOCK_M"] == fp8["BLOCK_M"] == 128
    assert (bf16["gate_up"]["BLOCK_N"], bf16["down"]["BLOCK_N"]) == (128, 256)
    assert (fp8["gate_up"]["BLOCK_N"], fp8["down"]["BLOCK_N"]) == (64, 128)
    below = rows * 256 // 8
    assert heuristic_config(below, 256, 512, 2048, 8, torch.bfloat16)["BLOCK_M"] == 64
    assert heuristic_config(below, 256, 512, 2048, 8, torch.bfloat16, fp8=True) == heuristic_config(
        below, 256, 512, 2048, 8, torch.bfloat16
    )
    tiny = check_config(heuristic_config(4096, 8, 24, 32, 2, torch.float32))
    assert tiny["gate_up"]["BLOCK_N"] == 32 and tiny["down"]["BLOCK_N"] == 32 and tiny["gate_up"]["BLOCK_K"] == 32


def test_table_entry_wins_by_nearest_bucket(table_dir):
    key = shape_key(8, 24, 32, 2, torch.float32)
    other = {**TUNED, "BLOCK_M": 64}
    write_table(table_dir, triton.__version__, key, {"16": TUNED, "256": other})
    cpu = torch.device("cpu")
    assert get_config(9, 8, 24, 32, 2, torch.float32, cpu) == TUNED
    assert get_config(200, 8, 24, 32, 2, torch.float32, cpu) == other
    # another dtype or shape has no entry: the heuristic
    assert get_config(9, 8, 24, 32, 2, torch.float16, cpu) == heuristic_config(16, 8, 24, 32, 2, torch.float16)


def test_counts_far_above_the_tuned_buckets_take_the_heuristic(table_dir):
    """A table tuned up to 256 tokens serves 512 from its largest entry; a prefill of 4096 tokens (512 rows per
    expert here) takes the heuristic's row blocks instead of the decode entry's."""
    key = shape_key(8, 24, 32, 2, torch.float32)
    write_table(table_dir, triton.__version__, key, {"16": TUNED, "256": TUNED})
    cpu = torch.device("cpu")
    assert get_config(300, 8, 24, 32, 2, torch.float32, cpu) == TUNED
    prefill = get_config(4096, 8, 24, 32, 2, torch.float32, cpu)
    assert prefill == heuristic_config(4096, 8, 24, 32, 2, torch.float32) and prefill["BLOCK_M"] == 128
    assert get_config(4096, 8, 24, 32, 2, torch.float32, cpu, True) == heuristic_config(
        4096, 8, 24, 32, 2, torch.float32, fp8=True
    )


def test_other_triton_versions_are_ignored(table_dir):
    key = shape_key(8, 24, 32, 2, torch.float32)
    write_table(table_dir, "0.0.0", key, {"16": TUNED})
    assert get_config(9, 8, 24, 32, 2, torch.float32, torch.device("cpu")) == heuristic_config(
        16, 8, 24, 32, 2, torch.float32
    )


def test_a_broken_entry_is_refused(table_dir):
    key = shape_key(8, 24, 32, 2, torch.float32)
    write_table(table_dir, triton.__version__, key, {"16": {"BLOCK_M": 16}})
    with pytest.raises(ValueError, match="gate_up/down tiles"):
        get_config(9, 8, 24, 32, 2, torch.float32, torch.device("cpu"))


def test_the_shipped_tables_hold_valid_entries_for_served_shapes():
    """Every shipped table: entries keyed by Triton version, then a shape key of a served expert shape (per rank),
    then power-of-two batch buckets, each a valid configuration (the lookup would refuse it at serving time)."""
    import re

    from lightllm.kernels.fused_moe.shapes import SERVED_SHAPES

    served = {
        shape_key(s.num_experts, s.inter, s.hidden, s.top_k, torch.bfloat16)
        for base in SERVED_SHAPES.values()
        for s in (base.sharded(tp) for tp in (1, 2, 4, 8) if base.inter % tp == 0)
    }
    tables = sorted(configs.CONFIG_DIR.glob("*.json"))
    assert tables
    for path in tables:
        for version, shapes in json.loads(path.read_text()).items():
            assert re.fullmatch(r"\d+\.\d+\.\d+", version), (path.name, version)
            for key, buckets in shapes.items():
                assert key in served, (path.name, key)
                for bucket, config in buckets.items():
                    assert int(bucket) & (int(bucket) - 1) == 0, (path.name, key, bucket)
                    check_config(config)
    # twin: a broken entry is refused by the same check
    with pytest.raises(ValueError):
        check_config({"BLOCK_M": 24, "gate_up": TUNED["gate_up"], "down": TUNED["down"]})
