"""The bottom layer: what every other layer needs and that needs none of them.

* ``errors``   the one error tree (``tsp.errors`` re-exports it)
* ``future``   the Future and the background event loop thread (fork-safe)
* ``pools``    thread pools for blocking I/O and codec work, sized from the usable CPUs
* ``ranges``   ByteRange and Buffer, coalescing of nearby ranges
* ``budget``   a bytes-in-flight budget and a bounded task runner
* ``retry``    retry policy with jittered exponential backoff
* ``buffers``  page-aligned host buffers
* ``recycled`` large buffers handed out again once nothing uses them (network answers)
* ``gcpause``  the cyclic garbage collector paused around bursts of small allocations

Modules here import the standard library, numpy and each other, never
``tensorstore_py.kvstore``, ``tensorstore_py.drivers`` or the user API.
"""
