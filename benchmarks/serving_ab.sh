#!/usr/bin/env bash
# A/B of two servers on one machine, alternating (A B A B ...), because on the lent GPU machines
# the same server's throughput moves by more between runs and machines than most changes do.
#
#   bash benchmarks/serving_ab.sh MODEL_DIR A_SRC B_SRC [ROUNDS] [LEVELS]
#
# A_SRC / B_SRC: source trees to serve from (e.g. this checkout, and `git worktree add /tmp/base
# main@{1}`); each server runs with LLMSERVE_STEP_TRACE, so every line also gives the median
# decode step at the level's batch size. Output: one line per (server, round, C), under ${OUT:-./ab-out}.
#   ROUNDS default 2, LEVELS default "32 128"; in 512 / out 128, 2C timed requests after C warm-up.
set -u
model=$1 a=$2 b=$3 rounds=${4:-2} levels=${5:-"32 128"}
out=${OUT:-./ab-out}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
source "$here/server_helpers.sh"
port=${PORT:-8123}

serve_bench() {  # NAME SRC
  local name=$1 src=$2
  rm -f "$out/tr_$name.jsonl"
  (cd "$src" && LLMSERVE_STEP_TRACE="$out/tr_$name.jsonl" PYTHONPATH="${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$src" exec python3 -c \
     "import sys; from llmserve.cli import main; sys.exit(main())" \
     serve --model "$model" --port "$port" --max-concurrent-requests 1024) > "$out/serve_$name.log" 2>&1 &
  local pid=$!
  wait_for_health $pid "$port" "$out/serve_$name.log" || return 1
  for c in $levels; do
    timeout 300 python3 "$here/serving.py" --backend openai --model "$(basename "$model")" --base-url "http://127.0.0.1:$port" \
      --tokenizer "$model" --input-len 512 --output-len 128 --num-prompts $((2 * c)) --max-concurrency "$c" --warmup "$c" \
      > "$out/bench_${name}_$c.log" 2>&1
    echo "$name C=$c: $(grep -E 'output tokens \(' "$out/bench_${name}_$c.log" | awk '{print $NF}') out tok/s"
  done
  kill -INT $pid; wait $pid
  python3 - "$out/tr_$name.jsonl" $levels <<'PY'
import json, os, statistics, sys
if not os.path.exists(sys.argv[1]):
    sys.exit("    no step trace (that tree predates LLMSERVE_STEP_TRACE)")
steps = [json.loads(line) for line in open(sys.argv[1])]
for rows in map(int, sys.argv[2:]):
    ms = [(s["end"] - s["start"]) * 1e3 for s in steps if s["prefill"] == 0 and s["decode"] == rows]
    print(f"    decode step at {rows} rows: p50 {statistics.median(ms):.2f} ms over {len(ms)} steps" if ms else f"    no pure decode step at {rows} rows")
PY
}

for r in $(seq "$rounds"); do
  serve_bench "A$r" "$a"
  serve_bench "B$r" "$b"
done
