"""Checkpoints on object storage (``msc://PROFILE/path``: NVIDIA's multi-storage-client, as Megatron-LM's
``--enable-msc`` reads them).

The rest of the package reads local files (mmap, ``pread``); a remote checkpoint is *staged*: its objects listed
once, each made a sparse local file of its size, and only the byte ranges a command needs fetched into place by ranged
GETs — the metadata of a verdict (:mod:`~megatron_preflight.remote.mirror`), a rank's bytes for a load, every byte for
an offline reshard. :mod:`~megatron_preflight.remote.store` is the one place that talks to the client."""
