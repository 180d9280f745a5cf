"""Layout discovery: what a Megatron checkpoint dir holds, from metadata only (:mod:`.discover`), described by the
records of :mod:`.model`; shard naming in :mod:`.naming`, torch_dist metadata in :mod:`.dist`, the compact transport of
a layout between ranks in :mod:`.transport`."""
