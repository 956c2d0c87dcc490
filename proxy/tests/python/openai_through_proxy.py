"""The official `openai` client, once straight at the upstream and once through the proxy:
every case must look exactly the same to the client. Prints one JSON line per proxied call
with its interaction id, for the Rust test to find the records in Kafka.

usage: python3 openai_through_proxy.py DIRECT_BASE_URL PROXY_BASE_URL
"""
import json
import sys

import openai

direct_url, proxy_url = sys.argv[1], sys.argv[2]
direct = openai.OpenAI(base_url=direct_url, api_key="sk-test-SECRET", max_retries=0)
proxied = openai.OpenAI(base_url=proxy_url, api_key="sk-test-SECRET", max_retries=0)

TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "Find an order",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "Where is my order A-17?"}]


def plain(client):
    raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, logprobs=True)
    return raw.parse().model_dump(), raw.headers.get("x-hindsight-interaction-id")


def tools(client):
    raw = client.chat.completions.with_raw_response.create(model="tools", messages=MESSAGES, tools=TOOLS)
    return raw.parse().model_dump(), raw.headers.get("x-hindsight-interaction-id")


def streamed(client, model):
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=MESSAGES, tools=TOOLS, stream=True
    ) as resp:
        chunks = [c.model_dump() for c in resp.parse()]
        return chunks, resp.headers.get("x-hindsight-interaction-id")


cases = {
    "plain": plain,
    "tools": tools,
    "stream_text": lambda c: streamed(c, "m"),
    "stream_tools": lambda c: streamed(c, "tools"),
}
failed = 0
for name, call in cases.items():
    want, no_id = call(direct)
    got, interaction_id = call(proxied)
    assert no_id is None
    if want != got:
        failed += 1
        print(f"MISMATCH {name}:\n direct={want}\n proxy ={got}", file=sys.stderr)
    if not interaction_id:
        failed += 1
        print(f"NO INTERACTION ID {name}", file=sys.stderr)
    print(json.dumps({"case": name, "interaction_id": interaction_id}))

# Upstream client errors reach the client as the same exception.
for client in (direct, proxied):
    try:
        client.chat.completions.create(model="echo-error", messages=MESSAGES)
        failed += 1
        print("expected BadRequestError", file=sys.stderr)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "says no" in str(e), e
sys.exit(1 if failed else 0)
