"""The official `openai` client against `hindsight serve`: stream, tools, logprobs, json_schema.

Run by serve/tests/real_model.rs with OPENAI_BASE_URL pointing at the server.
"""
import json
import os

from openai import OpenAI

client = OpenAI()
MODEL = os.environ["HINDSIGHT_MODEL_NAME"]
ask = [{"role": "user", "content": "What is the capital of France?"}]

# Models list.
ids = [m.id for m in client.models.list().data]
assert MODEL in ids, ids

# Plain, with logprobs and our token ids.
r = client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=20,
                                   logprobs=True, top_logprobs=2)
text = r.choices[0].message.content
assert "Paris" in text, text
lp = r.choices[0].logprobs.content
assert len(lp) == r.usage.completion_tokens, (len(lp), r.usage)
assert all(t.logprob <= 0 for t in lp)
assert all(isinstance(t.model_extra["token_id"], int) for t in lp)
print("plain:", repr(text))

# Stream.
parts, finish = [], None
for chunk in client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=20,
                                            stream=True):
    for c in chunk.choices:
        parts.append(c.delta.content or "")
        finish = c.finish_reason or finish
assert "".join(parts) == text, ("".join(parts), text)
assert finish in ("stop", "length"), finish
print("stream ok")

# Tools, forced call: arguments follow the tool's schema.
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}]
r = client.chat.completions.create(
    model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
    tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
    temperature=0, max_tokens=60)
call = r.choices[0].message.tool_calls[0]
assert r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason
assert call.function.name == "get_weather"
args = json.loads(call.function.arguments)
assert args["unit"] in ("celsius", "fahrenheit"), args
print("tool call:", call.function.arguments)

# A tool result goes back through the template.
r2 = client.chat.completions.create(
    model=MODEL, temperature=0, max_tokens=30, tools=tools,
    messages=[{"role": "user", "content": "What's the weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}])
assert r2.choices[0].message.content is not None or r2.choices[0].message.tool_calls
print("after tool:", repr(r2.choices[0].message.content))

# Structured output.
schema = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 40},
    "confidence": {"type": "string", "enum": ["low", "medium", "high"]}},
    "required": ["answer", "confidence"], "additionalProperties": False}
r = client.chat.completions.create(
    model=MODEL, messages=ask, temperature=0.7, seed=5, max_tokens=60,
    response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
obj = json.loads(r.choices[0].message.content)
assert obj["confidence"] in ("low", "medium", "high"), obj
print("json_schema:", obj)

# Errors surface as the client's typed exceptions.
try:
    client.chat.completions.create(model="no-such-model", messages=ask)
    raise AssertionError("expected NotFoundError")
except Exception as e:  # openai.NotFoundError
    assert type(e).__name__ == "NotFoundError", repr(e)
try:
    client.chat.completions.create(model=MODEL, messages=ask, temperature=5)
    raise AssertionError("expected BadRequestError")
except Exception as e:
    assert type(e).__name__ == "BadRequestError", repr(e)

print("ALL OK")
