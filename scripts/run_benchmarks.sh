#!/usr/bin/env bash
# Reproduce the numbers in the README (Linux, root for cgroups and
# drop_caches; about an hour on 2 cores, most of it training).
#
#   bash scripts/run_benchmarks.sh [MODELS_DIR] [RESULTS_DIR]
#
# MODELS_DIR gets the models (about 25 GB); RESULTS_DIR the JSON and PNGs.
set -euo pipefail
cd "$(dirname "$0")/.."
models=${1:-$HOME/.cache/mlx_streaming/bench-models}
out=${2:-bench-results}
mkdir -p "$models" "$out"

# A model with learned routing (45 minutes of training), and a 6 GB
# synthetic one (random routing) in mlx-lm format, converted under a memory
# limit of a quarter of its experts.
[ -f "$models/trained/stream/experts/manifest.json" ] ||
  python scripts/train_moe.py --out "$models/trained" --minutes 45 --max-steps 2000
[ -f "$models/syn6g-mlx/config.json" ] ||
  python scripts/make_synthetic_moe.py --out "$models/syn6g-mlx" --format mlx-lm \
    --hidden-size 2048 --layers 16 --experts 128 --top-k 8 --moe-intermediate 768
rm -rf "$models/syn6g-stream"
sync && echo 3 > /proc/sys/vm/drop_caches
python scripts/run_limited.py --memory-limit-gb 1.5 -- \
  python -m mlx_streaming.convert --model "$models/syn6g-mlx" --out "$models/syn6g-stream" \
  --no-progress | tee "$out/convert-limited.json"

T="$models/trained"
S="$models/syn6g"
# Issue 2: decode vs mlx-lm, warm page cache, full and 25% pools.
python -m mlx_streaming.bench decode --model "$T/stream" --mlx-model "$T/mlx" \
  --pools 1.0,0.25 --max-tokens 300 --repeats 5 --out "$out/decode-trained-warm"
python -m mlx_streaming.bench decode --model "$S-stream" --mlx-model "$S-mlx" \
  --pools 1.0,0.25 --max-tokens 16 --repeats 5 --out "$out/decode-syn6g-warm"
# Issue 4: experts 3x the memory limit, cold.
python -m mlx_streaming.bench decode --model "$S-stream" --mlx-model "$S-mlx" \
  --pools 0.125,0.25 --memory-limit-gb 2 --cold --max-tokens 24 --repeats 3 \
  --out "$out/decode-syn6g-limited"
python -m mlx_streaming.bench cache --model "$T/stream" --tokens 1024 --out "$out/cache-trained"
python -m mlx_streaming.bench verify --model "$T/stream" --mlx-model "$T/mlx" --out "$out/verify-trained"
python -m mlx_streaming.bench verify --model "$S-stream" --pool 0.25 --repeats 4 \
  --out "$out/verify-syn6g"
python -m mlx_streaming.bench prefill --model "$T/stream" --mlx-model "$T/mlx" \
  --out "$out/prefill-trained"
# Issue 3: read throughput vs dd (cold and warm), then prefetch off/on/auto
# in cold decode on both models.
python -m mlx_streaming.bench io --dir "$models/io-blobs" --blob-gb 0.5 --rounds 5 \
  --out "$out/io-throughput"
python -m mlx_streaming.bench io --no-throughput --model "$T/stream" --pools 0.25,0.5 \
  --max-tokens 400 --temp 0.8 --direct-io on --repeats 5 --out "$out/io-prefetch-trained"
python -m mlx_streaming.bench io --no-throughput --model "$S-stream" --pools 0.25,0.5 \
  --max-tokens 24 --temp 0.8 --direct-io on --repeats 3 --out "$out/io-prefetch-syn6g"
