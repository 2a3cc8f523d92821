"""Array formats over kvstores: zarr v3 (with sharding), zarr v2, N5 and neuroglancer precomputed; groups.

Modules, top to bottom (each imports only modules below it):

* ``zarr3``     zarr.json parsing/validation, chunk keys (default and v2 encodings);
                registers the ``zarr3`` format
* ``zarr2``     .zarray parsing/validation, numcodecs filters and compressor;
                registers the ``zarr`` (alias ``zarr2``) format
* ``precomputed/`` neuroglancer precomputed: the ``info`` document, chunk encodings,
                the sharded format and the ``neuroglancer_precomputed`` driver
                (``precomputed/driver.py`` registers it)
* ``n5/``       the N5 format (attributes.json, blocks, compressions) and its
                ``driver`` module, which registers the ``n5`` format
* ``groups``    group documents (zarr v3, zarr v2, N5): create, attributes,
                members by listing; the "this is a group" error
* ``documents`` the atomic read-modify-write of a JSON document, and array
                attributes (``AttributedArray``)
* ``open``      ``open_driver(spec, create=..., ...)`` dispatches to the registered
                format; ``build_metadata(driver, ...)``; ``open_document``, the
                open/create flow of one-document formats
* ``formats``   the array-format registry (``register_array_format``, detection)
* ``engine``    ChunkedArray, the chunk engine: region -> chunks, concurrent I/O,
                read-modify-write; a format adds its parsed metadata and JSON layout
* ``fastpath``  batched blocking chunk I/O for stores that offer it (local files);
                ``ChunkOps`` says what it needs from an array
* ``rmw``       the retry policy of read-modify-write (lost races back off)
* ``base``      the ArrayDriver contract the view layer builds on
* ``cache``     CachePool: byte-limited LRU of decoded chunks (off by default)
* ``dtypes``    data type names and fill values (bfloat16/float8 via ml_dtypes)
* ``codecs/``   one codec per module, each registering itself (zarr3 name,
                zarr v2 decoder, ``compression=`` alias); the codec chain;
                ``sharding_indexed``
* ``grid``      which chunks a strided region touches

To add a codec: one module in ``codecs/`` plus one import line in
``codecs/__init__.py``. To add an array format: one module that calls
``register_array_format`` plus one import line below. The bytes-in-flight
budget is ``tensorstore_py.core.budget``.
"""

from tensorstore_py.drivers import zarr2, zarr3  # noqa: F401  (imported to register)
from tensorstore_py.drivers.n5 import driver as _n5_driver  # noqa: F401  (imported to register)
from tensorstore_py.drivers.precomputed import driver as precomputed_driver  # noqa: F401  (imported to register)
