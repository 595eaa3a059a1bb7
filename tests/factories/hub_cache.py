"""A local Hugging Face hub cache laid out as huggingface_hub writes it: files stored once in
``blobs/`` under their hash, ``snapshots/<commit>/`` holding relative symlinks to them, and
``refs/<revision>`` holding a commit hash (no newline)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_model(
    cache: Path, hub_id: str, folder: Path, commit: str, revisions: tuple[str, ...] = ("main",)
) -> Path:
    """Store ``folder``'s files as snapshot ``commit`` of ``hub_id`` in ``cache``, named by each
    of ``revisions`` (none: reachable by its commit hash only); returns the snapshot folder."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))  # as huggingface_hub links them
    for revision in revisions:
        ref = repo / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return snapshot
