"""The central directory of a zip file, read with :mod:`struct` from the file's last bytes.

A torch_dist checkpoint holds one ``torch.save`` zip blob per saved chunk (thousands per ``.distcp`` file), and each is
opened to learn where its tensor's bytes lie. :class:`zipfile.ZipFile` builds a ``ZipInfo`` object per record and
parses every extra field (~100 us a blob); this reads just what a reader needs — each record's name, method, sizes,
CRC and local header offset — in a few ``unpack_from`` calls. It is strict: a layout other than the plain one
``torch.save`` (and Python's ``zipfile``) write — a comment after the directory, bytes before the archive, a split or
encrypted archive, a count or size that does not add up — gives None, and the caller reads the file with
:mod:`zipfile`, which reports what is wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

_END = struct.Struct("<IHHHHIIH")  # end of central directory (22 bytes)
_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator (20 bytes)
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record (56 bytes)
_ENTRY = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header (46 bytes)
_EXTRA = struct.Struct("<HH")
END_SIG, LOCATOR_SIG, END64_SIG, ENTRY_SIG = 0x06054B50, 0x07064B50, 0x06064B50, 0x02014B50
STORED = 0
_FULL32, _FULL16 = 0xFFFFFFFF, 0xFFFF
_ZIP64_EXTRA = 0x0001
_ENCRYPTED, _UTF8 = 0x1, 0x800


@dataclass(frozen=True)
class Record:
    """One record of the archive, as its central directory entry describes it."""

    name: str
    header_offset: int  # where its local header begins
    compress_type: int
    compress_size: int
    file_size: int
    crc: int


def read_directory(read: Callable[[int, int], bytes], size: int) -> dict[str, Record] | None:
    """The records of the zip archive of ``size`` bytes that ``read(offset, n)`` reads, by name (a name given twice:
    the last, as :mod:`zipfile` does), or None when its layout is not the plain one (see the module docstring)."""
    try:
        return _directory(read, size)
    except struct.error:  # a read came back short: the file ends early
        return None


def _directory(read: Callable[[int, int], bytes], size: int) -> dict[str, Record] | None:
    if size < _END.size:
        return None
    end_at = size - _END.size
    sig, disk, cd_disk, n_disk, count, cd_size, cd_offset, comment = _END.unpack(read(end_at, _END.size))
    if sig != END_SIG or comment or disk or cd_disk or n_disk != count:
        return None
    cd_end = end_at
    if end_at >= _LOCATOR.size:
        lsig, ldisk, end64_at, disks = _LOCATOR.unpack(read(end_at - _LOCATOR.size, _LOCATOR.size))
        if lsig == LOCATOR_SIG:
            if ldisk or disks != 1 or end64_at + _END64.size > end_at - _LOCATOR.size:
                return None
            (sig64, _rec, _made, _need, disk64, cd_disk64, n_disk64, count64, cd_size64,
             cd_offset64) = _END64.unpack(read(end64_at, _END64.size))
            if sig64 != END64_SIG or disk64 or cd_disk64 or n_disk64 != count64:
                return None
            count, cd_size, cd_offset, cd_end = count64, cd_size64, cd_offset64, end64_at
        elif _FULL32 in (cd_size, cd_offset) or count == _FULL16:
            return None  # zip64 values without their record
    if cd_offset + cd_size != cd_end:
        return None  # bytes before the archive, or between its directory and its end records
    return _entries(read(cd_offset, cd_size), count, cd_offset)


def _entries(cd: bytes, count: int, cd_offset: int) -> dict[str, Record] | None:
    out: dict[str, Record] = {}
    pos = 0
    for _ in range(count):
        if pos + _ENTRY.size > len(cd):
            return None
        (sig, _made, _need, flags, method, _time, _date, crc, csize, usize, name_len, extra_len, comment_len,
         disk, _iattr, _eattr, offset) = _ENTRY.unpack_from(cd, pos)
        head = pos + _ENTRY.size
        pos = head + name_len + extra_len + comment_len
        if sig != ENTRY_SIG or flags & _ENCRYPTED or pos > len(cd):
            return None
        raw = cd[head:head + name_len]
        try:
            name = raw.decode("utf-8" if flags & _UTF8 else "cp437")
        except UnicodeDecodeError:
            return None
        if _FULL32 in (usize, csize, offset) or disk == _FULL16:
            wide = _zip64_fields(cd[head + name_len:head + name_len + extra_len], usize, csize, offset, disk)
            if wide is None:
                return None
            usize, csize, offset, disk = wide
        if disk or offset >= cd_offset:
            return None
        out[name] = Record(name, offset, method, csize, usize, crc)
    return out if pos == len(cd) else None


def _zip64_fields(extra: bytes, usize: int, csize: int, offset: int,
                  disk: int) -> tuple[int, int, int, int] | None:
    """The sizes, offset and disk number with the values their zip64 extra field holds for those given in full."""
    pos = 0
    while pos + _EXTRA.size <= len(extra):
        tag, n = _EXTRA.unpack_from(extra, pos)
        body = extra[pos + _EXTRA.size:pos + _EXTRA.size + n]
        pos += _EXTRA.size + n
        if tag != _ZIP64_EXTRA:
            continue
        at = 0
        values = [usize, csize, offset]
        for i, full in enumerate(values):
            if full == _FULL32:
                if at + 8 > len(body):
                    return None
                values[i] = struct.unpack_from("<Q", body, at)[0]
                at += 8
        if disk == _FULL16:
            if at + 4 > len(body):
                return None
            disk = struct.unpack_from("<I", body, at)[0]
        return values[0], values[1], values[2], disk
    return None
