"""Model providers against OpenAI- and Anthropic-compatible local servers,
and the replay provider. The key travels only in its header; 429 with
Retry-After is retried; usage is returned; errors are redacted."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.common.config.model import Model
from tests.credentials.conftest import broker_stub, make_config
from tests.support.fakes.models import FakeAnthropic, FakeOpenAI

pytestmark = pytest.mark.timeout(60)

KEY_ENV = "AFE_TEST_MODEL_KEY"
TOOLS = [pb.ToolSpec(name="read_file", description="Read a file",
                     parameters_json_schema=json.dumps({"type": "object", "properties": {"path": {"type": "string"}},
                                                        "required": ["path"]}))]


def conversation() -> list[pb.Message]:
    return [
        pb.Message(role="system", content="You fix bugs."),
        pb.Message(role="user", content="Fix calc.py"),
        pb.Message(role="assistant", content="Reading.", tool_calls=[
            pb.ToolCall(id="c0", name="list_dir", arguments_json='{"path": "."}')]),
        pb.Message(role="tool", tool_call_id="c0", content="calc.py\ntest_calc.py"),
    ]


async def test_r14_openai_tool_calls_usage_and_key_in_header_only(layout):
    key = "sk-" + "Fake1234" * 4
    async with FakeOpenAI(key) as fake:
        model = Model(name="gpt", provider="openai", model="gpt-test", base_url=fake.url + "/v1", api_key_env=KEY_ENV)
        fake.fail_next(429, '{"error": {"message": "rate limited"}}', headers={"Retry-After": "0"})
        fake.reply_tool_call("read_file", {"path": "calc.py"}, call_id="call_42", text="Looking.")
        fake.reply_text("Done.", prompt_tokens=100, completion_tokens=3)
        async with broker_stub(make_config(layout.data_dir.parent, models=(model,)), layout,
                               secrets_={KEY_ENV: key}) as (s, _):
            first = await s.Complete(pb.CompleteRequest(model="gpt", messages=conversation(), tools=TOOLS,
                                                        max_tokens=256, ticket_id="m1"))
            second = await s.Complete(pb.CompleteRequest(model="gpt", messages=conversation(), tools=TOOLS))
    assert first.stop_reason == "tool_use" and first.message.content == "Looking."
    call = first.message.tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments_json)) == ("call_42", "read_file", {"path": "calc.py"})
    assert (first.usage.input_tokens, first.usage.output_tokens) == (20, 9)
    assert second.stop_reason == "end_turn" and second.message.content == "Done."
    assert (second.usage.input_tokens, second.usage.output_tokens) == (100, 3)
    assert len(fake.seen) == 3  # the 429 was retried
    sent = fake.seen[1].json()
    assert sent["model"] == "gpt-test" and sent["max_tokens"] == 256
    assert sent["tools"][0]["function"]["name"] == "read_file"
    assert sent["messages"][2]["tool_calls"][0]["function"]["name"] == "list_dir"
    assert sent["messages"][3] == {"role": "tool", "tool_call_id": "c0", "content": "calc.py\ntest_calc.py"}
    assert all(x.headers.get("Authorization") == f"Bearer {key}" for x in fake.seen)
    assert not fake.token_seen_outside(key, "Authorization")


async def test_r14_anthropic_tool_use_usage_and_key_in_header_only(layout):
    key = "anthropic-key-" + "Q9" * 12
    async with FakeAnthropic(key) as fake:
        model = Model(name="claude", provider="anthropic", model="claude-test", base_url=fake.url,
                      api_key_env=KEY_ENV, max_tokens=512)
        fake.fail_next(429, '{"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}',
                       headers={"Retry-After": "0"})
        fake.fail_next(529, '{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}')
        fake.reply_tool_call("read_file", {"path": "calc.py"}, call_id="toolu_9", text="Let me read it.")
        async with broker_stub(make_config(layout.data_dir.parent, models=(model,)), layout,
                               secrets_={KEY_ENV: key}) as (s, _):
            out = await s.Complete(pb.CompleteRequest(model="claude", messages=conversation(), tools=TOOLS,
                                                      max_tokens=100000))
    assert out.stop_reason == "tool_use" and out.message.content == "Let me read it."
    call = out.message.tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments_json)) == ("toolu_9", "read_file", {"path": "calc.py"})
    assert (out.usage.input_tokens, out.usage.output_tokens) == (30, 12)
    assert len(fake.seen) == 3
    sent = fake.seen[-1].json()
    assert sent["system"] == "You fix bugs." and sent["max_tokens"] == 512   # capped by the manifest
    assert sent["tools"][0]["input_schema"]["required"] == ["path"]
    assert sent["messages"][1]["content"][1] == {"type": "tool_use", "id": "c0", "name": "list_dir",
                                                 "input": {"path": "."}}
    assert sent["messages"][2] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "c0", "content": "calc.py\ntest_calc.py"}]}
    assert all(x.headers.get("x-api-key") == key for x in fake.seen)
    assert not fake.token_seen_outside(key, "x-api-key")


async def test_r27_model_errors_are_redacted_and_name_the_variable(layout):
    key = "plainkey" + "Kk7" * 8
    async with FakeOpenAI("another-key") as fake:
        model = Model(name="gpt", provider="openai", model="m", base_url=fake.url + "/v1", api_key_env=KEY_ENV)
        async with broker_stub(make_config(layout.data_dir.parent, models=(model,)), layout,
                               secrets_={KEY_ENV: key}) as (s, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.Complete(pb.CompleteRequest(model="gpt", messages=conversation()))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and KEY_ENV in info.value.details()
            fake.fail_next(400, json.dumps({"error": {"message": f"bad request from key {key}"}}))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.Complete(pb.CompleteRequest(model="gpt", messages=conversation()))
            assert key not in info.value.details() and "[redacted]" in info.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.Complete(pb.CompleteRequest(model="nope", messages=conversation()))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND and "gpt" in info.value.details()
        async with broker_stub(make_config(layout.data_dir.parent, models=(model,)), layout) as (s, _):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.Complete(pb.CompleteRequest(model="gpt", messages=conversation()))
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and KEY_ENV in info.value.details()


async def test_replay_follows_the_script_by_assistant_turns(layout, short_tmp):
    demo = Path("services/common/demo/demo-model.yaml").absolute()
    looping = short_tmp / "loop.yaml"
    looping.write_text("loop: true\nresponses:\n  - content: again\n    tool_calls: [{name: run, arguments: "
                       "{command: 'true'}}]\n    usage: {input_tokens: 5, output_tokens: 2}\n")
    models = (Model(name="demo", provider="replay", script=demo),
              Model(name="loop", provider="replay", script=looping))
    async with broker_stub(make_config(layout.data_dir.parent, models=models), layout) as (s, _):
        msgs = [pb.Message(role="user", content="fix it")]
        names = []
        for _ in range(6):
            out = await s.Complete(pb.CompleteRequest(model="demo", messages=msgs))
            names.append([c.name for c in out.message.tool_calls])
            assert out.usage.input_tokens > 0 and out.usage.output_tokens > 0
            msgs.append(out.message)
        loop_out = None
        for _ in range(3):
            loop_out = await s.Complete(pb.CompleteRequest(model="loop", messages=msgs))
            msgs.append(loop_out.message)
    assert names == [["list_dir"], ["read_file"], ["write_file"], ["run"], [], []]
    assert loop_out is not None and loop_out.message.tool_calls[0].name == "run"
    assert (loop_out.usage.input_tokens, loop_out.usage.output_tokens) == (5, 2)
