"""Passkey retrieval with calibrated configs, dense in the same run (CPU-sized).

`sparseprefill eval passkey --config` runs one config per method; this script runs
several configs of the same method (say, two XAttention targets) on the same keys,
beside the unpatched SDPA model, and records every trial: the verdict (greedy answer
equal to the key, by teacher forcing as `evaluate.answer_correct`) and the margin
(over the answer tokens, the least logit of the right token minus the best other
one: negative iff that token is not the argmax), so near-misses show.

`--check-seqlen N` first compares, for every config on one passkey prompt of N
tokens, the last position's logits of the `masked` backend (the integration's
evaluation backend: reference plans, attention by SDPA with the plan's mask) with
the `reference` backend's (float64 spec): the check that the faster path measures
the same model.

Usage:
    python benches/passkey_configs.py --lengths 4096 --depths 0 0.25 0.5 0.75 1 --trials 3 \\
        --config r099=benches/results/calibrate/smollm2-4k-r099/xattention.json \\
        --config r099-row09=benches/results/calibrate/smollm2-4k-r099-row09/xattention.json \\
        --backend masked --check-seqlen 1024 --json out/passkey-configs.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sparseprefill import evaluate
from sparseprefill.calibrate import config_method, load_config
from sparseprefill.integrations.transformers import patch, unpatch


def answer_margin(model: Any, prompt: torch.Tensor, answer: torch.Tensor) -> float:
    """Least (right token's logit - best other logit) over the answer tokens, teacher forced:
    > 0 iff greedy decoding produces the answer (`evaluate.answer_correct`)."""
    with torch.no_grad():
        first = model(prompt, use_cache=True, logits_to_keep=1)
        rest = model(answer[:, :-1], past_key_values=first.past_key_values, use_cache=True)
    logits = torch.cat([first.logits[:, -1:], rest.logits], dim=1)[0].float()
    right = logits.gather(1, answer[0][:, None])[:, 0]
    other = logits.scatter(1, answer[0][:, None], float("-inf")).amax(1)
    return float((right - other).min())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], metavar="LABEL=PATH",
                        help="a `sparseprefill calibrate` config and its label (repeatable)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--trials", type=int, default=3, help="keys per (length, depth)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("reference", "masked", "fast"), default="masked")
    parser.add_argument("--check-seqlen", type=int, default=0,
                        help="compare masked vs reference logits on one prompt of this length first (0: skip)")
    parser.add_argument("--no-dense", action="store_true", help="skip the unpatched model")
    parser.add_argument("--model", choices=("smollm2", "gemma3-270m"), default="smollm2")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    configs: list[tuple[str, str, Any]] = []
    for item in args.config:
        label, _, path = item.partition("=")
        if not path:
            parser.error(f"--config takes LABEL=PATH, got {item!r}")
        method = config_method(path)
        configs.append((label, method, load_config(path, method=method)))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    model, tokenizer = evaluate.load_gemma3() if args.model == "gemma3-270m" else evaluate.load_smollm2()
    print(f"loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "check": [], "trials": []}

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))

    if args.check_seqlen:
        prompt, _ = evaluate.passkey_prompt(tokenizer, args.check_seqlen, 0.5, 12345)
        for label, method, config in configs:
            logits = {}
            for backend in ("reference", "masked"):
                patch(model, method, config, backend=backend, min_seqlen=0)  # type: ignore[arg-type]
                t0 = time.perf_counter()
                with torch.no_grad():
                    logits[backend] = model(prompt, logits_to_keep=1, use_cache=False).logits[0, -1].double()
                logits[backend + "_s"] = torch.tensor(time.perf_counter() - t0)
                unpatch(model)
            row = {"label": label, "seqlen": int(prompt.shape[1]),
                   "max_abs_logit_diff": float((logits["masked"] - logits["reference"]).abs().max()),
                   "max_abs_logit": float(logits["reference"].abs().max()),
                   "same_argmax": bool(logits["masked"].argmax() == logits["reference"].argmax()),
                   "reference_s": float(logits["reference_s"]), "masked_s": float(logits["masked_s"])}
            result["check"].append(row)
            print(f"check {row}", file=sys.stderr, flush=True)
            save()

    rng = random.Random(args.seed)
    keys = {(n, d): [rng.randrange(10000, 100000) for _ in range(args.trials)]
            for n in args.lengths for d in args.depths}
    runs: list[tuple[str, str | None, Any]] = [] if args.no_dense else [("dense", None, None)]
    runs += configs
    for label, method, config in runs:
        if method is not None:
            patch(model, method, config, backend=args.backend, min_seqlen=0)  # type: ignore[arg-type]
        try:
            for n in args.lengths:
                for d in args.depths:
                    for key in keys[(n, d)]:
                        prompt, answer = evaluate.passkey_prompt(tokenizer, n, d, key)
                        t0 = time.perf_counter()
                        margin = answer_margin(model, prompt, answer)
                        row = {"label": label, "seqlen": n, "tokens": int(prompt.shape[1]), "depth": d,
                               "key": key, "correct": margin > 0, "margin": margin,
                               "seconds": time.perf_counter() - t0}
                        result["trials"].append(row)
                        print(f"{label} N={n} depth={d} key={key}: {'OK' if margin > 0 else 'miss'} "
                              f"margin {margin:+.2f} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
                        save()
        finally:
            if method is not None:
                unpatch(model)

    labels = [r[0] for r in runs]
    print("| config | " + " | ".join(f"depth {d:g}" for d in args.depths) + " | total |")
    print("| --- |" + " --- |" * (len(args.depths) + 1))
    for label in labels:
        rows = [r for r in result["trials"] if r["label"] == label]
        cells = [f"{sum(r['correct'] for r in rows if r['depth'] == d)}/{sum(r['depth'] == d for r in rows)}"
                 for d in args.depths]
        print(f"| {label} | " + " | ".join(cells) + f" | {sum(r['correct'] for r in rows)}/{len(rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
