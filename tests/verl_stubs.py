"""Import `verl.trainer.ppo.core_algos` without verl's distributed stack.

verl's package ``__init__`` imports ``verl.protocol`` and with it ray, tensordict, codetiming and
orjson, none of which the functions of ``core_algos`` that the tests call use. `import_core_algos`
puts a bare stand-in module for each one that is not installed into ``sys.modules`` while verl's
modules import, with only the names read at import time (found by importing verl 0.9.1 with each
missing), and takes them out again afterwards, so that no other test sees a fake ray or tensordict.
"""

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
    if "verl.trainer.ppo.core_algos" in sys.modules:
        return sys.modules["verl.trainer.ppo.core_algos"]
    missing = {
        name: names
        for name, names in STAND_INS.items()
        if importlib.util.find_spec(name.partition(".")[0]) is None
    }
    sys.modules.update({name: _stand_in(name, names) for name, names in missing.items()})
    if "tensordict.tensorclass" in missing:
        sys.modules["tensordict"].tensorclass = sys.modules["tensordict.tensorclass"]
    try:
        import verl.trainer.ppo.core_algos as core_algos
    finally:
        for name in missing:
            del sys.modules[name]
    return core_algos
