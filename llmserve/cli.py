"""The ``llmserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from llmserve.sampling_params import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one worker process each (default: 1)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weights and KV cache dtype (default: float32 on CPU, the checkpoint's fp16/bf16 on GPU)")
    p.add_argument("--max-total-token-num", type=int, default=None, help="KV cache size in tokens (default: from free memory; 16384 on CPU)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="on GPU, decode steps of up to this many requests replay CUDA graphs captured at start-up "
                        "(batch sizes 1, 2, 4, then multiples of 8); 0 = none (default: 256)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly, capturing no CUDA graphs (as vLLM's flag)")
    p.add_argument("--dequantize", action="store_true",
                   help="on CPU, expand a GGUF model's Q4_0/Q4_1/Q8_0 matrices to float32 at load instead of "
                        "running them in their blocks with the quantized kernel (the same values; slower, "
                        "4-8x the memory; GPUs always dequantize)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="on one GPU, wait for each step's tokens before scheduling the next, instead of "
                        "scheduling it while the GPU runs (as SGLang's flag); same tokens, slower")


def _step_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of how steps run: CUDA graphs, the overlapped loop, quantized weights."""
    return dict(cuda_graph_max_bs=0 if args.enforce_eager else args.cuda_graph_max_bs,
                overlap=False if args.disable_overlap_schedule else None, dequantize=args.dequantize)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--mem-fraction", type=float, default=0.85,
                   help="on GPU, the share of the card's memory this server may hold: weights, KV cache and "
                        "activations; the KV cache gets what the weights leave of it (default: 0.85)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="most tokens of one request, prompt + max_new_tokens; longer requests get a 422 (default: the model's context, capped by the KV cache)")
    p.add_argument("--max-input-tokens", type=int, default=None,
                   help="most prompt tokens of one request (default: max-total-tokens - 1)")
    p.add_argument("--max-concurrent-requests", type=int, default=128,
                   help="client requests in flight at once; more get HTTP 429 'overloaded' (default: 128)")
    p.add_argument("--max-batch-prefill-tokens", type=int, default=8192,
                   help="prompt tokens prefilled in one step; longer prompts are split over steps (default: 8192)")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split prompts over steps to keep within --max-batch-prefill-tokens, so long prompts "
                        "do not stall running streams; --no-chunked-prefill runs each prompt whole (default: on)")
    p.add_argument("--max-running-requests", type=int, default=256,
                   help="requests decoded together in one batch (default: 256)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send to the OpenAI endpoints (default: the model file or directory name)")
    p.add_argument("--payload-limit", type=int, default=None, metavar="BYTES",
                   help="largest request body; larger ones get HTTP 413 before they are parsed (default: 25 MiB, "
                        "room for a 4 MiB-character prompt however its client escapes it)")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|vllm|PATH",
                   help="defaults for the sampling fields a request leaves unset (temperature, top_p, top_k, "
                        "typical_p, repetition_penalty): 'auto' takes the model's generation_config.json (for a "
                        ".gguf, one beside it, or for the embedded model its model card's temperature 0.2, "
                        "top_p 0.9); 'none' (or vLLM's 'vllm') keeps each API's own defaults; PATH: a folder "
                        "holding a generation_config.json. /info shows what applies (default: auto)")
    from llmserve.tool_parsers import tool_parser_names

    p.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                   help="how the model writes tool calls in its answers, read for tool_choice 'auto' "
                        "(default: the one its chat template's tool format implies, if any)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $LLMSERVE_API_KEY, else none)")
    p.add_argument("--max-best-of", type=int, default=2,
                   help="most samples a TGI request's best_of may ask for (TGI's flag and default: 2)")
    p.add_argument("--full-text-enabled", action="store_true",
                   help="TGI streams: each event's token text is the whole text so far, not the token's own "
                        "(seed 004's fullTextEnabled; default: off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM inference with a token-level KV cache and Triton kernels.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the model over HTTP (TGI and OpenAI APIs)",
                           description="Serve a model over HTTP: TGI's /generate and /generate_stream, OpenAI's "
                                       "/v1/completions and /v1/chat/completions, /health, /info and /metrics.")
    _add_model_args(serve)
    _add_serve_args(serve)

    gen = sub.add_parser("generate", help="continue a raw text prompt")
    gen.add_argument("prompt", nargs="+", help="one or more prompts, generated together in one batch")
    chat = sub.add_parser("chat", help="answer a user message through the model's chat template")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="system message")
    for p in (serve, chat):
        p.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                       help="how conversations become prompts: a built-in template name (llama3, chatml, ...; "
                            "see `llmserve templates`), a JSON file of template fields, or a Jinja file "
                            "(default: the model's own template, else one matched from its name)")
    templates = sub.add_parser("templates", help="list the built-in chat templates, or show how one renders a conversation")
    templates.add_argument("name", nargs="?", help="a template to show (a built-in name, a .json or .jinja file)")
    for p in (gen, chat):
        _add_model_args(p)
        _add_sampling_args(p)
    for p in (serve, gen, chat):
        p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                       help="how much to log; info adds the HTTP access log when serving (default: warning)")
    return parser


def serve(args: argparse.Namespace) -> int:
    from llmserve.server.api.state import ServerConfig
    from llmserve.engine.engine import EngineConfig
    from llmserve.server.serve import run_server

    engine_config = EngineConfig(
        model=args.model, tp=args.tp, dtype=args.dtype, max_total_token_num=args.max_total_token_num,
        mem_fraction=args.mem_fraction, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_batch_prefill_tokens, chunked_prefill=args.chunked_prefill,
        **_step_options(args),
    )
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get("LLMSERVE_API_KEY") or None,
        max_concurrent_requests=args.max_concurrent_requests, max_total_tokens=args.max_total_tokens,
        max_input_tokens=args.max_input_tokens, served_model_name=args.served_model_name,
        chat_template=args.chat_template, payload_limit=args.payload_limit, generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser,
        max_best_of=args.max_best_of, full_text_enabled=args.full_text_enabled,
    )
    return run_server(engine_config, config, log_level=args.log_level)


EXAMPLE_CONVERSATION = [
    {"role": "system", "content": "{system}"}, {"role": "user", "content": "{user 1}"},
    {"role": "assistant", "content": "{answer 1}"}, {"role": "user", "content": "{user 2}"},
]


def show_templates(name: str | None) -> int:
    from llmserve.chat_template import CHAT_TEMPLATES, ChatTemplateError, RoleTemplate, load_chat_template

    if name is None:
        print(f"{'name':<22}{'session_len':>12}  {'temperature':>11}  {'top_p':>5}  stop words")
        for key in CHAT_TEMPLATES.names():
            t = CHAT_TEMPLATES.get(key)()
            kind = "" if isinstance(t, RoleTemplate) and t.capability == "chat" else "  (base model: plain prompts)"
            print(f"{key:<22}{t.session_len:>12}  {t.temperature:>11}  {t.top_p:>5}  {t.stop_words or ''}{kind}")
        return 0
    chosen = load_chat_template(name)
    if chosen.source == "jinja":
        print("a Jinja template renders with the model's tokenizer; start `llmserve chat` with it to try it")
        return 0
    for title, messages in (("with a system message", EXAMPLE_CONVERSATION), ("without", EXAMPLE_CONVERSATION[1:2])):
        try:
            print(f"# {title}:\n{chosen.render(messages)!r}")
        except ChatTemplateError as e:
            print(f"# {title}: {e}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "templates":
        try:
            return show_templates(args.name)
        except ValueError as e:
            print(f"llmserve: error: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from llmserve.llm import LLM
    from llmserve.server.engine_client import EngineError
    from llmserve.worker.protocol import WorkerError

    try:
        if args.command == "serve":
            return serve(args)
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        )
        chat_template = args.chat_template if args.command == "chat" else None
        with LLM(args.model, tp=args.tp, dtype=args.dtype, max_total_token_num=args.max_total_token_num,
                 chat_template=chat_template, **_step_options(args)) as llm:
            print(llm.engine.summary(), file=sys.stderr)
            if args.command == "chat":
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                print(llm.chat(messages + [{"role": "user", "content": args.message}], params).text)
            else:
                for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
                    print(prompt + out.text)   # a raw continuation reads best after its prompt
    except (ValueError, WorkerError, EngineError) as e:   # bad model, bad flags, bad prompt: one line, no traceback
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
