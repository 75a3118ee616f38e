"""Responses input items as chat messages, without a server: a stored conversation reads as items before the
input; a reasoning item joins the assistant message after it, and one that no assistant message follows (an answer
cut short while it reasoned) is an assistant turn of its own rather than being lost or joining a later turn."""

from __future__ import annotations

from lightllm.server.http.responses_protocol import INPUT_ITEMS, ResponsesRequest


def _reasoning(text: str) -> dict:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def _request(input_items) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": input_items, "instructions": "Be terse."})


def test_reasoning_cut_short_is_a_turn_of_its_own():
    items = [{"role": "user", "content": "a"}, _reasoning("thinking"), {"role": "user", "content": "b"}]
    items += [_reasoning("more"), {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}]
    assert _request(items).messages() == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "reasoning_content": "thinking"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c", "reasoning_content": "more"},
    ]
    # the twin: with its answer after it, the reasoning joins that answer
    answered = [items[0], items[1], {"role": "assistant", "content": "x"}, items[2]]
    assert _request(answered).messages()[2] == {"role": "assistant", "content": "x", "reasoning_content": "thinking"}


def test_reasoning_before_a_tool_output_and_at_the_end_stays_in_its_turn():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [{"role": "user", "content": "a"}, call, _reasoning("r1")]
    items += [{"type": "function_call_output", "call_id": "c1", "output": "ok"}, _reasoning("r2")]
    messages = _request(items).messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "assistant", "tool", "assistant"]
    assert messages[3]["reasoning_content"] == "r1" and messages[5] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "r2",
    }


def test_a_stored_conversation_reads_as_items_and_instructions_are_the_requests_own():
    history = INPUT_ITEMS.validate_python(
        [{"type": "message", "role": "user", "content": "first", "id": "msg_1"}, _reasoning("r")]
    )
    request = ResponsesRequest.model_validate({"model": "m", "input": "second"})
    continued = request.model_copy(update={"input": [*history, *request.input_items()]})
    assert continued.messages() == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "", "reasoning_content": "r"},
        {"role": "user", "content": "second"},
    ]
    # the twin: without the history only the input is there
    assert request.messages() == [{"role": "user", "content": "second"}]
