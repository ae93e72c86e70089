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
- `zero_dp_3` (ZeRO-3): no DDP; the parameters are sharded too (`sharding.zero3`), one unit per
  layer with `auto_wrap` (else the whole model is one unit), gathered for each forward and
  backward; the model is sharded when the optimizer is built, so evaluation before training
  runs on the whole model. Saving streams `model.safetensors` a unit at a time; generate()
  runs with `synced_gpus` so ranks finishing first keep step with the others.
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

At stage 3 the config's `offload_param` (device cpu or nvme) puts the parameter shards, and on
disk their gradient shards too, in a store of their own (`offload.param_store`), read ahead a
unit at a time; the optimizer must be offloaded as well (`offload_optimizer`, or the `offload` of
`--sharded_ddp "zero_dp_3 offload"`: CPU RAM). Room on disk for both stores, and their folders
free of other runs, are checked when the Trainer is built, before anything is written.
"""

import functools
import logging
import os

from transformers import PreTrainedModel, Seq2SeqTrainer, Trainer
from transformers.trainer import TRAINING_ARGS_NAME

import torch

from . import faults
from .args import ShardedDDPOption, set_ddp_bucket, world_size_from_env
from .checkpoint import check_writable, save_model
from .config import apply as config_apply
from .config.load import parse_size
from .disk import describe_write_error
from .errors import ArgumentError, CheckpointError
from .loading import META_WEIGHTS
from .sharding import ShardedGradScaler, zero3_weights
from .training import build, checkpoints, loss, plan
from .training.evaluation import gather_for_metrics
from .training.guard import check_distributed_setup
from .training.supervision import Supervisor, save_on_interrupt

logger = logging.getLogger(__name__)

__all__ = ["ShardedSeq2SeqTrainer", "ShardedTrainer", "ShardedTrainerMixin", "check_distributed_setup"]


class ShardedTrainerMixin:
    """Adds the trainer_shard options to a Trainer subclass. See the module docstring; each
    override below hands its work to one module of `training/`."""

    sharded_model = None  # ZeRO-3: the zero3.ShardedModel, once the optimizer is built
    param_offload_spec = None  # ZeRO-3: where the parameter shards live (offload_param), or None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_distributed_setup(self.args)
        faults.apply_timeout(self.args.ddp_timeout)
        self._plan_sharding()
        model = self.accelerator.unwrap_model(self.model)
        declared = loss.declared_normalization(model)
        if declared is not None:
            self.model_accepts_loss_kwargs = declared
        # a **kwargs model that says nothing is watched on its first training step (compute_loss)
        self._loss_kwargs_known = declared is not None or not self.model_accepts_loss_kwargs or (
            self.compute_loss_func is not None or not loss.LossKwargsObserver(model).can_observe
        )
        if self.sharding_stage is not None and self.optimizer is not None:
            self._adopt_sharded_optimizer(self.optimizer)  # the user's own, via optimizers=(...)
        elif _on_meta(model):
            self._shard_meta_model(model)
        if getattr(model, "hf_device_map", None):
            # placed by a device map (offload.dispatch): its hooks move the weights; accelerate
            # would move a map of one entry ({"": "disk"}) whole, which offloaded weights cannot
            _force_prepare_model(self.accelerator, device_placement=False)
        self._supervisor = Supervisor()
        self._staged = self._last_checkpoint = None
        self.callback_handler.callbacks.insert(0, self._supervisor.callback(self.args))  # first: it says where the step begins

    # ---- loss normalization: training/loss.py -----------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        if self._loss_kwargs_known or num_items_in_batch is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch, **kwargs)
        # The first training step of a model that takes **kwargs and declares nothing: it is given
        # the count as the Trainer would give it, with the Trainer's rescaling held back until
        # the model shows whether it divides by the count.
        observer = loss.LossKwargsObserver(self.accelerator.unwrap_model(model))
        self.model_accepts_loss_kwargs = False
        with observer:
            result = super().compute_loss(model, {**inputs, "num_items_in_batch": num_items_in_batch}, return_outputs,
                                          num_items_in_batch, **kwargs)  # fmt: skip
        self._loss_kwargs_known = True
        name = type(self.accelerator.unwrap_model(model)).__name__
        if not observer.normalized:
            logger.info("%s returns a per-batch mean loss: not rescaling it by token counts", name)
            return result
        self.model_accepts_loss_kwargs = True
        if self.args.average_tokens_across_devices:  # as Trainer.compute_loss scales a normalized loss
            scale = self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu
            result = (result[0] * scale, result[1]) if return_outputs else result * scale
        logger.info("%s divides its loss by the token count: the Trainer's normalization applies", name)
        return result

    # ---- faults: training/supervision.py --------------------------------------------------------

    def train(self, *args, **kwargs):
        """The Trainer's `train()`, with every rank bounded in its wait for a failed peer (the
        error names it: `PeerFailedError`) and SIGINT/SIGTERM stopping after the current step,
        with a checkpoint under --save_on_interrupt (`TrainingInterrupted`). Collective."""
        with self._supervisor.running(self.args.ddp_timeout):
            self._check_output_room()
            output = super().train(*args, **kwargs)
        checkpoint = self._last_checkpoint if save_on_interrupt(self.args) else None
        self._supervisor.raise_if_interrupted(self.state.global_step, checkpoint)
        return output

    def _check_output_room(self) -> None:
        """Before training: --output_dir writable, with room for a checkpoint (or the final model)."""
        saves = self.args.save_strategy != "no" or save_on_interrupt(self.args)
        purpose = " for a checkpoint of this run" if saves else " for the trained model"
        check_writable(self.args.output_dir, self._checkpoint_bytes(with_optimizer=saves), "--output_dir", purpose)
        if saves:
            checkpoints.check_output_dirs(self.args)  # several nodes: --save_on_each_node as their disks need
        if self.args.should_save:
            checkpoints.clear_staging(self.args.output_dir)

    def _checkpoint_bytes(self, with_optimizer: bool = True) -> int:
        model = self.accelerator.unwrap_model(self.model)
        with_optimizer = with_optimizer and not self.args.save_only_model
        return plan.checkpoint_bytes(model, self.sharding_stage is not None, self._state_tensors(), with_optimizer)

    # ---- sharding: training/plan.py, training/build.py ------------------------------------------

    def _plan_sharding(self) -> None:
        """The ZeRO stage and offload of this run, from the flags and the --offload config."""
        self.offload_config = getattr(self.args, "offload_config", None)
        self._sharding_stage, self.offload_spec = plan.plan(self.args, self.offload_config)
        # ZeRO-3's parameter store: the config's offload_param, or what auto chose
        self.param_offload_spec = plan.param_offload_spec(self.offload_config) if self._sharding_stage == 3 else None
        options = getattr(self.args, "sharded_ddp", None) or []
        model = self.accelerator.unwrap_model(self.model)
        if ShardedDDPOption.AUTO in options and self.train_dataset is not None:  # nothing to choose for evaluation
            self._sharding_stage, self.offload_spec, self.param_offload_spec = plan.choose_strategy(
                self.args, model, self.train_dataset, self.offload_config
            )
        config_optimizer = config_apply.optimizer_cls_and_kwargs(self.offload_config, self.args)
        if config_optimizer is not None:
            if self.optimizer_cls_and_kwargs is not None or self.optimizer is not None:
                raise ArgumentError(
                    "the --offload config has an `optimizer` section and the trainer was given its own optimizer; "
                    "keep one"
                )
            self.optimizer_cls_and_kwargs = config_optimizer
        if self.offload_config is not None:  # "auto" sizes need the model's hidden size: say so before training
            sizes = config_apply.hidden_size_fills(self.offload_config, model)
            if self._sharding_stage == 1 and self.offload_config.reduce_bucket_size is None:
                problems = set_ddp_bucket(self.args, sizes["reduce_bucket_size"], self.args.offload)
                if problems:
                    raise ArgumentError(problems)
        # the parameter store checked with the optimizer's
        world_size = world_size_from_env()
        params = self.param_offload_spec
        param_bytes = plan.param_store_bytes(params, model, world_size, self.args, self.offload_config)
        plan.check_disk_room(self.offload_spec, model, self._state_tensors(), self.args.process_index, world_size,
                             params, param_bytes)  # fmt: skip

    def _state_tensors(self):
        """Per-element state tensors of the optimizer the Trainer will build (None: a factory)."""
        model = self.accelerator.unwrap_model(self.model)
        optim_class, kwargs = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
        return plan.state_tensors(optim_class, kwargs)

    @property
    def sharding_stage(self):
        """1 (ZeRO-1: `--sharded_ddp simple`), 2 (ZeRO-2: `zero_dp_2`, or offload on one process),
        3 (ZeRO-3: `zero_dp_3`, or a config at stage 3), or None without sharding."""
        return self._sharding_stage

    def create_optimizer(self, model=None):
        stage = self.sharding_stage
        if stage is None or self.optimizer is not None:
            return super().create_optimizer(model)
        build.cast_for_mixed_precision(model if model is not None else self.model, self.args)
        if stage == 3 and self.sharded_model is None:  # sharded before the Trainer groups them for its optimizer
            unwrapped = self.accelerator.unwrap_model(model if model is not None else self.model)
            self.sharded_model = build.shard_for_stage3(unwrapped, self.args, self.offload_config,
                                                        self.get_decay_parameter_names(unwrapped),
                                                        param_offload=self.param_offload_spec)  # fmt: skip
        plain = super().create_optimizer(model)
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        self.optimizer = build.wrap(plain, stage, self.offload_spec, self.args, self.offload_config, model)
        self._adopt_sharded_optimizer(self.optimizer)
        return self.optimizer

    def _shard_meta_model(self, model) -> None:
        """A model built on the meta device (`loading.load_meta`, for parameter offload: its
        weights are never whole in memory) is sharded now, its weights read from its checkpoint a
        tensor at a time straight into the parameter store, so that evaluation before training
        runs it too; `create_optimizer` then finds it sharded."""
        folder = getattr(model, META_WEIGHTS)
        if self.sharding_stage != 3:
            raise ArgumentError("the model is on the meta device (no weights): that is for ZeRO-3 with parameter "
                                "offload (--sharded_ddp \"zero_dp_3 offload\" with an --offload config whose "
                                "offload_param names a device); load the model with from_pretrained otherwise")  # fmt: skip
        weights = zero3_weights.checkpoint_weights(folder)
        try:
            self.sharded_model = build.shard_for_stage3(model, self.args, self.offload_config,
                                                        self.get_decay_parameter_names(model), weights=weights,
                                                        param_offload=self.param_offload_spec)  # fmt: skip
        finally:
            weights.close()
        _force_prepare_model(self.accelerator, evaluation_mode=True, device_placement=False)
        if self.args.process_index == 0:
            logger.info("zero_dp_3: the model was built on the meta device; its weights were read from %s a tensor "
                        "at a time into the parameter store", folder)  # fmt: skip

    def _move_model_to_device(self, model, device):
        if _on_meta(model):  # sharded from its checkpoint where it is (`_shard_meta_model`)
            return
        super()._move_model_to_device(model, device)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None and self.offload_config is not None and self.offload_config.scheduler is not None:
            self.lr_scheduler = config_apply.make_scheduler(
                self.offload_config, optimizer or self.optimizer, num_training_steps, self.args.learning_rate, self.args
            )
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def _adopt_sharded_optimizer(self, optimizer) -> None:
        """Make the Trainer step through `optimizer`; refuse one that would silently not shard."""
        build.check_adoptable(optimizer, self.sharding_stage, self.offload_spec, self.args)
        self.sharded_optimizer = optimizer
        if self.sharding_stage == 3:
            self.sharded_model = optimizer.sharded_model
        if self.args.fp16:
            # accelerate scales the loss and steps through this; see ShardedGradScaler
            self.accelerator.scaler = ShardedGradScaler(optimizer)
        if self.sharding_stage == 2:
            # No DDP around the model: the optimizer's hooks reduce-scatter the gradients.
            _force_prepare_model(self.accelerator, evaluation_mode=True)
        elif self.sharding_stage == 3:
            # Nor at stage 3 (the model's hooks reduce-scatter), and no `.to(device)`: the model was
            # sharded where it is, and moving parameters whose memory is freed crashes
            _force_prepare_model(self.accelerator, evaluation_mode=True, device_placement=False)
        logger.info("--sharded_ddp: %r", optimizer)

    def _clip_grad_norm(self, model):
        if self.sharding_stage is None:
            return super()._clip_grad_norm(model)
        return self.sharded_optimizer.clip_grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.sharding_stage is not None and grad_norm is None:
            grad_norm = self.sharded_optimizer.grad_norm()
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ---- checkpoints: training/checkpoints.py (see [Note: sharded checkpoints] there) -----------

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's save, into `.checkpoint-staging/checkpoint-N`; renamed to `checkpoint-N`
        once every rank has written its files (`checkpoints.StagedSave`). Collective."""
        run_dir = self._get_output_dir(trial)
        save = checkpoints.StagedSave(run_dir, self.state.global_step, self.args, self._checkpoint_bytes,
                                      self._last_checkpoint)  # fmt: skip
        save.begin()
        self._staged = save  # _get_output_dir, _save and _save_optimizer_and_scheduler write into it
        try:
            super()._save_checkpoint(model, trial)  # no collective may raise in between: see _save
        except (OSError, RuntimeError) as e:
            save.record(e)
        finally:
            self._staged = None
        save.gather()
        sharded = self.sharding_stage is not None and not self.args.save_only_model
        optimizer = self.sharded_optimizer if sharded else None
        self._last_checkpoint = save.publish(self.state, optimizer, self.accelerator.unwrap_model(self.model))
        self._supervisor.checkpoint_saved(self._last_checkpoint)

    def _get_output_dir(self, trial) -> str:
        run_dir = super()._get_output_dir(trial)
        return os.path.join(run_dir, checkpoints.STAGING) if self._staged is not None else run_dir

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharding_stage is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        model = self.accelerator.unwrap_model(self.model)
        self._staged.save_optimizer_shard(self.sharded_optimizer, model, output_dir)
        if self.args.should_save and self.lr_scheduler is not None:
            checkpoints.save_scheduler(self.lr_scheduler, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        if not checkpoints.has_optimizer_shards(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        model = self.accelerator.unwrap_model(self.model)
        sharded = self.sharding_stage is not None
        checkpoints.load_optimizer_shards(checkpoint, self.sharded_optimizer if sharded else self.optimizer, model,
                                          sharded)  # fmt: skip
        if self.lr_scheduler is not None:
            checkpoints.load_scheduler(checkpoint, self.lr_scheduler)

    def _load_best_model(self) -> None:
        """ZeRO-3: the best checkpoint's weights read unit by unit into the shards (collective);
        otherwise the Trainer's own."""
        sharded = self.sharded_model
        if sharded is None:
            return super()._load_best_model()
        logger.info("Loading best model from %s (score: %s).", self.state.best_model_checkpoint, self.state.best_metric)
        zero3_weights.load_weights(sharded, self.state.best_model_checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Check the checkpoint against its manifest (ranks share the CRC work) before loading.
        A model sharded already (ZeRO-3 built on the meta device) reads the weights unit by unit
        (collective), never the whole state dict in memory; otherwise the Trainer's own."""
        checkpoints.check_manifest(resume_from_checkpoint, self.args)
        if self.sharded_model is not None and isinstance(self.accelerator.unwrap_model(self.model), PreTrainedModel):
            return zero3_weights.load_weights(self.sharded_model, resume_from_checkpoint)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save(self, output_dir=None, state_dict=None) -> None:
        """The weights tensor by tensor, without the full copy `save_pretrained` makes of
        parameters that share storage (the flat buffer's views; see checkpoint.py), split into
        files of at most --max_shard_size."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if state_dict is not None or not isinstance(model, PreTrainedModel):
            if state_dict is None and self.sharded_model is not None:  # gathered unit by unit, on every rank
                state_dict = model.state_dict()  # (the Trainer calls _save on every rank: a collective is safe)
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        sharded = self.sharded_model
        if not self.args.should_save and sharded is None:
            return
        if self.args.should_save:
            logger.info("Saving model checkpoint to %s", output_dir)
        try:
            max_size = parse_size(getattr(self.args, "max_shard_size", "5GB"))
            if sharded is not None:  # ZeRO-3: every rank takes part in each unit's gather (Trainer.save_model
                # calls _save on every rank), the saving ones write
                files = zero3_weights.save_weights(sharded, output_dir, max_size, self.args.should_save)
                if not self.args.should_save:
                    return
            else:
                files = save_model(model, output_dir, max_size)
            if self._staged is not None:
                self._staged.model_files = files
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        except OSError as e:
            if self._staged is None:
                raise CheckpointError(f"the model could not be saved to {output_dir!r}: "
                                      f"{describe_write_error(e, output_dir)}; free space there or pass another "
                                      "--output_dir") from None  # fmt: skip
            # inside a checkpoint: the other ranks go on to the Trainer's barrier; every rank
            # learns of it at _save_checkpoint's gather (raising here would leave them waiting)
            self._staged.record(e, output_dir)

    # ---- evaluation: training/evaluation.py -------------------------------------------------------

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = gather_for_metrics(self.accelerator, self.args)
        return super().evaluation_loop(*args, **kwargs)


def _on_meta(model) -> bool:
    """Built on the meta device by `loading.load_meta`, not sharded yet (a device-mapped model's
    offloaded weights are on meta too, under accelerate's hooks: not this)."""
    return getattr(model, META_WEIGHTS, None) is not None and any(p.device.type == "meta" for p in model.parameters())


def _force_prepare_model(accelerator, **forced) -> None:
    """Make `accelerator.prepare_model` always run with `forced` keywords: `accelerator.prepare`
    passes `device_placement` explicitly (None: the accelerator's default), which a
    `functools.partial` default would not override."""
    original = accelerator.prepare_model

    @functools.wraps(original)
    def prepare_model(model, *args, **kwargs):
        return original(model, *args, **{**kwargs, **forced})

    accelerator.prepare_model = prepare_model


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """`transformers.Trainer` with `--sharded_ddp` / `--offload` support."""


class ShardedSeq2SeqTrainer(ShardedTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with `--sharded_ddp` / `--offload` support."""
