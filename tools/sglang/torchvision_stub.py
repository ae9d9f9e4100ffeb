"""The stand-in ``torchvision`` package of the SGLang client venvs.

Why a stub: importing ``sglang.srt.disaggregation.nixl.conn`` reaches
``sglang.srt.configs``, whose image-processor configs import ``torchvision.transforms`` at
import time, and ``transformers`` refuses to register image processors unless it finds a
``torchvision`` package. The ``torchvision`` wheels on the package index depend on a CUDA
build of torch that would shadow the CPU torch these venvs share with ``.venv`` (several GB,
and no GPU here). Nothing that the client tests run touches an image, so a package that
only *imports* is enough.

The stub's classes tolerate every attribute read (on the class and on instances), calls and
subclassing, because ``transformers`` and the SGLang configs read enum members and
functions off them at import time. It declares version ``0.0.0`` (in ``__version__`` and in
a ``.dist-info``), so any "torchvision >= X" feature check answers no. Anything that really
*uses* it gets a stub object back, never an image; no client test does.
"""

from __future__ import annotations

from pathlib import Path

STUB_VERSION = "0.0.0"

_INIT = '''\
"""Stand-in torchvision written by nixl-staging's tools/sglang set-up: it only imports.

See tools/sglang/torchvision_stub.py in nixl-staging for why it exists.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "{version}"
STUB = True


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _make(f"{{cls.__name__}}.{{name}}")


class _Anything(metaclass=_AnyMeta):
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _make(name)()


def _make(name):
    return _AnyMeta(name, (_Anything,), {{"__module__": __name__}})


def _module_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _make(name)
        setattr(sys.modules[module_name], name, value)
        return value

    return __getattr__


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
'''

_METADATA = """\
Metadata-Version: 2.1
Name: torchvision
Version: {version}
Summary: Stand-in written by nixl-staging tools/sglang (imports only; no image code)
"""


def write_stub(site_packages: Path) -> Path:
    """Write the stub package and its ``.dist-info`` into ``site_packages``; return the
    package directory.

    Raises:
        FileExistsError: a ``torchvision`` that is not this stub is already there.
        OSError: the files cannot be written.
    """
    package = site_packages / "torchvision"
    init = package / "__init__.py"
    if package.exists() and "STUB = True" not in init.read_text(encoding="utf-8"):
        raise FileExistsError(f"{package} is a real torchvision; refusing to overwrite it")
    package.mkdir(parents=True, exist_ok=True)
    init.write_text(_INIT.format(version=STUB_VERSION), encoding="utf-8")
    dist = site_packages / f"torchvision-{STUB_VERSION}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(_METADATA.format(version=STUB_VERSION), encoding="utf-8")
    (dist / "INSTALLER").write_text("nixl-staging tools/sglang\n", encoding="utf-8")
    (dist / "RECORD").write_text("", encoding="utf-8")
    return package
