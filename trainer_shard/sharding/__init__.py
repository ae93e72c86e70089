"""ZeRO-1/2/3 sharding: partition -> flat buffers -> gradient reducer -> ShardedOptimizer (ZeRO-1/2)
or a ShardedModel (ZeRO-3: parameters sharded unit by unit, for a plain training loop)."""

from .optimizer import NotConsolidatedError, ShardedOptimizer
from .scaler import DynamicLossScaler, ShardedGradScaler
from .zero3 import ShardedModel, shard_model

__all__ = ["DynamicLossScaler", "NotConsolidatedError", "ShardedGradScaler", "ShardedModel", "ShardedOptimizer",
           "shard_model"]
