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
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints
from transformers.training_args import ParallelMode

import torch

from .args import ShardedDDPOption, stage_from_options, world_size_from_env
from . import comm
from . import faults
from .checkpoint import (
    STAGING,
    check_writable,
    describe_write_error,
    format_bytes,
    is_write_error,
    manifest_problems,
    publish,
    save_model,
    unique_state_dict,
    write_manifest,
)
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
        faults.apply_timeout(self.args.ddp_timeout)
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
        self._fault_watch = self._interrupt = self._stop_agreement = None
        self.callback_handler.callbacks.insert(0, _FaultCallback(self))  # first: it says where the step begins

    # ---- faults --------------------------------------------------------------------------------
    # See [Note: fault watch] and [Note: interrupts] in faults.py.

    def train(self, *args, **kwargs):
        """The Trainer's `train()`, with every rank bounded in its wait for a failed peer (the
        error names it: `PeerFailedError`) and SIGINT/SIGTERM stopping after the current step,
        with a checkpoint under --save_on_interrupt (`TrainingInterrupted`). Collective."""
        self._fault_watch = faults.FaultWatch.start(self.args.ddp_timeout)
        self._interrupt = faults.InterruptGuard(self._fault_watch)
        self._stop_agreement, self._stopped_by = faults.StopAgreement(), None
        try:
            self._check_output_room()
            output = super().train(*args, **kwargs)
        except BaseException as e:
            failure = self._explain_failure(e)
            if failure is e:
                raise
            raise failure from e
        finally:
            self._interrupt.restore()
            if self._fault_watch is not None:
                self._fault_watch.stop()
            self._fault_watch = self._stop_agreement = None
        signum = self._stopped_by or self._interrupt.signum
        if signum:
            checkpoint = getattr(self, "_last_checkpoint", None) if _save_on_interrupt(self.args) else None
            raise faults.TrainingInterrupted(signum, self.state.global_step, checkpoint)
        return output

    def _explain_failure(self, error):
        """The error this rank leaves `train()` with: a `PeerFailedError` naming the rank at fault
        when a collective failed because of another rank; else `error`, posted for the others."""
        watch = self._fault_watch
        if watch is None or isinstance(error, faults.PeerFailedError):
            return error
        found = watch.wait_for_culprit(error) if isinstance(error, Exception) and faults.is_comm_error(error) else None
        if found is None:
            watch.post_failure(error)
            return error
        watch.post_failure(found[1], because_of=found[0])  # the others learn the job is over, and why
        return faults.PeerFailedError(found[0], watch.message(found))

    def _check_output_room(self) -> None:
        """Before training: --output_dir writable, with room for a checkpoint (or the final model)."""
        saves = self.args.save_strategy != "no" or _save_on_interrupt(self.args)
        purpose = " for a checkpoint of this run" if saves else " for the trained model"
        check_writable(self.args.output_dir, self._checkpoint_bytes(with_optimizer=saves), "--output_dir", purpose)
        if self.args.should_save:
            shutil.rmtree(os.path.join(self.args.output_dir, STAGING), ignore_errors=True)  # a killed run's

    def _checkpoint_bytes(self, with_optimizer: bool = True) -> int:
        """About what a checkpoint of this run writes: the weights, and the optimizer's state."""
        model = self.accelerator.unwrap_model(self.model)
        total = sum(t.numel() * t.element_size() for t in unique_state_dict(model).values())  # what save_model writes
        if not with_optimizer or self.args.save_only_model:
            return total
        states = self._state_tensors()
        states = 2 if states is None else states  # a factory's optimizer: say Adam's
        trainable = [p for p in model.parameters() if p.requires_grad]
        if self.sharding_stage is not None:  # fp32 masters and state
            return total + 4 * (1 + states) * sum(p.numel() for p in trainable)
        return total + states * sum(p.numel() * p.element_size() for p in trainable)

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
        states = self._state_tensors()
        if states is None:
            return  # an optimizer factory: its class is known once built; the store checks then
        model = self.accelerator.unwrap_model(self.model)
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        needed = 4 * (1 + states) * -(-numel // max(1, world_size_from_env()))
        check_disk_store(self.offload_spec.nvme_path, self.args.process_index, needed)

    def _state_tensors(self):
        """How many per-element state tensors the optimizer keeps (AdamW: 2), before it is built;
        None for an optimizer factory (its class is known only once built)."""
        model = self.accelerator.unwrap_model(self.model)
        optim_class, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
        if not (isinstance(optim_class, type) and issubclass(optim_class, torch.optim.Optimizer)):
            return None
        kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model", "optimizer_dict")}
        return len(per_element_state(optim_class, kwargs))

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
        self._shard_folder = Path(output_dir) / state_io.FOLDER
        self._shard_written = state_io.write_shard(self.sharded_optimizer, self._shard_folder, state_io.param_names(model))
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
        once every rank has written its files. A rank that cannot write (a full or read-only disk)
        makes every rank raise `CheckpointError` naming it, with the partial checkpoint removed and
        the earlier ones untouched. See [Note: sharded checkpoints]. Collective."""
        self._model_files = self._shard_written = self._save_failure = None
        run_dir = self._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, final = os.path.join(run_dir, STAGING, name), os.path.join(run_dir, name)
        faults.at(phase=f"saving {name}")
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving
        comm.barrier()
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)  # no collective may raise in between: see _save
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            if not isinstance(e, OSError) and not is_write_error(e):
                raise
            self._save_failure = self._save_failure or describe_write_error(e, staging)
        finally:
            self._staging = False
        # every rank's files are written, or who failed and why
        outcomes = comm.all_gather_objects((self._save_failure, self._shard_written))
        self._raise_if_save_failed(outcomes, name, staging)
        best = self.state.best_model_checkpoint
        if best is not None and os.path.dirname(best) == os.path.join(run_dir, STAGING):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
        failure = None
        if self.args.should_save:
            try:
                if best != self.state.best_model_checkpoint:
                    self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
                write_manifest(staging, {**(self._model_files or {}), **self._write_shard_index(outcomes)})
                publish(staging, final)
            except OSError as e:
                failure = describe_write_error(e, staging)
        # nobody goes on before the checkpoint is in place
        self._raise_if_save_failed([(f, None) for f in comm.all_gather_objects(failure)], name, staging)
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=False)
        self._last_checkpoint = final
        if self._fault_watch is not None:
            self._fault_watch.last_checkpoint = final
        faults.at(phase="training")

    def _raise_if_save_failed(self, outcomes, name: str, staging: str) -> None:
        failed = [(r, failure or shard) for r, (failure, shard) in enumerate(outcomes)
                  if failure or isinstance(shard, str)]  # fmt: skip
        if not failed:
            return
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(staging))
            except OSError:
                pass
        comm.barrier()
        last = getattr(self, "_last_checkpoint", None) or get_last_checkpoint_or_none(self.args.output_dir)
        kept = f"{last} (the last complete checkpoint) is untouched" if last else "no earlier checkpoint exists"
        causes = "; ".join(f"rank {r}: {text}" for r, text in failed)
        fix = ("make it writable again, or point --output_dir at a writable disk" if "read-only" in causes else
               "free space there (or lower --save_total_limit), or point --output_dir at a disk with room")  # fmt: skip
        raise CheckpointError(
            f"{name} was not saved: {causes}. A checkpoint of this run takes about "
            f"{format_bytes(self._checkpoint_bytes())}. What it had written was removed; {kept}. To go on, {fix}, "
            "and resume with --resume_from_checkpoint latest"
        )

    def _write_shard_index(self, outcomes) -> dict:
        """Rank 0: the index of the optimizer shards every rank wrote; their files' sizes and CRCs."""
        if self.sharding_stage is None or self.args.save_only_model:
            return {}
        world = self.sharded_optimizer.world_size
        files = {state_io.rank_file(r, world): outcomes[r][1] for r in range(world)}
        model = self.accelerator.unwrap_model(self.model)
        state_io.write_index(self.sharded_optimizer, self._shard_folder, state_io.param_names(model), files)
        return {f"{state_io.FOLDER}/{name}": info for name, info in files.items()}

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
        try:
            self._model_files = save_model(model, output_dir, parse_size(getattr(self.args, "max_shard_size", "5GB")))
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        except OSError as e:
            if not getattr(self, "_staging", False):
                raise CheckpointError(f"the model could not be saved to {output_dir!r}: "
                                      f"{describe_write_error(e, output_dir)}; free space there or pass another "
                                      "--output_dir") from None  # fmt: skip
            # inside a checkpoint: the other ranks go on to the Trainer's barrier; every rank
            # learns of it at _save_checkpoint's gather (raising here would leave them waiting)
            self._save_failure = describe_write_error(e, output_dir)

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


class _FaultCallback(TrainerCallback):
    """Keeps the fault watch told where this rank is, and stops every rank after the same step
    once one of them got SIGINT/SIGTERM (see [Note: interrupts])."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs):
        faults.at(step=state.global_step + 1, phase="training")

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer._stop_agreement is None:
            return
        signum = trainer._stop_agreement.agree(trainer._interrupt.signum)
        if signum and not trainer._stopped_by:
            trainer._stopped_by = signum
            control.should_training_stop = True
            control.should_save = control.should_save or _save_on_interrupt(args)

    def on_evaluate(self, args, state, control, **kwargs):
        faults.at(phase="training")

    def on_prediction_step(self, args, state, control, **kwargs):
        faults.at(phase="evaluating")


def _save_on_interrupt(args) -> bool:
    return bool(getattr(args, "save_on_interrupt", False))  # a plain TrainingArguments has no such flag


def get_last_checkpoint_or_none(output_dir):
    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """`transformers.Trainer` with `--sharded_ddp` / `--offload` support."""


class ShardedSeq2SeqTrainer(ShardedTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with `--sharded_ddp` / `--offload` support."""
