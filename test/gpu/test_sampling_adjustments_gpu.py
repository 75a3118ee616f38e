"""logit_bias, min_tokens, allowed_token_ids and bad words on CUDA: through the fixed buffers' CUDA graphs with overlap scheduling (a biased
row's overlapped draw runs the sampler on the device; MTP windows are verified on the host) the engine gives the
tokens and finish reasons of eager synchronous steps on the same GPU, in every state mode, plain and with MTP 2
(`unit_tests/models/test_logit_bias_engine.py`, `test_min_tokens_engine.py` and `test_bad_words_engine.py` are the
CPU suites against transformers, with the twins)."""

from __future__ import annotations

import pytest
import torch

from unit_tests.models import test_bad_words_engine as rules_suite
from unit_tests.models import test_logit_bias_engine as bias_suite
from unit_tests.models import test_min_tokens_engine as min_suite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES = [("native", 0), ("replay", 0), ("native", 2), ("compact", 2), ("replay", 2)]


@pytest.mark.parametrize("mode, mtp_step", MODES)
def test_logit_bias_in_graphs_equals_eager(mode, mtp_step):
    bias, expected, *_ = bias_suite.reference.__wrapped__()
    graphs = bias_suite.run(mode, mtp_step, bias, device="cuda", graphs=True)
    eager = bias_suite.run(mode, mtp_step, bias, device="cuda", graphs=False)
    assert graphs == eager
    assert graphs["biased"] != bias_suite.run(mode, mtp_step, {}, device="cuda", graphs=False)["biased"]


@pytest.mark.parametrize("mode, mtp_step", MODES)
def test_min_tokens_in_graphs_equals_eager(mode, mtp_step):
    stops, *_ = min_suite.reference.__wrapped__()
    graphs = min_suite.run(mode, mtp_step, stops, min_suite.MIN_TOKENS, device="cuda", graphs=True)
    eager = min_suite.run(mode, mtp_step, stops, min_suite.MIN_TOKENS, device="cuda", graphs=False)
    assert graphs == eager and len(graphs[0]["held"]) > min_suite.MIN_TOKENS


@pytest.mark.parametrize("mode, mtp_step", MODES)
def test_allowed_ids_and_bad_words_in_graphs_equal_eager(mode, mtp_step):
    allowed, bad, _, unrestricted = rules_suite.reference.__wrapped__()
    graphs = rules_suite.run(mode, mtp_step, allowed, bad, graphs=True, device="cuda")
    eager = rules_suite.run(mode, mtp_step, allowed, bad, graphs=False, device="cuda")
    assert graphs == eager
    assert set(graphs["limited"]) <= set(allowed) and graphs["banned"] != unrestricted["banned"]
