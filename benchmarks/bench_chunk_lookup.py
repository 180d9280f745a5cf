"""Finding the saved chunk of each piece of a torch_dist tensor, as the layer and expert counts grow.

A torch_dist checkpoint saves a stacked-layer tensor (``decoder.layers.mlp.linear_fc1.weight``, shape layers x ...)
as one chunk per layer and TP rank (and expert): 80 layers at TP8 are 640 chunks of one tensor, 32 layers x 64
experts 2048. Every piece a reshard, diff or fingerprint reads is looked up among them. This times
``DistReader._candidates`` + the holding check for every chunk's own box (what reading every piece of the tensor
does) against a scan of all the tensor's chunks per piece (the lookup before this index). Chunk records only: no
file is read.

Usage: python benchmarks/bench_chunk_lookup.py
"""

from __future__ import annotations

import time

from megatron_preflight.reshard.sources.torch_dist_reader import Chunk, DistReader, Slab


def chunks_of(layers: int, experts: int, tp: int) -> list[Chunk]:
    rows, cols = 1024, 512
    out = []
    for layer in range(layers):
        for e in range(experts):
            for t in range(tp):
                lead = (layer, e) if experts > 1 else (layer,)
                out.append(Chunk((*lead, t * rows, 0), (*(1,) * len(lead), rows, cols), "__0_0.distcp",
                                 len(out) * 100, 100))
    return out


def holds(c: Chunk, s: Slab) -> bool:
    return all(co <= o and o + n <= co + cs for o, n, co, cs in zip(s.offsets, s.sizes, c.offsets, c.sizes,
                                                                    strict=True))


def main() -> None:
    print(f"{'tensor chunks':>14} {'layout':>22} {'scan s':>8} {'indexed s':>10} {'speedup':>8}")
    for layers, experts, tp in ((32, 1, 8), (80, 1, 8), (32, 64, 1), (64, 128, 1)):
        chunks = chunks_of(layers, experts, tp)
        reader = DistReader("/nonexistent", {"w": chunks})
        slabs = [Slab("w", c.offsets, c.sizes, 0, 0) for c in chunks]
        t0 = time.perf_counter()
        for s in slabs:
            next(c for c in chunks if holds(c, s))
        scan = time.perf_counter() - t0
        t0 = time.perf_counter()
        for s in slabs:
            assert reader._holding_chunk(s) is not None
        indexed = time.perf_counter() - t0
        layout = f"{layers} layers x {experts} exp x TP{tp}"
        print(f"{len(chunks):>14} {layout:>22} {scan:>8.3f} {indexed:>10.4f} {scan / indexed:>7.0f}x")
    print("scan: every chunk of the tensor tried per piece, in order (the lookup before the index); indexed: the "
          "chunks filed under the piece's layer (and expert) only. One lookup per chunk: reading every piece once.")


if __name__ == "__main__":
    main()
