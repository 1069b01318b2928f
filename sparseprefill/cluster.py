"""`sparseprefill cluster`: SharePrefill's offline head clustering (Sec. 5.2, Appendix C).

1. Prompt: a retrieval task built like InfiniteBench's Retr.KV (a JSON object of
   random UUID keys and values, then the question for one key's value), in the
   model's chat template, `--seqlen` tokens long.
2. Maps: one prefill; the post-RoPE q, k of every layer are captured and each query
   head's causal attention is pooled to a `S x S` map (`pooled_attention`): cell
   `(i, j)` is the attention mass key cell `j` receives, averaged over the rows of
   query cell `i` (rows sum to 1). Each map is scaled to a maximum of 1 and
   square-rooted (so that weaker structure is not lost next to the sink) before the
   autoencoder sees it.
3. Codes: the convolutional autoencoder of Appendix C, its shapes scaled to `S`
   (conv 3x3 -> 16, max-pool 4, conv 3x3 -> 32, max-pool 4, linear to a 64-d latent;
   the decoder mirrors it with transposed convolutions x2, x2, x4 and a sigmoid),
   trained with Adam (lr 1e-3, mean squared error, full batch) for up to `--epochs`
   epochs with early stopping (`--patience` epochs without a relative improvement of
   1e-4 of the loss). Fixed seeds.
4. Clusters: the latent codes are standardised per dimension (z-scores), clustered
   hierarchically (scipy `linkage`, Ward by default) and cut with `fcluster` at the
   distance `--threshold`; clusters with fewer than `--min-size` heads become the
   noise cluster (`NOISE`). Clusters are numbered by size, largest first.

Writes a `ClusterLayout` JSON (the layout `SharePrefillState` reads), optionally a
PNG (cluster of every layer/head, cluster sizes, a mean map per cluster) and the
maps themselves (`--maps-out`, reusable with `--maps`). Needs the `cluster` extra
(scipy) and, to capture, the `hf` extra and the SmolLM2 package.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .reference.shareprefill import NOISE, ClusterLayout

LATENT = 64
RETRIEVAL_INTRO = (
    "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
)


# -- prompt and maps -------------------------------------------------------------------


def _uuid(rng: random.Random) -> str:
    digits = f"{rng.getrandbits(128):032x}"
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def retrieval_prompt(tokenizer: Any, seqlen: int, *, seed: int = 0) -> tuple[torch.Tensor, str]:
    """An InfiniteBench Retr.KV-style prompt of at most `seqlen` tokens (chat template).

    Random UUID key-value pairs fill a JSON object; the question asks for the value of
    the pair in the middle. Pairs are added while the prompt fits.

    Returns:
        (ids int64 `[1, L]` with `L <= seqlen`, the expected value).

    Raises:
        ValueError: `seqlen` too short for a single pair.
    """
    rng = random.Random(seed)

    def build(pairs: list[tuple[str, str]]) -> tuple[str, str]:
        key, value = pairs[len(pairs) // 2]
        data = json.dumps(dict(pairs), indent=None)
        content = f'{RETRIEVAL_INTRO}{data}\n\nKey: "{key}"\nThe value associated with the specified key is: '
        text: str = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=False)
        return text, value

    def count(pairs: list[tuple[str, str]]) -> int:
        return len(tokenizer(build(pairs)[0], add_special_tokens=False)["input_ids"])

    pairs = [(_uuid(rng), _uuid(rng))]
    if count(pairs) > seqlen:
        raise ValueError(f"seqlen {seqlen} is too short for one key-value pair")
    per_pair = max(1, count(pairs + [(_uuid(rng), _uuid(rng)) for _ in range(8)]) - count(pairs)) / 8
    extra = max(0, int((seqlen - count(pairs)) / per_pair) - 1)
    pairs += [(_uuid(rng), _uuid(rng)) for _ in range(extra)]
    while len(pairs) > 1 and count(pairs) > seqlen:
        pairs.pop()
    while True:
        more = pairs + [(_uuid(rng), _uuid(rng))]
        if count(more) > seqlen:
            break
        pairs = more
    text, value = build(pairs)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids], dtype=torch.int64), value


def pooled_attention(q: torch.Tensor, k: torch.Tensor, *, size: int, scale: float,
                     rows_per_step: int = 512) -> torch.Tensor:
    """Causal attention of every query head pooled to `size x size` cells.

    Cell `(i, j)`: the softmax mass of the keys in key cell `j`, summed per row and
    averaged over the rows of query cell `i` (cells split `[0, N)` into `size` near-equal
    ranges); each map row sums to 1.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. scale: softmax scale.
        size: map side.

    Returns:
        float32 `[B, Hq, size, size]`.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    cell = (torch.arange(n, device=q.device) * size) // n
    kg = k.to(torch.float32).unsqueeze(2)
    out = torch.zeros(b, hkv, g, size, size, dtype=torch.float32, device=q.device)
    for start in range(0, n, rows_per_step):
        stop = min(n, start + rows_per_step)
        qg = q[:, :, start:stop].to(torch.float32).reshape(b, hkv, g, stop - start, d)
        scores = torch.matmul(qg, kg[:, :, :, :stop].transpose(-1, -2)) * scale
        causal = torch.arange(stop, device=q.device)[None, :] <= torch.arange(start, stop, device=q.device)[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, -torch.inf), dim=-1)
        per_cell = torch.zeros(b, hkv, g, stop - start, size, dtype=torch.float32, device=q.device)
        per_cell.index_add_(-1, cell[:stop], probs)
        out.index_add_(3, cell[start:stop], per_cell)
    rows = torch.bincount(cell, minlength=size).clamp(min=1).to(torch.float32)
    return (out / rows[:, None]).reshape(b, hq, size, size)


def model_maps(model: Any, ids: torch.Tensor, *, size: int, log: Any = None) -> torch.Tensor:
    """The pooled maps of every layer and query head of one prefill.

    Returns:
        float32 `[L, Hq, size, size]` (batch row 0).
    """
    from .integrations.transformers import _layer_indices, capture_qkv

    layers = sorted(_layer_indices(model))
    with capture_qkv(model, layers, dtype=None) as store, torch.no_grad():
        model(ids.to(model.device), logits_to_keep=1, use_cache=False)
    maps = []
    for layer in layers:
        q, k, _ = store.layers[layer]
        maps.append(pooled_attention(q, k, size=size, scale=store.scale[layer])[0])
        del store.layers[layer]
        if log is not None:
            print(f"maps: layer {layer} done", file=log, flush=True)
    return torch.stack(maps)


def prepare_maps(maps: torch.Tensor) -> torch.Tensor:
    """Autoencoder input: each map scaled to a maximum of 1, then square-rooted: `[M, 1, S, S]`."""
    flat = maps.reshape(-1, *maps.shape[-2:]).to(torch.float32)
    peak = flat.amax(dim=(-1, -2), keepdim=True).clamp(min=1e-12)
    return (flat / peak).sqrt().unsqueeze(1)


# -- the autoencoder of Appendix C -------------------------------------------------------


class MapAutoencoder(nn.Module):
    """Appendix C's convolutional autoencoder, scaled to `size x size` maps (size % 16 == 0).

    Raises:
        ValueError: a size that is not a positive multiple of 16.
    """

    def __init__(self, size: int, latent: int = LATENT) -> None:
        super().__init__()
        if size <= 0 or size % 16:
            raise ValueError(f"map size must be a positive multiple of 16, got {size}")
        side = size // 16
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4, 4),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4, 4),
            nn.Flatten(), nn.Linear(32 * side * side, latent),
        )
        self.decoder = nn.Sequential(
            nn.Linear(latent, 32 * side * side), nn.ReLU(), nn.Unflatten(1, (32, side, side)),
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(8, 1, 4, stride=4), nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.encoder(x))
        return out


@dataclass
class Training:
    """How the autoencoder training went."""

    epochs: int
    loss: float
    best_epoch: int
    seconds: float


def train_autoencoder(x: torch.Tensor, *, epochs: int = 1000, patience: int = 50, lr: float = 1e-3,
                      seed: int = 0, latent: int = LATENT, threads: int | None = 1
                      ) -> tuple[MapAutoencoder, Training]:
    """Train `MapAutoencoder` on maps `x: [M, 1, S, S]` (full batch, MSE, Adam).

    Early stopping: stop after `patience` epochs without the loss falling below
    `(1 - 1e-4)` times the best so far; the best weights are returned. `threads`
    (default 1; None keeps torch's setting) is torch's CPU thread count during training:
    these convolutions are small, and on 2 shared cores one thread ran 10x faster.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(x, epochs=epochs, patience=patience, lr=lr, seed=seed, latent=latent)
    finally:
        torch.set_num_threads(previous)


def _train(x: torch.Tensor, *, epochs: int, patience: int, lr: float, seed: int, latent: int
           ) -> tuple[MapAutoencoder, Training]:
    torch.manual_seed(seed)
    model = MapAutoencoder(int(x.shape[-1]), latent)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    best, best_epoch, best_state = float("inf"), 0, None
    start = time.perf_counter()
    epoch = 0
    for epoch in range(1, epochs + 1):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        value = float(loss.detach())
        if value < best * (1 - 1e-4):
            best, best_epoch = value, epoch
            best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        elif epoch - best_epoch >= patience:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    return model, Training(epochs=epoch, loss=best, best_epoch=best_epoch,
                           seconds=time.perf_counter() - start)


def latent_codes(model: MapAutoencoder, x: torch.Tensor) -> torch.Tensor:
    """Encoder outputs of `x: [M, 1, S, S]`: float32 `[M, latent]`."""
    with torch.no_grad():
        codes: torch.Tensor = model.encoder(x)
    return codes


# -- hierarchical clustering ----------------------------------------------------------------


def cluster_codes(codes: torch.Tensor, *, threshold: float, min_size: int,
                  method: str = "ward") -> list[int]:
    """Cluster standardised codes; small clusters become `NOISE`.

    Args:
        codes: float `[M, latent]`.
        threshold: `fcluster` distance threshold.
        min_size: clusters with fewer members are noise.
        method: scipy linkage method.

    Returns:
        M cluster ids: 0 for the largest cluster, 1 for the next, ..., `NOISE` for noise
        (ties in size: the cluster whose first member comes first).
    """
    from scipy.cluster.hierarchy import fcluster, linkage

    z = codes.to(torch.float64)
    std = z.std(dim=0, unbiased=False)
    z = (z - z.mean(dim=0)) / torch.where(std > 0, std, 1.0)
    if z.shape[0] < 2:
        labels = [1] * z.shape[0]
    else:
        labels = [int(x) for x in fcluster(linkage(z.numpy(), method=method), t=threshold,
                                           criterion="distance")]
    members: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        members.setdefault(label, []).append(i)
    kept = sorted((m for m in members.values() if len(m) >= min_size), key=lambda m: (-len(m), m[0]))
    out = [NOISE] * len(labels)
    for cid, m in enumerate(kept):
        for i in m:
            out[i] = cid
    return out


def cluster_maps(maps: torch.Tensor, *, threshold: float = 10.0, min_size: int = 5, method: str = "ward",
                 epochs: int = 1000, patience: int = 50, seed: int = 0, threads: int | None = 1
                 ) -> tuple[ClusterLayout, Training]:
    """The whole offline step on pooled maps `[L, Hq, S, S]`: autoencoder, codes, clusters.

    Returns:
        (the layout, the training record).
    """
    layers, heads = int(maps.shape[0]), int(maps.shape[1])
    x = prepare_maps(maps)
    model, training = train_autoencoder(x, epochs=epochs, patience=patience, seed=seed, threads=threads)
    ids = cluster_codes(latent_codes(model, x), threshold=threshold, min_size=min_size, method=method)
    table = tuple(tuple(ids[l * heads:(l + 1) * heads]) for l in range(layers))
    meta = {"map_size": int(maps.shape[-1]), "threshold": threshold, "min_size": min_size,
            "linkage": method, "seed": seed, "epochs": training.epochs, "loss": training.loss}
    return ClusterLayout(table, meta=meta), training


def save_picture(layout: ClusterLayout, maps: torch.Tensor, path: Path) -> None:
    """PNG: the cluster of every (layer, head), the cluster sizes, and each cluster's mean map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = torch.tensor(layout.clusters)
    sizes = layout.sizes()
    ids = [c for c in sizes if c != NOISE]
    shown = ids[:12]
    fig = plt.figure(figsize=(12, 7))
    grid = fig.add_gridspec(2, 8)
    ax = fig.add_subplot(grid[:, :3])
    masked = torch.where(table == NOISE, torch.nan, table.to(torch.float32))
    ax.imshow(masked.numpy(), cmap="tab20", aspect="auto", interpolation="nearest")
    for (l, h), c in zip(torch.cartesian_prod(torch.arange(table.shape[0]), torch.arange(table.shape[1])).tolist(),
                         table.flatten().tolist()):
        ax.text(h, l, "n" if c == NOISE else str(c), ha="center", va="center", fontsize=6)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title("cluster of each head (n: noise)")
    ax = fig.add_subplot(grid[0, 3:])
    labels = [("noise" if c == NOISE else str(c)) for c in sizes]
    ax.bar(range(len(sizes)), list(sizes.values()), color=["0.6" if c == NOISE else "C0" for c in sizes])
    ax.set_xticks(range(len(sizes)), labels, fontsize=7)
    ax.set_ylabel("heads")
    ax.set_title(f"{len(ids)} clusters, {sizes.get(NOISE, 0)} noise heads of {table.numel()}")
    flat = prepare_maps(maps)[:, 0]
    for i, c in enumerate(shown[:5]):
        ax = fig.add_subplot(grid[1, 3 + i])
        members = (table.flatten() == c).nonzero()[:, 0]
        ax.imshow(flat[members].mean(dim=0).numpy(), cmap="magma")
        ax.set_title(f"cluster {c} ({len(members)})", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# -- command line -----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill cluster`."""
    parser.add_argument("--seqlen", type=int, default=8192, help="prompt length in tokens")
    parser.add_argument("--map-size", type=int, default=64, help="pooled map side (multiple of 16)")
    parser.add_argument("--maps", type=Path, default=None,
                        help="read pooled maps [L, H, S, S] (torch.save) instead of running the model")
    parser.add_argument("--maps-out", type=Path, default=None, help="also save the pooled maps here")
    parser.add_argument("--threshold", type=float, default=10.0, help="fcluster distance threshold")
    parser.add_argument("--min-size", type=int, default=5, help="smaller clusters become noise")
    parser.add_argument("--linkage", default="ward", help="scipy linkage method")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--patience", type=int, default=50, help="early-stopping patience in epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for training")
    parser.add_argument("--device", default="cpu", help="where the model runs")
    parser.add_argument("--out", type=Path, default=Path("clusters.json"))
    parser.add_argument("--png", type=Path, default=None, help="picture of the clustering")


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill cluster`."""
    if args.map_size <= 0 or args.map_size % 16:
        print(f"--map-size must be a positive multiple of 16, got {args.map_size}", file=sys.stderr)
        return 2
    meta: dict[str, Any] = {}
    if args.maps is not None:
        maps = torch.load(args.maps, map_location="cpu")
        meta["maps"] = str(args.maps)
    else:
        from .evaluate import MODEL_FILE, load_smollm2

        t0 = time.perf_counter()
        model, tokenizer = load_smollm2(device=args.device)
        ids, value = retrieval_prompt(tokenizer, args.seqlen, seed=args.seed)
        print(f"prompt: Retr.KV-style, {ids.shape[1]} tokens, answer {value}", file=sys.stderr)
        maps = model_maps(model, ids, size=args.map_size, log=sys.stderr)
        print(f"maps {tuple(maps.shape)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        meta.update({"model": MODEL_FILE, "prompt": "InfiniteBench Retr.KV style", "tokens": int(ids.shape[1])})
        if args.maps_out is not None:
            args.maps_out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(maps, args.maps_out)
    if maps.shape[-1] != args.map_size:
        print(f"maps are {maps.shape[-1]} wide, --map-size is {args.map_size}", file=sys.stderr)
        return 2
    layout, training = cluster_maps(maps, threshold=args.threshold, min_size=args.min_size,
                                    method=args.linkage, epochs=args.epochs, patience=args.patience,
                                    seed=args.seed, threads=args.threads)
    layout = ClusterLayout(layout.clusters, meta={**meta, **layout.meta,
                                                  "train_seconds": round(training.seconds, 1)})
    layout.save(args.out)
    sizes = layout.sizes()
    print(f"autoencoder: {training.epochs} epochs (best {training.best_epoch}), loss {training.loss:.3e}, "
          f"{training.seconds:.1f} s")
    print(f"{len([c for c in sizes if c != NOISE])} clusters, sizes "
          f"{[n for c, n in sizes.items() if c != NOISE]}, {sizes.get(NOISE, 0)} noise heads")
    print(f"wrote {args.out}")
    if args.png is not None:
        save_picture(layout, maps, args.png)
        print(f"picture: {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill cluster", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
