"""The old module names of kvwire 0.1, kept importable for one release.

kvwire's flat top level became stage packages (``wire``, ``kv``, ``pipeline``, ``cli``).
``import kvwire.codec`` and ``from kvwire.chain import receive`` still work: a finder on
``sys.meta_path`` answers each old dotted name with the module it became (the very same
module object, so ``kvwire.codec is kvwire.wire.codec``) and warns, with a
:class:`DeprecationWarning` pointing at the importing line, where the name went.
``kvwire.graph`` (a package once) answers with a stand-in package whose names and
submodules are those of :mod:`kvwire.pipeline.graph` and its neighbours.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Any

MOVED = {
    "kvwire.spec": "kvwire.wire.spec",
    "kvwire.packet": "kvwire.wire.packet",
    "kvwire.partial": "kvwire.wire.layers",
    "kvwire.quant": "kvwire.wire.quant",
    "kvwire.signing": "kvwire.wire.signing",
    "kvwire.codec": "kvwire.wire.codec",
    "kvwire.codec_checks": "kvwire.wire.checks",
    "kvwire.codec_options": "kvwire.wire.options",
    "kvwire.rope": "kvwire.wire.rope",
    "kvwire.atomic": "kvwire.wire.atomic",
    "kvwire.chain": "kvwire.kv.chain",
    "kvwire.splice": "kvwire.kv.splice",
    "kvwire.pipefile": "kvwire.pipeline.spec",
    "kvwire.transcript": "kvwire.pipeline.transcript",
    "kvwire.handoff": "kvwire.pipeline.handoff",
    "kvwire.agent": "kvwire.pipeline.agent",
    "kvwire.worker": "kvwire.pipeline.worker",
    "kvwire.results": "kvwire.pipeline.results",
    "kvwire.fidelity": "kvwire.pipeline.fidelity",
    "kvwire.cost": "kvwire.pipeline.cost",
    "kvwire.breakeven": "kvwire.pipeline.breakeven",
    "kvwire.graph.structure": "kvwire.pipeline.spec",
    "kvwire.graph.runner": "kvwire.pipeline.graph",
    "kvwire.graph.merge": "kvwire.pipeline.merge",
    "kvwire.cli_console": "kvwire.cli.console",
    "kvwire.cli_fuse": "kvwire.cli.fuse",
    "kvwire.cli_fuser": "kvwire.cli.fuser",
    "kvwire.cli_graph": "kvwire.cli.graph",
    "kvwire.cli_pipeline": "kvwire.cli.pipeline",
    "kvwire.cli_serve": "kvwire.cli.serve",
    "kvwire.cli_types": "kvwire.cli.types",
    "kvwire.hf.variant": "kvwire.variant",  # it finds models (kvwire.models), which convert through hf
    "kvwire.serve.allocator": "kvwire.allocator",  # the compact load trims the heap too (kvwire.hf.loading)
}
PACKAGES = {"kvwire.graph": "kvwire.pipeline.graph"}  # old packages that became modules
# (``kvwire.pipeline`` and ``kvwire.cli`` kept their names: packages now, exporting what the modules did)


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}: import it from there ({old} goes in the next release)",
                  DeprecationWarning, stacklevel=stacklevel + 1)  # + 1: this function


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module it became (the same object; its own ``__spec__`` kept)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.real_spec: Any = None

    def create_module(self, spec: Any) -> types.ModuleType:
        _warn(spec.name, self.new, stacklevel=2)  # import machinery frames are skipped: the importing line
        module = importlib.import_module(self.new)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.real_spec  # the import system set the alias's spec on the shared module

    def get_code(self, fullname: str) -> types.CodeType:
        """``python -m OLD``: run the new module as ``__main__`` (runpy asks for the old name's code)."""
        _warn(fullname, self.new, stacklevel=2)
        return compile(f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n",
                       f"<{fullname}, moved to {self.new}>", "exec")


class _Package(importlib.abc.Loader):
    """An old package that became a module: a stand-in package forwarding its names to that module."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: Any) -> types.ModuleType:
        _warn(spec.name, self.new, stacklevel=2)
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        new = self.new

        def __getattr__(name: str) -> Any:
            return getattr(importlib.import_module(new), name)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))
        if fullname in PACKAGES:
            return importlib.util.spec_from_loader(fullname, _Package(PACKAGES[fullname]), is_package=True)
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before the path finder: a stale folder of an old package loses


def attribute(name: str) -> Any:
    """``kvwire.<name>`` for an old module name (``kvwire.chain`` after ``import kvwire``), with the warning."""
    old = f"kvwire.{name}"
    new = MOVED.get(old) or PACKAGES.get(old)
    if new is None or "." in name:
        raise AttributeError(f"module 'kvwire' has no attribute {name!r}")
    _warn(old, new, stacklevel=3)  # the caller of kvwire.__getattr__
    if old not in PACKAGES:
        return importlib.import_module(new)
    with warnings.catch_warnings():  # said once, above
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(old)
