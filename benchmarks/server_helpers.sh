# Sourced by the benchmark scripts that start a server (serving_ab.sh, server_vs_engine.sh).

wait_for_health() {  # PID PORT LOG: until the server answers /health; 1 (and its log's tail) if it died
  local pid=$1 port=$2 log=$3
  while ! curl -sf "localhost:$port/health" >/dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "the server did not start:"; tail -5 "$log"; return 1; }
    sleep 1
  done
}
