"""lightllm.tools.measure_acceptance: its own count of drafts and accepted drafts equals the engine's stats for the
same prompts (greedy, MTP 2), on a trained toy checkpoint and on a random one; the table and means follow the counts."""

from __future__ import annotations

import pytest

from lightllm import LLM, SamplingParams
from lightllm.tools.make_tiny_model import tiny_model_dir
from lightllm.tools.measure_acceptance import AcceptanceCounts, heldout_prompts, main, measure_acceptance
from unit_tests.helpers.demo_toy import toy_demo_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW = 23


def _checkpoint(name: str) -> str:
    return str(toy_demo_checkpoint()[0]) if name == "trained" else str(tiny_model_dir("qwen3_5"))


def _prompts(model_dir: str) -> list[list[int]]:
    from tokenizers import Tokenizer

    return heldout_prompts(Tokenizer.from_file(f"{model_dir}/tokenizer.json"), 4, 19)


@pytest.mark.parametrize("name", ["trained", "random"])
def test_counts_equal_the_engine_stats(name):
    model_dir = _checkpoint(name)
    prompts = _prompts(model_dir)
    counts = measure_acceptance(model_dir, mtp_step=2, max_new_tokens=MAX_NEW, prompts=prompts)
    with LLM(model_dir, device="cpu", data_type="float32", mtp_step=2, max_total_token_num=1024) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
        stats = llm.engine.stats
    assert counts.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in outs)
    assert counts.num_windows == stats.num_spec_windows > 0
    assert counts.num_draft_tokens == stats.num_draft_tokens
    assert counts.num_accepted_draft_tokens == stats.num_accepted_draft_tokens
    assert counts.accepted_length_counts == list(stats.accepted_length_counts)
    # the count is not a tautology: fewer tokens give fewer windows
    shorter = measure_acceptance(model_dir, mtp_step=2, max_new_tokens=MAX_NEW - 9, prompts=prompts)
    assert shorter.num_windows < stats.num_spec_windows


def test_record_table_and_means_from_known_windows():
    counts = AcceptanceCounts(2)
    # windows accepting 0, 1, 2, 2 drafts, one window at the length limit with one draft accepted, one with none
    for num_drafts, accepted in [(2, 0), (2, 1), (2, 2), (2, 2), (1, 1), (0, 0)]:
        counts.record(num_drafts, accepted)
    assert counts.num_windows == 5 and counts.num_draft_tokens == 9 and counts.num_accepted_draft_tokens == 6
    assert counts.proposed_at == [5, 4] and counts.reached_at == [5, 3] and counts.accepted_at == [4, 2]
    assert counts.accepted_length_counts == [1, 2, 2]
    assert counts.mean_accepted_length == pytest.approx(1 + 6 / 5)
    assert counts.rate_at(0) == pytest.approx(0.8) and counts.rate_at(1) == pytest.approx(2 / 3)
    table = counts.table()
    assert "| 1 | 5 | 5 | 4 | 0.800 | 0.800 |" in table and "| 2 | 4 | 3 | 2 | 0.667 | 0.400 |" in table
    assert table.endswith("mean accepted length at MTP 2: 2.200")


def test_cli_prints_the_table(capsys, tmp_path):
    model_dir = _checkpoint("trained")
    out = tmp_path / "counts.json"
    main(
        ["--model_dir", model_dir, "--device", "cpu", "--num_prompts", "2", "--max_new_tokens", "6", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert "| draft position |" in text and "mean accepted length at MTP 2:" in text
    assert '"num_prompts": 2' in out.read_text()


def test_rejects_a_zero_mtp_step():
    with pytest.raises(ValueError, match="mtp_step must be >= 1"):
        measure_acceptance(_checkpoint("random"), mtp_step=0, prompts=[[1, 2, 3]])
