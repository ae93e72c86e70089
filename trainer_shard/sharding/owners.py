"""Which `ShardedOptimizer` a parameter belongs to: one at a time.

[Note: one optimizer per parameter] A `ShardedOptimizer` moves its parameters into its flat
buffers and (ZeRO-2) hooks them, so two live on the same parameter cannot both work: the older
one's hook would take `.grad` before the newer one's sees it. torch users re-create optimizers
freely (the Trainer's `create_optimizer` after `trainer.optimizer = None`, a hyperparameter
search, a user re-wrapping), so a new optimizer takes its parameters over: every live optimizer
holding any of them is closed first (its hooks removed, its shards and offload store freed,
before the new one opens a store at the same path), and refuses further use with a message
that says why. An optimizer that is garbage-collected removes its hooks too (`weakref.finalize`
in its constructor). Not collective: every rank does the same, as every rank builds the same.

[Note: hooks hold their owner weakly] The garbage collector does not see the hooks of
`register_post_accumulate_grad_hook`: torch keeps them in C++, and a tensor's traversal visits
its `register_hook` hooks only (torch 2.13: a parameter whose post-accumulate hook refers to an
object that refers back to the parameter is never collected, where the same with `register_hook`
is). A hook that held its `GradReducer` or `ShardedModel` would keep it, the model, its shards and
its disk stores (locked) for the life of the process, once the user drops them: the next run in
that process (a hyperparameter search, a notebook, the tests) could not open a store there. So
the hooks hold their owner through a weak reference (`post_accumulate_grad_hook`).
"""

import weakref

from torch.utils.weak import WeakIdKeyDictionary

_OWNER = WeakIdKeyDictionary()  # parameter -> weakref to the optimizer that holds it


def post_accumulate_grad_hook(param, method, *args):
    """`param.register_post_accumulate_grad_hook` that calls the bound `method(*args, param)` while
    its object lives, holding it weakly: see [Note: hooks hold their owner weakly]."""
    method = weakref.WeakMethod(method)

    def hook(p) -> None:
        bound = method()
        if bound is not None:
            bound(*args, p)

    return param.register_post_accumulate_grad_hook(hook)


def claim(optimizer, params) -> list:
    """Record `optimizer` as the owner of `params`; returns the other live, open optimizers that
    held any of them (for the caller to close), in the order first met."""
    previous = {}
    for p in params:
        ref = _OWNER.get(p)
        owner = ref() if ref is not None else None
        if owner is not None and owner is not optimizer and not owner.closed:
            previous.setdefault(id(owner), owner)
        _OWNER[p] = weakref.ref(optimizer)
    return list(previous.values())

