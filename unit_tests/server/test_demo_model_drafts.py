"""The shipped demo model's own MTP drafts through every state mode: its head drafts well, so verify windows end at
every position (drafts rejected first, midway, and all kept) with the real head's drafts rather than scripted ones;
the greedy tokens must equal plain greedy decoding without drafts, whatever the mode (fp32 state)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.llm import LLM
from lightllm.tools.demo_model import trained_model_dir
from lightllm.tools.demo_model.corpus import heldout_documents

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 6, 40, 40


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    folder = trained_model_dir()
    assert folder is not None, "the trained demo checkpoint is part of the package (lightllm/tools/demo_model/weights)"
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("".join(d.text for d in heldout_documents())).ids
    starts = torch.randint(0, len(ids) - PROMPT_LEN, (NUM_PROMPTS,), generator=torch.Generator().manual_seed(7))
    return [ids[s : s + PROMPT_LEN] for s in starts.tolist()]


def greedy(prompts: list[list[int]], mode: str, mtp_step: int) -> tuple[list[list[int]], list[int]]:
    """(tokens per prompt, windows by accepted length) of the demo model's greedy decoding."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(ssm_state_mode=mode, mtp_step=mtp_step, data_type="float32", device="cpu") as llm:
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
        return tokens, list(llm.engine.stats.accepted_length_counts)


@pytest.fixture(scope="module")
def plain(prompts) -> list[list[int]]:
    return greedy(prompts, "native", 0)[0]


@pytest.mark.parametrize("mode,mtp_step", [("native", 2), ("compact", 2), ("replay", 3)])
def test_real_drafts_give_plain_greedy_tokens_in_every_mode(prompts, plain, mode, mtp_step):
    tokens, lengths = greedy(prompts, mode, mtp_step)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == plain
    # windows ended at every length, all drafts kept included: the accept paths ran with real drafts
    assert len(lengths) == mtp_step + 1 and all(n > 0 for n in lengths), lengths
    assert sum((k + 1) * n for k, n in enumerate(lengths)) / sum(lengths) > 1.5, lengths


def test_teeth_other_prompts_give_other_tokens(prompts, plain):
    """The comparison above can fail: the same run with one token of each prompt changed decodes otherwise."""
    changed = [[*p[:-1], (p[-1] + 1) % 3000] for p in prompts]
    assert greedy(changed, "replay", 3)[0] != plain
