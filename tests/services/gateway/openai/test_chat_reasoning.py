"""Reasoning and tool calls through the unmodified `openai` client, the model's output forced to exact texts."""

import json

import openai
import pytest

from tests.services.gateway.support import wait_whole

pytestmark = pytest.mark.timeout(120)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def dsml(*calls: tuple[str, dict]) -> str:
    """Tool calls as the model writes them (deepseek-recipe's rendering of an assistant turn)."""
    invokes = []
    for name, arguments in calls:
        params = "".join(
            f'<｜DSML｜ parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜ parameter>\n"
            for k, v in arguments.items()
        )
        invokes.append(f'<｜DSML｜ invoke name="{name}">\n{params}</｜DSML｜ invoke>\n')
    return "\n\n<｜DSML｜ calls>\n" + "".join(invokes) + "</｜DSML｜ calls>"


def test_streamed_reasoning_then_content(openai_client, forced, served):
    with forced.forcing("Let me think.</think>The answer is 4."):
        chunks = list(openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, stream=True))
        plain = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40)
    kinds, reasoning, content = [], "", ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        r, c = getattr(delta, "reasoning_content", None) or "", delta.content or ""
        assert "</think>" not in r + c and "<think>" not in r + c
        kinds += ["reasoning"] * bool(r) + ["content"] * bool(c)
        reasoning, content = reasoning + r, content + c
    assert (
        kinds == sorted(kinds, key=lambda k: k != "reasoning") and "content" in kinds
    )  # reasoning first, then content
    assert (reasoning, content) == ("Let me think.", "The answer is 4.")
    message = plain.choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert plain.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    wait_whole(served)


def test_thinking_off_through_chat_template_kwargs(openai_client, forced, served):
    with forced.forcing("Hello there."):
        reply = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=20, extra_body={"chat_template_kwargs": {"thinking": False}}
        )
    assert reply.choices[0].message.content == "Hello there."
    assert not getattr(reply.choices[0].message, "reasoning_content", None)
    off = served.server.chat.render({"messages": USER, "thinking": {"type": "disabled"}}).token_ids
    assert off[-1] == 128822 and reply.usage.prompt_tokens == len(off)  # the prompt ends with </think>
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=2, extra_body={"chat_template_kwargs": {"tools_in_user": 1}}
        )


def test_reasoning_effort_is_one_of_openais(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=1, reasoning_effort="ultra")
    assert err.value.body["param"] == "reasoning_effort"
    for effort in ("low", "medium", "high"):
        assert openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=1, reasoning_effort=effort)


def test_developer_role_is_rendered_as_system(openai_client, served):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "developer", "content": "Be brief."}, *USER], max_tokens=1
    )
    as_system = served.server.chat.render({"messages": [{"role": "system", "content": "Be brief."}, *USER]})
    assert reply.usage.prompt_tokens == len(as_system.token_ids)


def test_two_turn_tool_loop(openai_client, forced, served):
    call = dsml(("get_weather", {"city": "Paris", "days": 3}))
    with forced.forcing("I should look it up.</think>" + call):
        plain = openai_client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=100)
        with openai_client.chat.completions.stream(
            model="tiny", messages=USER, tools=[WEATHER], max_tokens=100
        ) as stream:
            events = list(stream)
            streamed = stream.get_final_completion()
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and streamed.choices[0].finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "I should look it up."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 3}
    (same,) = streamed.choices[0].message.tool_calls
    assert (same.function.name, same.function.arguments) == (tool_call.function.name, tool_call.function.arguments)
    pieces = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 1  # the arguments arrive while they are generated, not in one piece
    # Second turn: the call and its result go back; the answer is plain content.
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [tool_call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "sunny, 21 C"},
    ]
    with forced.forcing("It is sunny.</think>Sunny, 21 C in Paris."):
        answer = openai_client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=60)
    assert answer.choices[0].message.content == "Sunny, 21 C in Paris." and answer.choices[0].finish_reason == "stop"
    rendered = served.server.chat.render({"messages": history, "tools": [WEATHER]})
    assert "<tool_result>sunny, 21 C</tool_result>" in rendered.prompt
    assert answer.usage.prompt_tokens == len(rendered.token_ids)


def test_parallel_tool_calls_false_keeps_the_first(openai_client, forced):
    calls = dsml(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"}))
    with forced.forcing("Two cities.</think>" + calls):
        both = openai_client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=120)
        one = openai_client.chat.completions.create(
            model="tiny", messages=USER, tools=[WEATHER], max_tokens=120, parallel_tool_calls=False
        )
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Oslo"]
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]


def test_tool_choice_none_leaves_the_tools_out(openai_client, served):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=1
    )
    assert reply.usage.prompt_tokens == len(served.server.chat.render({"messages": USER}).token_ids)


@pytest.mark.parametrize(
    "choice,tools,match",
    [
        ({"type": "function", "function": {"name": "get_time"}}, [WEATHER], "not in tools"),
        ("required", [], "needs tools"),
        ("sometimes", [WEATHER], "tool_choice must be"),
    ],
)
def test_tool_choice_refusals_name_why(openai_client, choice, tools, match):
    with pytest.raises(openai.BadRequestError, match=match) as err:
        openai_client.chat.completions.create(
            model="tiny", messages=USER, tools=tools, tool_choice=choice, max_tokens=1
        )
    assert err.value.body["param"] == "tool_choice"


def test_chat_logprobs_cover_every_token_plain_and_streamed(openai_client, forced):
    with forced.forcing("Hm.</think>Yes."):
        plain = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=20, logprobs=True, top_logprobs=2
        )
        chunks = list(
            openai_client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=20, logprobs=True, top_logprobs=2, stream=True
            )
        )
    tokens = plain.choices[0].logprobs.content
    assert len(tokens) == plain.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in tokens]
    assert "".join(t.token for t in tokens).startswith("Hm.</think>Yes.")


def test_earlier_reasoning_is_rendered_as_the_model_expects(openai_client, served):
    """A finished turn's reasoning is dropped from the prompt; a turn that called tools keeps it (the recipe's
    rendering), so the reasoning a client sends back must reach the renderer."""
    finished = [*USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}, *USER]
    with_reasoning = openai_client.chat.completions.create(model="tiny", messages=finished, max_tokens=1)
    bare = [*USER, {"role": "assistant", "content": "Sunny."}, *USER]
    assert with_reasoning.usage.prompt_tokens == len(served.server.chat.render({"messages": bare}).token_ids)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    loop = [
        *USER,
        {"role": "assistant", "content": "", "reasoning_content": "Need the weather.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = openai_client.chat.completions.create(model="tiny", messages=loop, tools=[WEATHER], max_tokens=1)
    rendered = served.server.chat.render({"messages": loop, "tools": [WEATHER]})
    assert "<think>Need the weather.</think>" in rendered.prompt
    assert reply.usage.prompt_tokens == len(rendered.token_ids)


def test_reasoning_effort_none_and_include_reasoning_false(openai_client, forced, served):
    with forced.forcing("Plain answer."):
        off = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, reasoning_effort="none")
    assert off.choices[0].message.content == "Plain answer."
    assert off.usage.prompt_tokens == len(
        served.server.chat.render({"messages": USER, "thinking": {"type": "disabled"}}).token_ids
    )
    with forced.forcing("Hidden.</think>Shown."):
        reply = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=10, extra_body={"include_reasoning": False}
        )
    assert reply.choices[0].message.content == "Shown."
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None


def test_usage_counts_the_reasoning_tokens(openai_client, forced, served):
    """completion_tokens_details.reasoning_tokens: the output tokens before </think> (plain, streamed, n = 2
    summed); 0 with thinking off; the markers are the V4.1 vocabulary's."""
    from model.deepseek_v41.tokenizer import load_v41_tokenizer
    from services.gateway.openai.chat_stream import THINK_END_ID, THINK_START_ID

    vocab = load_v41_tokenizer()
    assert (vocab.token_to_id("<think>"), vocab.token_to_id("</think>")) == (THINK_START_ID, THINK_END_ID)
    thought = "Let me think."
    with forced.forcing(thought + "</think>The answer is 4.") as ids:
        plain = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, n=2)
        chunks = list(
            openai_client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=40, stream=True, stream_options={"include_usage": True}
            )
        )
        off = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=40, extra_body={"chat_template_kwargs": {"thinking": False}}
        )
    num_thought = ids.index(THINK_END_ID)
    assert num_thought == len(vocab.encode(thought, add_special_tokens=False).ids) > 0
    assert plain.usage.completion_tokens_details.reasoning_tokens == 2 * num_thought
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == num_thought
    assert off.usage.completion_tokens_details.reasoning_tokens == 0 and off.usage.completion_tokens == len(ids)
    with forced.forcing("no end of thought", end=False):
        cut = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    assert cut.usage.completion_tokens_details.reasoning_tokens == 3  # all of it was reasoning
    with forced.forcing("no end of thought") as ids:  # the end token ends the output inside the reasoning
        ended = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40)
        streamed = list(
            openai_client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=40, stream=True, stream_options={"include_usage": True}
            )
        )
    assert ended.usage.completion_tokens == len(ids)  # the end token is an output token, not a reasoning one
    assert ended.usage.completion_tokens_details.reasoning_tokens == len(ids) - 1
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == len(ids) - 1
    wait_whole(served)


def test_only_reasoning_leaves_content_null(openai_client, forced):
    """An answer that never left its reasoning has content null (OpenAI's and vLLM's), plain and streamed (no
    content delta), and with include_reasoning false; a tool call without text before it likewise."""
    with forced.forcing("Still thinking"):
        plain = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40)
        chunks = list(openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, stream=True))
        hidden = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=40, extra_body={"include_reasoning": False}
        )
    message = plain.choices[0].message
    assert (message.reasoning_content, message.content) == ("Still thinking", None)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == "Still thinking"
    assert hidden.choices[0].message.content is None
    with forced.forcing("Look it up.</think>" + dsml(("get_weather", {"city": "Paris"}))):
        call = openai_client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=120)
    assert call.choices[0].message.tool_calls and call.choices[0].message.content is None
    with forced.forcing("Done.</think>"):  # reasoning, then no answer text: null too
        empty = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=40)
    assert empty.choices[0].message.content is None
