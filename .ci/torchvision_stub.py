"""A stand-in for torchvision in the CPU SGLang environment of .ci/sglang-env (installed there
as torchvision/__init__.py; never part of hlserve).

PyPI's only torchvision for torch 2.13.0 is linked against the CUDA torch and fails to load
beside the CPU one. SGLang imports torchvision at module level only in vision-model code
(processors, configs such as internvl_utils), which ``sglang.srt.configs`` imports
eagerly; its scheduler never calls it. So ``import torchvision`` and any
``torchvision.x.y`` here give modules whose names are placeholders, and calling or
instantiating one raises: nothing vision-related can run by accident.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+hlserve-stand-in"
_WHY = ("torchvision is a stand-in in this environment (hlserve's .ci/sglang-env: no CPU "
        "build of torchvision matches torch 2.13.0); vision models do not run here")


class _Members(type):
    """Any member of a placeholder (InterpolationMode.BILINEAR) is the placeholder itself."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return cls


class _Placeholder(metaclass=_Members):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(_WHY)

    def __class_getitem__(cls, item):
        return cls


def _attr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        # an enum-like member (InterpolationMode.BILINEAR) or a class: a placeholder type
        value = _Members(name, (_Placeholder,), {})
        setattr(sys.modules[module_name], name, value)
        return value
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _attr(spec.name)
        return module

    def exec_module(self, module):
        pass


__path__ = []  # a package: submodules come from the finder
__getattr__ = _attr(__name__)
sys.meta_path.append(_Finder())
