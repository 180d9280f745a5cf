"""A ``torch.save``-compatible zip archive written record by record, each record streamed in pieces.

``torch._C.PyTorchFileWriter`` takes each record as one buffer, so a 200 MB tensor must sit whole in memory. This
writer streams a record in chunks instead. The layout is what torch writes: every record stored (no compression)
under ``<archive>/``, the data of each record aligned to 64 bytes (a padding extra field, as torch does), zip64
where needed; ``torch.load`` and ``torch.load(mmap=True)`` read the result.
"""

from __future__ import annotations

import os
import struct
import zipfile
from typing import IO

ALIGN = 64
_PAD_ID = 0x4246  # "FB", the padding extra field torch's own writer uses


def _pad(start: int) -> int:
    return (-start) % ALIGN


def zip_size(records: list[tuple[str, int]], archive: str) -> int:
    """The size of the archive :class:`TorchZipWriter` writes for ``records`` ((name, bytes), in order): local
    headers with the alignment padding, the data, the central directory (zip64 fields where zipfile adds them) and the
    end records."""
    pos = cd = 0
    for name, size in records:
        fname = len(f"{archive}/{name}".encode())
        zip64 = size >= zipfile.ZIP64_LIMIT - 1024
        extra = 4 + _pad(pos + 30 + fname + (20 if zip64 else 0) + 4)
        offset = pos
        pos += 30 + fname + extra + (20 if zip64 else 0) + size
        fields = (2 if size > zipfile.ZIP64_LIMIT else 0) + (1 if offset > zipfile.ZIP64_LIMIT else 0)
        cd += 46 + fname + extra + (4 + 8 * fields if fields else 0)
    end = 22
    if len(records) > zipfile.ZIP_FILECOUNT_LIMIT or cd > zipfile.ZIP64_LIMIT or pos > zipfile.ZIP64_LIMIT:
        end += 56 + 20  # the zip64 end record and its locator
    return pos + cd + end


class TorchZipWriter:
    def __init__(self, path: str, archive: str = "archive") -> None:
        self.archive = archive
        self._fh = open(path, "wb")  # noqa: SIM115 - closed (after an fsync) in close()
        self._zf = zipfile.ZipFile(self._fh, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def _info(self, name: str, size: int) -> tuple[zipfile.ZipInfo, bool]:
        info = zipfile.ZipInfo(f"{self.archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size >= zipfile.ZIP64_LIMIT - 1024
        fp = self._zf.fp
        assert fp is not None
        start = fp.tell() + 30 + len(info.filename.encode()) + (20 if zip64 else 0) + 4
        pad = _pad(start)
        info.extra = struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
        return info, zip64

    def open(self, name: str, size: int) -> IO[bytes]:
        """A writable stream for record ``name`` of exactly ``size`` bytes."""
        info, zip64 = self._info(name, size)
        return self._zf.open(info, "w", force_zip64=zip64)

    def write(self, name: str, data: bytes) -> None:
        with self.open(name, len(data)) as fh:
            fh.write(data)

    def close(self) -> None:
        """Finish the archive and make it durable (fsync) before the caller records it as written."""
        try:
            self._zf.close()
            self._fh.flush()
            os.fsync(self._fh.fileno())
        finally:
            self._fh.close()

    def __enter__(self) -> TorchZipWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
