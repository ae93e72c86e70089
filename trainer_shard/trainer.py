"""Where trainer_shard hooks into the transformers Trainer: `ShardedTrainerMixin` goes first in the
bases of any Trainer subclass (`class MyTrainer(ShardedTrainerMixin, Seq2SeqTrainer): ...`). What
it does is told in `training/__init__.py`; each override here hands its work to one module there.
"""

import logging
import os

from transformers import PreTrainedModel, Seq2SeqTrainer, Trainer

from . import faults
from .config import apply as config_apply
from .disk import describe_write_error
from .errors import CheckpointError
from .sharding import zero3_weights
from .training import build, checkpoints, loss, plan, precision, saving, stage3
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
        precision.resolve(self)  # before the model is prepared: autocast wraps it then
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
        elif stage3.on_meta(model):
            self.sharded_model = stage3.shard_meta_model(self, model)
            precision.install(self, model)
        if getattr(model, "hf_device_map", None):
            # placed by a device map (offload.dispatch): its hooks move the weights; accelerate
            # would move a map of one entry ({"": "disk"}) whole, which offloaded weights cannot
            build.force_prepare_model(self.accelerator, device_placement=False)
        self._supervisor = Supervisor()
        self._staged = self._last_checkpoint = None
        self.callback_handler.callbacks.insert(0, self._supervisor.callback(self.args))  # first: it says where the step begins

    # ---- loss normalization: training/loss.py -----------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        if self._loss_kwargs_known or num_items_in_batch is None or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch, **kwargs)
        self._loss_kwargs_known = True
        return loss.observed_first_step(self, model, inputs, num_items_in_batch, return_outputs, lambda given: super(
            ShardedTrainerMixin, self).compute_loss(model, given, return_outputs, num_items_in_batch, **kwargs))

    # ---- faults: training/supervision.py --------------------------------------------------------

    def train(self, *args, **kwargs):
        """The Trainer's `train()`, with every rank bounded in its wait for a failed peer (the
        error names it: `PeerFailedError`) and SIGINT/SIGTERM stopping after the current step,
        with a checkpoint under --save_on_interrupt (`TrainingInterrupted`). Collective."""
        with self._supervisor.running(self.args.ddp_timeout):
            checkpoints.check_output_room(self.args, self._checkpoint_bytes)
            output = super().train(*args, **kwargs)
        checkpoint = self._last_checkpoint if save_on_interrupt(self.args) else None
        self._supervisor.raise_if_interrupted(self.state.global_step, checkpoint)
        return output

    def _checkpoint_bytes(self, with_optimizer: bool = True) -> int:
        model = self.accelerator.unwrap_model(self.model)
        with_optimizer = with_optimizer and not self.args.save_only_model
        return plan.checkpoint_bytes(model, self.sharding_stage is not None, self._state_tensors(), with_optimizer)

    # ---- sharding: training/plan.py, training/build.py ------------------------------------------

    def _plan_sharding(self) -> None:
        """The ZeRO stage and offload of this run, from the flags and the --offload config."""
        self.offload_config = getattr(self.args, "offload_config", None)
        plan.plan_trainer(self)

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
            self.sharded_model = stage3.shard_for_stage3(unwrapped, self.args, self.offload_config,
                                                        self.get_decay_parameter_names(unwrapped),
                                                        param_offload=self.param_offload_spec)  # fmt: skip
        plain = super().create_optimizer(model)
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        self.optimizer = build.wrap(plain, stage, self.offload_spec, self.args, self.offload_config, model)
        self._adopt_sharded_optimizer(self.optimizer)
        return self.optimizer

    def _move_model_to_device(self, model, device):
        if stage3.on_meta(model):  # sharded from its checkpoint where it is (`stage3.shard_meta_model`)
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
        build.adopt(self, optimizer)

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
        otherwise (a PEFT model's adapter too) the Trainer's own."""
        sharded = self.sharded_model
        if sharded is None or not isinstance(self.accelerator.unwrap_model(self.model), PreTrainedModel):
            return super()._load_best_model()  # a PEFT model's adapter: load_state_dict on the sharded model
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
        """The weights tensor by tensor (`saving.save`); a failure inside a checkpoint recorded for
        every rank to learn of at `_save_checkpoint`'s gather (raising here would leave the others
        waiting at the Trainer's barrier)."""
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if state_dict is not None or not isinstance(model, PreTrainedModel):
            if state_dict is None and self.sharded_model is not None:  # gathered unit by unit, on every rank
                state_dict = saving.sharded_state_dict(self.sharded_model, model)  # (_save runs on every rank)
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        try:
            files = saving.save(self, output_dir)
        except OSError as e:
            if self._staged is None:
                raise CheckpointError(f"the model could not be saved to {output_dir!r}: "
                                      f"{describe_write_error(e, output_dir)}; free space there or pass another "
                                      "--output_dir") from None  # fmt: skip
            self._staged.record(e, output_dir)
            return
        if self._staged is not None and files is not None:
            self._staged.model_files = files

    # ---- evaluation: training/evaluation.py -------------------------------------------------------

    def evaluation_loop(self, *args, **kwargs):
        self.gather_function = gather_for_metrics(self.accelerator, self.args)
        return super().evaluation_loop(*args, **kwargs)


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """`transformers.Trainer` with `--sharded_ddp` / `--offload` support."""


class ShardedSeq2SeqTrainer(ShardedTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with `--sharded_ddp` / `--offload` support."""
