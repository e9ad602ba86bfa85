"""HF transformers' own tensor parallelism as ``tp_scaling.py``'s peer: the checkpoint loaded with
``from_pretrained(tp_plan="auto")`` under torchrun, one process per GPU (NCCL; gloo on a CPU), and
its decode step timed as ``offline.py`` times HF's (``hf_peer.HFPeer``: random prompts of
``--prompt-len`` tokens prefilled in one forward, then greedy steps, each forward + argmax
between CUDA events). Every rank draws the same prompts (HF's tensor parallelism wants the same
inputs on every rank). Rank 0 prints one JSON line and, with ``--json``, writes it.

HF needs the checkpoint's files: ``make_random_model.py --out DIR`` writes the weights that
``llmserve --load-format dummy`` draws (same generator, same seed), so both sides run the same model.

Run (GPUs):  torchrun --nproc-per-node 2 benchmarks/hf_tp_peer.py --model /tmp/llama3-8b-random --batch-sizes 1,32
Smoke (CPU): torchrun --nproc-per-node 2 benchmarks/hf_tp_peer.py --model /tmp/tiny --batch-sizes 1,2 --prompt-len 16 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from common import remove_script_dir_from_sys_path, write_json
from hf_peer import PEERS, HFPeer

remove_script_dir_from_sys_path()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory with its weights (make_random_model.py writes one)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--mode", choices=PEERS, default="hf",
                   help="hf: eager with DynamicCache; hf-compiled: StaticCache + torch.compile (see hf_peer.py)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    placement = {"tp_plan": "auto"} if world > 1 else ({"device_map": "cuda"} if cuda else {})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 **placement).eval()
    peer = HFPeer(model, args.mode)
    tpot_ms = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        torch.manual_seed(batch)        # the same prompts on every rank
        _, step_ms = peer.run(batch, args.prompt_len, args.warmup_steps, args.steps)
        tpot_ms[batch] = statistics.median(step_ms)
    if int(os.environ.get("RANK", "0")) == 0:
        result = {"benchmark": "hf_tp_peer", "tp": world, "mode": args.mode, "model": args.model,
                  "prompt_len": args.prompt_len, "steps": args.steps, "tpot_ms": tpot_ms}
        print(json.dumps(result))
        if args.json:
            write_json(args.json, result)
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
