"""sparseprefill.fast: the `reference` API on fused Triton kernels.

Same names, signatures, defaults and return types as `sparseprefill.reference`.
Inputs are float16/bfloat16 CUDA tensors (or CPU tensors under
`TRITON_INTERPRET=1`); everything is validated before any kernel launch.
"""

from ..reference.minference import HeadPattern, MInferenceConfig, SearchResult
from ..reference.attention import AttentionState
from ..reference.delta_kv import PackedKV
from ..reference.delta_xattention import TilePackedKV
from ..reference.plan import BlockColumnPlan, stack_plans
from ..reference.sample_attention import SampleAttentionSettings
from ..reference.shareprefill import ClusterLayout, LayerDecision, Pivot, SharePattern, SharePrefillState
from .a_shape import a_shape, a_shape_plan
from .anchor_attention import anchor_attention, anchor_attention_plan
from .headwise import headwise, headwise_plan
from .attention import attention, sparse_attention
from .block_sparse import block_sparse, block_sparse_plan
from .chunked import chunk_plan
from .dense import dense, dense_plan
from .delta_kv import (
    delta_keep_mask,
    delta_kv,
    delta_kv_attention,
    delta_kv_density,
    delta_kv_plans,
    delta_pack,
)
from .delta_xattention import (
    delta_tile_pack,
    delta_xattention,
    delta_xattention_attention,
    delta_xattention_density,
    delta_xattention_kv_reduction,
    delta_xattention_plans,
    delta_xattention_tiles,
    exact_tiles,
    skip_tiles,
)
from .flexprefill_vs import flexprefill_vs, flexprefill_vs_plan
from .dpxa import dpxa, dpxa_plan, dpxa_scoring_ratio, dpxa_tile_weights
from .metrics import density, recall, relative_error
from .minference import minference, minference_plan, search_patterns
from .sample_attention import sample_attention, sample_attention_plan
from .shareprefill import (
    shareprefill,
    shareprefill_layer,
    shareprefill_layer_plan,
    shareprefill_plan,
    shareprefill_stack,
)
from .streaming import streaming, streaming_plan
from .varlen import varlen_attention, varlen_plans
from .vertical_slash import vertical_slash, vertical_slash_plan
from .xattention import select_tiles, xattention, xattention_plan, xattention_tile_weights

__all__ = [
    "AttentionState",
    "BlockColumnPlan",
    "ClusterLayout",
    "HeadPattern",
    "LayerDecision",
    "MInferenceConfig",
    "PackedKV",
    "Pivot",
    "SampleAttentionSettings",
    "SearchResult",
    "SharePattern",
    "SharePrefillState",
    "TilePackedKV",
    "a_shape",
    "a_shape_plan",
    "anchor_attention",
    "anchor_attention_plan",
    "headwise",
    "headwise_plan",
    "attention",
    "block_sparse",
    "block_sparse_plan",
    "chunk_plan",
    "delta_keep_mask",
    "delta_kv",
    "delta_kv_attention",
    "delta_kv_density",
    "delta_kv_plans",
    "delta_pack",
    "delta_tile_pack",
    "delta_xattention",
    "delta_xattention_attention",
    "delta_xattention_density",
    "delta_xattention_kv_reduction",
    "delta_xattention_plans",
    "delta_xattention_tiles",
    "dense",
    "dense_plan",
    "density",
    "dpxa",
    "dpxa_plan",
    "dpxa_scoring_ratio",
    "dpxa_tile_weights",
    "exact_tiles",
    "flexprefill_vs",
    "flexprefill_vs_plan",
    "minference",
    "minference_plan",
    "recall",
    "relative_error",
    "sample_attention",
    "sample_attention_plan",
    "search_patterns",
    "select_tiles",
    "shareprefill",
    "shareprefill_layer",
    "shareprefill_layer_plan",
    "shareprefill_plan",
    "shareprefill_stack",
    "skip_tiles",
    "sparse_attention",
    "stack_plans",
    "streaming",
    "streaming_plan",
    "varlen_attention",
    "varlen_plans",
    "vertical_slash",
    "vertical_slash_plan",
    "xattention",
    "xattention_plan",
    "xattention_tile_weights",
]
