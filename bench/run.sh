#!/usr/bin/env bash
# Run every benchmark, one JSON file each, into bench/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
for which in control data; do
    .venv/bin/hicached bench "$which" --json > "bench/results/$which.json"
    echo "bench/results/$which.json"
done
