"""A ``torch.save``-compatible zip archive written record by record, each record streamed in pieces.

``torch._C.PyTorchFileWriter`` takes each record as one buffer, so a 200 MB tensor must sit whole in memory. This
writer streams a record in chunks instead. The layout is what torch writes: every record stored (no compression)
under ``<archive>/``, the data of each record aligned to 64 bytes (a padding extra field, as torch does), zip64
where needed; ``torch.load`` and ``torch.load(mmap=True)`` read the result. The records are laid out from the zip
specification (APPNOTE 6.3) byte for byte as Python's ``zipfile`` lays out stored records (tested), but each record's
CRC-32 is taken with :mod:`megatron_preflight.crc` (ISA-L where installed: ~6x zlib's, which ``zipfile`` uses), and
whether a record needs zip64 is decided once, so the alignment padding and :func:`zip_size` always agree with what is
written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import IO, Any

from megatron_preflight import crc
from megatron_preflight.reshard.targets.output_file import open_output

ALIGN = 64
_PAD_ID = 0x4246  # "FB", the padding extra field torch's own writer uses
ZIP64_LIMIT = (1 << 31) - 1  # sizes and offsets above this take zip64 fields (zipfile's limit)
FILECOUNT_LIMIT = (1 << 16) - 1
_VERSION, _ZIP64_VERSION = 20, 45
_UNIX = 3  # "version made by" host system
_ATTR = 0o600 << 16  # rw------- (what zipfile gives a record written through open())
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the fixed date torch also writes
_DOS_TIME = 0
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_END64 = struct.Struct("<4sQ2H2L4Q")
_LOCATOR = struct.Struct("<4sLQL")


def _pad(start: int) -> int:
    return (-start) % ALIGN


def _local_zip64(size: int) -> bool:
    """Whether a record of ``size`` bytes carries zip64 sizes in its local header (zipfile's rule for a stored
    record: with a margin below the limit)."""
    return size * 1.05 > ZIP64_LIMIT


def _local_extra_len(start: int, name_len: int, zip64: bool) -> int:
    """The length of the padding extra field (header included) of a record whose local header starts at ``start``:
    its data starts at a multiple of ALIGN."""
    return 4 + _pad(start + _LOCAL.size + name_len + (20 if zip64 else 0) + 4)


def _central_fields(size: int, offset: int) -> list[int]:
    return ([size, size] if size > ZIP64_LIMIT else []) + ([offset] if offset > ZIP64_LIMIT else [])


def zip_size(records: list[tuple[str, int]], archive: str) -> int:
    """The size of the archive :class:`TorchZipWriter` writes for ``records`` ((name, bytes), in order): local
    headers with the alignment padding, the data, the central directory (zip64 fields where needed) and the end
    records."""
    pos = cd = 0
    for name, size in records:
        fname = len(f"{archive}/{name}".encode())
        zip64 = _local_zip64(size)
        extra = _local_extra_len(pos, fname, zip64)
        fields = _central_fields(size, pos)
        pos += _LOCAL.size + fname + extra + (20 if zip64 else 0) + size
        cd += _CENTRAL.size + fname + extra + (4 + 8 * len(fields) if fields else 0)
    end = _END.size
    if len(records) > FILECOUNT_LIMIT or cd > ZIP64_LIMIT or pos > ZIP64_LIMIT:
        end += _END64.size + _LOCATOR.size
    return pos + cd + end


@dataclass
class _Entry:
    name: bytes
    size: int
    offset: int  # of the local header
    pad_extra: bytes
    zip64: bool
    crc: int = 0
    known: bool = False  # the CRC was given before the data (not taken, not rewritten)

    def local_header(self) -> bytes:
        extra = self.pad_extra
        sizes = self.size
        if self.zip64:
            extra += struct.pack("<HHQQ", 1, 16, self.size, self.size)
            sizes = 0xFFFFFFFF
        version = _ZIP64_VERSION if self.zip64 else _VERSION
        return _LOCAL.pack(b"PK\x03\x04", version, 0, 0, 0, _DOS_TIME, _DOS_DATE, self.crc, sizes, sizes,
                           len(self.name), len(extra)) + self.name + extra

    def central_header(self) -> bytes:
        fields = _central_fields(self.size, self.offset)
        extra = (struct.pack("<HH" + "Q" * len(fields), 1, 8 * len(fields), *fields) if fields else b"") \
            + self.pad_extra
        size = 0xFFFFFFFF if self.size > ZIP64_LIMIT else self.size
        offset = 0xFFFFFFFF if self.offset > ZIP64_LIMIT else self.offset
        version = _ZIP64_VERSION if (fields or self.zip64) else _VERSION
        return _CENTRAL.pack(b"PK\x01\x02", version, _UNIX, version, 0, 0, 0, _DOS_TIME, _DOS_DATE, self.crc, size,
                             size, len(self.name), len(extra), 0, 0, 0, _ATTR, offset) + self.name + extra


class TorchZipWriter:
    """A torch zip archive written record by record: to ``path`` (a file of its own, written as
    :func:`~.output_file.open_output` chooses and fsynced on close), or into an
    open file ``fh`` at its current position (an archive inside a bigger file — a torch_dist chunk's blob —: its
    offsets counted from where it starts; the file left open, its caller makes it durable)."""

    def __init__(self, path: str | None, archive: str = "archive", *, fh: IO[bytes] | None = None) -> None:
        self.archive = archive
        self._own = fh is None
        self._fh: Any = open_output(path) if fh is None else fh  # type: ignore[arg-type]  # (closed by close())
        self._base = 0 if fh is None else fh.tell()
        self._entries: list[_Entry] = []
        self._current: _Entry | None = None
        self._left = 0

    def begin(self, name: str, size: int, *, crc32: int | None = None) -> None:
        """Start record ``name`` of exactly ``size`` bytes (its data: :meth:`append`, then :meth:`end`). ``crc32``:
        the record's CRC-32 when known before its data (its header is then written once, with no seek back)."""
        if self._current is not None:
            raise ValueError("another record of this archive is still being written")
        fname = f"{self.archive}/{name}".encode()
        offset = self._fh.tell() - self._base
        zip64 = _local_zip64(size)
        pad = _local_extra_len(offset, len(fname), zip64) - 4
        self._current = _Entry(fname, size, offset, struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad, zip64,
                               crc32 or 0, crc32 is not None)
        self._left = size
        self._fh.write(self._current.local_header())  # (an unknown CRC is rewritten once the data is through)

    def append(self, data: Any, running_crc: int | None = None) -> None:
        """The next bytes of the current record (any buffer: a numpy array's memory is written without a copy).
        ``running_crc``: the CRC-32 of the record's bytes so far, ``data`` included, when the caller took it (on
        another thread, say); it is then not taken here."""
        entry = self._current
        assert entry is not None, "append() outside a record"
        view = memoryview(data).cast("B")
        if view.nbytes > self._left:
            raise ValueError(f"record {entry.name.decode()} is longer than its declared {entry.size} bytes")
        if not entry.known:
            entry.crc = crc.crc32(view, entry.crc) if running_crc is None else running_crc
        self._fh.write(view)
        self._left -= view.nbytes

    def end(self) -> None:
        """Finish the current record: its size checked, its CRC written into its header."""
        entry = self._current
        assert entry is not None, "end() outside a record"
        if self._left:
            raise ValueError(f"record {entry.name.decode()} is {self._left} bytes short of its declared {entry.size}")
        if not entry.known:  # (a seek flushes the file's buffer: a blob of small records would pay it per record)
            here = self._fh.tell()
            self._fh.seek(self._base + entry.offset)
            self._fh.write(entry.local_header())
            self._fh.seek(here)
        self._entries.append(entry)
        self._current = None

    def write(self, name: str, data: Any) -> None:
        """One whole record (any buffer): its CRC-32 taken first, its header written once."""
        view = memoryview(data).cast("B")
        self.begin(name, view.nbytes, crc32=crc.crc32(view))
        self.append(view)
        self.end()

    def _end_records(self) -> bytes:
        start = self._fh.tell() - self._base
        central = b"".join(e.central_header() for e in self._entries)
        count, size = len(self._entries), len(central)
        out = central
        if count > FILECOUNT_LIMIT or start > ZIP64_LIMIT or size > ZIP64_LIMIT:
            out += _END64.pack(b"PK\x06\x06", 44, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0, count, count, size, start)
            out += _LOCATOR.pack(b"PK\x06\x07", 0, start + size, 1)
            count, size, start = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(start, 0xFFFFFFFF)
        return out + _END.pack(b"PK\x05\x06", 0, 0, count, count, size, start, 0)

    def close(self) -> None:
        """Finish the archive and make it durable (fsync) before the caller records it as written (an archive inside
        a caller's file: finished only)."""
        if not self._own:
            self._fh.write(self._end_records())
            return
        try:
            if not self._fh.closed:
                self._fh.write(self._end_records())
                self._fh.commit()
        finally:
            self._fh.close()

    def __enter__(self) -> TorchZipWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
