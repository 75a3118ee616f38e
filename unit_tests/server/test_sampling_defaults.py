"""`--generation_config`: the sampling knobs a request leaves out take the checkpoint's generation_config.json values
(the demo model ships temperature 0.6, top_k 20, top_p 0.95), a request's own values win, `none` restores OpenAI's
defaults; a file with a value no request could ask for stops the start-up naming it. Seeded sampling through the
real engine on the CPU tells which parameters a request ran with."""

from __future__ import annotations

import json

import httpx
import pytest

from lightllm.server.args import load_server_args
from lightllm.server.llm import LLM
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.server.sampling_defaults import read_sampling_defaults
from lightllm.tools.demo_model import trained_model_dir
from unit_tests.server.live_server import LiveServer

DEMO_DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
OPENAI_DEFAULTS = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}


def _folder(tmp_path, **fields):
    folder = tmp_path / "gen"
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "eos_token_id": 1, **fields}))
    return str(folder)


def test_the_file_values_are_read_and_checked(tmp_path):
    demo = str(trained_model_dir())
    assert read_sampling_defaults("auto", demo) == DEMO_DEFAULTS
    assert read_sampling_defaults("none", demo) == {}
    # a folder without the file: nothing under auto, an error when the folder was named
    assert read_sampling_defaults("auto", str(tmp_path)) == {}
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        read_sampling_defaults(str(tmp_path), demo)
    # a word that is no folder (vLLM's "vllm") is named as such, with the accepted words
    for word in ("vllm", str(tmp_path / "absent")):
        with pytest.raises(ValueError, match=r"not a folder; give auto, none or a folder"):
            read_sampling_defaults(word, demo)
    folder = _folder(tmp_path, temperature=0.3, min_p=0.05, repetition_penalty=1.1, max_new_tokens=99)
    assert read_sampling_defaults(folder, demo) == {"temperature": 0.3, "min_p": 0.05, "repetition_penalty": 1.1}
    for bad, field in (({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"), ({"top_k": True}, "top_k")):
        with pytest.raises(ValueError, match=rf"generation_config.json: .*{field}.*--generation_config none"):
            read_sampling_defaults(_folder(tmp_path, **bad), demo)


def test_a_bad_file_refuses_the_start_with_the_way_out(tmp_path):
    folder = _folder(tmp_path, top_p=2.0)
    with pytest.raises(ValueError, match="top_p"):
        load_server_args([], device="cpu", generation_config=folder)
    _, info = load_server_args([], device="cpu", generation_config="none")
    assert info.sampling_defaults == ()


def _text(server: LiveServer, **knobs) -> str:
    body = {"model": server.model, "prompt": "def parse(", "max_tokens": 24, "seed": 11, "ignore_eos": True, **knobs}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module", params=["auto", "none"])
def server(request):
    s = LiveServer(
        runner_factory=DEFAULT_RUNNER_FACTORY,
        device="cpu",
        generation_config=request.param,
        max_running_requests=2,
        max_total_token_num=1024,
    )
    yield request.param, s
    s.close()


def test_requests_without_knobs_sample_with_the_configured_defaults(server):
    source, s = server
    defaults = DEMO_DEFAULTS if source == "auto" else OPENAI_DEFAULTS
    others = OPENAI_DEFAULTS if source == "auto" else DEMO_DEFAULTS
    plain = _text(s)
    assert plain == _text(s, **defaults)
    # the twin: the other set of parameters samples another text from the same seed
    assert plain != _text(s, **others)
    # a request's own value wins over the default
    assert _text(s, temperature=0) == _text(s, **{**defaults, "temperature": 0})


@pytest.mark.parametrize("source,expected", [("auto", DEMO_DEFAULTS), ("none", OPENAI_DEFAULTS)])
def test_the_offline_llm_defaults_to_the_same(source, expected):
    with LLM(device="cpu", generation_config=source, max_running_requests=2, max_total_token_num=512) as llm:
        params = llm.default_sampling_params()
        assert {k: getattr(params, k) for k in expected} == expected
