"""Artemis autoload: instruments a training rank when torch.distributed starts.

The SPANK plugin puts this folder first on PYTHONPATH and sets
ARTEMIS_ENABLED=1.  Python imports ``sitecustomize`` at start-up, so this file
runs in every Python process of the job -- most of which never touch torch.

* ARTEMIS_ENABLED unset (or 0): nothing at all happens besides chaining.
* Otherwise a meta-path hook waits for ``torch.distributed`` to be imported by
  the program itself (torch is never imported from here) and wraps
  ``init_process_group``; once a process group exists, ``torch_hook.install()``
  runs.  Any failure is reported on stderr once and training goes on.
* Either way, the next ``sitecustomize`` further down sys.path (a site's or a
  distribution's) still runs: this file must not hide it.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    later = []
    seen_self = False
    for entry in sys.path:
        if not seen_self:
            seen_self = os.path.abspath(entry or os.getcwd()) == _HERE
            continue
        later.append(entry)
    if not seen_self:
        later = [e for e in sys.path if os.path.abspath(e or os.getcwd()) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is None or spec.loader is None or spec.origin == __file__:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_artemis_chained_sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 -- the site's file failing must not look like ours
        print(f"artemis: chained sitecustomize {spec.origin} failed: {err!r}", file=sys.stderr)


def _enabled() -> bool:
    return os.environ.get("ARTEMIS_ENABLED", "").strip().lower() in ("1", "yes", "true", "on")


def _install_probe() -> None:
    try:
        try:
            import torch_hook
        except ImportError:
            # The SPANK plugin only puts autoload/ on PYTHONPATH; torch_hook is its parent.
            sys.path.append(os.path.dirname(os.path.dirname(_HERE)))
            import torch_hook
        torch_hook.install()
    except Exception as err:  # noqa: BLE001
        print(f"artemis: probe not installed: {err!r}", file=sys.stderr)


def _patch_distributed(module) -> None:
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_artemis", False):
        return

    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        _install_probe()
        return result

    init_process_group._artemis = True
    init_process_group.__wrapped__ = original
    init_process_group.__doc__ = original.__doc__
    module.init_process_group = init_process_group
    if c10d is not None and getattr(c10d, "init_process_group", None) is original:
        c10d.init_process_group = init_process_group  # init_device_mesh & co. call it there


class _Loader:
    """Delegates to torch.distributed's real loader, then patches the module."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            _patch_distributed(module)
        except Exception as err:  # noqa: BLE001
            print(f"artemis: could not hook torch.distributed: {err!r}", file=sys.stderr)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _DistributedFinder:
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(name, path, target) if find else None
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _enabled():
    if "torch.distributed" in sys.modules:
        _patch_distributed(sys.modules["torch.distributed"])
    else:
        sys.meta_path.insert(0, _DistributedFinder())
_chain()
