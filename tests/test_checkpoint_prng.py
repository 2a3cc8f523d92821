"""Typed PRNG key leaves (``jax.random.key``) are saved as key data and restored as keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidArgumentError


def _data(keys: object) -> bytes:
    return np.asarray(jax.random.key_data(keys)).tobytes()


def test_prng_keys_round_trip(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'ckpt'}/"
    keys = jax.random.split(jax.random.key(3), 8)
    tree = {"k": jax.random.key(0), "rbg": jax.random.key(1, impl="rbg"), "ks": keys, "x": np.arange(3)}
    tsp.checkpoint.save(url, tree, step=4).result()

    out = tsp.checkpoint.restore(url)  # no target: keys again
    for name in ("k", "rbg", "ks"):
        assert out[name].dtype == tree[name].dtype, name
        assert out[name].shape == tree[name].shape, name
        assert _data(out[name]) == _data(tree[name]), name
    assert jax.random.uniform(out["k"]) == jax.random.uniform(tree["k"])
    assert out["x"].tolist() == [0, 1, 2]

    target = {"k": jax.ShapeDtypeStruct((), tree["k"].dtype), "ks": keys, "rbg": tree["rbg"]}
    got = tsp.checkpoint.restore(url, target=target)
    assert _data(got["ks"]) == _data(keys) and got["ks"].sharding == keys.sharding
    assert _data(got["rbg"]) == _data(tree["rbg"]) and got["rbg"].dtype == tree["rbg"].dtype
    assert _data(got["k"]) == _data(tree["k"])

    # the key data is an ordinary uint32 leaf for readers without JAX types
    raw = tsp.checkpoint.open_array(url, "['ks']").result().read().result()
    assert raw.dtype == np.uint32 and raw.tobytes() == _data(keys)


def test_prng_key_target_of_another_impl_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'ckpt'}/"
    tsp.checkpoint.save(url, {"k": jax.random.key(0)}).result()
    with pytest.raises(InvalidArgumentError, match=r"leaf \['k'\].*key<fry>.*key<rbg>"):
        tsp.checkpoint.restore(url, target={"k": jax.random.key(1, impl="rbg")})
