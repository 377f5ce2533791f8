"""Checkpoints written off the training thread: the step pays for a copy to host memory only.

* ``snapshot`` - ``host_snapshot``: the copy in host memory, taken at the save's step, of a state
  that training goes on updating in place;
* ``writer``   - ``BackgroundSaver``: a thread per rank writes the captured files (``PendingFile``,
  hashed as they are written) and rank 0 publishes the checkpoint exactly as a synchronous save.

Imports torch (both modules need it) and, of this package's parent, ``rng``, ``save`` and ``state``.
"""
from ds_trhash.checkpoints.background.snapshot import host_snapshot
from ds_trhash.checkpoints.background.writer import BackgroundSaver, Finished, PendingFile, write_torch_file

__all__ = ["BackgroundSaver", "Finished", "PendingFile", "host_snapshot", "write_torch_file"]
