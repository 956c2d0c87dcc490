#!/usr/bin/env python3
"""Send one signed feedback event to Hindsight (standard library only).

    HINDSIGHT_SECRET=s3cret python3 send.py '{"interaction_id": "<id>", "kind": "thumbs", "value": true}'

Signature: x-hindsight-signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>,
x-hindsight-timestamp: <unix seconds>. Set IDEMPOTENCY_KEY to make retries safe.
"""
import hashlib
import hmac
import json
import os
import sys
import time
import urllib.error
import urllib.request


def send(event: dict, url: str, secret: str | None, idempotency_key: str | None = None) -> tuple[int, dict]:
    body = json.dumps(event, separators=(",", ":")).encode()
    path = "/hindsight/v1/feedback/batch" if "events" in event else "/hindsight/v1/feedback"
    headers = {"content-type": "application/json"}
    if secret:
        ts = str(int(time.time()))
        sig = hmac.new(secret.encode(), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
        headers["x-hindsight-timestamp"] = ts
        headers["x-hindsight-signature"] = f"v1={sig}"
    if idempotency_key:
        headers["Idempotency-Key"] = idempotency_key
    req = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 4xx: {"error": {"message": ..., "param": ..., ...}}
        return e.code, json.loads(e.read() or b"{}")


if __name__ == "__main__":
    status, answer = send(
        json.loads(sys.argv[1]),
        os.environ.get("HINDSIGHT_URL", "http://127.0.0.1:8080"),
        os.environ.get("HINDSIGHT_SECRET"),
        os.environ.get("IDEMPOTENCY_KEY"),
    )
    print(json.dumps(answer))
    print(status)
    sys.exit(0 if status == 202 else 1)
