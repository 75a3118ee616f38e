"""Fields of vLLM's and OpenAI's request APIs beyond this server's own: each one that would change the output is
refused with a 400 naming it unless it asks for nothing; vLLM's guided_* fields constrain the output as the
structured_outputs they were renamed to; vLLM's add_special_tokens and include_reasoning are honoured."""

from __future__ import annotations

import json

import httpx
import pytest

from lightllm.server.http.extra_fields import REFUSED
from unit_tests.engine.fake_runner import FakeRunner
from unit_tests.server.live_server import (
    FAKE_RUNNER,
    LiveServer,
    fake_checkpoint,
    reasoning_and_content,
    tiny_checkpoint_server,
)

# each refused field: a value that asks for something, and its neutral value (sent by clients that set everything)
ASKING = {
    "use_beam_search": (True, False),
    "length_penalty": (0.5, 1.0),
    "guided_whitespace_pattern": (" ", None),
    "logits_processors": (["pkg.proc"], []),
    "kv_transfer_params": ({"do_remote_decode": True}, None),
    "vllm_xargs": ({"k": 1}, {}),
    "documents": ([{"text": "a"}], []),
    "mm_processor_kwargs": ({"fps": 1}, {}),
    "prediction": ({"type": "content", "content": "x"}, None),
    "prompt_embeds": ("AAAA", None),
    "web_search_options": ({"search_context_size": "low"}, None),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "repetition_detection": ({"max_pattern_size": 4}, None),
    "logprob_token_ids": ([3], None),
    "watermarking": (True, False),
    "structural_tag": ('{"type": "structural_tag"}', None),
}
MESSAGES = [{"role": "user", "content": "Name a prime."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The fake runner behind a tokenizer that adds a BOS (`<|endoftext|>`) around a text it encodes with its
    special tokens."""
    model_dir = fake_checkpoint(tmp_path_factory.mktemp("bos"))
    path = f"{model_dir}/tokenizer.json"
    with open(path) as f:
        tokenizer = json.load(f)
    bos = next(t for t in tokenizer["added_tokens"] if t["content"] == "<|endoftext|>")
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos["content"], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos["content"]: {"id": bos["content"], "ids": [bos["id"]], "tokens": [bos["content"]]}},
    }
    with open(path, "w") as f:
        json.dump(tokenizer, f)
    s = LiveServer(runner_factory=FAKE_RUNNER, model_dir=model_dir, device="cpu", max_total_token_num=2048)
    s.bos = bos["id"]
    yield s
    s.close()


def _post(s: LiveServer, route: str, **fields) -> httpx.Response:
    body = {"model": s.model, "max_tokens": 4, **fields}
    if route == "chat/completions":
        body.setdefault("messages", MESSAGES)
    else:
        body.setdefault("prompt", "Name a prime.")
    return httpx.post(f"{s.base_url}/v1/{route}", json=body, timeout=60)


def test_the_table_covers_every_refused_field():
    assert set(ASKING) == set(REFUSED)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("name", sorted(ASKING))
def test_a_field_that_asks_for_what_is_not_done_gets_400_naming_it(server, route, name):
    asking, neutral = ASKING[name]
    r = _post(server, route, **{name: asking})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name and r.json()["error"]["message"].startswith(f"{name}: ")
    # the twin: its neutral value (and null) asks for nothing
    for value in (neutral, None):
        assert _post(server, route, **{name: value}).status_code == 200, (name, value)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_guided_fields_constrain_as_structured_outputs(server, route):
    """Each guided_* field gives the output its structured_outputs twin gives, from one seed, and that output obeys
    the constraint; unconstrained, the fake model writes something else."""
    cases = {
        "guided_choice": ("choice", ["alpha", "beta"], lambda t: t in ("alpha", "beta")),
        "guided_regex": ("regex", "[0-9]{3}", lambda t: len(t) == 3 and t.isdigit()),
        "guided_json": ("json", SCHEMA, None),
        "guided_grammar": ("grammar", 'start: "x" "y"+', lambda t: t.startswith("xy") and set(t[1:]) == {"y"}),
    }
    for name, (key, value, valid) in cases.items():
        fields = {"seed": 3, "max_tokens": 48, "temperature": 1.0}
        if route == "chat/completions":
            # the template's opened reasoning block stays free of the grammar: none is opened
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        guided, structured = (
            _post(server, route, **fields, **{name: value}),
            _post(server, route, **fields, structured_outputs={key: value}),
        )
        assert guided.status_code == 200 and structured.status_code == 200, (guided.text, structured.text)
        text = _text(guided, route)
        assert text == _text(structured, route), name
        if valid is None:
            assert isinstance(json.loads(text)["a"], bool)
        else:
            assert valid(text), (name, text)
    assert _text(_post(server, route, seed=3, max_tokens=24), route) not in ("alpha", "beta")


@pytest.mark.parametrize(
    "route, fields, param",
    [
        ("completions", {"guided_choice": []}, "guided_choice"),
        ("completions", {"guided_regex": "[a-"}, "guided_regex"),
        ("chat/completions", {"guided_json": 5}, "guided_json"),
        (
            "chat/completions",
            {"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
            "guided_json",
        ),
        ("chat/completions", {"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ],
)
def test_a_bad_guided_field_is_named_as_sent(server, route, fields, param):
    r = _post(server, route, **fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(param)


def test_guided_beside_structured_outputs_or_another_guided_gets_400(server):
    r = _post(server, "completions", guided_regex="a+", structured_outputs={"regex": "b+"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    r = _post(server, "chat/completions", guided_regex="a+", guided_choice=["a"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice", r.text


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_its_chunks(server, route):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far (its prompt's
    tokens, the tokens it has generated, never decreasing), ending at the tokens it generated; the final chunk has
    the request's. Without it (the twin) only the final chunk has a usage."""

    def chunks(continuous: bool) -> list[dict]:
        options = {"include_usage": True, "continuous_usage_stats": continuous}
        r = _post(server, route, stream=True, max_tokens=6, n=2, ignore_eos=True, stream_options=options)
        assert r.status_code == 200, r.text
        lines = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: {")]
        return [json.loads(line) for line in lines]

    *streamed, final = chunks(True)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    for index in (0, 1):
        mine = [e["usage"] for e in streamed if e["choices"][0]["index"] == index]
        counts = [u["completion_tokens"] for u in mine]
        assert counts == sorted(counts) and counts[-1] == 6 and len(mine) >= 2
        assert {u["prompt_tokens"] for u in mine} == {final["usage"]["prompt_tokens"]}
    plain = chunks(False)
    assert [("usage" in e) for e in plain] == [False] * (len(plain) - 1) + [True]


def test_add_special_tokens_as_in_vllm(server, prompts_sent):
    """Completions add the tokenizer's BOS by default, chat does not (its template writes its markers); each route
    takes the other when asked, and /tokenize counts what the route would send."""
    tok = server.tokenizer
    rendered = tok.render_chat(MESSAGES)
    cases = [
        ("completions", {}, tok.encode("Name a prime.")),
        ("completions", {"add_special_tokens": False}, tok.encode_rendered("Name a prime.")),
        ("chat/completions", {}, tok.encode_rendered(rendered)),
        ("chat/completions", {"add_special_tokens": True}, tok.encode(rendered)),
    ]
    for route, fields, expected in cases:
        prompts_sent.clear()
        assert _post(server, route, **fields).status_code == 200
        assert prompts_sent == [expected], (route, fields)
        # the twin: the BOS is there exactly when the tokenizer's markers were asked for
        assert (expected[0] == server.bos) == (route == "completions") ^ bool(fields), (route, fields)
        counted = {"prompt": "Name a prime."} if route == "completions" else {"messages": MESSAGES}
        r = httpx.post(f"{server.base_url}/tokenize", json={**counted, **fields}, timeout=60)
        assert r.json()["tokens"] == expected, (route, fields)


@pytest.fixture(scope="module")
def thinking_server():
    s = tiny_checkpoint_server("qwen3_5", "think")
    yield s
    s.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_include_reasoning_false_leaves_the_reasoning_out(thinking_server, stream):
    s = thinking_server
    body = {"model": s.model, "messages": MESSAGES, "max_tokens": 12, "seed": 9, "stream": stream}
    shown = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)
    hidden = httpx.post(f"{s.base_url}/v1/chat/completions", json={**body, "include_reasoning": False}, timeout=60)
    assert shown.status_code == hidden.status_code == 200, (shown.text, hidden.text)
    reasoning, content = reasoning_and_content(shown, stream)
    assert reasoning, "the template opens a reasoning block: the fake model's output is reasoning"
    assert reasoning_and_content(hidden, stream) == ("", content)
    assert "reasoning_content" not in (hidden.text if stream else json.dumps(hidden.json()["choices"][0]["message"]))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_thinking_token_budget_forces_the_reasoning_end(thinking_server, stream):
    """The template opens a reasoning block: with a budget of 3 the fake model's greedy output has </think> forced
    as its fourth token and goes on from there (token ids read back through return_tokens_as_token_ids), the
    reasoning holds three tokens and the rest is content. Twin: without the budget the fourth token is the model's."""
    s = thinking_server
    runner = FakeRunner(s.info.vocab_size)
    prompt = s.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    end = s.tokenizer.encode_rendered("</think>")
    assert len(end) == 1
    forced = runner.greedy(prompt, 3) + end
    forced += runner.greedy(prompt + forced, 12 - len(forced))
    plain = runner.greedy(prompt, 12)
    assert plain[3] != end[0]
    body = {"model": s.model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"logprobs": True, "return_tokens_as_token_ids": True, "stream": stream}
    for budget, expected in ((3, forced), (None, plain)):
        fields = {} if budget is None else {"thinking_token_budget": budget}
        r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body | fields, timeout=60)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            entries = [
                e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]
            ]
        else:
            entries = r.json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in entries] == [f"token_id:{t}" for t in expected]
    split = httpx.post(f"{s.base_url}/v1/chat/completions", json=body | {"thinking_token_budget": 3}, timeout=60)
    assert reasoning_and_content(split, stream) == (s.tokenizer.decode(forced[:3]), s.tokenizer.decode(forced[4:]))


def test_spaces_between_special_tokens_is_accepted_either_way(server):
    """Both values give the same text (the fast tokenizer joins special tokens as they are); a non-boolean is 400."""
    texts = []
    for value in (True, False):
        r = _post(
            server,
            "completions",
            prompt="Name a prime.",
            seed=4,
            skip_special_tokens=False,
            spaces_between_special_tokens=value,
        )
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]
    r = _post(server, "completions", spaces_between_special_tokens="no")
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"


def test_thinking_budget_then_a_grammar(thinking_server):
    """A budget of 2 with a JSON schema: two reasoning tokens, the forced </think>, then output the schema parses
    (the grammar starts at the forced end, as at the model's own)."""
    s = thinking_server
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2, 3]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    body = {"model": s.model, "messages": MESSAGES, "max_tokens": 48, "seed": 3, "thinking_token_budget": 2}
    body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    body |= {"logprobs": True, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    tokens = [int(e["token"].split(":")[1]) for e in choice["logprobs"]["content"]]
    assert tokens[2] == s.tokenizer.encode_rendered("</think>")[0]
    assert choice["message"]["reasoning_content"] == s.tokenizer.decode(tokens[:2])
    assert json.loads(choice["message"]["content"])["n"] in (1, 2, 3) and choice["finish_reason"] == "stop"


def test_truncation_side_right_keeps_the_prompts_start(server, prompts_sent):
    """truncation_side right: the engine reads the first k prompt tokens (text, token ids, rendered chat) and an
    echo repeats them; left (the default) the last k. A side that is neither gets 400 naming it."""
    tok = server.tokenizer
    text = "one two three four five six seven eight nine ten"
    ids = tok.encode(text)
    r = _post(server, "completions", prompt=text, truncate_prompt_tokens=4, truncation_side="right", echo=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(tok.decode(ids[:4], skip_special_tokens=False))
    rendered = tok.encode_rendered(tok.render_chat(MESSAGES))
    for side in ("right", "left"):
        assert _post(server, "chat/completions", truncate_prompt_tokens=6, truncation_side=side).status_code == 200
    assert prompts_sent == [ids[:4], rendered[:6], rendered[-6:]]
    r = _post(server, "completions", truncate_prompt_tokens=4, truncation_side="middle")
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side", r.text


def _text(r: httpx.Response, route: str) -> str:
    choice = r.json()["choices"][0]
    return choice["text"] if route == "completions" else choice["message"]["content"]


def test_best_of_on_chat_is_one_or_400(server):
    assert _post(server, "chat/completions", best_of=1).status_code == 200
    r = _post(server, "chat/completions", best_of=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_reasoning_effort_none_switches_thinking_off(server, prompts_sent):
    """reasoning_effort none renders the prompt enable_thinking false renders; another effort, or a template
    variable that sets thinking itself, leaves the prompt as the template has it (the twins)."""
    cases = [
        {"reasoning_effort": "none"},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "high"},
        {},
        {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
    ]
    for fields in cases:
        assert _post(server, "chat/completions", **fields).status_code == 200, fields
    off, explicit_off, high, default, kept_on = prompts_sent
    assert off == explicit_off and high == default == kept_on and off != default


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, prompts_sent):
    """vLLM's truncate_prompt_tokens: the engine reads the last k prompt tokens (of a text, of token ids, of a
    rendered chat), -1 as many as leave room for max_tokens; an echo repeats what was read. Twins: a k above the
    prompt's length keeps it whole; 0, and -1 without max_tokens on chat, are 400s naming the field."""
    tok = server.tokenizer
    text = "one two three four five six seven eight nine ten"
    ids = tok.encode(text)
    r = _post(server, "completions", prompt=text, truncate_prompt_tokens=4, echo=True)
    assert r.status_code == 200, r.text
    assert prompts_sent == [ids[-4:]] and r.json()["usage"]["prompt_tokens"] == 4
    assert r.json()["choices"][0]["text"].startswith(tok.decode(ids[-4:], skip_special_tokens=False))
    prompts_sent.clear()
    assert _post(server, "completions", prompt=[ids, ids[:3]], truncate_prompt_tokens=5).status_code == 200
    assert prompts_sent == [ids[-5:], ids[:3]]
    prompts_sent.clear()
    rendered = tok.encode_rendered(tok.render_chat(MESSAGES))
    assert _post(server, "chat/completions", truncate_prompt_tokens=6).status_code == 200
    assert _post(server, "chat/completions", truncate_prompt_tokens=10**6).status_code == 200
    assert prompts_sent == [rendered[-6:], rendered]
    prompts_sent.clear()
    total = server.args.max_req_total_len
    long_ids = [ids[i % len(ids)] for i in range(total + 50)]
    assert _post(server, "completions", prompt=long_ids, truncate_prompt_tokens=-1, max_tokens=7).status_code == 200
    assert prompts_sent == [long_ids[-(total - 7) :]]
    for route, fields in (
        ("completions", {"truncate_prompt_tokens": 0}),
        ("chat/completions", {"truncate_prompt_tokens": -1, "max_tokens": None}),
    ):
        r = _post(server, route, **fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
