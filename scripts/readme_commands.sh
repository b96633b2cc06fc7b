#!/usr/bin/env bash
# Run the README's CPU-sized command blocks as printed, in order, each in a fresh shell that
# followed the README's one activation line (`source .venv/bin/activate`). A block is CPU-sized
# when the line before its ```bash fence is `<!-- ci: run -->`. Needs scripts/setup.sh first.
# CI (.ci/run) calls it after the test suite; on 2 cores it takes ~3 minutes (the main job's
# 200 iterations are most of it). `scripts/readme_commands.sh --list` prints the blocks only.
set -euo pipefail
cd "$(dirname "$0")/.."
blocks=$(mktemp -d)
trap 'rm -rf "$blocks"' EXIT
# one file per marked block: blocks/NN.sh
awk -v dir="$blocks" '
  /^<!-- ci: run -->$/ { marked = 1; next }
  marked && /^```bash$/ { n++; file = sprintf("%s/%02d.sh", dir, n); inside = 1; marked = 0; next }
  inside && /^```$/ { inside = 0; close(file); next }
  inside { print > file; next }
  { marked = 0 }
' README.md
shopt -s nullglob
files=("$blocks"/*.sh)
[ ${#files[@]} -gt 0 ] || { echo "readme_commands.sh: no '<!-- ci: run -->' block in README.md" >&2; exit 1; }
if [ "${1:-}" = --list ]; then
  for f in "${files[@]}"; do echo "--- block $(basename "$f" .sh)"; cat "$f"; done
  exit 0
fi
[ -x .venv/bin/python ] || { echo "readme_commands.sh: run scripts/setup.sh first (.venv is missing)" >&2; exit 1; }
for f in "${files[@]}"; do
  echo "readme_commands.sh: block $(basename "$f" .sh):" >&2
  sed 's/^/    /' "$f" >&2
  start=$(date +%s)
  env -i HOME="$HOME" PATH=/usr/local/bin:/usr/bin:/bin TERM="${TERM:-dumb}" \
    bash --noprofile --norc -c "set -euo pipefail; source .venv/bin/activate; source '$f'" \
    || { echo "readme_commands.sh: block $(basename "$f" .sh) failed" >&2; exit 1; }
  echo "readme_commands.sh: block $(basename "$f" .sh) ok ($(( $(date +%s) - start )) s)" >&2
done
