"""Where trainer_shard hooks into the transformers Trainer.

`ShardedTrainerMixin` goes first in the bases of any Trainer subclass:

    class MyTrainer(ShardedTrainerMixin, Seq2SeqTrainer): ...

With neither `--sharded_ddp` nor `--offload` it changes nothing the Trainer computes: the same
seed and data give bit-identical weights. What it always adds is the distributed guard: a run
launched on several processes that would not train together stops with a clear error.

With `--sharded_ddp simple|zero_dp_2` it swaps in `ShardedOptimizer` around the optimizer the
Trainer would have built (same class, hyperparameters and weight-decay groups):

- `simple` (ZeRO-1): the model is wrapped in DDP as usual; each rank steps its shard.
- `zero_dp_2` (ZeRO-2): no DDP; the optimizer's backward hooks reduce-scatter the gradients.
- `--bf16` / `--fp16`: the model's parameters and gradients become 16-bit; each rank keeps fp32
  master weights for its shard. fp16 scales the loss dynamically (`ShardedGradScaler`).
- gradient clipping and the logged grad norm use the global norm over all shards;
  checkpoints hold each rank's optimizer shard and resume at any world size (see
  [Note: sharded checkpoints]).

With `--offload CONFIG.json` (or `--sharded_ddp "zero_dp_2 offload"`, CPU offload with the
defaults) the optimizer's master weights and state go to the offload engine's store, CPU RAM
or disk, and the config's sections take effect (`config.apply`): its ZeRO stage when
`--sharded_ddp` names none, bucket sizes, `overlap_comm`, the optimizer (replacing `--optim`),
the WarmupLR/WarmupDecayLR schedule (replacing `--lr_scheduler_type`) and the fp16 loss scaler.
On one process, offload runs the ZeRO-2 path on a world of one.
"""

import functools
import inspect
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers import PreTrainedModel, Seq2SeqTrainer, Trainer
from transformers.trainer import (
    OPTIMIZER_NAME,
    OPTIMIZER_NAME_BIN,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
)
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.training_args import ParallelMode

import torch

from .args import ShardedDDPOption, stage_from_options, world_size_from_env
from . import comm
from .checkpoint import STAGING, manifest_problems, publish, save_model, write_manifest
from .config import apply as config_apply
from .config.load import parse_size
from .errors import ArgumentError, CheckpointError, DistributedSetupError
from .offload import OffloadSpec
from .offload.engine import per_element_state
from .offload.store import check_disk_store
from .sharding import ShardedGradScaler, ShardedOptimizer
from .sharding import state_io
from .sharding.optimizer import DEFAULT_BUCKET_NUMEL

logger = logging.getLogger(__name__)


def check_distributed_setup(args) -> None:
    """Raise unless every process torchrun started is in one process group the Trainer uses.

    Catches the traps of DESIGN.md for any TrainingArguments, ours or a user's own:
    no `use_cpu` without GPUs (each rank trains alone), or a backend set without `use_cpu`
    (the data is sharded but the model never wrapped, so ranks diverge).
    """
    world_size = world_size_from_env()
    if world_size <= 1:
        return
    state = args.distributed_state
    joined = (
        args.parallel_mode == ParallelMode.DISTRIBUTED
        and state is not None
        and state.distributed_type != DistributedType.NO
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == world_size
        and args.world_size == world_size
    )
    if not joined:
        raise DistributedSetupError(
            f"WORLD_SIZE={world_size} processes were launched, but the Trainer did not join them into one "
            f"process group (parallel_mode={args.parallel_mode.value}, device={args.device}), so each rank would "
            "train on its own. On a machine without GPUs pass --use_cpu (ShardedTrainingArguments sets it for "
            "you); with GPUs, launch one process per GPU with torchrun."
        )
    if state.distributed_type == DistributedType.MULTI_CPU and args.device.type != "cpu":
        raise DistributedSetupError(
            f"the process group is set up for the CPU but the model would go to {args.device}; pass --use_cpu"
        )


def model_normalizes_by_num_items(model) -> bool:
    """Whether the model's loss divides by the `num_items_in_batch` the Trainer passes it.

    The Trainer takes any `**kwargs` in `forward` as a yes, then multiplies the loss by the world
    size and skips the division by the gradient accumulation steps. T5, BART, Marian, mBART and
    Pegasus (transformers 5.x) accept `**kwargs` but return a plain per-batch mean, so their loss
    and gradients come out world_size x accumulation_steps too large. Models that honour the
    count go through `self.loss_function` or name `num_items_in_batch` in `forward`.
    """
    explicit = getattr(model, "accepts_loss_kwargs", None)
    if explicit is not None:
        return bool(explicit)
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True  # cannot tell: keep the Trainer's own judgement
    return "loss_function" in source or "num_items_in_batch" in source


class ShardedTrainerMixin:
    """Adds the trainer_shard options to a Trainer subclass. See the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_distributed_setup(self.args)
        self._plan_sharding()
        model = self.accelerator.unwrap_model(self.model)
        if self.model_accepts_loss_kwargs and not model_normalizes_by_num_items(model):
            # Per-batch mean losses, averaged over ranks by DDP and over micro-steps by the
            # Trainer: the classic data-parallel loss. Nothing changes on one process without
            # accumulation, where the Trainer's scaling factors are both 1.
            logger.info("%s returns a per-batch mean loss: not rescaling it by token counts", type(model).__name__)
            self.model_accepts_loss_kwargs = False
        if self.sharding_stage is not None and self.optimizer is not None:
            self._adopt_sharded_optimizer(self.optimizer)  # the user's own, via optimizers=(...)
        if getattr(model, "hf_device_map", None):
            # placed by a device map (offload.dispatch): its hooks move the weights; accelerate
            # would move a map of one entry ({"": "disk"}) whole, which offloaded weights cannot
            self.accelerator.prepare_model = functools.partial(self.accelerator.prepare_model, device_placement=False)

    # ---- sharding -----------------------------------------------------------------------------

    def _plan_sharding(self) -> None:
        """The ZeRO stage and offload of this run, from the flags and the --offload config."""
        options = getattr(self.args, "sharded_ddp", None) or []
        self.offload_config = getattr(self.args, "offload_config", None)
        self._sharding_stage, self.offload_spec = config_apply.plan(
            self.offload_config, stage_from_options(options), world_size_from_env()
        )
        if ShardedDDPOption.OFFLOAD in options and self.offload_spec is None:
            self.offload_spec = OffloadSpec("cpu")  # --sharded_ddp "zero_dp_2 offload": the defaults
        if ShardedDDPOption.AUTO in options and self.train_dataset is not None:  # nothing to choose for evaluation
            self._sharding_stage, self.offload_spec = self._choose_strategy()
        config_optimizer = config_apply.optimizer_cls_and_kwargs(self.offload_config, self.args)
        if config_optimizer is not None:
            if self.optimizer_cls_and_kwargs is not None or self.optimizer is not None:
                raise ArgumentError(
                    "the --offload config has an `optimizer` section and the trainer was given its own optimizer; "
                    "keep one"
                )
            self.optimizer_cls_and_kwargs = config_optimizer
        if self.offload_spec is not None and self.offload_spec.device == "nvme":
            self._check_disk_room()

    def _choose_strategy(self) -> tuple:
        """--sharded_ddp auto: rank 0 estimates every strategy (planner.py: exact state bytes, a
        measured activation probe) and picks the least costly one that fits the memory per rank
        (the config's max_memory, else what it detects); every rank takes its choice. Collective."""
        from . import planner

        args, rank = self.args, self.args.process_index
        configured = getattr(self.offload_config, "max_memory", None) or {}
        device = args.device
        budget = configured.get("cpu" if device.type == "cpu" else device.index or 0) or planner.detect_budget(device)
        decision = None
        if rank == 0:
            model = self.accelerator.unwrap_model(self.model)
            source, target = planner.dataset_lengths(self.train_dataset) if self.train_dataset is not None else (128, 128)
            precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
            with tempfile.TemporaryDirectory() as folder:
                model.config.save_pretrained(folder)
                probes = planner.measure_probes(folder, precision, source, target, device.type)
            rows = planner.estimate(model.config, world_size=max(1, args.world_size), precision=precision,
                                    batch_size=args.per_device_train_batch_size, source_length=source,
                                    target_length=target, device=device.type, probes=probes, max_memory=budget)  # fmt: skip
            choice = planner.choose(rows, budget)
            decision = (choice and (choice["strategy"], choice["offload"]), planner.explain(rows, choice, budget))
        decision = comm.all_gather_objects(decision)[0]
        chosen, why = decision
        if chosen is None:
            raise ArgumentError(f"--sharded_ddp auto: {why}; lower --per_device_train_batch_size or the sequence "
                                "lengths, or add ranks")  # fmt: skip
        if rank == 0:
            print(f"--sharded_ddp auto: {why}", flush=True)
        strategy, offload = chosen
        stage = {"ddp": None, "simple": 1, "zero_dp_2": 2}[strategy]
        spec = {"none": None, "cpu": OffloadSpec("cpu"),
                "disk": OffloadSpec("nvme", nvme_path=os.path.join(args.output_dir, "offload_store"))}[offload]  # fmt: skip
        return stage, spec

    def _check_disk_room(self) -> None:
        """Before training: room on disk for this rank's shard (master + the optimizer's
        per-element state, fp32); the store checks the exact, padded size again when it opens."""
        model = self.accelerator.unwrap_model(self.model)
        optim_class, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
        if not (isinstance(optim_class, type) and issubclass(optim_class, torch.optim.Optimizer)):
            return  # an optimizer factory: its class is known once built; the store checks then
        kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model", "optimizer_dict")}
        tensors = 1 + len(per_element_state(optim_class, kwargs))
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        needed = 4 * tensors * -(-numel // max(1, world_size_from_env()))
        check_disk_store(self.offload_spec.nvme_path, self.args.process_index, needed)

    @property
    def sharding_stage(self):
        """1 (ZeRO-1: `--sharded_ddp simple`), 2 (ZeRO-2: `zero_dp_2`, or offload on one process),
        or None without sharding."""
        return self._sharding_stage

    def _bucket_numel(self) -> int:
        config = self.offload_config
        if config is None:
            return DEFAULT_BUCKET_NUMEL
        return config.reduce_bucket_size if self.sharding_stage == 2 else config.allgather_bucket_size

    def create_optimizer(self, model=None):
        stage = self.sharding_stage
        if stage is None or self.optimizer is not None:
            return super().create_optimizer(model)
        self._cast_model_for_mixed_precision(model if model is not None else self.model)
        plain = super().create_optimizer(model)
        scaler = config_apply.loss_scaler(self.offload_config) if self.args.fp16 else None
        overlap = self.offload_config.overlap_comm if self.offload_config is not None else True
        accum = self.offload_config.grad_accum_dtype if self.offload_config is not None else None
        grad_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(accum)
        self.optimizer = ShardedOptimizer.wrap(
            plain, stage=stage, loss_scaler=scaler, offload=self.offload_spec, bucket_numel=self._bucket_numel(),
            overlap_comm=overlap, grad_dtype=grad_dtype,
        )  # fmt: skip
        self._adopt_sharded_optimizer(self.optimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None and self.offload_config is not None and self.offload_config.scheduler is not None:
            self.lr_scheduler = config_apply.make_scheduler(
                self.offload_config, optimizer or self.optimizer, num_training_steps, self.args.learning_rate
            )
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def _adopt_sharded_optimizer(self, optimizer) -> None:
        """Make the Trainer step through `optimizer`; refuse one that would silently not shard."""
        stage = self.sharding_stage
        if not isinstance(optimizer, ShardedOptimizer) or optimizer.stage != stage or (
            (optimizer.offload is None) != (self.offload_spec is None)
        ):
            raise ArgumentError(
                f"--sharded_ddp asks for ZeRO-{stage} but the trainer was given {type(optimizer).__name__}"
                f"{f' at stage {optimizer.stage}, offload {optimizer.offload}' if isinstance(optimizer, ShardedOptimizer) else ''} through "
                f"optimizers=(...); let the trainer build it (optimizer_cls_and_kwargs=...), or pass "
                f"ShardedOptimizer.wrap(your_optimizer, stage={stage}, offload={self.offload_spec})"
            )
        if self.args.fp16 and optimizer.loss_scaler is None:
            raise ArgumentError("--fp16 needs the ShardedOptimizer built with loss_scaler=True")
        self.sharded_optimizer = optimizer
        if self.args.fp16:
            # accelerate scales the loss and steps through this; see ShardedGradScaler
            self.accelerator.scaler = ShardedGradScaler(optimizer)
        if stage == 2:
            # No DDP around the model: the optimizer's hooks reduce-scatter the gradients.
            self.accelerator.prepare_model = functools.partial(self.accelerator.prepare_model, evaluation_mode=True)
        logger.info("--sharded_ddp: %r", optimizer)

    def _cast_model_for_mixed_precision(self, model) -> None:
        """16-bit parameters and gradients on the device; fp32 masters live in the optimizer shards."""
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None
        if dtype is not None:
            model.to(dtype)

    def _clip_grad_norm(self, model):
        if self.sharding_stage is None:
            return super()._clip_grad_norm(model)
        return self.sharded_optimizer.clip_grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.sharding_stage is not None and grad_norm is None:
            grad_norm = self.sharded_optimizer.grad_norm()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ---- checkpoints ---------------------------------------------------------------------------
    # [Note: sharded checkpoints] A sharded run saves the model in the usual Hugging Face form and
    # each rank's optimizer shard next to it (`optimizer_shards/`, see sharding/state_io.py); it
    # resumes from such a folder at any world size, stage or offload, or without sharding. Every
    # checkpoint is written under `.checkpoint-staging/` and renamed into place once all ranks
    # have finished, with a manifest of its files' sizes and CRC-32s that resuming checks first.

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharding_stage is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        model = self.accelerator.unwrap_model(self.model)
        files = state_io.save_shards(self.sharded_optimizer, Path(output_dir) / state_io.FOLDER, state_io.param_names(model))
        self._shard_files = {f"{state_io.FOLDER}/{name}": info for name, info in files.items()}
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        shards = Path(checkpoint) / state_io.FOLDER
        if not shards.is_dir():
            if not any((Path(checkpoint) / name).is_file() for name in (OPTIMIZER_NAME, OPTIMIZER_NAME_BIN)):
                raise CheckpointError(
                    f"{str(checkpoint)!r} holds no optimizer state ({state_io.FOLDER}/ or {OPTIMIZER_NAME}): it was "
                    "saved with --save_only_model, or its save did not finish. Resuming would restart the optimizer "
                    "silently; resume from a complete checkpoint, or start a new run from these weights with "
                    "--model_name_or_path"
                )
            return super()._load_optimizer_and_scheduler(checkpoint)
        model = self.accelerator.unwrap_model(self.model)
        if self.sharding_stage is not None:
            state_io.load_shards(self.sharded_optimizer, shards, state_io.param_names(model))
        else:
            state_io.load_into_plain(self.optimizer, model, shards)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        if self.lr_scheduler is not None:
            if not scheduler.is_file():
                raise CheckpointError(f"{str(scheduler)!r} is missing: the LR schedule cannot resume; resume from a "
                                      "complete checkpoint")  # fmt: skip
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, STAGING) if getattr(self, "_staging", False) else run_dir

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's save, into `.checkpoint-staging/checkpoint-N`; renamed to `checkpoint-N`
        once every rank has written its files. See [Note: sharded checkpoints]. Collective."""
        self._model_files = self._shard_files = None
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, final = os.path.join(run_dir, STAGING, name), os.path.join(run_dir, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
        comm.barrier()
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = False
        comm.barrier()  # every rank's files are written
        best = self.state.best_model_checkpoint
        if best is not None and os.path.dirname(best) == os.path.join(run_dir, STAGING):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
        if self.args.should_save:
            if best != self.state.best_model_checkpoint:
                self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
            write_manifest(staging, self._known_files())
            publish(staging, final)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=False)
        comm.barrier()  # nobody goes on before the checkpoint is in place

    def _known_files(self) -> dict:
        """Sizes and CRC-32s the writers computed, so the manifest does not read those files again."""
        return {**(getattr(self, "_model_files", None) or {}), **(getattr(self, "_shard_files", None) or {})}

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Check the checkpoint against its manifest (ranks share the CRC work) before loading."""
        rank, world = self.args.process_index, self.args.world_size
        problems = manifest_problems(resume_from_checkpoint, rank, world)
        if world > 1:
            problems = sorted({p for found in comm.all_gather_objects(problems) for p in found})
        if problems:
            raise CheckpointError(f"checkpoint {str(resume_from_checkpoint)!r} cannot be resumed: "
                                  + "; ".join(problems) + ". Resume from an earlier checkpoint")  # fmt: skip
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save(self, output_dir=None, state_dict=None) -> None:
        """The weights tensor by tensor, without the full copy `save_pretrained` makes of
        parameters that share storage (the flat buffer's views; see checkpoint.py), split into
        files of at most --max_shard_size."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if state_dict is not None or not isinstance(model, PreTrainedModel):
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        logger.info("Saving model checkpoint to %s", output_dir)
        self._model_files = save_model(model, output_dir, parse_size(getattr(self.args, "max_shard_size", "5GB")))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def evaluation_loop(self, *args, **kwargs):
        # Seq2SeqTrainer.evaluate/predict (transformers 5.x) switch the gather to
        # `accelerator.gather`, which keeps the samples that the even-batches sharding repeats to
        # fill the last batch, and the loop no longer truncates to the dataset length: with N
        # ranks, predictions, labels, loss and BLEU then include duplicates. `gather_for_metrics`
        # drops them. On one process the two are the same.
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )
        return super().evaluation_loop(*args, **kwargs)


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """`transformers.Trainer` with `--sharded_ddp` / `--offload` support."""


class ShardedSeq2SeqTrainer(ShardedTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with `--sharded_ddp` / `--offload` support."""
