"""The ``llmserve`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from llmserve.sampling_params import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one worker process each (default: 1)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weights and KV cache dtype (default: float32 on CPU, the checkpoint's fp16/bf16 on GPU)")
    p.add_argument("--max-total-token-num", type=int, default=None, help="KV cache size in tokens (default: from free memory; 16384 on CPU)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM inference with a token-level KV cache and Triton kernels.")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a raw text prompt")
    gen.add_argument("prompt", nargs="+", help="one or more prompts, generated together in one batch")
    chat = sub.add_parser("chat", help="answer a user message through the model's chat template")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="system message")
    for p in (gen, chat):
        _add_model_args(p)
        _add_sampling_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from llmserve.llm import LLM
    from llmserve.server.router.model_rpc import WorkerError

    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop,
        )
        with LLM(args.model, tp=args.tp, dtype=args.dtype, max_total_token_num=args.max_total_token_num) as llm:
            info = llm.engine.info
            print(f"# {info.model_type}, {info.num_params / 1e6:.0f}M params, {info.dtype} on {info.device}, "
                  f"tp={args.tp}, KV cache {info.max_total_token_num} tokens", file=sys.stderr)
            if args.command == "chat":
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                prompts = [llm.chat_prompt(messages + [{"role": "user", "content": args.message}])]
            else:
                prompts = args.prompt
            for prompt, out in zip(prompts, llm.generate(prompts, params)):
                # a raw continuation reads best after its prompt; a chat answer stands alone
                print(out.text if args.command == "chat" else prompt + out.text)
    except (ValueError, WorkerError) as e:   # bad model, bad flags, bad prompt: one line, no traceback
        print(f"llmserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
