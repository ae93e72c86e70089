"""Fault supervision around `train()`: every rank bounded in its wait for a failed peer, and
SIGINT/SIGTERM stopping every rank after the same step. See [Note: fault watch] and
[Note: interrupts] in faults.py, which this drives.

    supervisor = Supervisor()
    callbacks.insert(0, supervisor.callback(args))   # first: it says where each step begins
    with supervisor.running(args.ddp_timeout):
        trainer.train()
    supervisor.raise_if_interrupted(global_step, last_checkpoint)
"""

import contextlib

from transformers.trainer_callback import TrainerCallback

from .. import faults


def save_on_interrupt(args) -> bool:
    """--save_on_interrupt (a plain TrainingArguments has no such flag)."""
    return bool(getattr(args, "save_on_interrupt", False))


class Supervisor:
    """The fault watch, the signal guard and the stop agreement of one `train()` call."""

    def __init__(self):
        self.watch = self.interrupt = self.agreement = None
        self.stopped_by = None  # the signal every rank agreed to stop for

    @contextlib.contextmanager
    def running(self, timeout: float):
        """Around the Trainer's `train()`: an error a failed peer caused leaves as a
        `PeerFailedError` naming that rank. Collective."""
        self.watch = faults.FaultWatch.start(timeout)
        self.interrupt = faults.InterruptGuard(self.watch)
        self.agreement, self.stopped_by = faults.StopAgreement(), None
        try:
            yield self
        except BaseException as e:
            failure = self.explain_failure(e)
            if failure is e:
                raise
            raise failure from e
        finally:
            self.interrupt.restore()
            if self.watch is not None:
                self.watch.stop()
            self.watch = self.agreement = None

    def explain_failure(self, error):
        """The error this rank leaves `train()` with: a `PeerFailedError` naming the rank at fault
        when a collective failed because of another rank; else `error`, posted for the others."""
        watch = self.watch
        if watch is None or isinstance(error, faults.PeerFailedError):
            return error
        found = watch.wait_for_culprit(error) if isinstance(error, Exception) and faults.is_comm_error(error) else None
        if found is None:
            watch.post_failure(error)
            return error
        watch.post_failure(found[1], because_of=found[0])  # the others learn the job is over, and why
        return faults.PeerFailedError(found[0], watch.message(found))

    def checkpoint_saved(self, path: str) -> None:
        """Tell the watch where the last complete checkpoint is (its failure messages name it)."""
        if self.watch is not None:
            self.watch.last_checkpoint = path

    def raise_if_interrupted(self, global_step: int, checkpoint) -> None:
        """After `train()` returned: `TrainingInterrupted` if a signal stopped it."""
        signum = self.stopped_by or (self.interrupt.signum if self.interrupt is not None else None)
        if signum:
            raise faults.TrainingInterrupted(signum, global_step, checkpoint)

    def callback(self, args) -> TrainerCallback:
        return _FaultCallback(self, save_on_interrupt(args))


class _FaultCallback(TrainerCallback):
    """Keeps the fault watch told where this rank is, and stops every rank after the same step
    once one of them got SIGINT/SIGTERM (see [Note: interrupts])."""

    def __init__(self, supervisor: Supervisor, save: bool):
        self.supervisor, self.save = supervisor, save

    def on_step_begin(self, args, state, control, **kwargs):
        faults.at(step=state.global_step + 1, phase="training")

    def on_step_end(self, args, state, control, **kwargs):
        supervisor = self.supervisor
        if supervisor.agreement is None:
            return
        signum = supervisor.agreement.agree(supervisor.interrupt.signum)
        if signum and not supervisor.stopped_by:
            supervisor.stopped_by = signum
            control.should_training_stop = True
            control.should_save = control.should_save or self.save

    def on_evaluate(self, args, state, control, **kwargs):
        faults.at(phase="training")

    def on_prediction_step(self, args, state, control, **kwargs):
        faults.at(phase="evaluating")
