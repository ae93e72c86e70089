"""The exceptions trainer_shard raises for users' mistakes.

Each message names the problem and the fix. They subclass ValueError so code written for the
transformers Trainer, which raises ValueError for bad arguments, keeps working.
"""


class TrainerShardError(ValueError):
    """Base class: a user's mistake, reported before anything is written."""


class ArgumentError(TrainerShardError):
    """A bad or impossible combination of command-line / TrainingArguments options.

    Holds every problem found, so the user fixes them in one go.
    """

    def __init__(self, problems):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems with the arguments:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


class DataError(TrainerShardError):
    """A data file that is missing, empty, not UTF-8, or out of step with its pair."""


class DistributedSetupError(TrainerShardError):
    """Several processes were launched but would not train together."""


class ShardingError(TrainerShardError):
    """An optimizer, model or parameter set the sharded optimizer cannot work with."""


class ConfigError(TrainerShardError):
    """An offload config with problems: every one of them, each with its JSON path and the fix."""

    def __init__(self, source: str, problems):
        self.source = source
        self.problems = list(problems)  # [(json_path, message)]
        lines = [f"  - {path}: {message}" for path, message in self.problems]
        count = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__(f"offload config {source}: {count}\n" + "\n".join(lines))


class CheckpointError(TrainerShardError):
    """A checkpoint that is missing files, has corrupt ones, or does not fit the run resuming it."""
