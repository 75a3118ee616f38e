"""`--chat_template`: a template file or the template text replaces the checkpoint's for every chat rendering (chat
completions, /tokenize of messages); a name that is neither a file nor a template, or a template that does not
parse, stops the start-up naming the flag and the line."""

from __future__ import annotations

import httpx
import pytest

from lightllm.server.chat_template import read_chat_template
from unit_tests.server.live_server import LiveServer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
MESSAGES = [{"role": "user", "content": "reverse a list"}]


def test_a_file_or_the_text_is_taken_and_checked(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="no such file, and no Jinja markup"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    path.write_text("line one\n{% for m in messages %}\n{{ m.content }}")
    with pytest.raises(ValueError, match=r"--chat_template: .*t\.jinja, line 3: .*endfor"):
        read_chat_template(str(path))
    # a file that is not UTF-8 text is named with the flag, not a traceback
    path.write_bytes(b"{{ messages }}\xff\xfe")
    with pytest.raises(ValueError, match=r"--chat_template .*t\.jinja: cannot read it as UTF-8 text"):
        read_chat_template(str(path))


def test_templates_transformers_renders_are_accepted():
    """The check parses in transformers' own environment: its loop controls and `{% generation %}` (in templates
    made for training) are valid there, while a tag no environment knows is still refused."""
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    tracked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert read_chat_template(loop) == loop
    assert read_chat_template(tracked) == tracked
    with pytest.raises(ValueError, match=r"--chat_template: the template text, line 1: .*'nonsense'"):
        read_chat_template("{% for m in messages %}{% nonsense %}{% endfor %}")


@pytest.fixture(scope="module", params=[TEMPLATE, None], ids=["flag", "checkpoint"])
def server(request):
    s = LiveServer(device="cpu", chat_template=request.param, max_running_requests=2, max_total_token_num=1024)
    yield request.param, s
    s.close()


def test_chat_prompts_are_rendered_with_the_flag_template(server):
    template, s = server
    r = httpx.post(f"{s.base_url}/tokenize", json={"model": s.model, "messages": MESSAGES}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    ours = s.tokenizer.encode("[user] reverse a list\n[assistant] ")
    # the twin: the checkpoint's own template renders another prompt
    assert (ids == ours) == (template is not None)
    body = {"model": s.model, "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(f"{s.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), r.text
