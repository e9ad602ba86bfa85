"""What the HTTP process spends on each streamed token, beside a server that does only what any
server must.

Why: the HTTP process detokenizes, serializes and writes every token of every replica. At a GPU's
token rate that is a core's work: on 2 x H200, ``--dp 2`` gave 1.47x one replica's throughput,
both replicas streaming through one HTTP process (benchmarks/README.md, data parallelism).

What is measured
  ours    ``llmserve serve --model MODEL`` under ``serving.py``'s load (``--num-prompts`` random
          prompts of ``--input-len`` tokens, ``--output-len`` out, ``--concurrency`` in flight,
          ``ignore_eos``), once per ``--backends`` API. The HTTP process's CPU time (its own
          threads, from /proc: not the engine core's nor the workers') over the run, divided by
          the tokens streamed. The default model is a tiny random Llama made here, so that the
          engine on a CPU makes tokens faster than a real model would and the HTTP process has
          work enough to measure; what a token costs the HTTP process does not depend on the model.
  floor   a bare asyncio server (uvloop when installed, as uvicorn picks it) answering TGI's
          ``POST /generate_stream``: every open stream gets one event a step, at the step interval
          ours ran at (its mean inter-token latency), each event one ``json.dumps`` of a TGI
          token event and one chunked write. What any server must do per token; nothing else.
  The same load generator drives both, from this process's child: its CPU is not counted.

Columns
  tok/s            output tokens per second of the run
  HTTP CPU s       the server process's CPU seconds over the run
  CPU us / token   HTTP CPU over the tokens streamed
  one core's tok/s 1e6 / (CPU us / token): the most tokens a second that process could stream
  x floor          CPU us / token over the floor's

Peer: none on a CPU. lightllm's HTTP server needs its GPU router processes and TGI's router is
Rust (not installed here); on the GPU machine, lightllm's is the peer to add.

Run:   python benchmarks/frontend_cost.py --json benchmarks/results/frontend_cost-cpu.json
Smoke: python benchmarks/frontend_cost.py --num-prompts 16 --output-len 16 --backends tgi
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from common import markdown_table, remove_script_dir_from_sys_path, write_json
from server_process import HERE, llmserve_server, serving_load

remove_script_dir_from_sys_path()

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``'s own threads (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK      # utime, stime: fields 14 and 15 of stat


def server_pid(port: int) -> int:
    """The pid listening on ``port`` (the HTTP process), from /proc/net/tcp and the fds."""
    hexport = f"{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[1].endswith(":" + hexport) and cols[3] == "0A":     # 0A: LISTEN
                    inodes.add(cols[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
    raise RuntimeError(f"nothing listens on port {port}")


def measured_load(port: int, tokenizer: str, args: argparse.Namespace, *flags: str) -> dict:
    """serving.py's summary of the load against the server on ``port``, with the server's CPU."""
    pid = server_pid(port)
    before = cpu_seconds(pid)
    summary = serving_load(f"http://127.0.0.1:{port}", tokenizer, args.concurrency, args.num_prompts,
                           args.input_len, args.output_len, "--ignore-eos", "--quiet", *flags)
    summary["server_cpu_s"] = cpu_seconds(pid) - before
    return summary


# -- the floor server ---------------------------------------------------------------------------
_EVENT = {"index": 0, "token": {"id": 1, "text": " word", "logprob": -1.0, "special": False}, "top_tokens": [],
          "generated_text": None, "details": None}


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


async def _floor_main(port: int, step_s: float) -> None:
    streams: dict[asyncio.StreamWriter, list] = {}     # writer -> [tokens left, done event]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(step_s)
            for writer, state in list(streams.items()):
                state[0] -= 1
                event = dict(_EVENT, index=state[1])
                state[1] += 1
                if state[0] == 0:
                    event["generated_text"] = "text"
                writer.write(_chunk(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"))
                if state[0] == 0:
                    writer.write(b"0\r\n\r\n")
                    del streams[writer]
                    state[2].set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:                                  # keep-alive: one request after another
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.I)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if not head.startswith(b"POST /generate_stream"):          # serving.py's GET /metrics
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                body = json.loads(body)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                done = asyncio.Event()
                streams[writer] = [body["parameters"]["max_new_tokens"], 1, done]
                await done.wait()
        writer.close()

    ticking = asyncio.ensure_future(ticker())
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()
    ticking.cancel()


@contextlib.contextmanager
def floor_server(port: int, step_s: float) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "frontend_cost.py"), "--serve-floor", str(port),
                             "--step-s", str(step_s)])
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(RuntimeError):
                server_pid(port)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the floor server did not start")
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        proc.wait()


def run_floor(port: int, step_s: float) -> None:
    try:
        import uvloop
        uvloop.run(_floor_main(port, step_s))
    except ImportError:
        asyncio.run(_floor_main(port, step_s))


# -- the benchmark ------------------------------------------------------------------------------
def tiny_model(directory: str) -> str:
    out = os.path.join(directory, "tiny")
    subprocess.run([sys.executable, os.path.join(HERE, "make_random_model.py"), "--shape", "tiny", "--device", "cpu",
                    "--out", out], check=True, stdout=subprocess.DEVNULL)
    return out


def row(name: str, s: dict, floor_us: float | None) -> list[str]:
    tokens = s["total_output_tokens"]
    us = s["server_cpu_s"] / tokens * 1e6
    return [name, f"{s['output_throughput']:.0f}", f"{s['server_cpu_s']:.2f}", f"{us:.0f}", f"{1e6 / us:.0f}",
            f"{us / floor_us:.2f}x" if floor_us else "1x"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: a tiny random Llama made here)")
    p.add_argument("--backends", default="tgi,openai,openai-chat")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--server-flags", default="", help="more flags for llmserve serve, one string")
    p.add_argument("--json", default=None)
    p.add_argument("--serve-floor", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-s", type=float, default=0.05, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_floor:
        run_floor(args.serve_floor, args.step_s)
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_model(tmp)
        results: dict[str, dict] = {}
        with llmserve_server(model, args.port, args.server_flags.split()):
            for backend in args.backends.split(","):
                results[backend] = measured_load(args.port, model, args, "--backend", backend)
                print("ours,", backend, "|".join(row("", results[backend], None)[1:5]), file=sys.stderr)
        step_s = results[args.backends.split(",")[0]]["itl_ms"]["mean"] / 1e3
        with floor_server(args.port + 1, step_s):
            results["floor"] = measured_load(args.port + 1, model, args, "--backend", "tgi", "--no-server-tokenize")

    floor_us = results["floor"]["server_cpu_s"] / results["floor"]["total_output_tokens"] * 1e6
    rows = [row(f"ours, {b}", results[b], floor_us) for b in args.backends.split(",")]
    rows.append(row(f"floor (bare asyncio, tgi events, a step every {step_s * 1e3:.0f} ms)", results["floor"], None))
    print(f"\n### HTTP process CPU per streamed token: {args.num_prompts} requests, {args.concurrency} in flight, "
          f"{args.input_len} in / {args.output_len} out\n")
    print(markdown_table(["server", "tok/s", "HTTP CPU s", "CPU us / token", "one core's tok/s", "x floor"], rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
