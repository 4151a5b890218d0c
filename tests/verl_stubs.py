"""Import verl's modules (`verl.trainer.ppo.core_algos`, ...) without its distributed stack.

verl's package ``__init__`` imports ``verl.protocol`` and with it ray, tensordict, codetiming and
orjson, none of which the functions of ``core_algos`` and ``rollout_corr_helper`` that the tests
call use. `import_verl_module` (`import_core_algos`) puts a bare stand-in module for each one that
is not installed into ``sys.modules`` while verl's modules import, with only the names read at
import time (found by importing verl 0.9.1 with each missing), and takes them out again
afterwards, so that no other test sees a fake ray or tensordict.
"""

import importlib
import importlib.util
import sys
import types

# module -> the names verl's modules read from it at import time
STAND_INS = {
    "ray": ("ObjectRef",),  # annotations in verl.protocol
    "tensordict": ("TensorDict",),  # verl.protocol, verl.utils.torch_functional
    "tensordict.tensorclass": ("NonTensorData", "NonTensorStack"),  # verl.utils.tensordict_utils
    "codetiming": ("Timer",),  # verl.utils.profiler.performance
    "orjson": (),  # imported only (verl.utils.tracking)
}


def _stand_in(name: str, attributes: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(name, "stand-in for verl's import (tests/verl_stubs.py)")
    module.__path__ = []  # a package, so that its submodules can be stood in for too
    for attribute in attributes:
        setattr(module, attribute, type(attribute, (), {}))
    return module


def import_core_algos():
    """verl's ``verl.trainer.ppo.core_algos`` module, imported with the stand-ins."""
    return import_verl_module("verl.trainer.ppo.core_algos")


def import_verl_module(name: str) -> types.ModuleType:
    """verl's module `name`, e.g. ``verl.trainer.ppo.rollout_corr_helper``, imported with the
    stand-ins."""
    if name in sys.modules:
        return sys.modules[name]
    missing = {
        name: names
        for name, names in STAND_INS.items()
        if importlib.util.find_spec(name.partition(".")[0]) is None
    }
    sys.modules.update({stood: _stand_in(stood, names) for stood, names in missing.items()})
    if "tensordict.tensorclass" in missing:
        sys.modules["tensordict"].tensorclass = sys.modules["tensordict.tensorclass"]
    try:
        module = importlib.import_module(name)
    finally:
        for stood in missing:
            del sys.modules[stood]
    return module
