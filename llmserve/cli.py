"""The ``llmserve`` command line."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from llmserve import __version__
from llmserve.common.logs import LOG_FORMATS, LOG_LEVELS, configure_logging, report_error
from llmserve.common.basemodel.layer_weights.random_weights import LOAD_FORMATS
from llmserve.quantization import KV_CACHE_DTYPES, QUANTIZATION_CHOICES
from llmserve.sampling_params import SamplingParams

# Every canonical flag ``--some-flag`` may also come from ``LLMSERVE_SOME_FLAG`` (the command line
# wins), so that a container or a Helm chart can configure the server through its environment.
ENV_PREFIX = "LLMSERVE_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
# vLLM's and TGI's spellings of --dtype's values: auto (None) leaves the choice to llmserve.
_DTYPES = {"auto": None, "float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
           "bfloat16": "bfloat16"}


def _dtype(value: str) -> str | None:
    try:
        return _DTYPES[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(_DTYPES)})") from None


# Aliases: the first option string of each flag is ours (and names its environment variable); the
# others are vLLM's and TGI's names for the same setting, so their launch manifests run unchanged.
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-id", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", "--num-shard", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, one worker process each (default: 1)")
    p.add_argument("--pp", "--pipeline-parallel-size", "-pp", "--pp-size", type=int, default=1, metavar="N",
                   help="pipeline stages of --tp ranks each, holding 1/N of the layers each: for a model that one "
                        "node's --tp GPUs cannot hold, or nodes between which --tp would not pay (--nnodes N puts "
                        "a stage on each). The stages run one after another (no micro-batches yet): a step takes "
                        "as long as on one GPU plus the hand-offs, and runs eagerly (no CUDA graphs, no overlapped "
                        "loop) (default: 1)")
    p.add_argument("--dtype", type=_dtype, default=None, metavar="{auto,float32,float16,bfloat16}",
                   help="weights and KV cache dtype; vLLM's 'half' and 'float' work too (default: auto: float32 "
                        "on CPU, the checkpoint's fp16/bf16 on GPU)")
    p.add_argument("--max-total-token-num", "--max-batch-total-tokens", type=int, default=None, metavar="N",
                   help="KV cache size in tokens (default: from free memory; 16384 on CPU)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="on GPU, decode steps of up to this many requests replay CUDA graphs captured at start-up "
                        "(batch sizes 1, 2, 4, then multiples of 8), and with --speculate so do verify steps of up "
                        "to this many and --speculate-max-batch requests; 0 = none (default: 256)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly, capturing no CUDA graphs (as vLLM's flag)")
    p.add_argument("--enable-custom-all-reduce", action="store_true",
                   help="at --tp > 1 on the GPUs of one node, run small all-reduces (a decode step's) over "
                        "peer-to-peer buffers in torch's symmetric memory instead of NCCL (the default; the flag "
                        "is kept for launch scripts that pass it)")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="NCCL for every all-reduce (vLLM's flag)")
    p.add_argument("--dequantize", action="store_true",
                   help="on CPU, expand a GGUF model's Q4_0/Q4_1/Q8_0 matrices to float32 at load instead of "
                        "running them in their blocks with the quantized kernel (the same values; slower, "
                        "4-8x the memory; GPUs always dequantize)")
    p.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES, default=None,
                   help="the weights' quantization (as vLLM's flag): a quantized checkpoint's format is read from "
                        "its config.json, this only checks it; fp8 also quantizes a bf16/fp16 checkpoint at load "
                        "(per-channel FP8 weights, dynamic per-token FP8 activations)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's dtype (as vLLM's flag): auto, the model's; fp8 (= fp8_e4m3), float8 e4m3 "
                        "with a scale per layer for K and for V (the checkpoint's k_scale / v_scale where it has "
                        "them, else 1.0): twice a bf16 cache's tokens in the same memory (default: auto)")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="where the weights come from (as vLLM's flag): auto, the checkpoint's files; dummy, random "
                        "weights drawn from config.json alone, to benchmark a model's shapes without its checkpoint "
                        "(Llama, Mistral, Qwen3, Qwen3-MoE, Mixtral, Gemma 2; the output means nothing) (default: auto)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="on GPUs, wait for each step's tokens before scheduling the next, instead of "
                        "scheduling it while the GPU runs (as SGLang's flag); same tokens, slower")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="prompt-lookup speculation: draft up to K tokens per decoding request per step from "
                        "n-grams of its own prompt and output, and verify them in one forward; the same tokens, "
                        "faster on outputs that copy their input (TGI's flag) (default: 0, off)")
    p.add_argument("--speculate-max-batch", type=int, default=None, metavar="N",
                   help="steps of more than N decoding requests draft nothing: there verifying costs more than "
                        "it saves (default: 32 on a GPU, 8 on a CPU, where a step's cost grows with its rows)")
    p.add_argument("--prompt-lookup-max-ngram", type=int, default=3, metavar="N",
                   help="longest n-gram of a sequence's end looked up for a draft (default: 3)")
    p.add_argument("--prompt-lookup-min-ngram", type=int, default=1, metavar="N",
                   help="shortest n-gram looked up when no longer one recurs (default: 1)")
    p.add_argument("--step-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a step that has not finished after SECONDS means a hung worker (a stopped process, a "
                        "collective that never returns): the engine stops, open requests end with an error and "
                        "the server exits non-zero; loading the model, compiling and capturing CUDA graphs at "
                        "start-up have no deadline (default: 600)")


def _lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH`` (a local PEFT adapter directory); a bare PATH is named after its directory."""
    name, sep, path = value.partition("=")
    if not sep:
        name, path = os.path.basename(os.path.normpath(value)), value
    path = os.path.abspath(os.path.expanduser(path))
    if not name or not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH with PATH a local LoRA adapter directory")
    return name, path


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", "--lora-adapters", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH",
                   help="LoRA adapters to serve: PEFT directories (adapter_config.json, adapter_model.safetensors) "
                        "on this machine, each selected by its NAME (TGI's adapter_id, OpenAI's model)")
    p.add_argument("--max-loras", type=int, default=4, metavar="N",
                   help="adapters resident on the device at once; others load on demand, the least recently "
                        "used one that no running request uses evicted (default: 4)")
    p.add_argument("--max-lora-rank", type=int, default=64, metavar="R",
                   help="largest adapter rank served; sizes the device pool (default: 64)")
    p.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                   help="adapters kept read in host memory; others are read from disk when loaded (default: all)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load adapters "
                        "from local directories a request names (default: off)")


def _lora_options(args: argparse.Namespace) -> dict:
    names = [name for name, _ in args.lora_modules]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise ValueError(f"--lora-modules names {duplicate!r} twice")
    return dict(lora_modules=dict(args.lora_modules), max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                max_cpu_loras=args.max_cpu_loras, allow_runtime_lora_updating=args.allow_runtime_lora_updating)


def _step_options(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of how steps run: CUDA graphs, the overlapped loop, the weights'
    source and quantization, speculation, the deadline."""
    return dict(cuda_graph_max_bs=0 if args.enforce_eager else args.cuda_graph_max_bs,
                custom_all_reduce=False if args.disable_custom_all_reduce else (True if args.enable_custom_all_reduce else None),
                overlap=False if args.disable_overlap_schedule else None, dequantize=args.dequantize,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, load_format=args.load_format, speculate=args.speculate, speculate_max_batch=args.speculate_max_batch,
                prompt_lookup_min_ngram=args.prompt_lookup_min_ngram, prompt_lookup_max_ngram=args.prompt_lookup_max_ngram,
                step_timeout=args.step_timeout)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", "--hostname", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument("--mem-fraction", "--gpu-memory-utilization", "--cuda-memory-fraction", type=float, default=0.85,
                   metavar="FRACTION",
                   help="on GPU, the share of the card's memory this server may hold: weights, KV cache and "
                        "activations; the KV cache gets what the weights leave of it (default: 0.85)")
    p.add_argument("--max-total-tokens", "--max-model-len", type=int, default=None, metavar="N",
                   help="most tokens of one request, prompt + max_new_tokens; longer requests get a 422 (default: the model's context, capped by the KV cache)")
    p.add_argument("--max-input-tokens", "--max-input-length", type=int, default=None, metavar="N",
                   help="most prompt tokens of one request (default: max-total-tokens - 1)")
    p.add_argument("--max-concurrent-requests", type=int, default=128, metavar="N",
                   help="client requests in flight at once; more get HTTP 429 'overloaded' (default: 128)")
    p.add_argument("--max-batch-prefill-tokens", "--max-num-batched-tokens", type=int, default=8192, metavar="N",
                   help="prompt tokens prefilled in one step; longer prompts are split over steps (default: 8192)")
    p.add_argument("--chunked-prefill", "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split prompts over steps to keep within --max-batch-prefill-tokens, so long prompts "
                        "do not stall running streams; --no-chunked-prefill runs each prompt whole (default: on)")
    p.add_argument("--prefix-cache", "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep computed prompts' and answers' KV in a radix tree, so a request that starts with a "
                        "cached prefix prefills only the rest; --no-prefix-cache prefills every prompt whole (default: on)")
    p.add_argument("--max-running-requests", "--max-num-seqs", "--max-batch-size", type=int, default=256, metavar="N",
                   help="requests decoded together in one batch (default: 256)")
    p.add_argument("--max-top-n-tokens", type=int, default=5, metavar="N",
                   help="most alternatives per token a TGI request may ask for (top_n_tokens) (default: 5)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send to the OpenAI endpoints (default: the model file or directory name)")
    p.add_argument("--payload-limit", type=int, default=None, metavar="BYTES",
                   help="largest request body; larger ones get HTTP 413 before they are parsed (default: 25 MiB, "
                        "room for a 4 MiB-character prompt however its client escapes it)")
    p.add_argument("--max-images-per-request", type=int, default=1,
                   help="images one request may bring, for a model that takes images (default: 1)")
    p.add_argument("--max-image-bytes", type=int, default=20 * 2**20, metavar="BYTES",
                   help="largest encoded image a request may bring or name (default: 20 MiB)")
    p.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                   help="largest image, width x height once decoded (default: 4096 x 4096)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let requests name image files (file:// URLs or absolute paths) under DIR; without "
                        "it a request can never read the server's disk (default: off)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="hosts whose http(s) image URLs requests may name (redirects included); '*' for any; "
                        "without it the server fetches no URL a request names (default: none)")
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
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none)")
    p.add_argument("--max-best-of", type=int, default=2,
                   help="most samples a TGI request's best_of may ask for (TGI's flag and default: 2)")
    p.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="HTTP processes serving the port, each on a core of its own, in front of the same engine "
                        "(vLLM's flag; default: 1). One process caps a server near 7,000 streamed tokens/s; "
                        "with more, interactive sessions (/v1/chat/interactive) are refused and "
                        "--max-concurrent-requests holds per process")
    p.add_argument("--max-sessions", type=int, default=256, metavar="N",
                   help="interactive sessions (/v1/chat/interactive) kept at once; a new one ends the least "
                        "recently used idle one (default: 256)")
    p.add_argument("--session-idle-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="an interactive session idle this long is ended and its cached tokens unpinned (default: 600)")
    p.add_argument("--full-text-enabled", action="store_true",
                   help="TGI streams: each event's token text is the whole text so far, not the token's own "
                        "(seed 004's fullTextEnabled; default: off)")
    p.add_argument("--no-ui", action="store_true",
                   help="serve no chat page at GET / (default: a page that chats with the model from a browser)")


def _add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dp", "--data-parallel-size", "-dp", "--dp-size", type=int, default=1, metavar="N",
                   help="data-parallel replicas: N engine cores of --tp workers each behind the one HTTP process, "
                        "replica r on GPUs r*tp .. r*tp+tp-1; each request goes to the replica whose prefix cache "
                        "likely holds most of its prompt, else to the least busy (default: 1)")
    p.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="spread the tp x pp ranks over N machines, tp*pp/N each (stage by stage: rank r is tp rank "
                        "r %% tp of stage r // tp); run the same command on every machine with its --node-rank, "
                        "and --headless on all but the head (default: 1)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this machine's place among the --nnodes: 0 is the head, which serves HTTP and runs "
                        "the engine (default: 0)")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="where the ranks of every node meet (torch.distributed's store, hosted by the head's "
                        "rank 0): an address of the head every node reaches; needed with --nnodes > 1")
    p.add_argument("--dist-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="the head fails with an error naming the missing nodes if their ranks have not joined "
                        "within SECONDS, and a headless node if the head has not come up (default: 120)")
    p.add_argument("--headless", action="store_true",
                   help="run only this node's ranks for the head at --dist-init-addr: no HTTP server, no engine; "
                        "exits when the head stops")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM inference with a token-level KV cache and Triton kernels.")
    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the model over HTTP (TGI and OpenAI APIs)",
                           description="Serve a model over HTTP: TGI's /generate and /generate_stream, OpenAI's "
                                       "/v1/completions and /v1/chat/completions, /health, /info and /metrics. "
                                       f"Every flag --some-flag may also be set as {ENV_PREFIX}SOME_FLAG in the "
                                       "environment; the command line wins.")
    # `vllm serve MODEL`: the model as a positional argument, the same as --model
    serve.add_argument("positional_model", nargs="?", default=None, metavar="MODEL",
                       help="the same as --model (as in `vllm serve MODEL`)")
    _add_model_args(serve)
    _add_serve_args(serve)
    _add_node_args(serve)
    _add_lora_args(serve)

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
        _add_log_args(p)
    serve.add_argument("--log-stats-interval", type=float, default=5.0, metavar="SECONDS",
                       help="while the engine is busy, log its throughput, running and waiting requests and KV "
                            "cache use every SECONDS (0: never; default: 5)")
    serve.add_argument("--disable-log-stats", dest="log_stats_interval", action="store_const", const=0.0,
                       help="the same as --log-stats-interval 0 (vLLM's flag)")
    for command in _subparsers(parser).values():     # last: flags added anywhere above get theirs
        for action in command._actions:
            if (var := env_var(action)) is not None and action.help is not None:
                action.help += f" [env: {var}]"
    return parser


def _add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="how much to log; info adds the HTTP access log when serving (default: warning)")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="log lines of every process (HTTP, engine core, workers) as text, or as one JSON object "
                        "per line (default: text)")
    p.add_argument("--json-output", dest="log_format", action="store_const", const="json",
                   help="the same as --log-format json (TGI's flag)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line over the ``LLMSERVE_*`` environment over the defaults."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    command = _subparsers(parser).get(argv[0]) if argv else None
    if command is not None:
        apply_env_defaults(command, os.environ)
    args = parser.parse_args(argv)
    if getattr(args, "positional_model", None) is not None:   # as vLLM: it wins over --model
        args.model = args.positional_model
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def env_var(action: argparse.Action) -> str | None:
    """``LLMSERVE_SOME_FLAG`` for the flag ``--some-flag`` (named by its first option string:
    aliases, positionals and --help have none)."""
    if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    name = action.option_strings[0]
    if not name.startswith("--") or name[2:].replace("-", "_") != action.dest:
        return None      # an alias stored into another flag's value (--json-output, say)
    return ENV_PREFIX + action.dest.upper()


def apply_env_defaults(parser: argparse.ArgumentParser, environ: dict[str, str]) -> None:
    """Make each flag's ``LLMSERVE_*`` variable its default, converted and checked as the flag
    would be: a bad value stops the command with an error naming the variable."""
    for action in parser._actions:
        var = env_var(action)
        if var is None or var not in environ:
            continue
        try:
            action.default = _env_value(parser, action, environ[var])
        except (argparse.ArgumentError, argparse.ArgumentTypeError, ValueError) as e:
            parser.error(f"environment variable {var}={environ[var]!r}: {getattr(e, 'message', e)}")


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, raw: str) -> object:
    if action.nargs == 0:     # a switch: store_true, store_false, --[no-]flag
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            raise ValueError(f"expected one of {sorted(_TRUE)} or {sorted(_FALSE - {''})}")
        on = value in _TRUE
        return (not on) if isinstance(action, argparse._StoreFalseAction) else on
    many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    values = [parser._get_value(action, item) for item in (shlex.split(raw) if many else [raw])]
    for value in values:
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"invalid choice: {value!r} (choose from {', '.join(map(str, action.choices))})")
    return values if many else values[0]


def serve(args: argparse.Namespace) -> int:
    from llmserve.server.api.state import ServerConfig
    from llmserve.engine.config import EngineConfig, check_nodes, check_pipeline
    from llmserve.server.serve import run_server

    engine_config = EngineConfig(
        model=args.model, tp=args.tp, pp=args.pp, dtype=args.dtype, max_total_token_num=args.max_total_token_num,
        mem_fraction=args.mem_fraction, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_batch_prefill_tokens, chunked_prefill=args.chunked_prefill,
        prefix_cache=args.prefix_cache, nnodes=args.nnodes, dp=args.dp, dist_init_addr=args.dist_init_addr,
        dist_timeout=args.dist_timeout, **_step_options(args), **_lora_options(args),
    )
    check_nodes(engine_config)
    check_pipeline(engine_config)
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.headless != (args.node_rank > 0):
        raise ValueError("--headless is for the nodes of --node-rank 1 and up; node 0 is the head, which serves")
    if args.api_server_count < 1 or (args.headless and args.api_server_count > 1):
        raise ValueError(f"--api-server-count must be at least 1 (and 1 with --headless, which serves no HTTP), "
                         f"got {args.api_server_count}")
    if args.headless:
        from llmserve.worker.node import run_node

        return run_node(engine_config.world_size, args.nnodes, args.node_rank, args.dist_init_addr, args.dist_timeout)
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or None,
        max_concurrent_requests=args.max_concurrent_requests, max_model_len=args.max_total_tokens,
        max_input_tokens=args.max_input_tokens, max_top_n_tokens=args.max_top_n_tokens,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template, payload_limit=args.payload_limit, generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser,
        max_best_of=args.max_best_of, full_text_enabled=args.full_text_enabled,
        max_images_per_request=args.max_images_per_request, max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels, allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=tuple(args.allowed_media_domains),
        max_sessions=args.max_sessions, session_idle_timeout=args.session_idle_timeout, ui=not args.no_ui,
        api_server_count=args.api_server_count,
    )
    return run_server(engine_config, config, log_level=args.log_level, log_stats_interval=args.log_stats_interval)


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
    args = parse_args(argv)
    if args.command == "templates":
        try:
            return show_templates(args.name)
        except ValueError as e:
            print(f"llmserve: error: {e}", file=sys.stderr)
            return 2
    configure_logging(args.log_level, args.log_format, role=("node" if getattr(args, "headless", False) else "http") if args.command == "serve" else "cli")
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
        with LLM(args.model, tp=args.tp, pp=args.pp, dtype=args.dtype, max_total_token_num=args.max_total_token_num,
                 chat_template=chat_template, **_step_options(args)) as llm:
            print(llm.engine.summary(), file=sys.stderr)
            if args.command == "chat":
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                print(llm.chat(messages + [{"role": "user", "content": args.message}], params).text)
            else:
                for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
                    print(prompt + out.text)   # a raw continuation reads best after its prompt
    except (ValueError, WorkerError, EngineError) as e:   # bad model, bad flags, bad prompt: one line, no traceback
        report_error(str(e))
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
