#!/usr/bin/env bash
# Regenerates dashboard.schema.json, the JSON schema hindsight.json is validated against
# (tests/prometheus.rs, with check-jsonschema from PyPI). No registry package ships Grafana's
# dashboard JSON schema as such; npm's @grafana/schema ships Grafana's dashboard types, generated
# by Grafana from its own CUE schema, as TypeScript declarations. This turns the classic
# dashboard type (`Dashboard` in raw/dashboard/x, the JSON that file provisioning and the
# import API take) into a JSON schema with ts-json-schema-generator: unknown keys are refused
# (`additionalProperties: false`), enums and required fields kept.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SCHEMA_VERSION=13.2.3
GENERATOR_VERSION=2.9.0
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
npm pack --silent "@grafana/schema@$SCHEMA_VERSION" >/dev/null
tar xzf "grafana-schema-$SCHEMA_VERSION.tgz"
npm install --silent --no-audit --no-fund --no-save "ts-json-schema-generator@$GENERATOR_VERSION" >/dev/null
cp package/dist/types/raw/dashboard/x/types.gen.d.ts dashboard.d.ts
npx ts-json-schema-generator --path dashboard.d.ts --type Dashboard --no-type-check \
  -o "$HERE/dashboard.schema.json"
echo "wrote $HERE/dashboard.schema.json (@grafana/schema $SCHEMA_VERSION)"
