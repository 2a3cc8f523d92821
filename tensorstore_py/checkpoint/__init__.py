"""Checkpoints of pytrees (numpy, sharded ``jax.Array``) with one atomic commit per step.

Quick tour::

    import tensorstore_py as tsp
    tsp.checkpoint.save("file:///tmp/ckpt/", {"w": w}, step=0).result()
    tree = tsp.checkpoint.restore("file:///tmp/ckpt/")          # numpy leaves

    mgr = tsp.CheckpointManager("gs://bucket/run1/", max_to_keep=3)
    mgr.save(step, params)        # returns once the device->host copy is done
    mgr.wait_until_finished()
    params = mgr.restore(mgr.latest_step(), target=abstract_params)

See docs/CHECKPOINTS.md for the layout on storage and the guarantees.
"""

from __future__ import annotations

from tensorstore_py.checkpoint.api import leaf_paths, open_array, restore, save
from tensorstore_py.checkpoint.coordination import Coordinator, JaxCoordinator, SingleProcess
from tensorstore_py.checkpoint.manager import CheckpointManager
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.checkpoint.saving import SaveOptions
from tensorstore_py.checkpoint.storage import StepInfo

__all__ = [
    "leaf_paths",
    "open_array",
    "CheckpointManager",
    "Coordinator",
    "JaxCoordinator",
    "ReadStats",
    "SaveOptions",
    "SingleProcess",
    "StepInfo",
    "restore",
    "save",
]
