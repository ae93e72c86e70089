"""trainer_shard: ZeRO-style sharding and offload for the Hugging Face Trainer, driven by flags."""

from .args import ShardedDDPOption, ShardedSeq2SeqTrainingArguments, ShardedTrainingArguments
from .errors import ArgumentError, ConfigError, DataError, DistributedSetupError, ShardingError, TrainerShardError
from .loading import load_meta
from .offload import OffloadSpec, OffloadStoreError
from .sharding import ShardedOptimizer
from .trainer import ShardedSeq2SeqTrainer, ShardedTrainer, ShardedTrainerMixin

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ConfigError",
    "DataError",
    "DistributedSetupError",
    "OffloadSpec",
    "OffloadStoreError",
    "ShardedDDPOption",
    "ShardedOptimizer",
    "ShardedSeq2SeqTrainer",
    "ShardedSeq2SeqTrainingArguments",
    "ShardedTrainer",
    "ShardedTrainerMixin",
    "ShardedTrainingArguments",
    "ShardingError",
    "TrainerShardError",
    "load_meta",
]
