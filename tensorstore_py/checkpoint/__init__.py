"""Checkpoints of pytrees (numpy, sharded ``jax.Array``) with one atomic commit per step.

Quick tour::

    import tensorstore_py as tsp
    tsp.checkpoint.save("file:///tmp/ckpt/", {"w": w}, step=0).result()
    tree = tsp.checkpoint.restore("file:///tmp/ckpt/")          # numpy leaves

    mgr = tsp.CheckpointManager("gs://bucket/run1/", max_to_keep=3)
    mgr.save(step, params)        # returns once the state is staged (device snapshot or host)
    mgr.wait_until_finished()
    params = mgr.restore(mgr.latest_step(), target=abstract_params)

See docs/CHECKPOINTS.md for the layout on storage and the guarantees.

Modules, each importing only those above it (this package's ``__init__`` only
re-exports; no module imports it)::

    coordination  the Coordinator protocol (publish / wait_for) and its two implementations
    attempts      a multi-process save's name (step, attempt) and its failure reports
    inflight      saves in flight, finished or abandoned at interpreter exit
    prng          typed PRNG key leaves as key data
    pytree        flatten / unflatten with a JSON structure
    layout        per-leaf chunk grids, zarr v3 metadata, region math
    storage       the steps of one root: StepStore, StepInfo, list_steps, read_spans
    jax_adapter   the JAX edge: shards to save, target regions (never imports JAX itself)
    staging       how a save's shards leave the devices (SaveOptions.staging)
    assembly      restored blocks built on their devices (restore(assemble=...))
    leaves        a saved array leaf as a TensorStore view
    saving        snapshot + background writes + one commit
    restoring     plan and read the regions a process needs
    api           save / restore / leaf_paths / open_array and the shared Root
    tiers         the local tier: per-process parts, promotion to the root, the step to restore
    tiered        a manager's two tiers: local saves, background promotions, restores
    preemption    SIGTERM and JAX's preemption sync point
    manager       CheckpointManager (retention, async saves, a local tier, preemption)
    foreign       restoring a foreign checkpoint's arrays into a target
    safetensors_* safetensors: the format, restore (native ranged reads), export
    orbax_import  Orbax steps (tree metadata; arrays read with TensorStore)
    interop       finding a foreign checkpoint where a root was expected
"""

from __future__ import annotations

from tensorstore_py.checkpoint.api import leaf_paths, open_array, restore, save
from tensorstore_py.checkpoint.coordination import Coordinator, JaxCoordinator, SingleProcess
from tensorstore_py.checkpoint.manager import CheckpointManager
from tensorstore_py.checkpoint.restoring import ReadStats
from tensorstore_py.checkpoint.safetensors_io import restore_safetensors
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
    "restore_safetensors",
    "save",
]
