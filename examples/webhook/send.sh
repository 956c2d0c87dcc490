#!/usr/bin/env bash
# Send one signed feedback event (or a batch) to Hindsight with curl + openssl.
#
#   HINDSIGHT_SECRET=s3cret ./send.sh '{"interaction_id":"<id>","kind":"thumbs","value":true}'
#   HINDSIGHT_BATCH=1 ./send.sh '{"events":[...]}'        # POST /hindsight/v1/feedback/batch
#   IDEMPOTENCY_KEY=retry-42 ./send.sh '...'              # retries with the same key are accepted once
#
# Signature: x-hindsight-signature: v1=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>
# with x-hindsight-timestamp: <unix seconds>. The body must be sent byte-for-byte as signed.
set -euo pipefail

url="${HINDSIGHT_URL:-http://127.0.0.1:8080}"
body="${1:?usage: send.sh '<json event>'}"
path=/hindsight/v1/feedback
[ -n "${HINDSIGHT_BATCH:-}" ] && path=/hindsight/v1/feedback/batch

headers=(-H 'content-type: application/json')
if [ -n "${HINDSIGHT_SECRET:-}" ]; then
  ts=$(date +%s)
  sig=$(printf '%s.%s' "$ts" "$body" | openssl dgst -sha256 -hmac "$HINDSIGHT_SECRET" -r | cut -d' ' -f1)
  headers+=(-H "x-hindsight-timestamp: $ts" -H "x-hindsight-signature: v1=$sig")
fi
[ -n "${IDEMPOTENCY_KEY:-}" ] && headers+=(-H "Idempotency-Key: $IDEMPOTENCY_KEY")

curl -sS -X POST "$url$path" "${headers[@]}" --data-binary "$body" -w '\n%{http_code}\n'
