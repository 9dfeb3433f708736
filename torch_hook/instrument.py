"""The patches that let the probe see a training loop it did not write.

* ``torch.distributed`` collectives (module attributes of both
  ``torch.distributed`` and ``distributed_c10d``), wrapped: synchronous calls
  are timed around the call, asynchronous ones counted at issue and timed in
  ``Work.wait()``.
* ``Work.wait`` on the pybind ``Work`` class.
* ``DataLoader`` iterators' ``__next__``: data time and batch size.
* DDP: ``DistributedDataParallel.__init__`` gets a one-shot forward pre-hook
  that, at the first forward, registers a timing wrapper around the default
  all-reduce comm hook.  Registering at first forward rather than in
  ``__init__`` leaves the user free to register their own hook right after
  construction; ``register_comm_hook`` is wrapped so such a hook is timed too.
  The C++ reducer calls the hook per gradient bucket, so DDP's own
  communication -- which never passes through ``torch.distributed`` Python
  functions -- is timed.
* Step boundaries: a global optimizer step post-hook.

Every wrapper body that belongs to the probe is guarded: an exception in the
probe's own code is counted and swallowed; exceptions of the wrapped call
itself propagate unchanged.  ``uninstall()`` restores every original.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_hook.clock import elapsed_ms, mark_for

# op -> name of the parameter whose size is the op's byte count (None: no data).
# bytes = the largest buffer the rank hands the op: the reduced tensor, the
# gathered output, the scattered input, the sent/received tensor.
COLLECTIVES: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_gather": "tensor_list",
    "all_gather_into_tensor": "output_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "broadcast": "tensor",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
}
_ALWAYS_ASYNC = {"isend", "irecv"}
_MAX_TRACKED_WORKS = 4096

_local = threading.local()  # .inside: the probe's own or an already-timed call is running
# The installed probe.  Patches are per install, but a comm hook stays on its
# DDP model for good, so the hook finds the probe here at every call: a model
# built under one install is timed again after uninstall() + install().
_current: Any = None


class _Spec:
    __slots__ = ("op", "data_pos", "data_name", "group_pos", "async_pos")

    def __init__(self, op: str, fn: Callable[..., Any]):
        params = list(inspect.signature(fn).parameters)
        self.op = op
        self.data_name = COLLECTIVES[op]
        self.data_pos = params.index(self.data_name) if self.data_name in params else -1
        self.group_pos = params.index("group") if "group" in params else -1
        self.async_pos = params.index("async_op") if "async_op" in params else -1

    def arg(self, args: tuple, kwargs: dict, pos: int, name: str | None) -> Any:
        if name is not None and name in kwargs:
            return kwargs[name]
        return args[pos] if 0 <= pos < len(args) else None


def _nbytes(obj: Any) -> float:
    if isinstance(obj, torch.Tensor):
        return float(obj.numel() * obj.element_size())
    if isinstance(obj, list | tuple):
        return float(sum(t.numel() * t.element_size() for t in obj if isinstance(t, torch.Tensor)))
    return 0.0


def _first_tensor(obj: Any) -> Any:
    if isinstance(obj, list | tuple):
        return obj[0] if obj else None
    return obj


class Instrumentation:
    """Owns every patch; ``target`` receives the measurements (the Probe)."""

    def __init__(self, target: Any):
        self.target = target
        self.errors = 0
        self.last_error: str | None = None
        self._restore: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self._works: dict[int, tuple[str, str, float]] = {}
        self._group_names: dict[int, str] = {}
        self._pacer: Any = None  # weakref to the optimizer whose steps are the boundaries
        self.explicit_steps = False

    def fault(self, err: BaseException) -> None:
        """An exception in the probe's own code: counted, kept for stats, swallowed."""
        self.errors += 1
        self.last_error = repr(err)

    # -- install / uninstall -------------------------------------------------
    def install(self) -> None:
        c10d = dist.distributed_c10d
        for op in COLLECTIVES:
            original = getattr(c10d, op, None)
            if original is None:
                continue
            wrapper = self._collective_wrapper(_Spec(op, original), original)
            for module in (dist, c10d):
                if getattr(module, op, None) is original:
                    self._set(module, op, wrapper)
        self._set(c10d.Work, "wait", self._wait_wrapper(c10d.Work.wait))
        from torch.utils.data import dataloader

        self._set(dataloader._BaseDataLoaderIter, "__next__",
                  self._next_wrapper(dataloader._BaseDataLoaderIter.__next__))
        self._install_ddp()
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handles.append(register_optimizer_step_post_hook(self._optimizer_hook))
        global _current
        _current = self.target

    def uninstall(self) -> None:
        global _current
        if _current is self.target:
            _current = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        self._works.clear()

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)))
        setattr(owner, name, value)

    # -- helpers -------------------------------------------------------------
    def group_name(self, group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        key = id(group)
        name = self._group_names.get(key)
        if name is None:
            try:
                ranks = dist.get_process_group_ranks(group)
                name = f"ranks:{ranks[0]}-{ranks[-1]}/{len(ranks)}" if ranks else "group"
            except Exception:  # noqa: BLE001 -- not a registered process group
                name = "group"
            self._group_names[key] = name
        return name

    def _record(self, op: str, group: str, nbytes: float, calls: int, start: Any, end: Any) -> None:
        recorder = self.target.recorder
        ms = elapsed_ms(start, end)
        if ms is not None:
            recorder.comm(op, group, nbytes, calls, ms, ms)
        else:
            def resolve(start: Any = start, end: Any = end) -> tuple[float, float] | None:
                value = elapsed_ms(start, end)
                return None if value is None else (value, value)

            recorder.comm_pending(op, group, nbytes, calls, resolve)

    # -- torch.distributed ---------------------------------------------------
    def _collective_wrapper(self, spec: _Spec, original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not self.target.active or getattr(_local, "inside", False):
                return original(*args, **kwargs)
            try:
                data = spec.arg(args, kwargs, spec.data_pos, spec.data_name) if spec.data_name else None
                group = self.group_name(spec.arg(args, kwargs, spec.group_pos, "group"))
                is_async = spec.op in _ALWAYS_ASYNC or bool(spec.arg(args, kwargs, spec.async_pos, "async_op"))
                nbytes = _nbytes(data)
                start = mark_for(_first_tensor(data)) if not is_async else None
            except Exception as err:  # noqa: BLE001
                self.fault(err)
                return original(*args, **kwargs)
            _local.inside = True
            try:
                result = original(*args, **kwargs)
            finally:
                _local.inside = False
            try:
                if is_async:
                    if result is not None:
                        if len(self._works) >= _MAX_TRACKED_WORKS:
                            self._works.clear()  # never-waited works: forget them
                        self._works[id(result)] = (spec.op, group, nbytes)
                        self.target.recorder.comm(spec.op, group, nbytes, 1, 0.0, 0.0)
                else:
                    self._record(spec.op, group, nbytes, 1, start, mark_for(_first_tensor(data)))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return result

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        collective.__name__ = spec.op
        collective.__doc__ = original.__doc__
        return collective

    def _wait_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.target.active or getattr(_local, "inside", False):
                return original(work, *args, **kwargs)
            try:
                op, group, _ = self._works.pop(id(work), ("wait", "async", 0.0))
                start = self.target.timeline_mark()
            except Exception as err:  # noqa: BLE001
                self.fault(err)
                return original(work, *args, **kwargs)
            _local.inside = True
            try:
                result = original(work, *args, **kwargs)
            finally:
                _local.inside = False
            try:
                self._record(op, group, 0.0, 0, start, self.target.timeline_mark())
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return result

        wait.__wrapped__ = original  # type: ignore[attr-defined]
        return wait

    # -- DataLoader ----------------------------------------------------------
    def _next_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def __next__(iterator: Any) -> Any:
            if not self.target.active:
                return original(iterator)
            start = time.perf_counter()
            batch = original(iterator)  # StopIteration passes through untouched
            try:
                self.target.recorder.data((time.perf_counter() - start) * 1e3, batch_size(batch))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return batch

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        return __next__

    # -- optimizer -----------------------------------------------------------
    def _optimizer_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self.explicit_steps or not self.target.active:
                return
            # With several optimizers per iteration (GANs, per-module optimizers)
            # the first one seen paces the steps; the others are ignored.
            pacer = self._pacer() if self._pacer is not None else None
            if pacer is None:
                self._pacer = weakref.ref(optimizer)
            elif pacer is not optimizer:
                return
            self.target.boundary()
        except Exception as err:  # noqa: BLE001
            self.fault(err)

    # -- DDP -----------------------------------------------------------------
    def _install_ddp(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        init, register, builtin = DDP.__init__, DDP.register_comm_hook, DDP._register_builtin_comm_hook
        inst = self

        # ``self`` positional-only: callers pass ``module=`` by keyword
        # (Lightning does), which must reach DDP's own ``module`` parameter.
        @functools.wraps(init)
        def __init__(self: Any, /, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            module = self
            try:
                holder: list[Any] = []

                def first_forward(mod: Any, inputs: Any) -> None:
                    holder[0].remove()
                    try:
                        target = _current  # maybe a later install than the one that saw __init__
                        if not getattr(mod, "_artemis_comm_hook", False) and target is not None and target.active:
                            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                            mod.register_comm_hook(mod.process_group, allreduce_hook)
                    except Exception as err:  # noqa: BLE001
                        inst.fault(err)

                holder.append(module.register_forward_pre_hook(first_forward))
            except Exception as err:  # noqa: BLE001
                inst.fault(err)

        @functools.wraps(register)
        def register_comm_hook(self: Any, /, state: object, hook: Callable[..., Any]) -> None:
            self._artemis_comm_hook = True
            register(self, state, inst.timed_comm_hook(hook, state))

        @functools.wraps(builtin)
        def _register_builtin_comm_hook(self: Any, /, comm_hook_type: Any) -> None:
            self._artemis_comm_hook = True  # C++ hook: not timed, but never displaced
            builtin(self, comm_hook_type)

        self._set(DDP, "__init__", __init__)
        self._set(DDP, "register_comm_hook", register_comm_hook)
        self._set(DDP, "_register_builtin_comm_hook", _register_builtin_comm_hook)

    def timed_comm_hook(self, hook: Callable[..., Any], state: object) -> Callable[..., Any]:
        """Wrap a DDP comm hook so each bucket's launch and completion are marked."""
        # The default hooks take their process group as state (None = world).
        if state is None or isinstance(state, dist.ProcessGroup):
            group = self.group_name(state)
        else:
            group = "ddp"
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        op = "all_reduce" if hook is default_hooks.allreduce_hook else f"ddp:{getattr(hook, '__name__', 'hook')}"

        # DDP inspects the hook's signature: the parameter must be named "bucket",
        # and annotations, if any, must be the real types (not the strings that
        # `from __future__ import annotations` would make), so there are none.
        def artemis_timed_hook(state, bucket):  # type: ignore[no-untyped-def]
            target = _current
            if target is None or not target.active:
                return hook(state, bucket)
            try:
                buffer = bucket.buffer()
                nbytes = _nbytes(buffer)
                launch = mark_for(buffer)
            except Exception as err:  # noqa: BLE001
                target.instrumentation.fault(err)
                return hook(state, bucket)
            _local.inside = True  # the hook's own dist.all_reduce is this bucket
            try:
                fut = hook(state, bucket)
            finally:
                _local.inside = False
            try:
                return target.ddp.bucket(op, group, nbytes, launch, buffer, fut)
            except Exception as err:  # noqa: BLE001
                target.instrumentation.fault(err)
                return fut

        artemis_timed_hook.__qualname__ = getattr(hook, "__qualname__", "artemis_timed_hook")
        return artemis_timed_hook


def batch_size(batch: Any) -> float | None:
    """Leading dimension of the first tensor in a batch (tensor, sequence or mapping)."""
    for _ in range(4):  # bounded descent into nested containers
        if isinstance(batch, torch.Tensor):
            return float(batch.shape[0]) if batch.dim() > 0 else None
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, list | tuple):
            batch = batch[0] if batch else None
        else:
            return None
    return None
