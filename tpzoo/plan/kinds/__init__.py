"""The plan's exact costs of the built-in layer kinds, one module per kind named after it (attention.py for the
"attention" kind, ...): each registers its cost class under the kind's name (tpzoo.plan.costs.register_cost, whose
docstring is the protocol). Every module of this folder is imported here, so adding a kind's costs is adding its
file; a kind without one is planned from Derived's approximations."""
import importlib
import pkgutil

from ..costs import (COSTS, Acts, Collective, Cost, Derived, Matmul, Stateless, Weights,  # noqa: F401 (re-exported)
                     cost_of, entry_exit, register_cost)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
