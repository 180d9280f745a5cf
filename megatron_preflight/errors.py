"""User-facing errors: one paragraph naming the file and the fix, never a traceback."""

from __future__ import annotations


class PreflightError(Exception):
    """An error the user can act on. ``str()`` is the whole message: what, where, and the fix."""

    def __init__(self, message: str, path: str | None = None, fix: str | None = None, code: str = "error"):
        self.message = message
        self.path = path
        self.fix = fix
        self.code = code
        super().__init__(message)

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        parts = [self.message.rstrip(".") + "."]
        if self.path:
            parts.insert(0, f"{self.path}:")
        if self.fix:
            parts.append(f"Fix: {self.fix.rstrip('.')}.")
        return " ".join(parts)


class UnsafePickleError(PreflightError):
    """A checkpoint pickle references a global outside the allow-list."""


class CorruptFileError(PreflightError):
    """A checkpoint file is truncated, empty or not a torch file."""
