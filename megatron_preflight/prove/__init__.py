"""Proving a checkpoint's content: ``diff`` (two checkpoints by global tensor content)."""
