"""`--generation_config`: the sampling knobs a request leaves out take the checkpoint's generation_config.json values
(the demo model ships temperature 0.6, top_k 20, top_p 0.95), a request's own values win, `none` restores OpenAI's
defaults; a file with a value no request could ask for stops the start-up naming it. Seeded sampling through the
real engine on the CPU tells which parameters a request ran with."""

from __future__ import annotations

import json

import httpx
import pytest

from lightllm.engine.sampling_params import SamplingParams
from lightllm.server.args import load_server_args
from lightllm.server.llm import LLM
from lightllm.server.output import default_length
from lightllm.server.runner_factory import DEFAULT_RUNNER_FACTORY
from lightllm.server.sampling_defaults import read_sampling_defaults
from lightllm.tools.demo_model import trained_model_dir
from unit_tests.server.live_server import FAKE_RUNNER, LiveServer

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
    folder = _folder(tmp_path, temperature=0.3, min_p=0.05, repetition_penalty=1.1, max_new_tokens=99, num_beams=1)
    expected = {"temperature": 0.3, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 99}
    assert read_sampling_defaults(folder, demo) == expected
    for bad, field in (
        ({"top_p": 0.0}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": True}, "top_k"),
        ({"max_new_tokens": 0}, r"max_tokens=0: .* \(from max_new_tokens\)"),
        ({"max_new_tokens": 2.5}, r"max_tokens=2.5: .* \(from max_new_tokens\)"),
    ):
        with pytest.raises(ValueError, match=rf"generation_config.json: .*{field}.*--generation_config none"):
            read_sampling_defaults(_folder(tmp_path, **bad), demo)


def test_the_default_length_fills_only_an_unset_max_tokens_and_fits_the_context():
    ids = list(range(10))
    unset = SamplingParams(max_tokens=None)
    assert default_length(ids, unset, 30, 100).max_tokens == 30
    # clipped to the 90 tokens the prompt leaves: a default never refuses a prompt
    assert default_length(ids, unset, 500, 100).max_tokens == 90
    # the request's min_tokens wins over a shorter default
    assert default_length(ids, SamplingParams(max_tokens=None, min_tokens=40), 30, 100).max_tokens == 40
    # the request's own length, and no default, leave the params as they are
    assert default_length(ids, SamplingParams(max_tokens=7), 30, 100).max_tokens == 7
    assert default_length(ids, unset, None, 100).max_tokens is None


def test_a_bad_file_refuses_the_start_with_the_way_out(tmp_path):
    folder = _folder(tmp_path, top_p=2.0)
    with pytest.raises(ValueError, match="top_p"):
        load_server_args([], device="cpu", generation_config=folder)
    _, info = load_server_args([], device="cpu", generation_config="none")
    assert info.sampling_defaults == ()
    # max_new_tokens reaches the offline LLM's defaults as max_tokens
    _, info = load_server_args([], device="cpu", generation_config=_folder(tmp_path, max_new_tokens=7))
    assert dict(info.sampling_defaults) == {"max_tokens": 7}


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
        # the demo model's file sets no max_new_tokens: SamplingParams' own 16
        assert params.max_tokens == 16


def _completion_tokens(server: LiveServer, path: str, **fields) -> int:
    body = {"model": server.model, "ignore_eos": True, "temperature": 0, **fields}
    r = httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("source", ["file", "none"])
def test_a_chat_answer_without_max_tokens_takes_the_files_length(tmp_path, source):
    """max_new_tokens 3: a chat request that sets no length gets 3 tokens, one that sets 5 gets 5; a completion
    request keeps OpenAI's 16; with `none` (the twin) the chat answer runs past 3."""
    s = LiveServer(
        runner_factory=DEFAULT_RUNNER_FACTORY,
        device="cpu",
        generation_config=_folder(tmp_path, max_new_tokens=3) if source == "file" else "none",
        max_running_requests=2,
        max_total_token_num=1024,
    )
    try:
        chat = {"messages": [{"role": "user", "content": "Tell me a story."}]}
        unset = _completion_tokens(s, "chat/completions", **chat)
        assert unset == 3 if source == "file" else unset > 3
        assert _completion_tokens(s, "chat/completions", **chat, max_tokens=5) == 5
        # truncate_prompt_tokens -1 leaves room for the file's length; with none there is none to leave (the twin)
        if source == "file":
            assert _completion_tokens(s, "chat/completions", **chat, truncate_prompt_tokens=-1) == 3
        else:
            body = {"model": s.model, "truncate_prompt_tokens": -1, **chat}
            r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert _completion_tokens(s, "chat/completions", **chat, max_completion_tokens=4) == 4
        assert _completion_tokens(s, "completions", prompt="def parse(") == 16
    finally:
        s.close()


def test_the_offline_default_length_is_clipped_to_each_prompts_room(tmp_path):
    """The file's max_new_tokens as the offline default: a prompt too long for it still runs (clipped to its room,
    as over HTTP); the same length asked for explicitly is refused (the twin)."""
    folder = _folder(tmp_path, max_new_tokens=10_000)
    flags = dict(device="cpu", generation_config=folder, max_running_requests=2, max_total_token_num=512)
    with LLM(runner_factory=FAKE_RUNNER, max_req_total_len=64, **flags) as llm:
        prompt = list(range(3, 43))
        (out,) = llm.generate(prompt)
        assert 1 <= len(out.outputs[0].token_ids) <= 64 - len(prompt)
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate(prompt, llm.default_sampling_params())
        with pytest.raises(ValueError, match="min_tokens"):
            llm.generate(prompt, SamplingParams(max_tokens=None, min_tokens=30))
