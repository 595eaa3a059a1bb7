"""Models named by their Hugging Face hub id (``owner/name``), found in the local cache.

The cache is huggingface_hub's layout (https://huggingface.co/docs/huggingface_hub/guides/
manage-cache): ``<cache>/models--{owner}--{name}/refs/{revision}`` holds a commit hash and
``snapshots/{hash}/`` the files (symlinks into ``blobs/``). cenote never downloads, with or
without ``HF_HUB_OFFLINE``: a model missing from the cache is an error naming where it looked.
Written by hand: huggingface_hub is no runtime dependency, and this layout is a few lines.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
# huggingface_hub's repo id, the owner required: parts of word characters, "." and "-", each
# starting and ending with a word character ("./x" stays a path); "--" and ".." are not allowed
_PART = r"\w(?:[\w.-]{0,94}\w)?"
_HUB_ID = re.compile(rf"{_PART}/{_PART}")
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are on this machine, and the name it is served under by default."""

    path: Path  # the model folder (a cache snapshot for a hub id) or the .gguf file
    name: str  # the hub id, or the folder's / file's name (never a path of this machine)


def locate_model(model: str | os.PathLike[str], revision: str | None) -> ModelSource:
    """A local folder or file as it is; else ``owner/name`` from the local hub cache at
    ``revision`` (None: ``main``), a ref name or a commit hash. Raises FileNotFoundError
    naming the id, the revision and the cache path looked in; ValueError for a ``revision``
    given with a local path."""
    path = Path(model)
    if path.exists() or not is_hub_id(str(model)):
        if revision is not None:
            raise ValueError(
                f"revision {revision!r} applies to hub ids; {model} is a local path, whose "
                "files are served as they are"
            )
        return ModelSource(path=path, name=path.name)
    return ModelSource(path=_snapshot_folder(str(model), revision), name=str(model))


def is_hub_id(text: str) -> bool:
    return _HUB_ID.fullmatch(text) is not None and "--" not in text and ".." not in text


def hub_cache_dir() -> Path:
    """huggingface_hub's ``constants.HF_HUB_CACHE``: ``$HF_HUB_CACHE``, else the legacy
    ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub`` (``HF_HOME`` defaulting to
    ``$XDG_CACHE_HOME/huggingface``, then ``~/.cache/huggingface``)."""
    home = os.getenv(
        "HF_HOME",
        os.path.join(os.getenv("XDG_CACHE_HOME", os.path.join("~", ".cache")), "huggingface"),
    )
    cache = os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def _snapshot_folder(hub_id: str, revision: str | None) -> Path:
    """The cached snapshot of ``hub_id`` at ``revision``: ``refs/{revision}`` names its commit,
    or ``revision`` is a commit hash whose snapshot is there."""
    revision = DEFAULT_REVISION if revision is None else revision
    if not revision or revision.startswith("/") or ".." in Path(revision).parts:
        raise ValueError(f"revision must be a branch, tag or commit hash, got {revision!r}")
    cache = hub_cache_dir()
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    missing = (
        f"{hub_id} is no local path, and hub model {hub_id!r} (revision {revision!r}) is not "
        f"in the Hugging Face cache {cache}"
    )
    if not repo.is_dir():
        raise FileNotFoundError(f"{missing}: no {repo}{_download_hint(hub_id, revision)}")
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    elif _COMMIT_HASH.fullmatch(revision):
        commit = revision
    else:
        raise FileNotFoundError(
            f"{missing}: no {ref}; cached revisions: {_cached_revisions(repo)}"
            f"{_download_hint(hub_id, revision)}"
        )
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        found = f"{ref} names commit {commit}, but no {snapshot}"
        if not ref.is_file():
            found = f"no {ref} nor {snapshot}"
        raise FileNotFoundError(
            f"{missing}: {found}; cached revisions: "
            f"{_cached_revisions(repo)}{_download_hint(hub_id, revision)}"
        )
    return snapshot


def _cached_revisions(repo: Path) -> str:
    refs = repo / "refs"
    names = sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file())
    snapshots = repo / "snapshots"
    commits = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    return f"refs {names or 'none'}, snapshots {commits or 'none'}"


def _download_hint(hub_id: str, revision: str) -> str:
    flag = "" if revision == DEFAULT_REVISION else f" --revision {revision}"
    return (
        f". cenote never downloads: download it first with `hf download {hub_id}{flag}` "
        f"(or `huggingface-cli download {hub_id}{flag}`), or point HF_HUB_CACHE / HF_HOME at "
        "the cache that holds it"
    )
