#!/usr/bin/env bash
# Start `llmserve serve` (default: the embedded model), time start -> /health -> first chat
# answer, print the resident memory of each of its processes, and stop it.
# Usage: bash benchmarks/cpu_startup.sh [llmserve serve flags...]   (PORT=... to move the port)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8391}
LLMSERVE=${LLMSERVE:-.venv/bin/llmserve}
if curl -s -o /dev/null "localhost:$PORT/health"; then echo "port $PORT is taken" >&2; exit 1; fi
t0=$(date +%s.%N)
"$LLMSERVE" serve --port "$PORT" "$@" > /tmp/llmserve-startup.log 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until curl -s -o /dev/null "localhost:$PORT/health"; do
  kill -0 $pid 2>/dev/null || { cat /tmp/llmserve-startup.log >&2; exit 1; }
  sleep 0.05
done
t1=$(date +%s.%N)
answer=$(curl -s "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":20,"temperature":0}')
t2=$(date +%s.%N)
python3 -c "import json,sys; print('answer:', json.loads(sys.argv[1])['choices'][0]['message']['content'])" "$answer"
echo "start -> /health $(python3 -c "print(f'{$t1 - $t0:.2f}')") s, start -> first answer $(python3 -c "print(f'{$t2 - $t0:.2f}')") s"
total=0
for p in $pid $(pgrep -P $pid) $(for c in $(pgrep -P $pid); do pgrep -P "$c" || true; done); do
  rss=$(awk '/VmRSS/{print $2}' "/proc/$p/status" 2>/dev/null || true)
  [ -n "$rss" ] || continue
  printf '  %-60s %6d MB\n' "$(tr '\0' ' ' < "/proc/$p/cmdline" | cut -c1-60)" $((rss / 1024))
  total=$((total + rss))
done
echo "resident memory, all processes: $((total / 1024)) MB"
