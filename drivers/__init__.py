"""Array formats over kvstores: zarr v3 (with sharding) and zarr v2."""
