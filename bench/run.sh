#!/usr/bin/env bash
# Run every benchmark, one JSON file each, into bench/results/.
# The CUDA bench runs only where torch sees a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
hc=.venv/bin/hicached
for which in control data ranks scale; do
    $hc bench "$which" --json > "bench/results/$which.json"
    echo "bench/results/$which.json"
done
for backend in file s3 mooncake; do
    $hc bench l3 --backend "$backend" --json > "bench/results/l3-$backend.json"
    echo "bench/results/l3-$backend.json"
done
if .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    for size in 65536 1048576; do
        $hc bench cuda --json --page-bytes "$size" --pages $((32 * 1048576 / size)) \
            > "bench/results/cuda-$size.json"
        echo "bench/results/cuda-$size.json"
    done
fi
