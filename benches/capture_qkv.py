"""Capture post-RoPE q/k/v of SmolLM2-135M layers on real text, on CPU.

The output (float16, ~47 MiB for 3 layers at 8K) is the input of
`sparseprefill eval table`, which needs no transformers and no model, so the file
can be carried to a GPU machine.

Usage (about a minute plus model loading on 2 CPU cores):
    python benches/capture_qkv.py                 # N=8192, layers 2 14 27 -> out/qkv_smollm2_8k.pt
    python benches/capture_qkv.py --seqlen 4096 --layers 0 15 29 --out out/qkv_4k.pt
"""

from __future__ import annotations

import sys

from sparseprefill.evaluate import main

if __name__ == "__main__":
    sys.exit(main(["capture", *sys.argv[1:]]))
