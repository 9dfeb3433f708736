"""The patches that let the probe see a training loop it did not write.

* ``torch.distributed`` collectives (module attributes of both
  ``torch.distributed`` and ``distributed_c10d``), wrapped: synchronous calls
  are timed around the call, asynchronous ones counted at issue and timed in
  ``Work.wait()``.
* ``Work.wait`` on the pybind ``Work`` class.
* Functional collectives (``torch.distributed._functional_collectives``,
  what DTensor and tensor parallel use): counted at issue, timed at
  ``wait_tensor``; under ``torch.compile`` every wrapper steps aside so Dynamo
  traces torch's own functions.
* ``P2POp`` / ``_check_op``: P2POps always hold c10d's own ``isend``/``irecv``.
* ``destroy_process_group``: the probe's own work on the group is finished first.
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
itself propagate unchanged.  Every wrapper keeps the original's signature
(``functools.wraps``; methods take ``self`` positional-only, so keyword
arguments such as ``module=`` reach the original).  ``uninstall()`` restores
every original.
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

# torch.distributed collectives: op -> name of the parameter whose size is the
# op's byte count (None: no tensor data).  bytes = the largest buffer the rank
# hands the op: the reduced tensor, the gathered output, the scattered input,
# the sent/received tensor.  A name missing from the installed torch is skipped
# (older torch has no ``*_single``); ``covered()`` says what was wrapped.
COLLECTIVES: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "all_gather": "tensor_list",
    "all_gather_single": "output_tensor",
    "all_gather_into_tensor": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather_coalesced": "output_tensor_lists",
    "reduce_scatter": "input_list",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "all_to_all_single": "input",
    "all_to_all": "input_tensor_list",
    "broadcast": "tensor",
    "reduce": "tensor",
    "gather": "tensor",
    "scatter": "tensor",
    "barrier": None,
    "monitored_barrier": None,
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list",
    # Object collectives pickle into tensors inside; their size is not known
    # before the call, so they are timed and counted without bytes.
    "all_gather_object": None,
    "gather_object": None,
    "broadcast_object_list": None,
    "scatter_object_list": None,
    "send_object_list": None,
    "recv_object_list": None,
}
_ALWAYS_ASYNC = {"isend", "irecv", "batch_isend_irecv"}
# c10d compares a P2POp's ``op`` with its own module globals ``isend``/``irecv``
# by identity, so those two are wrapped in the ``torch.distributed`` namespace
# only, and P2POp is handed the originals (see ``_install_p2p``).
_NAMESPACE_ONLY = {"isend", "irecv"}

# Functional collectives (torch.distributed._functional_collectives, "funcol"):
# what DTensor, tensor parallel and compiled code's eager fallbacks call.  Each
# issues a ``torch.ops._c10d_functional`` op and returns an
# ``AsyncCollectiveTensor`` that waits (``wait_tensor``) at first use.  The data
# parameter is named ``self`` or ``inputs``.  The ``*_inplace`` remaps exist
# only for Dynamo's tracing and are not wrapped.
FUNCTIONAL: tuple[str, ...] = (
    "broadcast", "all_reduce", "all_reduce_coalesced",
    "all_gather_single", "all_gather_single_autograd", "all_gather_tensor", "all_gather_tensor_autograd",
    "all_gather_single_coalesced", "all_gather_into_tensor_coalesced",
    "reduce_scatter_single", "reduce_scatter_single_autograd", "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "all_to_all_single_autograd", "permute_tensor",
)
_MAX_TRACKED_WORKS = 4096

_local = threading.local()  # .inside: the probe's own or an already-timed call is running
# The installed probe.  Patches are per install, but a comm hook stays on its
# DDP model for good, so the hook finds the probe here at every call: a model
# built under one install is timed again after uninstall() + install().
_current: Any = None
_compiling = torch.compiler.is_compiling


class _Spec:
    __slots__ = ("op", "data_pos", "data_name", "group_pos", "group_name", "async_pos")

    def __init__(self, op: str, fn: Callable[..., Any], data_name: str | None, group_name: str = "group"):
        params = list(inspect.signature(fn).parameters)
        self.op = op
        self.data_name = data_name
        self.data_pos = params.index(data_name) if data_name in params else -1
        self.group_name = group_name
        self.group_pos = params.index(group_name) if group_name in params else -1
        self.async_pos = params.index("async_op") if "async_op" in params else -1

    def arg(self, args: tuple, kwargs: dict, pos: int, name: str | None) -> Any:
        if name is not None and name in kwargs:
            return kwargs[name]
        return args[pos] if 0 <= pos < len(args) else None


def _nbytes(obj: Any) -> float:
    """Bytes of a tensor, or of the tensors in a (nested) list, or of P2POps' tensors."""
    if isinstance(obj, torch.Tensor):
        return float(obj.numel() * obj.element_size())
    if isinstance(obj, list | tuple):
        return float(sum(_nbytes(getattr(t, "tensor", t)) for t in obj))
    return 0.0


def _first_tensor(obj: Any) -> Any:
    for _ in range(3):  # bounded descent: list of lists, list of P2POps
        if isinstance(obj, list | tuple):
            obj = obj[0] if obj else None
        elif obj is not None and not isinstance(obj, torch.Tensor):
            obj = getattr(obj, "tensor", None)
        else:
            break
    return obj


def _keep_signature(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """Name, docs and ``__wrapped__`` of ``original`` on ``wrapper`` (``inspect.signature`` follows it)."""
    return functools.wraps(original)(wrapper)


class Instrumentation:
    """Owns every patch; ``target`` receives the measurements (the Probe)."""

    def __init__(self, target: Any):
        self.target = target
        self.errors = 0
        self.last_error: str | None = None
        self._restore: list[tuple[Any, str, Any]] = []
        self._handles: list[Any] = []
        self._works: dict[int, tuple[str, str, float]] = {}
        # functional collectives in flight: output storage address -> (op, group)
        self._tensors: dict[int, tuple[str, str]] = {}
        self._group_names: dict[int, str] = {}
        self._functional_groups: dict[Any, str] = {}
        # Group names whose collectives a completion hook times (NCCL): the
        # wrappers there add comm_wait and bytes only, the hook calls and ms.
        self.hooked: set[str] = set()
        self.on_new_group: Callable[[Any, str], None] | None = None
        self.wrapped: list[str] = []  # "torch.distributed.X" / "funcol.X", for covered()
        self._pacer: Any = None  # weakref to the optimizer whose steps are the boundaries
        self.explicit_steps = False

    def fault(self, err: BaseException) -> None:
        """An exception in the probe's own code: counted, kept for stats, swallowed."""
        self.errors += 1
        self.last_error = repr(err)

    # -- install / uninstall -------------------------------------------------
    def install(self) -> None:
        c10d = dist.distributed_c10d
        for op, data_name in COLLECTIVES.items():
            original = getattr(c10d, op, None)
            if original is None:
                continue
            wrapper = self._collective_wrapper(_Spec(op, original, data_name), original)
            modules = (dist,) if op in _NAMESPACE_ONLY else (dist, c10d)
            for module in modules:
                if getattr(module, op, None) is original:
                    self._set(module, op, wrapper)
            self.wrapped.append(f"torch.distributed.{op}")
        self._install_p2p()
        self._install_functional()
        self._install_destroy()
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
        self._tensors.clear()
        self.wrapped.clear()

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._restore.append((owner, name, owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)))
        setattr(owner, name, value)

    def _install_p2p(self) -> None:
        """P2POps always hold c10d's own ``isend``/``irecv``.

        c10d checks ``op in [isend, irecv]`` and picks the peer keyword by
        ``op is isend``, against its module globals; a P2POp built with the
        wrapped ``dist.isend`` (or with the original, before install) must pass
        both.  ``batch_isend_irecv`` itself is wrapped and times the batch.
        """
        c10d = dist.distributed_c10d
        originals = {getattr(dist, op): getattr(c10d, op) for op in _NAMESPACE_ONLY
                     if getattr(dist, op, None) is not getattr(c10d, op, None)}
        if not originals or not hasattr(c10d, "P2POp") or not hasattr(c10d, "_check_op"):
            return

        def unwrap(op: Any) -> Any:
            try:
                return originals.get(op, op)
            except TypeError:  # unhashable: not ours, c10d will reject it
                return op

        check, init = c10d._check_op, c10d.P2POp.__init__

        @functools.wraps(check)
        def _check_op(op: Any) -> None:
            return check(unwrap(op))

        @functools.wraps(init)
        def __init__(self: Any, /, op: Any, *args: Any, **kwargs: Any) -> None:
            init(self, unwrap(op), *args, **kwargs)

        self._set(c10d, "_check_op", _check_op)
        self._set(c10d.P2POp, "__init__", __init__)

    def _install_destroy(self) -> None:
        """``destroy_process_group`` first lets the probe finish its own work on the group."""
        c10d = dist.distributed_c10d
        original = getattr(c10d, "destroy_process_group", None)
        if original is None:
            return
        target = self.target

        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                quiesce = getattr(target, "quiesce", None)
                if quiesce is not None:
                    quiesce(args[0] if args else kwargs.get("group"))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return original(*args, **kwargs)

        wrapper = _keep_signature(destroy_process_group, original)
        for module in (dist, c10d):
            if getattr(module, "destroy_process_group", None) is original:
                self._set(module, "destroy_process_group", wrapper)

    def forget_groups(self) -> None:
        """Every process group is gone (destroyed): names, hooks and in-flight work with them."""
        self._group_names.clear()
        self._functional_groups.clear()
        self._works.clear()
        self._tensors.clear()
        self.hooked.clear()

    def _install_functional(self) -> None:
        try:
            import torch.distributed._functional_collectives as funcol
        except Exception:  # noqa: BLE001 -- a torch without functional collectives
            return
        for op in FUNCTIONAL:
            original = getattr(funcol, op, None)
            if original is None or not callable(original):
                continue
            params = inspect.signature(original).parameters
            data_name = "self" if "self" in params else "inputs" if "inputs" in params else None
            self._set(funcol, op, self._functional_wrapper(_Spec(op, original, data_name), original))
            self.wrapped.append(f"funcol.{op}")
        wait = getattr(funcol, "wait_tensor", None)
        if wait is not None:
            self._set(funcol, "wait_tensor", self._wait_tensor_wrapper(wait))
            self.wrapped.append("funcol.wait_tensor")
        self._async_tensor = getattr(funcol, "AsyncCollectiveTensor", None)

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
            if self.on_new_group is not None:
                self.on_new_group(group, name)
        return name

    def functional_group_name(self, group: Any) -> str:
        """Name of a funcol ``group``: a ProcessGroup, group name, DeviceMesh, (mesh, dim) or rank list."""
        if isinstance(group, dist.ProcessGroup):
            return self.group_name(group)
        if isinstance(group, list):
            ranks = [r for r in group if isinstance(r, int)]
            return f"ranks:{ranks[0]}-{ranks[-1]}/{len(ranks)}" if ranks else "functional"
        key = group if isinstance(group, str) else (id(group[0]), group[1]) if isinstance(group, tuple) else id(group)
        name = self._functional_groups.get(key)
        if name is None:
            if isinstance(group, str):
                pg = dist.distributed_c10d._resolve_process_group(group)
            elif isinstance(group, tuple):
                pg = group[0].get_group(group[1])
            else:
                pg = group.get_group()
            name = self._functional_groups[key] = self.group_name(pg)
        return name

    def _issue(self, op: str, group: str, nbytes: float) -> None:
        """An asynchronous collective started: counted now, timed at its wait."""
        self.target.recorder.comm(op, group, nbytes, 0 if group in self.hooked else 1, 0.0, 0.0)

    def _record(self, op: str, group: str, nbytes: float, calls: int, start: Any, end: Any) -> None:
        recorder = self.target.recorder
        hooked = group in self.hooked  # the completion hook counts the call and its duration
        if hooked:
            calls = 0
        ms = elapsed_ms(start, end)
        if ms is not None:
            recorder.comm(op, group, nbytes, calls, ms, 0.0 if hooked else ms)
        else:
            def resolve(start: Any = start, end: Any = end) -> tuple[float, float] | None:
                value = elapsed_ms(start, end)
                return None if value is None else (value, 0.0 if hooked else value)

            recorder.comm_pending(op, group, nbytes, calls, resolve)

    # -- torch.distributed ---------------------------------------------------
    def _collective_wrapper(self, spec: _Spec, original: Callable[..., Any]) -> Callable[..., Any]:
        target = self.target

        def collective(*args: Any, **kwargs: Any) -> Any:
            # Under torch.compile, Dynamo traces straight to the original (and
            # remaps it to a functional collective by identity).
            if _compiling() or not target.active or getattr(_local, "inside", False):
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
                    works = result if isinstance(result, list) else [result] if result is not None else []
                    if works:
                        if len(self._works) + len(works) > _MAX_TRACKED_WORKS:
                            self._works.clear()  # never-waited works: forget them
                        for work in works:
                            self._works[id(work)] = (spec.op, group, nbytes)
                        self._issue(spec.op, group, nbytes)
                else:
                    self._record(spec.op, group, nbytes, 1, start, mark_for(_first_tensor(data)))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return result

        return _keep_signature(collective, original)

    def _wait_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        target = self.target

        def wait(self_: Any, /, *args: Any, **kwargs: Any) -> Any:
            if _compiling() or not target.active or getattr(_local, "inside", False):
                return original(self_, *args, **kwargs)
            try:
                op, group, _ = self._works.pop(id(self_), ("wait", "async", 0.0))
                start = target.timeline_mark()
            except Exception as err:  # noqa: BLE001
                self.fault(err)
                return original(self_, *args, **kwargs)
            return self._timed_wait(op, group, start, original, (self_, *args), kwargs)

        return _keep_signature(wait, original)

    def _timed_wait(self, op: str, group: str, start: Any, original: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a wait with the wrappers off inside it; its time is ``op``'s comm_wait."""
        _local.inside = True
        try:
            result = original(*args, **kwargs)
        finally:
            _local.inside = False
        try:
            self._record(op, group, 0.0, 0, start, self.target.timeline_mark())
        except Exception as err:  # noqa: BLE001
            self.fault(err)
        return result

    # -- functional collectives ----------------------------------------------
    def _functional_wrapper(self, spec: _Spec, original: Callable[..., Any]) -> Callable[..., Any]:
        """Counted at issue; timed at ``wait_tensor`` when the result is an AsyncCollectiveTensor.

        A result that is already waited for (tracing, or funcol waiting early
        for a non-zero gather dim) is timed around the call instead.
        """
        target = self.target

        def functional(*args: Any, **kwargs: Any) -> Any:
            if _compiling() or not target.active or getattr(_local, "inside", False):
                return original(*args, **kwargs)
            try:
                data = spec.arg(args, kwargs, spec.data_pos, spec.data_name)
                group = self.functional_group_name(spec.arg(args, kwargs, spec.group_pos, "group"))
                start = mark_for(_first_tensor(data))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
                return original(*args, **kwargs)
            _local.inside = True
            try:
                result = original(*args, **kwargs)
            finally:
                _local.inside = False
            try:
                nbytes = max(_nbytes(data), _nbytes(result))
                outputs = result if isinstance(result, list | tuple) else (result,)
                pending = [t.elem for t in outputs if isinstance(t, self._async_tensor)]
                if pending:
                    if len(self._tensors) + len(pending) > _MAX_TRACKED_WORKS:
                        self._tensors.clear()
                    for tensor in pending:
                        self._tensors[tensor.untyped_storage().data_ptr()] = (spec.op, group)
                    self._issue(spec.op, group, nbytes)
                else:
                    self._record(spec.op, group, nbytes, 1, start, mark_for(_first_tensor(result)))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return result

        return _keep_signature(functional, original)

    def _wait_tensor_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The wait of a functional collective: its time is comm_wait.

        Looked up by the output's storage, so a wait on a view of the output
        (DTensor re-wraps views) is still the op's; an unknown tensor (an op
        issued by compiled code) is timed as ``wait_tensor``.
        """
        target = self.target

        def wait_tensor(*args: Any, **kwargs: Any) -> Any:
            if _compiling() or not target.active or getattr(_local, "inside", False):
                return original(*args, **kwargs)
            try:
                tensor = args[0] if args else kwargs.get("tensor")
                op, group = self._tensors.pop(tensor.untyped_storage().data_ptr(), ("wait_tensor", "functional"))
                start = target.timeline_mark()
            except Exception as err:  # noqa: BLE001
                self.fault(err)
                return original(*args, **kwargs)
            return self._timed_wait(op, group, start, original, args, kwargs)

        return _keep_signature(wait_tensor, original)

    # -- DataLoader ----------------------------------------------------------
    def _next_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def __next__(iterator: Any, /) -> Any:
            if not self.target.active:
                return original(iterator)
            start = time.perf_counter()
            batch = original(iterator)  # StopIteration passes through untouched
            try:
                self.target.recorder.data((time.perf_counter() - start) * 1e3, batch_size(batch))
            except Exception as err:  # noqa: BLE001
                self.fault(err)
            return batch

        return _keep_signature(__next__, original)

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
