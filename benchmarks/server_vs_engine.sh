#!/usr/bin/env bash
# The server against the offline engine on one machine, one run: benchmarks/engine.py (LLMEngine in
# this process, C requests in flight) and then `llmserve serve` under benchmarks/serving.py at the
# same concurrency, in 512 / out 128 by default. Prints one table: out tok/s and TPOT of each, their
# ratio, and the server's median pure-decode step of exactly C rows (LLMSERVE_STEP_TRACE, whole run).
#
#   bash benchmarks/server_vs_engine.sh MODEL_DIR [LEVELS] [INPUT_LEN] [OUTPUT_LEN]
#
# LEVELS default "1 32 128 256"; timed requests per level: 8 at C=1, else max(96, 2C), after C
# untimed. Logs and traces go to ${OUT:-./server-vs-engine}.
set -u
model=$1 levels=${2:-"1 32 128 256"} in_len=${3:-512} out_len=${4:-128}
out=${OUT:-./server-vs-engine}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/server_helpers.sh"
port=${PORT:-8124}
mkdir -p "$out"
nprompts() { if [ "$1" -eq 1 ]; then echo 8; elif [ $((2 * $1)) -gt 96 ]; then echo $((2 * $1)); else echo 96; fi; }
csv() { echo "$1" | tr ' ' ','; }

counts=$(for c in $levels; do nprompts "$c"; done | paste -sd,)
python3 "$here/engine.py" --model "$model" --concurrency "$(csv "$levels")" --num-prompts "$counts" \
  --input-len "$in_len" --output-len "$out_len" --json "$out/engine.json" > "$out/engine.log" 2>&1 \
  || { echo "engine.py failed:"; tail -5 "$out/engine.log"; exit 1; }

rm -f "$out/trace.jsonl"
LLMSERVE_STEP_TRACE="$out/trace.jsonl" python3 -c "import sys; from llmserve.cli import main; sys.exit(main())" \
  serve --model "$model" --port "$port" --max-concurrent-requests 1024 > "$out/serve.log" 2>&1 &
pid=$!
wait_for_health $pid "$port" "$out/serve.log" || exit 1
for c in $levels; do
  python3 "$here/serving.py" --backend openai --model "$(basename "$model")" --base-url "http://127.0.0.1:$port" \
    --tokenizer "$model" --input-len "$in_len" --output-len "$out_len" --num-prompts "$(nprompts "$c")" \
    --max-concurrency "$c" --warmup "$c" --result-file "$out/serving_c$c.json" > "$out/serving_c$c.log" 2>&1
done
kill -INT $pid; wait $pid

python3 - "$out" $levels <<'PY'
import json, statistics, sys
out, levels = sys.argv[1], [int(c) for c in sys.argv[2:]]
engine = {r["concurrency"]: r for r in json.load(open(f"{out}/engine.json"))["results"]}
steps = [json.loads(line) for line in open(f"{out}/trace.jsonl")]
print("| C | engine out tok/s | engine TPOT ms | server out tok/s | server TPOT ms | server / engine | server decode step p50 at C rows |")
print("|--:|--:|--:|--:|--:|--:|--:|")
for c in levels:
    s = json.load(open(f"{out}/serving_c{c}.json"))["summary"]
    ms = [(x["end"] - x["start"]) * 1e3 for x in steps if x["prefill"] == 0 and x["decode"] == c]
    e = engine[c]
    step = f"{statistics.median(ms):.2f} ms ({len(ms)} steps)" if ms else "-"
    print(f"| {c} | {e['out_tok_per_s']:.1f} | {e['tpot_ms']:.2f} | {s['output_throughput']:.1f} | "
          f"{s['tpot_ms']['mean']:.2f} | {s['output_throughput'] / e['out_tok_per_s']:.2f} | {step} |")
PY
