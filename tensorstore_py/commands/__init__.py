"""The logic of the ``tensorstore-py`` commands, each testable without a subprocess.

Every command is an async function returning plain data (the documented
``--json`` output, docs/CLI.md); :mod:`tensorstore_py.cli` parses arguments,
runs it and prints it with :mod:`tensorstore_py.commands.printers`.

=========  ====================================================================
module     commands
=========  ====================================================================
target     what a URL is: checkpoint root / versioned store / array / folder
inspect    ``ls``, ``info``, ``history``, ``diff``
checks     ``verify`` (store walk from ``kvstore.versioned.verify`` + chunk decode)
maintenance  ``gc`` (``kvstore.versioned.gc``)
export     ``cat``, ``copy``
=========  ====================================================================
"""
