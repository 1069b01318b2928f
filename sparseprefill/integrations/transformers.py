"""Run a sparse prefill method inside a Hugging Face transformers model.

    from sparseprefill.integrations.transformers import patch, unpatch

    model = AutoModelForCausalLM.from_pretrained(...)
    patch(model, method="streaming", config={"sink": 128, "window": 2048}, min_seqlen=4096)
    model.generate(...)   # a prefill of >= 4096 tokens runs sparse; decode steps run SDPA
    unpatch(model)        # back to the implementation the model had before

How it hooks in: `register_attention` puts a `SparsePrefillAttention` under a new
name in transformers' `AttentionInterface` (the table a model looks its
`config._attn_implementation` up in) and transformers' own `sdpa_mask` under the
same name in `AttentionMaskInterface`, so masks are built exactly as for `sdpa`:
None for an unpadded causal prefill, a bool `[B, 1, q_len, kv_len]` otherwise.
`patch` = `register_attention` + `model.set_attn_implementation(name)`; the name can
also be given as `from_pretrained(..., attn_implementation=name)`.

Routing of one attention call (one layer, one forward):

* the sparse path when the layer has a config, the call is a prefill without past
  keys (`q_len == kv_len`) and `q_len >= min_seqlen`;
* otherwise transformers' `sdpa_attention_forward` with the call's own arguments:
  decode steps, short prompts, prefill chunks after cached tokens and layers
  configured as None compute bit for bit what an `sdpa` model computes.

Padded batches (left, right or mixed padding; `generate` left-pads): when the mask
is causal with key padding (`mask[b, :, i, j] == (j <= i and token j of row b is
real)` on the rows of real tokens, what `sdpa_mask` builds from a 2-D
`attention_mask`; `key_padding` reads it), the real tokens
of each batch row are packed into FlashAttention's varlen layout and
`SparsePrefillAttention.varlen_attention` plans every prompt on its own (with its
own length's demo parameters) and runs them together: one `varlen_attention` call
(one kernel launch in `fast`) for plan-based methods, one call per prompt for
methods without a plan (Delta-KV), with state across layers (SharePrefill: one
state per prompt), with `use_ops=True`, or whose per-prompt plans have different
block sizes. Each prompt gets what it would get alone. The query positions that
are padding get transformers' own `sdpa_attention_forward` on exactly those rows of
q and of the mask (a left pad sees no key: SDPA's zeros); a row with fewer than
`min_seqlen` real tokens runs that SDPA call on its whole batch row, so
`min_seqlen` applies to each prompt's real length.

The sparse path raises instead of returning wrong output for what it cannot do:
any other mask (packed sequences' block-diagonal masks, custom 4-D masks), a
sliding-window layer whose window is shorter than the prompt, non-causal attention
(cross-attention, encoders; raised on every call, short ones included), attention
dropout, logit soft-capping, position biases and learned sinks.

Methods with state across layers (SharePrefill; `Method.new_state`): one state
per forward pass, made at the first sparse layer call and replaced when a layer index
comes again (the next forward) or the batch size, length or device change; each
layer runs the method's `*_layer` function with the model's `layer_idx`, so layer
order is the model's. Such a method must be the choice of every head of its layers.
`SparsePrefillAttention.last_state(method)` returns the state of the latest prefill
(its per-layer decisions, for instance); a padded batch has one state per packed
prompt, and `last_state` then returns their list.
`use_ops=True` runs the fast path through the `torch.library` custom ops of
`sparseprefill.fast.ops` (`torch.ops.sparseprefill.<method>` when every head of a
layer shares one choice: estimate, plan and kernel in one op, with the method's own
scale handling; the plan kernel op otherwise), so `torch.compile` sees each sparse
attention as one opaque op with a known output shape (docs/serving.md).

Backends: `fast` (Triton kernels, half precision), `reference` (the executable
spec: float64 math on dense masks; exact but slow, minutes per 4K prefill of
SmolLM2 on CPU) and `masked`, the evaluation backend: plans from the reference
estimators (the same plans as `reference`), attention through
`torch.nn.functional.scaled_dot_product_attention` with each plan's boolean mask in
q's dtype (`masked_sdpa_attention`); in float32 it equals the reference backend's
output to float32 rounding without the reference's float64 attention (which took 171 s
of a 196 s SmolLM2 4K prefill on 2 CPU cores; docs/integration.md). Methods without a
plan (Delta-KV) and methods
with state across layers (SharePrefill) run their reference functions under `masked`.

Supported: Llama-, Qwen2- and Mistral-style decoders (grouped-query attention is
native: K and V are never copied per query head), batch > 1, padded or not.
Written against transformers 5.23 (`AttentionInterface`, `AttentionMaskInterface`,
`PreTrainedModel.set_attn_implementation`); the GPU image's 5.17 has the same API.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "sparseprefill.integrations.transformers needs transformers >= 5.0: "
        "pip install 'sparseprefill[hf]'"
    ) from exc

from .. import fast, reference
from ..config import CalibratedConfig, read_config, split_dense_heads
from ..methods import DENSE, METHODS
from ..reference._checks import HALF_DTYPES, check_positive_int
from ..reference.plan import BlockColumnPlan
from ..reference.plan import stack_plans as stack_sequences

Backend = Literal["auto", "fast", "reference", "masked"]
HeadSpec = None | str | Mapping[str, Any]
LayerSpec = HeadSpec | Sequence[HeadSpec]
Config = (None | Mapping[str, Any] | Mapping[int, LayerSpec] | Callable[[int], LayerSpec] | str | os.PathLike[str]
          | CalibratedConfig)

_BACKENDS = ("auto", "fast", "reference", "masked")
# `masked` builds a plan's dense mask this many query rows x keys at a time (bool entries
# per batch row and head), so an 8K prompt never holds the whole [B, Hq, N, N] mask.
_MASK_ENTRIES = 1 << 25
_NAMES = itertools.count()
_PREVIOUS_ATTR = "_sparseprefill_previous"
_ATTENTION_ATTR = "_sparseprefill_attention"


@dataclass(frozen=True)
class Choice:
    """One head's method: a registered method name and its parameters.

    Attributes:
        method: a name in `sparseprefill.methods`.
        params: keyword parameters of the method's estimator; None means the
            registry's `demo_params(N)` for the prompt length N of the call.
        dense_heads: query heads of the layer that run full causal attention instead
            (a calibrated config's per-head dense fallback, the `dense_heads` key of a
            layer's dict): plan-based methods make those heads' plans full causal
            (`BlockColumnPlan.with_dense_heads`), the others have those heads' output
            replaced by full attention.
    """

    method: str
    params: Mapping[str, Any] | None
    dense_heads: tuple[int, ...] = ()


def _check_method(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"method must be a str, got {type(name).__name__}")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}")
    return name


def _head_choice(spec: HeadSpec, default_method: str, where: str) -> Choice:
    """Resolve one head's spec; None is full causal attention (the `dense` plan)."""
    if spec is None:
        return Choice(DENSE, None)
    if isinstance(spec, str):
        return Choice(_check_method(spec), None)
    if isinstance(spec, Mapping):
        try:
            params, dense_heads = split_dense_heads(spec)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        method = _check_method(params.pop("method", default_method))
        for key in params:
            if not isinstance(key, str):
                raise TypeError(f"{where}: parameter names must be str, got {key!r}")
        spec_ = METHODS[method]
        try:
            if spec_.plan_based:
                inspect.signature(spec_.plan_fn("reference")).bind(None, None, **params)
            spec_.check_params(params)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{where}: bad parameters for {method!r}: {exc}") from None
        new_state = METHODS[method].new_state
        if new_state is not None:
            try:
                new_state(params)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: bad parameters for {method!r}: {exc}") from None
        return Choice(method, params, tuple(sorted(set(dense_heads))))
    raise TypeError(f"{where}: expected None, a method name or a dict of parameters, got {type(spec).__name__}")


def _layer_choices(spec: LayerSpec, default_method: str, where: str, num_heads: int | None) -> list[Choice] | None:
    """Resolve one layer's spec to one `Choice` per query head (None: SDPA).

    A single spec is returned as a one-element list meaning "every head".
    """
    if spec is None:
        return None
    if isinstance(spec, (str, Mapping)):
        choice = _head_choice(spec, default_method, where)
        if num_heads is not None and any(h >= num_heads for h in choice.dense_heads):
            raise ValueError(f"{where}: dense_heads {list(choice.dense_heads)} name heads past the layer's "
                             f"{num_heads} query heads")
        return [choice]
    if isinstance(spec, Sequence):
        if num_heads is not None and len(spec) != num_heads:
            raise ValueError(f"{where}: a per-head list needs one entry per query head ({num_heads}), got {len(spec)}")
        out = [_head_choice(s, default_method, f"{where}, head {h}") for h, s in enumerate(spec)]
        if any(c.dense_heads for c in out):
            raise ValueError(f"{where}: dense_heads belongs to a whole layer's dict; in a per-head list "
                             "give the dense heads None")
        return out
    raise TypeError(f"{where}: expected None, a method name, a dict or a per-head list, got {type(spec).__name__}")


def stack_plans(plans: Sequence[BlockColumnPlan]) -> BlockColumnPlan:
    """Concatenate plans along the head dimension (one plan per head or head range).

    Args:
        plans: plans with equal `seqlen`, `block_m`, `block_n` and batch size.

    Returns:
        A validated plan whose heads are the inputs' heads, in order.

    Raises:
        ValueError: empty input or plans that disagree on sizes.
    """
    if not plans:
        raise ValueError("plans must not be empty")
    first = plans[0]
    for p in plans[1:]:
        if (p.seqlen, p.block_m, p.block_n, p.batch) != (first.seqlen, first.block_m, first.block_n, first.batch):
            raise ValueError(
                "per-head methods of one layer must share seqlen, block_m, block_n and batch; got "
                f"{(first.seqlen, first.block_m, first.block_n, first.batch)} and "
                f"{(p.seqlen, p.block_m, p.block_n, p.batch)}"
            )

    plans = [p.ungrouped() for p in plans]

    def cat(name: str, pad: bool) -> torch.Tensor:
        parts = [getattr(p, name) for p in plans]
        if pad:
            # Entries past the counts are padding (plan invariant 5), so zeros are fine.
            width = max(int(t.shape[3]) for t in parts)
            parts = [torch.nn.functional.pad(t, (0, width - int(t.shape[3]))) for t in parts]
        return torch.cat(parts, dim=1).contiguous()

    return BlockColumnPlan(
        seqlen=first.seqlen,
        block_m=first.block_m,
        block_n=first.block_n,
        block_count=cat("block_count", False),
        block_index=cat("block_index", True),
        column_count=cat("column_count", False),
        column_index=cat("column_index", True),
    ).validate()


class SparsePrefillAttention:
    """The attention function registered with transformers (see the module doc).

    Attributes:
        name: the key under which it is registered (`config._attn_implementation`).
        method: the default method name.
        backend: "fast", "reference", "masked" (reference plans, attention by SDPA with
            the plan's mask: see the module doc) or "auto" (fast for CUDA tensors, else
            reference).
        min_seqlen: shortest prompt that takes the sparse path.
        fast_dtype: dtype q, k, v are cast to for the fast backend when they are not
            float16/bfloat16 (the Triton kernels take half precision only); the
            output is cast back to the model's dtype.
        use_ops: run the fast backend through `sparseprefill.fast.ops` (see the module doc).
        calls: counts of attention calls by path, "sparse" and "sdpa".
    """

    def __init__(
        self,
        method: str,
        config: Config = None,
        *,
        backend: Backend = "auto",
        min_seqlen: int = 4096,
        fast_dtype: torch.dtype = torch.float16,
        name: str | None = None,
        use_ops: bool = False,
    ) -> None:
        self.method = _check_method(method)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.backend: Backend = backend
        self.min_seqlen = check_positive_int("min_seqlen", min_seqlen, minimum=0)
        if fast_dtype not in HALF_DTYPES:
            raise ValueError(f"fast_dtype must be torch.float16 or torch.bfloat16, got {fast_dtype}")
        self.fast_dtype = fast_dtype
        if not isinstance(use_ops, bool):
            raise TypeError(f"use_ops must be a bool, got {type(use_ops).__name__}")
        self.use_ops = use_ops
        if use_ops:
            from ..fast import ops  # noqa: F401  (registers torch.ops.sparseprefill.*)
        self.name = name if name is not None else f"sparseprefill-{next(_NAMES)}"
        self.calls: Counter[str] = Counter()
        if isinstance(config, (str, os.PathLike)):
            config = read_config(config, method=self.method)
        if isinstance(config, CalibratedConfig):
            if config.method != self.method:
                raise ValueError(f"config is a calibrated config for {config.method!r}, not {self.method!r}")
            config = config.layers
        self._config: None | Mapping[str, Any] | Mapping[int, LayerSpec] | Callable[[int], LayerSpec] = config
        self._per_layer = isinstance(config, Mapping) and any(isinstance(key, int) for key in config)
        self._resolved: dict[tuple[int | None, int], list[Choice] | None] = {}
        # Per stateful method: (one state per sequence, layers done in this forward pass,
        # the prefill's key: (B, N, device), or ("packed", cu_seqlens, device)).
        self._forward: dict[str, tuple[list[Any], set[int], tuple[Any, ...]]] = {}
        self._validate_config()

    def _validate_config(self) -> None:
        cfg = self._config
        if cfg is None or callable(cfg):
            return
        if not isinstance(cfg, Mapping):
            raise TypeError(
                "config must be None, a dict of parameters, a dict {layer_idx: spec} or a "
                f"callable layer_idx -> spec, got {type(cfg).__name__}"
            )
        if self._per_layer:
            for key, spec in cfg.items():
                if isinstance(key, bool) or not isinstance(key, int):
                    raise TypeError(f"config mixes layer indices and parameter names: key {key!r}")
                _layer_choices(spec, self.method, f"config[{key}]", None)
        else:
            _layer_choices(cast(Mapping[str, Any], cfg), self.method, "config", None)

    def layer_choices(self, layer_idx: int | None, num_heads: int) -> list[Choice] | None:
        """The methods of one layer, one per query head, or None for SDPA.

        Raises:
            ValueError, TypeError: a config that does not fit this layer.
        """
        key = (layer_idx, num_heads)
        if key not in self._resolved:
            cfg = self._config
            spec: LayerSpec
            where = f"layer {layer_idx}"
            if cfg is None:
                spec = self.method
            elif callable(cfg) or self._per_layer:
                if layer_idx is None:
                    raise ValueError(
                        "a per-layer config needs attention modules with an int `layer_idx`; "
                        "this module has none"
                    )
                spec = cfg(layer_idx) if callable(cfg) else cfg.get(layer_idx)  # type: ignore[call-overload]
            else:
                spec = cfg  # type: ignore[assignment]
            choices = _layer_choices(spec, self.method, where, num_heads)
            if choices is not None and len(choices) == 1:
                choices = choices * num_heads
            self._resolved[key] = choices
        return self._resolved[key]

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention-function signature.

        Args:
            module: the attention module (its `layer_idx` selects the config).
            query: `[B, Hq, q_len, D]`, post-RoPE; key, value: `[B, Hkv, kv_len, D]`
                (past keys included).
            attention_mask: None or bool `[B, 1, q_len, kv_len]` from `sdpa_mask`.
            dropout, scaling, is_causal, kwargs: as transformers passes them.

        Returns:
            (`[B, q_len, Hq, D]` in query's dtype, None): the layout transformers expects.

        Raises:
            ValueError: non-causal attention, or on the sparse path an input it cannot
                handle exactly (see the module doc), such as a mask that is neither
                causal nor causal with key padding.
        """
        layer_idx = getattr(module, "layer_idx", None)
        layer_idx = layer_idx if isinstance(layer_idx, int) else None
        if is_causal is False or not getattr(module, "is_causal", True):
            raise ValueError(
                f"{self.name}: layer {layer_idx} is non-causal (cross-attention or an encoder); "
                "sparse prefill methods are causal self-attention only, so patch the decoder only"
            )
        q_len, kv_len = int(query.shape[2]), int(key.shape[2])
        choices = self.layer_choices(layer_idx, int(query.shape[1]))
        if choices is None or q_len != kv_len or q_len < self.min_seqlen:
            self.calls["sdpa"] += 1
            return sdpa_attention_forward(  # type: ignore[no-any-return]
                module, query, key, value, attention_mask,
                dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
            )
        valid = self._check_sparse_call(layer_idx, q_len, attention_mask, dropout, kwargs)
        if valid is not None:
            assert attention_mask is not None
            return self._padded_call(module, query, key, value, attention_mask, valid, choices, layer_idx,
                                     dropout=dropout, scaling=scaling, is_causal=is_causal, kwargs=kwargs)
        self.calls["sparse"] += 1
        if any(METHODS[c.method].new_state is not None for c in choices):
            out = self.stateful_attention(query, key, value, choices, layer_idx, scale=scaling)
        else:
            out = self.sparse_attention(query, key, value, choices, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    def _padded_call(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        valid: torch.Tensor,
        choices: Sequence[Choice],
        layer_idx: int | None,
        *,
        dropout: float,
        scaling: float | None,
        is_causal: bool | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, None]:
        """A prefill whose mask is causal with key padding (see the module doc).

        Rows of at least `min_seqlen` real tokens are packed and run through
        `varlen_attention`; shorter rows, and the query positions that are padding,
        go to `sdpa_attention_forward` with their own rows of the mask.
        """
        b, hq, n, d = (int(x) for x in query.shape)
        mask, valid = mask.expand(b, -1, -1, -1), valid.expand(b, n)

        def sdpa(rows: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
            # transformers' own SDPA call on some batch rows (and some of their query rows).
            q = query[rows] if positions is None else query[rows][:, :, positions]
            m = mask[rows] if positions is None else mask[rows][:, :, positions]
            out: torch.Tensor = sdpa_attention_forward(
                module, q, key[rows], value[rows], m,
                dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
            )[0]
            return out

        lengths = [int(x) for x in valid.sum(1).tolist()]
        sparse_rows = [r for r in range(b) if lengths[r] >= max(1, self.min_seqlen)]
        if not sparse_rows:
            self.calls["sdpa"] += 1
            return sdpa_attention_forward(  # type: ignore[no-any-return]
                module, query, key, value, mask,
                dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
            )
        self.calls["sparse"] += 1
        out = torch.empty(b, n, hq, d, dtype=query.dtype, device=query.device)
        short = [r for r in range(b) if r not in sparse_rows]
        if short:
            rows = torch.tensor(short, device=query.device)
            out[rows] = sdpa(rows, None)
        rows = torch.tensor(sparse_rows, device=query.device)
        seq, pos = valid[rows].nonzero(as_tuple=True)
        batch_rows = rows[seq]
        q, k, v = (t.transpose(1, 2)[batch_rows, pos] for t in (query, key, value))
        lens = [lengths[r] for r in sparse_rows]
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=query.device)
        out[batch_rows, pos] = self.varlen_attention(q, k, v, cu_seqlens, choices, layer_idx=layer_idx,
                                                     scale=scaling)
        for r in sparse_rows:
            if lengths[r] < n:
                pads = (~valid[r]).nonzero().squeeze(1)
                out[r, pads] = sdpa(torch.tensor([r], device=query.device), pads)[0]
        return out, None

    def varlen_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        choices: Sequence[Choice],
        *,
        layer_idx: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """A packed batch of prompts (FlashAttention's varlen layout), each planned on its own.

        Plan-based methods: every sequence is estimated and planned alone (with its
        own length's demo parameters when the choice has none), the plans are
        stacked and one `varlen_attention` runs the batch (one kernel launch in
        `fast`). Sequence by sequence instead: methods without a plan (Delta-KV),
        methods with state across layers (SharePrefill: one state per sequence),
        `use_ops=True` (one method op per sequence) and plans whose block sizes differ
        between sequences (demo parameters that depend on the length).

        Args:
            q: `[T, Hq, D]`; k, v: `[T, Hkv, D]`; cu_seqlens: int32 `[S + 1]`, sequence `s`
                is rows `[cu_seqlens[s], cu_seqlens[s + 1])`, none empty.
            choices: one `Choice` per query head.
            layer_idx: the model's layer index (methods with state across layers).
            scale: softmax scale, `1/sqrt(D)` if None.

        Returns:
            `[T, Hq, D]` in q's dtype.

        Raises:
            ValueError: an empty sequence, or what the method raises.
        """
        cu = [int(x) for x in cu_seqlens.tolist()]
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"every sequence must have at least one token, got cu_seqlens {cu}")
        use_fast = self._use_fast(q)
        out_dtype = q.dtype
        if use_fast and q.dtype not in HALF_DTYPES:
            q, k, v = (t.to(self.fast_dtype) for t in (q, k, v))
        seqs = [(_sequence(q, cu, s), _sequence(k, cu, s), _sequence(v, cu, s)) for s in range(len(cu) - 1)]
        first = choices[0]
        spec = METHODS[first.method]
        outs: list[torch.Tensor]
        if any(METHODS[c.method].new_state is not None for c in choices):
            outs = self._stateful_run(seqs, choices, layer_idx, scale=scale, key=("packed", tuple(cu), q.device))
        elif use_fast and self.use_ops:
            outs = [self._ops_attention(qs.contiguous(), ks.contiguous(), vs.contiguous(), choices, scale=scale)
                    for qs, ks, vs in seqs]
        elif not spec.plan_based and all(c == first for c in choices):
            run = spec.run_fn("fast" if use_fast else "reference")
            outs = [dense_heads_output(qs, ks, vs, run(qs, ks, vs, **_resolve_params(first, qs), scale=scale),
                                       first.dense_heads, use_fast=use_fast, scale=scale) for qs, ks, vs in seqs]
        else:
            # Each sequence alone (what `varlen_plans` does, with per-head mixes and
            # per-length demo parameters too), then one launch for the batch.
            impl = fast if use_fast else reference
            plans = [build_plan(qs, ks, choices, fast_plans=use_fast) for qs, ks, _ in seqs]
            if self.backend == "masked":
                outs = [masked_sdpa_attention(qs, ks, vs, plan, scale=scale)
                        for (qs, ks, vs), plan in zip(seqs, plans)]
                return torch.cat([o[0].transpose(0, 1) for o in outs]).to(out_dtype)
            stacked = _stack_sequence_plans(plans)
            if stacked is not None:
                out = impl.varlen_attention(q, k, v, cu_seqlens, stacked.seqlen, stacked, scale=scale)
                assert isinstance(out, torch.Tensor)
                return out.to(out_dtype)
            outs = [impl.sparse_attention(qs, ks, vs, plan, scale=scale) for (qs, ks, vs), plan in zip(seqs, plans)]
        return torch.cat([o[0].transpose(0, 1) for o in outs]).to(out_dtype)

    def _use_fast(self, q: torch.Tensor) -> bool:
        return self.backend == "fast" or (self.backend == "auto" and q.is_cuda)

    def stateful_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        choices: Sequence[Choice],
        layer_idx: int | None,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """One layer of a method with state across layers (see the module doc).

        Raises:
            ValueError: the layer mixes the method with others, or has no `layer_idx`.
        """
        out_dtype = q.dtype
        if self._use_fast(q) and q.dtype not in HALF_DTYPES:
            q, k, v = (t.to(self.fast_dtype) for t in (q, k, v))
        key = (int(q.shape[0]), int(q.shape[2]), q.device)
        return self._stateful_run([(q, k, v)], choices, layer_idx, scale=scale, key=key)[0].to(out_dtype)

    def _stateful_run(
        self,
        seqs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        choices: Sequence[Choice],
        layer_idx: int | None,
        *,
        scale: float | None,
        key: tuple[Any, ...],
    ) -> list[torch.Tensor]:
        """One layer of a stateful method on each of `seqs` (q, k, v), one state each.

        `key` identifies the prefill: the states are made anew when it changes or a
        layer index comes again (the next forward pass).
        """
        choice = choices[0]
        if any(c != choice for c in choices):
            raise ValueError(f"{self.name}, layer {layer_idx}: {choice.method!r} carries state across "
                             "heads and layers; give it to every head of the layer")
        if layer_idx is None:
            raise ValueError(f"{self.name}: {choice.method!r} needs attention modules with an int layer_idx")
        spec = METHODS[choice.method]
        assert spec.new_state is not None and spec.reference_layer is not None and spec.fast_layer is not None
        current = self._forward.get(choice.method)
        if current is None or layer_idx in current[1] or current[2] != key:
            current = ([spec.new_state(_resolve_params(choice, sv[0])) for sv in seqs], set(), key)
            self._forward[choice.method] = current
        current[1].add(layer_idx)
        use_fast = self._use_fast(seqs[0][0])
        layer_fn = spec.fast_layer if use_fast else spec.reference_layer
        return [dense_heads_output(qs, ks, vs, layer_fn(qs, ks, vs, state, layer=layer_idx, scale=scale),
                                   choice.dense_heads, use_fast=use_fast, scale=scale)
                for (qs, ks, vs), state in zip(seqs, current[0])]

    def last_state(self, method: str) -> Any:
        """The state of the latest prefill of a stateful method (None before the first);
        after a padded batch, a list with the state of each packed sequence."""
        current = self._forward.get(method)
        if current is None:
            return None
        return list(current[0]) if current[2][0] == "packed" else current[0][0]

    def _check_sparse_call(
        self, layer_idx: int | None, n: int, mask: torch.Tensor | None, dropout: float, kwargs: Mapping[str, Any]
    ) -> torch.Tensor | None:
        """Raise for what the sparse path cannot do; return the key padding, if any.

        Returns:
            None for a plain causal call (no mask, or a mask without padding); else
            bool `[B, N]`, True at the real tokens of each batch row.
        """
        where = f"{self.name}, layer {layer_idx}, prompt of {n} tokens"
        # Before the mask test: a sliding-window layer's mask is not plain causal either.
        window = kwargs.get("sliding_window")
        if window is not None and int(window) < n:
            raise ValueError(
                f"{where}: this is a sliding-window layer (window {window}); sparse methods assume "
                "full causal attention. Give this layer None in the config (SDPA) or keep prompts "
                "within the window"
            )
        valid = None
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise ValueError(f"{where}: expected a bool mask from sdpa_mask, got {type(mask).__name__}")
            valid = key_padding(mask, n)
            if valid is None:
                raise ValueError(
                    f"{where}: the attention mask is neither causal nor causal with key padding (expected "
                    "mask[b, :, i, j] == (j <= i and token j of row b is not padding) on every row whose "
                    "token is not padding, as transformers builds for a left- or right-padded batch). "
                    "Packed sequences (a block-diagonal mask "
                    "from position_ids), sliding windows and custom 4-D masks are not supported on the "
                    "sparse path; run such inputs unpacked, or raise min_seqlen above this length"
                )
            if bool(valid.all()):
                valid = None
        if dropout:
            raise ValueError(f"{where}: attention dropout ({dropout}) is not supported; call model.eval()")
        for name in ("softcap", "position_bias", "s_aux", "sinks"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{where}: `{name}` is not supported by sparse prefill methods")
        if kwargs.get("cache") is not None:
            raise ValueError(f"{where}: paged caches (continuous batching) are not supported")
        return valid

    def sparse_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        choices: Sequence[Choice],
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Estimate the plan of every head and run the sparse kernel once.

        Args:
            q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
            choices: one `Choice` per query head.
            scale: softmax scale, `1/sqrt(D)` if None.

        Returns:
            `[B, Hq, N, D]` in q's dtype.
        """
        use_fast = self._use_fast(q)
        out_dtype = q.dtype
        if use_fast and q.dtype not in HALF_DTYPES:
            q, k, v = (t.to(self.fast_dtype) for t in (q, k, v))
        first = choices[0]
        spec = METHODS[first.method]
        if use_fast and self.use_ops:
            return self._ops_attention(q, k, v, choices, scale=scale).to(out_dtype)
        if not spec.plan_based and all(c == first for c in choices):
            # A method that is not one plan's attention (Delta-KV) runs end to end.
            run = spec.run_fn("fast" if use_fast else "reference")
            result: torch.Tensor = run(q, k, v, **_resolve_params(first, q), scale=scale)
            result = dense_heads_output(q, k, v, result, first.dense_heads, use_fast=use_fast, scale=scale)
            return result.to(out_dtype)
        plan = build_plan(q, k, choices, fast_plans=use_fast)
        if self.backend == "masked":
            return masked_sdpa_attention(q, k, v, plan, scale=scale).to(out_dtype)
        impl = fast if use_fast else reference
        out: torch.Tensor = impl.sparse_attention(q, k, v, plan, scale=scale)
        return out.to(out_dtype)

    def _ops_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, choices: Sequence[Choice], *,
        scale: float | None,
    ) -> torch.Tensor:
        """The fast path through `sparseprefill.fast.ops` (half-precision q, k, v)."""
        from ..fast import ops

        first = choices[0]
        if all(c == first for c in choices) and not (first.dense_heads and METHODS[first.method].plan_based):
            out: torch.Tensor = ops.call(first.method, q, k, v, **_resolve_params(first, q), scale=scale)
            return dense_heads_output(q, k, v, out, first.dense_heads, use_fast=True, scale=scale)
        plan = build_plan(q, k, choices, fast_plans=True)
        return ops.sparse_attention(q, k, v, plan, scale=scale)


def key_padding(mask: torch.Tensor, n: int, rows_per_step: int = 1024) -> torch.Tensor | None:
    """The real tokens of a causal mask with key padding, or None for any other mask.

    transformers' `sdpa_mask` for a prefill with a 2-D `attention_mask` keeps key j
    for query i of batch row b iff `j <= i` and `attention_mask[b, j]`. A token is
    real iff its query row keeps its own key (the diagonal); every real row must keep
    exactly the real keys up to itself. The rows of pad tokens are not constrained:
    the integration computes them with SDPA on those very rows of the mask. Padding
    may be on the left, on the right or anywhere; a batch row may be all padding.

    Args:
        mask: bool `[B or 1, H or 1, n, n]`.
        n: the prompt length (query and key positions).
        rows_per_step: at most this many rows are compared at a time (fewer for
            long prompts: the temporaries stay near 64M entries, never another
            `n x n` mask per batch row).

    Returns:
        bool `[B or 1, n]`, True at real tokens, when every real row of `mask` (every
        head) is exactly `causal & real`; None otherwise (a block-diagonal mask of
        packed sequences, a sliding window, any other pattern).
    """
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (n, n):
        return None
    real = torch.diagonal(mask[:, 0], dim1=-2, dim2=-1)
    keys = torch.arange(n, device=mask.device)
    # At most ~64M mask entries per comparison (a few such temporaries at a time).
    step = max(1, min(rows_per_step, (1 << 26) // (int(mask.shape[0]) * int(mask.shape[1]) * n)))
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = torch.arange(start, stop, device=mask.device)
        slab = mask[:, :, start:stop, :]
        expected = (keys[None, :] <= rows[:, None])[None, None] & real[:, None, None, :]
        if not bool(((slab == expected) | ~real[:, None, start:stop, None]).all()):
            return None
    return real


def _sequence(t: torch.Tensor, cu: Sequence[int], s: int) -> torch.Tensor:
    """Sequence `s` of a packed `[T, H, D]` tensor as a `[1, H, n, D]` view."""
    return t[cu[s] : cu[s + 1]].transpose(0, 1).unsqueeze(0)


def _stack_sequence_plans(plans: Sequence[BlockColumnPlan]) -> BlockColumnPlan | None:
    """`stack_plans` of one plan per sequence (column groups unified), or None when
    their block sizes differ (demo parameters that depend on the length)."""
    if len({(p.block_m, p.block_n) for p in plans}) > 1:
        return None
    if len({p.column_group for p in plans}) > 1:
        plans = [p.ungrouped() for p in plans]
    return stack_sequences(list(plans))


def _resolve_params(choice: Choice, q: torch.Tensor) -> dict[str, Any]:
    spec = METHODS[choice.method]
    params = spec.demo_params(int(q.shape[2])) if choice.params is None else choice.params
    return spec.call_params(params, q) if choice.params is None else dict(params)


def masked_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, *, scale: float | None = None,
) -> torch.Tensor:
    """Attention restricted to a plan, through torch SDPA with the plan's boolean mask.

    The `masked` backend's attention (see the module doc): the keys are exactly those
    of `plan.to_dense_mask()`, as in `reference.sparse_attention`, but the arithmetic
    is SDPA's in q's dtype (float32: equal to the reference to float32 rounding), so
    it costs about what dense SDPA costs. The mask is built a chunk of query rows at
    a time (`plan.rows`, whole query blocks, about `_MASK_ENTRIES` entries per batch
    row and head). GQA is native (`enable_gqa`: K and V are not copied per query
    head). A row the plan gives no key gets output 0, as in the reference.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`; plan: a `BlockColumnPlan` of q's
            `B`, `Hq` and `N`, without a query offset.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        ValueError, TypeError: inputs `reference.sparse_attention` would refuse.
    """
    from ..reference._checks import check_qkv, resolve_scale
    from ..reference.attention import check_plan

    shape = check_qkv(q, k, v)
    sm_scale = resolve_scale(scale, shape.head_dim)
    check_plan(plan, shape.batch, shape.q_heads, shape.seqlen, q.device)
    if plan.query_offset:
        raise ValueError(f"plan.query_offset must be 0 (a whole prompt), got {plan.query_offset}")
    n = shape.seqlen
    step = max(1, _MASK_ENTRIES // max(n, 1) // plan.block_m) * plan.block_m
    out = torch.empty_like(q)
    for start in range(0, n, step):
        stop = min(n, start + step)
        mask = plan.rows(start, stop).to_dense_mask()  # [B, Hq, rows, stop]
        rows = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], attn_mask=mask, scale=sm_scale,
            enable_gqa=shape.q_heads != shape.kv_heads,
        )
        out[:, :, start:stop] = torch.where(mask.any(-1, keepdim=True), rows, 0.0)
    return out


def dense_heads_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, heads: Sequence[int], *,
    use_fast: bool, scale: float | None,
) -> torch.Tensor:
    """`out` `[B, Hq, N, D]` with the given heads replaced by full causal attention: the per-head
    dense fallback (`Choice.dense_heads`) of a method that is not one plan's attention
    (Delta-KV) or that runs its own layer function (SharePrefill). GQA: each head reads its
    own K/V head, nothing is copied."""
    if not heads:
        return out
    impl: Any = fast if use_fast else reference
    dense = METHODS[DENSE]
    group = int(q.shape[1]) // int(k.shape[1])
    out = out.clone()
    for h in heads:
        kv = h // group
        qh, kh, vh = q[:, h:h + 1], k[:, kv:kv + 1], v[:, kv:kv + 1]
        plan = dense.plan_fn("fast" if use_fast else "reference")(qh, kh, **dense.demo_params(int(q.shape[2])))
        out[:, h:h + 1] = impl.sparse_attention(qh, kh, vh, plan, scale=scale).to(out.dtype)
    return out


def _head_params(method: str, params: dict[str, Any], head: int, heads: int) -> dict[str, Any]:
    """A layer-wide choice's parameters for query head `head` planned alone: a per-head knob
    (`Method.knobs`, one value per query head of the layer) cut to that head's value."""
    out = dict(params)
    for knob in METHODS[method].knobs:
        value = out.get(knob)
        if isinstance(value, (list, tuple, torch.Tensor)) and len(value) == heads:
            out[knob] = value[head : head + 1]
    return out


def _headwise_heads(choices: Sequence[Choice], q: torch.Tensor) -> list[dict[str, Any] | None] | None:
    """The per-head choices as `headwise_plan` takes them (`{"method": ..., **params}`, None for a
    dense head; a layer-wide per-head knob cut to each head's value), or None when a head's
    method is not one `headwise` composes (then each head is planned alone)."""
    from ..config import METHOD, head_methods

    hq = int(q.shape[1])
    out: list[dict[str, Any] | None] = []
    for h, choice in enumerate(choices):
        if choice.method == DENSE or h in choice.dense_heads:
            out.append(None)
            continue
        if choice.method not in head_methods():
            return None
        params = _resolve_params(choice, q)
        for knob in METHODS[choice.method].knobs:
            value = params.get(knob)
            if isinstance(value, (list, tuple, torch.Tensor)) and len(value) == hq:
                item = value[h]
                params[knob] = item.item() if isinstance(item, torch.Tensor) else item
        out.append({METHOD: choice.method, **params})
    return out


def build_plan(
    q: torch.Tensor, k: torch.Tensor, choices: Sequence[Choice], *, fast_plans: bool
) -> BlockColumnPlan:
    """One plan for all heads: one estimator call if every head shares a method, else one per
    group of heads sharing a method and its non-knob parameters, merged (`headwise_plan`).

    Heads whose choice is full attention (`Choice(DENSE, None)`) are marked dense. Heads
    may differ in block sizes: the plan takes the finest (`BlockColumnPlan.refined`). A
    per-head knob given for the whole layer (`Method.knobs`) gives each head its element.
    A layer mixing in a method that `headwise` does not compose plans each head alone and
    needs equal block sizes.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        choices: one per query head.
        fast_plans: use the `fast` estimators (else `reference`).

    Returns:
        `BlockColumnPlan` with `B` and `Hq` of q.

    Raises:
        ValueError: a wrong number of choices, or heads whose block sizes differ.
    """
    b, hq, n, _ = q.shape
    if len(choices) != hq:
        raise ValueError(f"need one choice per query head ({hq}), got {len(choices)}")
    group = hq // int(k.shape[1])

    def plan_fn(choice: Choice) -> Callable[..., BlockColumnPlan]:
        spec = METHODS[choice.method]
        if not spec.plan_based:
            raise ValueError(f"method {choice.method!r} has no plan, so it cannot share a layer with other "
                             "methods per head; give every head of the layer the same method")
        return spec.plan_fn("fast" if fast_plans else "reference")

    first = choices[0]
    if all(c == first for c in choices):
        plan = plan_fn(first)(q, k, **_resolve_params(first, q))
        return plan.with_dense_heads(first.dense_heads)
    heads = _headwise_heads(choices, q)
    if heads is not None:
        # One estimate per group of heads sharing a method, the plans merged at their finest unit.
        plan_heads = fast.headwise_plan if fast_plans else reference.headwise_plan
        return plan_heads(q, k, heads=heads)
    plans: list[BlockColumnPlan | None] = [None] * hq
    sizes: dict[str, int] | None = None
    for h, choice in enumerate(choices):
        if choice == Choice(DENSE, None):
            continue
        kv = h // group
        params = _head_params(choice.method, _resolve_params(choice, q[:, h : h + 1]), h, hq)
        plan = plan_fn(choice)(q[:, h : h + 1], k[:, kv : kv + 1], **params)
        plans[h] = plan
        sizes = sizes or {"block_m": plan.block_m, "block_n": plan.block_n}
    for h, choice in enumerate(choices):
        if plans[h] is None:
            kv = h // group
            params = sizes if sizes is not None else _resolve_params(Choice(DENSE, None), q)
            plans[h] = plan_fn(Choice(DENSE, None))(q[:, h : h + 1], k[:, kv : kv + 1], **params)
    return stack_plans([p for p in plans if p is not None])


def register_attention(
    method: str,
    config: Config = None,
    *,
    backend: Backend = "auto",
    min_seqlen: int = 4096,
    fast_dtype: torch.dtype = torch.float16,
    name: str | None = None,
    use_ops: bool = False,
) -> SparsePrefillAttention:
    """Register a sparse attention with transformers under a new name.

    Use the returned object's `name` as `attn_implementation=` in `from_pretrained`
    or in `model.set_attn_implementation`; `patch` does both steps.

    Args:
        method: default method, a name in `sparseprefill.methods`.
        config: which method and parameters each layer and head uses:
            * None: `method` with its registry `demo_params(N)` in every layer;
            * a dict of parameters (optionally with a "method" key): every layer;
            * a dict `{layer_idx: spec}`: listed layers only, the others run SDPA;
            * a callable `layer_idx -> spec`.
            * the path of a `sparseprefill calibrate` config for `method`, or that config
              read (`sparseprefill.config.read_config`): `{layer_idx: spec}`, layers it
              lacks run SDPA; the file is read and checked once, here.
            A layer spec is None (SDPA, unchanged), a method name (its demo
            parameters), a parameter dict, or a list with one of those per query head,
            where None means full causal attention for that head. A parameter dict
            may hold `dense_heads`, query heads that run full causal attention
            (the per-head dense fallback; any method).
        backend: "fast", "reference" or "auto" (fast for CUDA tensors).
        min_seqlen: prompts shorter than this run SDPA.
        fast_dtype: half dtype for the fast backend when the model is float32.
        name: registration key; a fresh "sparseprefill-<n>" if None.
        use_ops: run the fast backend through the custom ops of `sparseprefill.fast.ops`
            (for `torch.compile`; see docs/serving.md).

    Returns:
        The registered `SparsePrefillAttention` (its `calls` counts the paths taken).

    Raises:
        TypeError, ValueError: an unknown method or a malformed config.
    """
    attn = SparsePrefillAttention(
        method, config, backend=backend, min_seqlen=min_seqlen, fast_dtype=fast_dtype, name=name,
        use_ops=use_ops,
    )
    AttentionInterface.register(attn.name, attn)
    # Without a mask function under our name transformers builds no mask at all, and
    # a padded batch would silently lose its padding.
    AttentionMaskInterface.register(attn.name, sdpa_mask)
    return attn


def _layer_indices(model: torch.nn.Module) -> set[int]:
    """Layer indices of the attention modules (those with `layer_idx` and `is_causal`)."""
    found: set[int] = set()
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "is_causal"):
            found.add(idx)
    return found


def patch(
    model: torch.nn.Module,
    method: str,
    config: Config = None,
    *,
    backend: Backend = "auto",
    min_seqlen: int = 4096,
    fast_dtype: torch.dtype = torch.float16,
    use_ops: bool = False,
) -> SparsePrefillAttention:
    """Switch a loaded model's attention to a sparse prefill method.

    Args:
        model: a transformers `PreTrainedModel` whose attention goes through
            `AttentionInterface` (Llama, Qwen2, Mistral and most decoders).
        method, config, backend, min_seqlen, fast_dtype, use_ops: see `register_attention`.

    Returns:
        The registered `SparsePrefillAttention`.

    Raises:
        TypeError: not a transformers model, or one that cannot switch attention.
        ValueError: a non-causal model, a config naming layers the model lacks, or a
            bad method/config.
    """
    hf_model: Any = model
    model_config = getattr(model, "config", None)
    if model_config is None or not callable(getattr(model, "set_attn_implementation", None)):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(model_config, "is_causal", True) is False or getattr(model_config, "is_encoder_decoder", False):
        raise ValueError(
            "model has non-causal attention (is_causal=False or encoder-decoder); sparse prefill "
            "methods are causal self-attention only"
        )
    attn = register_attention(
        method, config, backend=backend, min_seqlen=min_seqlen, fast_dtype=fast_dtype, use_ops=use_ops
    )
    config = attn._config
    if isinstance(config, Mapping) and attn._per_layer:
        known = _layer_indices(model)
        unknown = sorted(key for key in config if isinstance(key, int) and key not in known)
        if unknown:
            raise ValueError(f"config names layers {unknown} that the model lacks (it has {len(known)})")
    previous = model.__dict__.get(_PREVIOUS_ATTR, model_config._attn_implementation)
    hf_model.set_attn_implementation(attn.name)
    if model_config._attn_implementation != attn.name:
        raise TypeError(
            f"{type(model).__name__} cannot switch its attention implementation "
            "(it does not use transformers' AttentionInterface)"
        )
    model.__dict__[_PREVIOUS_ATTR] = previous
    model.__dict__[_ATTENTION_ATTR] = attn
    return attn


def unpatch(model: torch.nn.Module) -> None:
    """Restore the attention implementation the model had before `patch`.

    Raises:
        ValueError: the model was not patched.
    """
    if _PREVIOUS_ATTR not in model.__dict__:
        raise ValueError("model was not patched by sparseprefill")
    previous = model.__dict__.pop(_PREVIOUS_ATTR)
    model.__dict__.pop(_ATTENTION_ATTR, None)
    hf_model: Any = model
    hf_model.set_attn_implementation(previous)


def patched_attention(model: torch.nn.Module) -> SparsePrefillAttention | None:
    """The `SparsePrefillAttention` a model was patched with, or None."""
    attn = model.__dict__.get(_ATTENTION_ATTR)
    return attn if isinstance(attn, SparsePrefillAttention) else None


@dataclass
class CapturedQKV:
    """Post-RoPE q, k, v of the prefill of chosen layers (filled by `capture_qkv`).

    Attributes:
        layers: `{layer_idx: (q [B, Hq, N, D], k [B, Hkv, N, D], v [B, Hkv, N, D])}` on CPU.
        scale: `{layer_idx: softmax scale the model used}`.
    """

    layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    scale: dict[int, float]


@contextmanager
def capture_qkv(
    model: torch.nn.Module, layers: Sequence[int], *, dtype: torch.dtype | None = torch.float16
) -> Iterator[CapturedQKV]:
    """Record the prefill q, k, v of some layers while the model runs SDPA.

    Args:
        model: a transformers model (as for `patch`).
        layers: layer indices to record.
        dtype: dtype of the stored copies (None: the model's).

    Yields:
        A `CapturedQKV` filled by the model calls inside the `with` block (a later
        prefill overwrites an earlier one; decode steps are not recorded).

    Raises:
        TypeError: not a transformers model. ValueError: a layer the model lacks.
    """
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    wanted = set(layers)
    unknown = sorted(wanted - _layer_indices(model))
    if unknown:
        raise ValueError(f"layers {unknown} are not attention layers of this model")
    store = CapturedQKV(layers={}, scale={})

    def record(
        module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        idx = getattr(module, "layer_idx", None)
        if idx in wanted and query.shape[2] == key.shape[2]:
            assert isinstance(idx, int)
            store.layers[idx] = tuple(  # type: ignore[assignment]
                t.detach().to("cpu", dtype or t.dtype).contiguous() for t in (query, key, value)
            )
            scaling = kwargs.get("scaling")
            store.scale[idx] = float(scaling) if scaling is not None else float(query.shape[-1]) ** -0.5
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]

    name = f"sparseprefill-capture-{next(_NAMES)}"
    AttentionInterface.register(name, record)
    AttentionMaskInterface.register(name, sdpa_mask)
    hf_model: Any = model
    previous = hf_model.config._attn_implementation
    hf_model.set_attn_implementation(name)
    try:
        yield store
    finally:
        hf_model.set_attn_implementation(previous)


__all__ = [
    "CapturedQKV",
    "Choice",
    "SparsePrefillAttention",
    "build_plan",
    "capture_qkv",
    "key_padding",
    "patch",
    "patched_attention",
    "register_attention",
    "stack_plans",
    "unpatch",
]
