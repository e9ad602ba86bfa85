#!/usr/bin/env bash
# The prefix cache under a shared system prompt: `llmserve serve` with its prefix cache (the
# default) and with --no-prefix-cache, one after the other on this machine, each under
# benchmarks/serving.py --workload shared-prefix: C clients, one common prefix of P tokens, then a
# question of Q tokens per request (the issue's case: 64 clients, 2,000 + 200 tokens). Prints one
# table: throughput, TTFT p50 / p99 and the prefix cache's hit rate (from /metrics) per server.
#
#   bash benchmarks/prefix_cache_serving.sh MODEL_DIR [CLIENTS] [PREFIX_LEN] [INPUT_LEN] [OUTPUT_LEN] [MODES]
#
# Defaults 64 2000 200 128, MODES "on off"; 4C timed requests after C untimed ones (which also put
# the prefix in the cache, as the thousands of earlier requests of a real service would). Logs and
# results go to ${OUT:-./prefix-cache-serving}.
set -u
model=$1 clients=${2:-64} prefix_len=${3:-2000} in_len=${4:-200} out_len=${5:-128} modes=${6:-"on off"}
out=${OUT:-./prefix-cache-serving}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/server_helpers.sh"
port=${PORT:-8125}
mkdir -p "$out"

for mode in $modes; do
  flags=""
  [ "$mode" = off ] && flags="--no-prefix-cache"
  # shellcheck disable=SC2086
  python3 -c "import sys; from llmserve.cli import main; sys.exit(main())" \
    serve --model "$model" --port "$port" --max-concurrent-requests 1024 $flags > "$out/serve_$mode.log" 2>&1 &
  pid=$!
  wait_for_health $pid "$port" "$out/serve_$mode.log" || continue
  python3 "$here/serving.py" --backend openai --base-url "http://127.0.0.1:$port" --tokenizer "$model" \
    --workload shared-prefix --shared-prefix-len "$prefix_len" --input-len "$in_len" --output-len "$out_len" \
    --num-prompts $((4 * clients)) --max-concurrency "$clients" --warmup "$clients" \
    --result-file "$out/serving_$mode.json" > "$out/serving_$mode.log" 2>&1 \
    || { echo "serving.py failed ($mode):"; tail -5 "$out/serving_$mode.log"; }
  kill -INT $pid; wait $pid
done

python3 - "$out" $modes <<'PY'
import json, os, sys
out, modes = sys.argv[1], sys.argv[2:]
print("| prefix cache | req/s | out tok/s | total tok/s | TTFT p50 ms | TTFT p99 ms | E2E p50 ms | hit rate |")
print("|--|--:|--:|--:|--:|--:|--:|--:|")
for mode in modes:
    path = f"{out}/serving_{mode}.json"
    if not os.path.exists(path):
        print(f"| {mode} | (no result: see {out}/serving_{mode}.log) |")
        continue
    s = json.load(open(path))["summary"]
    cache = s.get("prefix_cache")
    hit = f"{cache['hit_rate']:.3f}" if cache and cache.get("hit_rate") is not None else "-"
    print(f"| {mode} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {s['total_token_throughput']:.1f} | "
          f"{s['ttft_ms']['p50']:.1f} | {s['ttft_ms']['p99']:.1f} | {s['e2e_ms']['p50']:.1f} | {hit} |")
PY
