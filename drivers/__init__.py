"""Array formats over kvstores: zarr v3 (with sharding) and zarr v2.

Modules:

* ``base``      the ArrayDriver contract the view layer builds on
* ``open``      ``open_driver(spec, create=..., ...)`` and ``build_metadata(...)``
* ``zarr3``     zarr.json parsing/validation, chunk keys (default and v2 encodings)
* ``zarr2``     .zarray parsing/validation, numcodecs filters and compressors
* ``engine``    the chunk engine: region -> chunks, concurrent I/O, read-modify-write
* ``fastpath``  batched blocking chunk I/O for stores that offer it (local files)
* ``grid``      which chunks a strided region touches
* ``budget``    bytes-in-flight budget and bounded task runner
* ``cache``     CachePool: byte-limited LRU of decoded chunks (off by default)
* ``dtypes``    data type names and fill values (bfloat16/float8 via ml_dtypes)
* ``codecs/``   one zarr v3 codec per module, the codec chain, sharding_indexed
"""
