"""The check's answers as enums, used end to end (plan, CLI, hook, JSON)."""

from __future__ import annotations

import enum


class Verdict(str, enum.Enum):
    LOAD = "load"  # the checkpoint loads as is
    RESHARD = "reshard"  # only the parallel layout differs: load through the resharder
    FAIL = "fail"  # the job must not start
    SKIP = "skip"  # hook only: nothing to check (no --load, or a missing checkpoint that is allowed)


class Loader(str, enum.Enum):
    NON_EP = "non-ep"
    EP_3D = "3d-ep"
    DIST = "dist"
    RESHARD = "reshard"
