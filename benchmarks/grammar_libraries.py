"""xgrammar against llguidance on this CPU: JSON-schema compile time and per-token mask time at a
~128k-token vocabulary (Llama 3's is 128,256).

No model hub: the vocabulary is a byte-level BPE trained here with `tokenizers` on the Python
sources of the installed packages (cached under the llmserve cache folder; training takes a
minute or two). The schemas are random (objects, arrays, enums, nested objects, `$ref`, string
formats), one instance of each is tokenized, and each library is walked along those tokens:

- compile: from the schema text to the first mask (llguidance compiles lazily, so its matcher's
  construction plus one mask; xgrammar's `compile_json_schema` with its cache off plus one mask);
- mask: one `fill_next_token_bitmask` / `compute_mask` per token of the instance, then the token
  consumed (not timed).

    python benchmarks/grammar_libraries.py [--schemas 60] [--vocab 128000] [--json PATH]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import sysconfig
import time

# Off sys.path: benchmarks/kernels.py would shadow the PyPI package transformers probes for.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

FORMATS = ["date", "date-time", "time", "email", "uuid", "ipv4"]
FORMAT_EXAMPLES = {"date": "2024-02-29", "date-time": "2024-02-29T12:30:00Z", "time": "12:30:00Z",
                   "email": "ada@example.com", "uuid": "123e4567-e89b-12d3-a456-426614174000", "ipv4": "10.0.0.1"}


def train_vocab(vocab_size: int) -> str:
    """A byte-level BPE tokenizer with ``vocab_size`` tokens, as tokenizer.json text (cached)."""
    from llmserve.common.cache import cache_root

    path = os.path.join(cache_root(), f"bench-bpe-{vocab_size}.json")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "**", "*.py"), recursive=True))
    random.Random(0).shuffle(files)
    text: list[str] = []
    size = 0
    for name in files:   # ~60 MB of source is enough for 128k merges
        try:
            with open(name, encoding="utf-8") as f:
                chunk = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        text.append(chunk)
        size += len(chunk)
        if size > 60_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    print(f"training a {vocab_size}-token BPE on {size / 1e6:.0f} MB of Python source...", file=sys.stderr)
    tok.train_from_iterator(text, trainer)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(tok.to_str())
    return tok.to_str()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of objects, arrays, enums, scalars, string formats and nested objects."""
    kinds = ["string", "integer", "number", "boolean", "enum", "format"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "object":
        props = {f"{rng.choice(['id', 'name', 'tags', 'value', 'items', 'meta'])}_{i}": random_schema(rng, depth + 1)
                 for i in range(rng.randint(1, 5))}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 4)}
    if kind == "enum":
        return {"enum": [f"v{rng.randint(0, 99)}_{i}" for i in range(rng.randint(2, 6))]}
    if kind == "format":
        return {"type": "string", "format": rng.choice(FORMATS)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(5, 40)}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": 10_000}
    return {"type": kind}


def with_ref(schema: dict) -> dict:
    """The schema with its top level moved under ``$defs`` and reached through ``$ref``."""
    return {"$defs": {"root": schema}, "type": "object", "properties": {"root": {"$ref": "#/$defs/root"}},
            "required": ["root"], "additionalProperties": False}


def instance(schema: dict, rng: random.Random, defs: dict | None = None):
    """A value that validates against ``random_schema``'s (or ``with_ref``'s) schemas."""
    defs = schema.get("$defs", defs)
    if "$ref" in schema:
        return instance(defs[schema["$ref"].rsplit("/", 1)[1]], rng, defs)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: instance(v, rng, defs) for k, v in schema["properties"].items()}
    if kind == "array":
        return [instance(schema["items"], rng, defs) for _ in range(rng.randint(schema["minItems"], schema["maxItems"]))]
    if kind == "string":
        return FORMAT_EXAMPLES[schema["format"]] if "format" in schema else "hello world"[: schema.get("maxLength", 11)]
    if kind == "integer":
        return rng.randint(0, 10_000)
    if kind == "number":
        return round(rng.uniform(-100, 100), 3)
    return rng.random() < 0.5


def pctl(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_llguidance(tokenizer_json: str, cases: list[tuple[str, list[int]]]) -> dict:
    import llguidance
    import numpy as np

    tok = llguidance.LLTokenizer(tokenizer_json)
    mask = np.zeros(((tok.vocab_size + 31) // 32,), dtype=np.int32)
    compile_s, mask_s = [], []
    for schema, tokens in cases:
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}))
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        for i, t in enumerate(tokens):
            if i:
                t0 = time.perf_counter()
                m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                mask_s.append(time.perf_counter() - t0)
            assert m.consume_token(t), (schema, m.get_error())
    return {"compile": compile_s, "mask": mask_s}


def bench_xgrammar(tokenizer_json: str, cases: list[tuple[str, list[int]]]) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(tokenizer_json),
                                 eos_token="<|eos|>")
    info = xgr.TokenizerInfo.from_huggingface(hf)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    compile_s, mask_s = [], []
    for schema, tokens in cases:
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":")))
        m.fill_next_token_bitmask(bitmask)
        compile_s.append(time.perf_counter() - t0)
        for i, t in enumerate(tokens):
            if i:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bitmask)
                mask_s.append(time.perf_counter() - t0)
            assert m.accept_token(t), schema
    return {"compile": compile_s, "mask": mask_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemas", type=int, default=60)
    ap.add_argument("--vocab", type=int, default=128_000)
    ap.add_argument("--libraries", default="llguidance,xgrammar")
    ap.add_argument("--json", help="write every number here")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    tokenizer_json = train_vocab(args.vocab)
    tok = Tokenizer.from_str(tokenizer_json)
    rng = random.Random(0)
    cases = []
    for i in range(args.schemas):
        schema = random_schema(rng)
        schema = with_ref(schema) if i % 3 == 0 else {"type": "object", "properties": {"answer": schema},
                                                      "required": ["answer"], "additionalProperties": False}
        text = json.dumps(instance(schema, rng), separators=(",", ":"))
        cases.append((json.dumps(schema), tok.encode(text).ids))
    print(f"vocabulary {tok.get_vocab_size()} tokens, {len(cases)} schemas, "
          f"{sum(len(t) for _, t in cases)} tokens of instances", file=sys.stderr)

    results = {}
    for lib in args.libraries.split(","):
        results[lib] = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[lib](tokenizer_json, cases)
    print(f"\n| library | compile p50 (ms) | compile p99 (ms) | mask p50 (us) | mask p99 (us) | mask mean (us) |")
    print("|---|---|---|---|---|---|")
    for lib, r in results.items():
        c, m = r["compile"], r["mask"]
        print(f"| {lib} | {pctl(c, .5) * 1e3:.2f} | {pctl(c, .99) * 1e3:.2f} | {pctl(m, .5) * 1e6:.1f} | "
              f"{pctl(m, .99) * 1e6:.1f} | {statistics.mean(m) * 1e6:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vocab": tok.get_vocab_size(), "schemas": [s for s, _ in cases], "results": results}, f)


if __name__ == "__main__":
    main()
