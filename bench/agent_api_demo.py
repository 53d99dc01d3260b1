"""The agent API as a framework calls it, against a running `stallfree serve`, with the official openai client.

Three calls, each printed with what came back: beta.chat.completions.parse with a pydantic model, a streamed tool
call under tool_choice "required" (the deltas as they arrive, then the accumulated call), and parallel tool calls.

    stallfree serve --model smollm2-135m --port 8000 &
    python -m stallfree.bench.agent_api_demo --url http://127.0.0.1:8000 --model smollm2-135m
"""
from __future__ import annotations

import argparse
import json
import time

import openai
import pydantic

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in an IANA time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}


class CalendarEvent(pydantic.BaseModel):
    name: str
    date: str
    participants: list[str]


def parse_demo(client: openai.OpenAI, model: str) -> None:
    start = time.perf_counter()
    completion = client.beta.chat.completions.parse(
        model=model, response_format=CalendarEvent, max_tokens=120, temperature=0,
        messages=[{"role": "system", "content": "Extract the event information."},
                  {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."}])
    choice = completion.choices[0]
    print(f"finish_reason: {choice.finish_reason}   ({time.perf_counter() - start:.2f} s)")
    print(f"content: {choice.message.content}")
    print(f"parsed:  {choice.message.parsed!r}")


def streamed_tool_call_demo(client: openai.OpenAI, model: str) -> None:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True, max_tokens=80,
        temperature=0,
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}])
    calls: dict[int, dict] = {}
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            print(f"delta: index={delta.index} id={delta.id} name={delta.function.name!r} "
                  f"arguments={delta.function.arguments!r}")
            call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        if choice.finish_reason:
            print(f"finish_reason: {choice.finish_reason}   ({time.perf_counter() - start:.2f} s)")
    for index, call in sorted(calls.items()):
        print(f"call {index}: {call['name']}({json.dumps(json.loads(call['arguments']))})  id={call['id']}")


def parallel_tool_calls_demo(client: openai.OpenAI, model: str) -> None:
    start = time.perf_counter()
    response = client.chat.completions.create(
        model=model, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=True, max_tokens=200,
        temperature=0, messages=[{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}])
    choice = response.choices[0]
    print(f"finish_reason: {choice.finish_reason}   ({time.perf_counter() - start:.2f} s)")
    for call in choice.message.tool_calls or []:
        print(f"call: {call.function.name}({call.function.arguments})  id={call.id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0, timeout=300)
    print(f"openai {openai.__version__} against {args.url} ({args.model})")
    for title, demo in (("beta.chat.completions.parse(response_format=CalendarEvent)", parse_demo),
                        ("streamed tool call, tool_choice=\"required\", parallel_tool_calls=False",
                         streamed_tool_call_demo),
                        ("parallel tool calls, tool_choice=\"required\", parallel_tool_calls=True",
                         parallel_tool_calls_demo)):
        print(f"\n== {title}")
        demo(client, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
