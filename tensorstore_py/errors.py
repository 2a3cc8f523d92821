"""The error tree of tensorstore_py (defined in :mod:`tensorstore_py.core.errors`).

``tsp.errors.<Name>`` and ``tsp.<Name>`` are the same classes; see the core
module's docstring for the tree.
"""

from tensorstore_py.core.errors import *  # noqa: F403 - this module re-exports the tree
from tensorstore_py.core.errors import __all__  # noqa: F401
