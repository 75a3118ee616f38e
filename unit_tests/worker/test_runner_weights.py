"""Where the runner's weights come from (`RunnerConfig.load_format`, `quantization`, set by --load_format and
--quantization): random weights from config.json alone, served over HTTP from a folder without weight files;
an unquantized checkpoint quantized to block FP8 while it loads."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from lightllm.models.layers.quantized_linear import Fp8Weight
from lightllm.tools.make_tiny_model import tiny_model_dir
from unit_tests.models.drive import make_runner, prefill
from unit_tests.server.live_server import LiveServer

REAL_RUNNER = "lightllm.server.runner_factory:create_runner"
PROMPT = [5, 9, 31, 7, 2, 44, 8]


@pytest.fixture(scope="module")
def weightless_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("weightless")
    for path in tiny_model_dir("qwen3_5_moe").iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    return folder


def _completion(server: LiveServer) -> list[str]:
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert all(v == v and abs(v) != float("inf") for v in choice["logprobs"]["token_logprobs"])
    return choice["logprobs"]["tokens"]


def test_load_format_dummy_serves_a_folder_without_weights(weightless_dir):
    flags = dict(model_dir=str(weightless_dir), device="cpu", max_running_requests=2, max_total_token_num=256)
    tokens = []
    for _ in range(2):
        server = LiveServer(REAL_RUNNER, load_format="dummy", **flags)
        try:
            tokens.append(_completion(server))
        finally:
            server.close()
    # deterministic: drawn from the config by tensor name, the same on every start
    assert tokens[0] == tokens[1] and len(tokens[0]) == 5


def test_quantization_fp8_quantizes_an_unquantized_checkpoint_while_loading():
    model_dir = str(tiny_model_dir("qwen3_next"))
    plain = make_runner(model_dir)
    fp8 = make_runner(model_dir, quantization="fp8")
    assert not any(isinstance(m, Fp8Weight) for m in plain.model.modules())
    assert sum(isinstance(m, Fp8Weight) for m in fp8.model.modules()) > 0
    logits = [prefill(r, r.add_request(), PROMPT) for r in (plain, fp8)]
    rel = (logits[1] - logits[0]).norm() / logits[0].norm()
    # block FP8 keeps the logits close (e4m3: ~3 significant bits per weight, scaled per 128 x 128 block) ...
    assert rel < 0.1
    # ... but not equal: the weights really are quantized
    assert not torch.equal(logits[0], logits[1])
