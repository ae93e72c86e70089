"""A compute dtype apart from the storage dtype: 16-bit parameters, fp32 matrix products.

On a CPU without 16-bit matrix kernels (AVX2 only: no AVX512-BF16 or AMX) torch runs bf16 and
fp16 matmuls in its reference loop, about 100x slower than fp32 (see DESIGN.md, measured facts).
`ComputeCast` keeps the parameters 16-bit (storage, shards, optimizer, reduction) and casts each
layer's parameters to the compute dtype only while that layer's forward runs:

    dtype, line = choose_compute_dtype("auto", torch.bfloat16, "cpu")   # fp32 on such a CPU
    logger.info(line)
    with ComputeCast(model, dtype):            # or cast = ComputeCast(...); ...; cast.remove()
        loss = model(**batch).loss
        loss.backward()                        # p.grad stays bf16

See [Note: compute casts] for how no whole fp32 copy of the model is ever held.
"""

import contextlib
import functools
import math
import time

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_map_only

from .constants import CHUNK_NUMEL, DTYPE_NAMES, PRECISIONS
from .dtypes import DTYPES

SLOWER_THAN = 2.0
"""`auto` computes in fp32 where a 16-bit matmul takes more than this many times fp32's."""

PROBE = (64, 256, 256)
"""m, k, n of the product `auto` times, on one thread: small, because without bf16 kernels the
bf16 product runs in torch's reference loop (bench/results/infinity_compute_avx2.md records the
probe of each row: 3.56 and 3.64 ms in bf16 against 0.05 ms in fp32), and every process runs it
at start."""

_HALF = (torch.bfloat16, torch.float16)
_NAME = {dtype: name for name, dtype in DTYPES.items()}  # the short names, listed last, win: "bf16"
_COMPUTE_NAMES = ("auto", *PRECISIONS, *DTYPE_NAMES)


def dtype_name(dtype: torch.dtype) -> str:
    return _NAME.get(dtype, str(dtype))


@functools.cache
def time_matmul(dtype: torch.dtype, device_type: str = "cpu") -> float:
    """Seconds one `PROBE` matmul takes in `dtype` on one core of this process's CPU: the fastest
    of a few after a warm-up (the fastest, because a loaded machine only ever adds time). On one
    thread: a product this small split over two threads of a busy machine waits for the
    scheduler whatever its dtype, and the kernels' speed per core is what the choice needs.
    Measured once a process for each (dtype, device type); tests replace this function
    (monkeypatch) to force either outcome."""
    m, k, n = PROBE
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device=device_type, dtype=dtype)
    b = torch.randn(k, n, generator=generator).to(device=device_type, dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm-up: first-call dispatch and allocation
        best, spent = float("inf"), 0.0
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
            if spent > 0.03:  # a slow dtype shows at the first product: cap the probe at ~30 ms
                break
    finally:
        torch.set_num_threads(threads)
    return best


def choose_compute_dtype(requested: str, storage_dtype: torch.dtype, device, *, timer=None) -> tuple:
    """(the compute dtype, one log line saying what was measured and chosen).

    `requested` is "auto" or a dtype name of `DTYPES` ("fp32", "bf16", "fp16", or the torch
    names): a name is taken as it is. "auto": fp32 storage computes in fp32; a device other than
    the CPU (CUDA) computes in the storage dtype; on the CPU a 16-bit storage dtype is timed
    against fp32 (`timer(dtype, "cpu")`, default `time_matmul`, measured once a process) and fp32
    is chosen where 16-bit is more than `SLOWER_THAN` times slower."""
    if requested not in _COMPUTE_NAMES:
        raise ValueError(f"compute dtype {requested!r} is not one of {', '.join(_COMPUTE_NAMES)}; "
                         "use auto to let each machine pick, or fp32 for fp32 matrix products")  # fmt: skip
    storage = dtype_name(storage_dtype)
    if requested != "auto":
        dtype = DTYPES[requested]
        return dtype, f"compute dtype {dtype_name(dtype)}: as asked; parameters stay {storage}"
    device_type = torch.device(device).type
    if storage_dtype == torch.float32 or not storage_dtype.is_floating_point:
        return storage_dtype, f"compute dtype {storage}: the parameters' dtype"
    if device_type != "cpu":
        return storage_dtype, (f"compute dtype {storage}: the parameters' dtype on {device_type} "
                               "(auto times CPUs only)")  # fmt: skip
    timer = timer or time_matmul
    half, full = timer(storage_dtype, "cpu"), timer(torch.float32, "cpu")
    ratio = half / max(full, 1e-9)
    dtype = torch.float32 if ratio > SLOWER_THAN else storage_dtype
    m, k, n = PROBE
    return dtype, (f"compute dtype {dtype_name(dtype)}: a {m}x{k}x{n} {storage} matmul took {half * 1e3:.2f} ms "
                   f"against {full * 1e3:.2f} ms in fp32 ({ratio:.1f}x; fp32 above {SLOWER_THAN:g}x) on this CPU; "
                   f"parameters stay {storage}")  # fmt: skip


# [Note: compute casts] `ComputeCast` hooks each of the given `units` (the layers: ZeRO-3's units,
# or `auto_wrap_units`' choice) and every module outside them that holds parameters directly
# (`parameters(recurse=False)`) of a floating dtype other than the compute dtype. Its forward
# pre-hook replaces each such parameter p (for a unit: every one in its subtree, so that a module
# reading a child's weight sees the copy too, as T5's feed-forward reads `wo.weight.dtype` to cast
# its activations), in the owning module's `_parameters` dict (item set only: ZeRO-3 puts a dict
# there whose item get gathers), by `_Cast.apply(p, dtype)`: a compute-dtype copy
# written into a pooled buffer, whose backward hands the gradient back to p in p's dtype. So
# `module.weight` reads the copy during the forward, `p.grad` stays 16-bit and accumulates as
# before, and the post-hook (always called, even when the forward raises) puts p back: the
# parameters are the same objects before and after. 16-bit floating inputs are cast to the
# compute dtype (integer inputs are not), and autocast is off inside these forwards, so the
# compute dtype wins over an enclosing `torch.autocast`. An `nn.Embedding` outside the units is a
# lookup, not a product: its table is never cast (T5's is 32128 rows), the rows it returns are.
#
# Autograd would save the copies for backward (a Linear saves its weight), which would keep a
# whole compute-dtype copy of the model alive from forward to backward. While a hooked forward
# runs, saved tensors go through our pack hook: a copy made by a forward now running (known by its
# storage's data pointer), or a view of one, is saved as a `_Recast` marker naming p and the view's
# layout; backward's unpack casts p again (after `ensure_ready(p)`: ZeRO-3 gathers p's unit there
# if its hooks released it). Any other tensor goes to the saved-tensor hooks that were active when
# the module's forward began (only the innermost default hooks apply, and ZeRO-3's and
# non-reentrant checkpointing's must keep seeing what is theirs), or to `outer` when one is given.
# Copies live from a layer's pre-hook to its post-hook: one unit (plus its enclosing hooked
# modules) at a time, never the model.
#
# An `nn.Linear` (exactly that class: PEFT's LoRA layers wrap one as `base_layer`) runs through
# `_CastLinear` instead of autograd's linear: its forward uses the unit's cast copy, its backward
# hands the 16-bit gradient straight to p (no fp32 weight-sized gradient for `_Cast` to convert) and
# recasts p and computes the weight gradient a block of rows at a time (`BLOCK_NUMEL`) in pooled
# buffers. A Linear outside the units (T5's `lm_head`, which shares the 32128-row embedding) is not
# swapped at all: its forward casts p block by block too, so no whole fp32 copy of a large weight
# is ever held. This took the peak RSS of a t5-large ZeRO-3 step with parameters, gradients and
# optimizer state on disk from 3.22 to 2.57 GiB, and the Trainer's `memory.map_large_blocks` (the
# fp32 blocks freed each layer go back to the OS) to 1.98 (bf16 compute: 1.97; infinity_compute_avx2.md).
#
# The forward's copies come from a pool keyed by (numel, dtype, device), which hands a buffer out
# again only when nothing but the pool references its storage (a module that returns its weight,
# or autograd saving it with saved-tensor hooks disabled, keeps it until they let go), so fp32
# buffers are not faulted in from the OS anew each layer and step. Backward's recasts are plain
# allocations, freed as each node is done (pooling them too moved a t5-large ZeRO-3 step's peak
# RSS by nothing measurable: what glibc keeps there is autograd's fp32 gradients and activations;
# see bench/results/infinity_compute_native.md).


class _Cast(torch.autograd.Function):
    """p -> a `dtype` copy of p made by `make(p)`; the gradient returns to p in p's dtype."""

    @staticmethod
    def forward(ctx, p, make):
        ctx.storage_dtype = p.dtype
        return make(p)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.storage_dtype), None


BLOCK_NUMEL = CHUNK_NUMEL
"""`_CastLinear` casts and multiplies a weight this many elements of rows at a time (16 MiB in fp32:
t5-large's feed-forward matrices in one block, its 126 MiB `lm_head` in eight)."""


def _row_blocks(weight):
    out_features, in_features = weight.shape
    rows = max(1, BLOCK_NUMEL // max(1, in_features))
    return [(start, min(out_features, start + rows)) for start in range(0, out_features, rows)]


class _CastLinear(torch.autograd.Function):
    """`x @ p.T (+ bias)` in the compute dtype for a 16-bit weight p, whose gradient (p's dtype)
    goes to p directly: see [Note: compute casts]. `w`: the forward's cast copy of p, or None to
    cast p a block of rows at a time here."""

    @staticmethod
    def forward(ctx, x, p, bias, w, cast):
        ctx.cast, ctx.param = cast, p  # p itself, not saved: backward casts it again (ZeRO-3 gathers it first)
        ctx.save_for_backward(x)
        if w is not None:
            return torch.nn.functional.linear(x, w, bias)
        return cast._blockwise_linear(x, p, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        cast, p = ctx.cast, ctx.param
        if cast._ensure_ready is not None:  # ZeRO-3: p's unit gathered again (its shape and values)
            cast._ensure_ready(p)
        need_x, need_w, need_bias = ctx.needs_input_grad[:3]
        out_features, in_features = p.shape
        grad2 = grad.reshape(-1, out_features)
        x2 = x.reshape(-1, in_features)
        blocks = _row_blocks(p)
        grad_x = torch.zeros_like(x2) if need_x and len(blocks) > 1 else None
        grad_w = torch.empty_like(p, memory_format=torch.contiguous_format) if need_w else None
        with record_function("trainer_shard::compute_linear_backward"):
            for start, stop in blocks:
                if need_x:
                    w = cast._cast_rows(p, start, stop)
                    if grad_x is None:
                        grad_x = torch.mm(grad2, w)
                    else:
                        grad_x.addmm_(grad2[:, start:stop], w)
                    del w
                if need_w:
                    product = cast._pooled((stop - start, in_features), p.device)
                    torch.mm(grad2[:, start:stop].t(), x2, out=product)
                    grad_w[start:stop].copy_(product)
                    del product
        if need_x:
            grad_x = grad_x.reshape(x.shape)
        grad_bias = grad2.sum(0) if need_bias else None
        return grad_x, grad_w, grad_bias, None, None


class _Recast:
    """What the pack hook saves in place of a cast copy (or a view of one): cast p again at unpack."""

    __slots__ = ("param", "dtype", "size", "stride", "offset")

    def __init__(self, param, dtype, view):
        self.param, self.dtype = param, dtype
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()


class _Pool:
    """Cast buffers (untyped storages) by (numel, dtype, device), each handed out again once
    nothing but the pool holds it (the forward that cast it is over): the same buffers every
    layer and step, none faulted from the OS anew."""

    def __init__(self):
        self._owned = {}

    def take(self, numel, dtype, device) -> torch.UntypedStorage:
        owned = self._owned.setdefault((numel, dtype, device), [])
        for storage in owned:
            if torch._C._storage_Use_Count(storage._cdata) == 1:  # only ours
                return storage
        storage = torch.UntypedStorage(numel * dtype.itemsize, device=device)
        owned.append(storage)
        return storage

    def nbytes(self) -> int:
        return sum(s.nbytes() for owned in self._owned.values() for s in owned)

    def clear(self) -> None:
        self._owned.clear()


class _Frame:
    """One running forward of a hooked module: what its post-hook undoes."""

    __slots__ = ("swapped", "casts", "autocast", "hooks")

    def __init__(self):
        self.swapped = []  # (the module holding it, name, the Parameter)
        self.casts = []  # (storage data pointer, storage): the pool hands the storage out again once only it holds it
        self.autocast = None  # the entered `torch.autocast(..., enabled=False)`
        self.hooks = False  # saved-tensor hooks pushed


class _CastCheckpoint:
    """A layer's `_gradient_checkpointing_func`, running the checkpointed forward through
    `ComputeCast._run_unit` (see `_wrap_checkpointing`); `remove()` puts the original back."""

    def __init__(self, cast, unit, func):
        self.cast, self.unit, self.func = cast, unit, func

    def __call__(self, forward, *args, **kwargs):
        return self.func(functools.partial(self.cast._run_unit, self.unit, forward), *args, **kwargs)


def _identity(x):
    return x


_IDENTITY = (_identity, _identity)


class ComputeCast:
    """Run the matrix products of `model` in `dtype` while its parameters stay in their own dtype:
    see [Note: compute casts]. Hooks the `units` (each cast whole while it runs) and every module
    outside them holding parameters directly of a floating dtype other than `dtype`; `remove()`
    (or leaving the `with` block) takes the hooks out.

    `ensure_ready(p)`, if given, is called before a parameter is cast again for backward (ZeRO-3
    gathers its unit). `outer=(pack, unpack)`, if given, receives every saved tensor that is not a
    cast copy; by default those go to the saved-tensor hooks active when each forward began (none:
    saved as they are)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, *, units=(), ensure_ready=None, outer=None):
        self.dtype = dtype
        self._ensure_ready, self._outer = ensure_ready, outer
        self._pool = _Pool()
        self._live = {}  # storage data pointer of a cast copy of a running forward -> its Parameter
        self._frames = {}  # module -> its running forwards' frames, innermost last
        self._held = 0  # bytes of the cast copies of running forwards
        self._handles = []
        self._linears = []  # the nn.Linear whose forward is ours (an instance attribute)
        self._units = set(units)
        inside = {m for unit in self._units for m in unit.modules() if m is not unit}
        for module in model.modules():
            if type(module) is torch.nn.Linear and "forward" not in module.__dict__ and self._casts(module.weight):
                alone = module not in inside and module not in self._units
                module.forward = functools.partial(self._linear_alone if alone else self._linear_in_unit, module)
                self._linears.append(module)
                if alone:  # not swapped: cast a block of rows at a time by its own forward
                    self._handles.append(module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
                    continue
            if module in self._units:
                pass  # cast whole while it runs
            elif module in inside or not any(map(self._casts, module.parameters(recurse=False))):
                continue
            elif type(module) is torch.nn.Embedding:  # a lookup: its rows cast, never the table
                self._handles.append(module.register_forward_hook(self._cast_output))
                continue
            self._handles += [
                module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                # first among the post-hooks: the parameters are back before ZeRO-3 releases its unit
                module.register_forward_hook(self._post_forward, always_call=True, prepend=True),
            ]

    def _pooled(self, shape, device) -> torch.Tensor:
        """A contiguous `self.dtype` tensor of `shape` in a pooled buffer (contents undefined)."""
        storage = self._pool.take(math.prod(shape), self.dtype, device)
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, 0, shape)

    def _cast_rows(self, p, start, stop) -> torch.Tensor:
        """Rows start:stop of the weight p, cast into a pooled buffer."""
        return self._pooled((stop - start, *p.shape[1:]), p.device).copy_(p[start:stop])

    def _linear_in_unit(self, module, x):
        """The forward of an nn.Linear inside a unit: `_CastLinear` with the unit's cast copy."""
        w = module.weight
        p = self._live.get(w.untyped_storage().data_ptr()) if self._live else None
        if p is None or not torch.is_grad_enabled() or w.dtype != self.dtype:  # no frame, or no autograd
            return torch.nn.functional.linear(x, w, module.bias)
        return _CastLinear.apply(x, p, module.bias, w.detach(), self)

    def _linear_alone(self, module, x):
        """The forward of an nn.Linear outside the units: p cast a block of rows at a time."""
        p, bias = module.weight, module.bias
        x = self._cast_input(x)
        bias = self._cast_input(bias) if bias is not None else None
        with contextlib.ExitStack() as stack:
            if torch.is_autocast_enabled(x.device.type):
                stack.enter_context(torch.autocast(x.device.type, enabled=False))
            if torch.is_grad_enabled():
                return _CastLinear.apply(x, p, bias, None, self)
            return self._blockwise_linear(x, p, bias)

    def _blockwise_linear(self, x, p, bias):
        out_features, in_features = p.shape
        x2 = x.reshape(-1, in_features)
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        out = torch.empty(x2.shape[0], out_features, dtype=self.dtype, device=x.device)
        with record_function("trainer_shard::compute_linear"):
            for start, stop in _row_blocks(p):
                w = self._cast_rows(p, start, stop)
                torch.mm(x2, w.t(), out=out[:, start:stop])
                del w
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], out_features)

    def _casts(self, p) -> bool:
        return p is not None and p.is_floating_point() and p.dtype != self.dtype

    def held_bytes(self) -> int:
        """Bytes of the cast copies of the forwards now running (0 between forwards)."""
        return self._held

    def pool_bytes(self) -> int:
        """Bytes of the idle pooled buffers, kept for the next layers and steps."""
        return self._pool.nbytes()

    def remove(self) -> None:
        """Take the hooks out and drop the pool. Not while a hooked forward runs."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._linears:
            forward = module.__dict__.get("forward")
            if isinstance(forward, functools.partial) and getattr(forward.func, "__self__", None) is self:
                del module.forward  # ours, not wrapped since (accelerate's hooks wrap `forward` in place)
        self._linears = []
        for unit in self._units:
            func = unit.__dict__.get("_gradient_checkpointing_func")
            if isinstance(func, _CastCheckpoint) and func.cast is self:
                unit._gradient_checkpointing_func = func.func
        self._pool.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    # -- forward
    def _pre_forward(self, module, args, kwargs):
        if module in self._units:
            self._wrap_checkpointing(module)
        return self._open(module, args, kwargs, save_hooks=True)

    def _open(self, module, args, kwargs, *, save_hooks):
        frame = _Frame()
        self._frames.setdefault(module, []).append(frame)
        try:
            device_type = self._cast_parameters(module, frame)
            if device_type is not None and torch.is_autocast_enabled(device_type):
                frame.autocast = torch.autocast(device_type, enabled=False)
                frame.autocast.__enter__()
            if save_hooks and torch.is_grad_enabled() and torch._C._autograd._saved_tensors_hooks_is_enabled():
                outer = self._outer or torch._C._autograd._top_saved_tensors_default_hooks(False) or _IDENTITY
                torch._C._autograd._push_saved_tensors_default_hooks(
                    functools.partial(self._pack, outer[0]), functools.partial(self._unpack, outer[1]))  # fmt: skip
                frame.hooks = True
            return tree_map_only(torch.Tensor, self._cast_input, (args, kwargs))
        except BaseException:
            self._post_forward(module, args, None)
            raise

    def _wrap_checkpointing(self, unit):
        """transformers' layers checkpoint their class `forward` inside `__call__`, so module hooks
        stay out of the recompute (`GradientCheckpointingLayer`): wrap the layer's checkpoint
        function so that a recompute, which runs without our pre-hook, casts the unit too."""
        func = unit.__dict__.get("_gradient_checkpointing_func")
        if func is not None and not isinstance(func, _CastCheckpoint):
            unit._gradient_checkpointing_func = _CastCheckpoint(self, unit, func)

    def _run_unit(self, unit, forward, *args, **kwargs):
        """The checkpointed forward of `unit`: as it is inside the forward (our pre-hook has cast
        the unit), in a frame of its own when backward recomputes it. That frame pushes no
        saved-tensor hooks: checkpoint's recompute must see every tensor it saved the first time."""
        if self._frames.get(unit):
            return forward(*args, **kwargs)
        args, kwargs = self._open(unit, args, kwargs, save_hooks=False)
        try:
            return forward(*args, **kwargs)
        finally:
            self._post_forward(unit, args, None)

    def _cast_parameters(self, module, frame):
        """Swap the parameters of the module (of its whole subtree for a unit) for their cast
        copies, one copy per parameter however often it is tied; the device type of the last."""
        device_type, copies = None, {}
        for owner in module.modules() if module in self._units else (module,):
            parameters = owner._parameters
            for name, raw in list(parameters.items()):
                if not self._casts(raw):  # fp32 already, or swapped by an enclosing unit's frame
                    continue
                p = parameters[name]  # item get: ZeRO-3 gathers an external parameter here
                cast = copies.get(id(p))
                if cast is None:
                    cast = copies[id(p)] = _Cast.apply(p, functools.partial(self._copy, frame))
                frame.swapped.append((owner, name, p))
                parameters[name] = cast
                device_type = p.device.type
        return device_type

    def _copy(self, frame, p):
        """A contiguous `self.dtype` copy of p in a pooled buffer, known to the pack hook."""
        with record_function("trainer_shard::compute_cast"):
            numel, device = p.numel(), p.device
            if numel == 0:
                return torch.empty(p.shape, dtype=self.dtype, device=device)
            cast = self._pooled(p.shape, device)
            cast.copy_(p)
            storage = cast.untyped_storage()
            ptr = storage.data_ptr()
            self._live[ptr] = p
            frame.casts.append((ptr, storage))
            self._held += storage.nbytes()
            return cast

    def _cast_inputs(self, module, args, kwargs):
        return tree_map_only(torch.Tensor, self._cast_input, (args, kwargs))

    def _cast_output(self, module, args, output):
        return tree_map_only(torch.Tensor, self._cast_input, output)

    def _cast_input(self, t):
        if t.dtype in _HALF and t.dtype != self.dtype:
            return t.to(self.dtype)
        return t

    def _post_forward(self, module, args, output):
        frames = self._frames.get(module)
        if not frames:  # a pre-hook registered before ours raised: ours never ran
            return None
        frame = frames.pop()
        if not frames:
            del self._frames[module]
        for owner, name, p in frame.swapped:
            owner._parameters[name] = p
        if frame.hooks:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if frame.autocast is not None:
            frame.autocast.__exit__(None, None, None)
        casts, frame.casts, frame.swapped = frame.casts, [], []
        for ptr, storage in casts:
            del self._live[ptr]
            self._held -= storage.nbytes()
        return None

    # -- saved tensors
    def _pack(self, outer_pack, tensor):
        if self._live and type(tensor) is torch.Tensor and tensor.layout is torch.strided:
            p = self._live.get(tensor.untyped_storage().data_ptr())
            if p is not None and tensor.dtype == self.dtype:
                return _Recast(p, self.dtype, tensor)
        return outer_pack(tensor)

    def _unpack(self, outer_unpack, packed):
        if type(packed) is not _Recast:
            return outer_unpack(packed)
        p = packed.param
        if self._ensure_ready is not None:
            self._ensure_ready(p)
        with record_function("trainer_shard::compute_recast"):
            full = p.to(packed.dtype, memory_format=torch.contiguous_format)
        if full.size() == packed.size and full.stride() == packed.stride and packed.offset == 0:
            return full
        return full.as_strided(packed.size, packed.stride, packed.offset)
