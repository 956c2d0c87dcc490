#!/usr/bin/env python3
"""A small support agent on the official `openai` package, pointed at the Hindsight proxy.

    python3 examples/agent/agent.py --base-url http://127.0.0.1:8080/v1 --secret s3cret \
        --ticket "Where is my order A-1001? My email is ana@example.com."

The only Hindsight-specific line of the agent itself is `base_url`. Each turn re-sends the whole
conversation, so the proxy groups the turns into one episode by itself (no header needed); pass
--episode ID to send `x-hindsight-episode` instead. After answering, the agent plays the user:
it checks its answer against the order it looked up and sends signed feedback for the answer's
interaction (`x-hindsight-interaction-id`) with examples/webhook/send.py's `send`.

Prints one JSON line: interaction ids, tool calls, answer, feedback status.
"""
import argparse
import json
import os
import sys
from pathlib import Path

from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "webhook"))
from send import send  # noqa: E402  (the signed webhook sender next door)

# The agent's "backend": a tiny in-file database.
ORDERS = {
    "A-1001": {"status": "shipped", "carrier": "DHL", "eta": "2 days", "customer": "C-7"},
    "A-1002": {"status": "processing", "carrier": None, "eta": "5 days", "customer": "C-9"},
}
CUSTOMERS = {
    "C-7": {"name": "Ana", "email": "ana@example.com", "tier": "gold"},
    "C-9": {"name": "Bo", "email": "bo@example.com", "tier": "standard"},
}


def lookup_order(order_id: str = "") -> dict:
    order = ORDERS.get(str(order_id).strip().upper())
    return {"order_id": order_id, **order} if order else {"error": f"no order {order_id!r}"}


def lookup_customer(customer_id: str = "", email: str = "") -> dict:
    if customer_id in CUSTOMERS:
        return {"customer_id": customer_id, **CUSTOMERS[customer_id]}
    for cid, c in CUSTOMERS.items():
        if email and c["email"] == email.strip().lower():
            return {"customer_id": cid, **c}
    return {"error": "no such customer"}


LOCAL_TOOLS = {"lookup_order": lookup_order, "lookup_customer": lookup_customer}
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_order", "description": "Status, carrier and ETA of an order.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                       "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "lookup_customer", "description": "A customer by id or email.",
        "parameters": {"type": "object", "properties": {"customer_id": {"type": "string"},
                                                         "email": {"type": "string"}}}}},
]
SYSTEM = ("You are a support agent for an online shop. Look orders and customers up with the "
          "tools, then answer the customer in one or two short sentences.")


def run_tool(name: str, arguments: str) -> dict:
    """Runs a tool call locally; an unknown tool or bad arguments become an error result."""
    try:
        return LOCAL_TOOLS[name](**json.loads(arguments or "{}"))
    except (KeyError, TypeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def streamed_turn(client, request: dict) -> tuple[str, dict, str]:
    """One streamed call: (interaction id, assistant message, finish reason)."""
    raw = client.chat.completions.with_raw_response.create(stream=True, **request)
    content, calls, finish = "", {}, None
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        if delta.content:
            content += delta.content
            print(delta.content, end="", flush=True, file=sys.stderr)  # the user sees it stream
        for d in delta.tool_calls or []:  # tool calls arrive as deltas: join them by index
            c = calls.setdefault(d.index, {"id": "", "type": "function",
                                           "function": {"name": "", "arguments": ""}})
            c["id"] = d.id or c["id"]
            if d.function:
                c["function"]["name"] += d.function.name or ""
                c["function"]["arguments"] += d.function.arguments or ""
    print(file=sys.stderr)
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return raw.headers.get("x-hindsight-interaction-id", ""), message, finish


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1"))
    p.add_argument("--feedback-url", help="the proxy's origin (default: --base-url without /v1)")
    p.add_argument("--secret", default=os.environ.get("HINDSIGHT_SECRET"), help="or HINDSIGHT_SECRET")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    p.add_argument("--model", help="default: the first model the server lists")
    p.add_argument("--ticket", default="Hi, where is my order A-1001? My email is ana@example.com.")
    p.add_argument("--episode", help="send x-hindsight-episode (default: the proxy infers episodes)")
    p.add_argument("--first-tool-choice", default="lookup_order",
                   help="tool_choice of the first turn: a function name (that call for sure: "
                        "what a small model needs), required, or auto")
    p.add_argument("--max-tool-rounds", type=int, default=1,
                   help="tool-call turns before the answer (turns after the first: auto); "
                        "raise it for a capable model")
    p.add_argument("--max-tokens", type=int, default=96)
    a = p.parse_args()
    feedback_url = a.feedback_url or a.base_url.rstrip("/").removesuffix("/v1")

    headers = {"x-hindsight-episode": a.episode} if a.episode else None
    client = OpenAI(base_url=a.base_url, api_key=a.api_key, default_headers=headers)
    model = a.model or client.models.list().data[0].id

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": a.ticket}]
    turns, tool_calls, looked_up = [], [], {}
    for rnd in range(a.max_tool_rounds + 1):
        if rnd == 0 and a.first_tool_choice not in ("auto", "required", "none"):
            choice = {"type": "function", "function": {"name": a.first_tool_choice}}
        elif rnd == 0:
            choice = a.first_tool_choice
        else:  # after the last allowed tool round the model must answer
            choice = "auto" if rnd < a.max_tool_rounds else "none"
        iid, message, finish = streamed_turn(client, {
            "model": model, "messages": messages, "tools": TOOLS, "tool_choice": choice,
            "temperature": 0, "max_tokens": a.max_tokens})
        turns.append({"interaction_id": iid, "finish_reason": finish,
                      "tool_calls": len(message.get("tool_calls", []))})
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            fn = call["function"]
            result = run_tool(fn["name"], fn["arguments"])
            tool_calls.append({"name": fn["name"], "arguments": fn["arguments"], "result": result})
            looked_up.update(result if "status" in result else {})
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": json.dumps(result)})

    answer = messages[-1].get("content") or ""
    answer_id = turns[-1]["interaction_id"]

    # The user's verdict: thumbs up if the answer states their order's real status, else thumbs
    # down with a critique (the dense signal the learner distils from).
    mine = next((o for o in ORDERS if o in a.ticket.upper()), None)
    status = ORDERS[mine]["status"] if mine else looked_up.get("status")
    good = bool(status) and status in answer.lower()
    events = [{"interaction_id": answer_id, "kind": "thumbs", "value": good, "source": "agent-example"}]
    if not good:
        events.append({"interaction_id": answer_id, "kind": "comment", "source": "agent-example",
                       "value": f"My order is {status}; the answer should say so." if status
                       else "The answer should tell me where my order is."})
    fb_status, fb_body = send({"events": events}, feedback_url, a.secret)

    print(json.dumps({
        "model": model, "turns": turns, "tool_calls": tool_calls,
        "answer": answer, "answer_chars": len(answer), "answer_interaction_id": answer_id,
        "feedback": {"status": fb_status, "thumbs": good, "response": fb_body},
    }))
    return 0 if 200 <= fb_status < 300 else 1


if __name__ == "__main__":
    sys.exit(main())
