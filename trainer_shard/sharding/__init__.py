"""ZeRO-1/ZeRO-2 sharding: partition -> flat buffers -> gradient reducer -> ShardedOptimizer."""

from .optimizer import NotConsolidatedError, ShardedOptimizer
from .scaler import DynamicLossScaler, ShardedGradScaler

__all__ = ["DynamicLossScaler", "NotConsolidatedError", "ShardedGradScaler", "ShardedOptimizer"]
