"""Bundles named `owner/name[@revision]`: found in the local Hugging Face hub cache, fetched by `sam3 download`.

The cache's layout and the rules that find it are huggingface_hub's (docs/sam3-bundle.md 14): a repository is
the folder `models--owner--name` of the cache directory; `refs/<revision>` holds the commit a branch or tag
names; `snapshots/<commit>/` is the bundle directory, its files links into `blobs/`. Only `download` needs
huggingface_hub (the `hub` extra), imported when it is called; the rest is the standard library.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from amdxdna_direct import files

from .manifest import BundleError

__all__ = ["DEFAULT_REVISION", "EXTRA", "HubError", "HubName", "cache_dir", "download", "locate", "offline",
           "parse_name", "resolve"]

DEFAULT_REVISION = "main"
EXTRA = "pip install 'amdxdna-direct[hub]'"
# A repository's folder in the cache: the type's plural and the id's parts joined by "--" (docs/sam3-bundle.md 14).
_FOLDER_PREFIX = "models--"
# One part of a repository id: ASCII letters, digits, "_", "-", ".", 1-96 of them, starting and ending with a
# letter, digit or "_" (docs/sam3-bundle.md 14).
_PART = re.compile(r"\w(?:[\w.-]{0,94}\w)?", re.ASCII)
# The values huggingface_hub takes for true in HF_HUB_OFFLINE, compared upper-cased.
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})
_REF_LIMIT = 4096


class HubError(BundleError):
    """A hub name that cannot be resolved or downloaded; the message names what was looked for."""


@dataclass(frozen=True)
class HubName:
    """A bundle named by its Hugging Face repository: `repo_id` (`owner/name`) and `revision` (branch, tag or
    commit; `main` when not given)."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    @property
    def folder(self) -> str:
        """The repository's folder in the cache: `models--owner--name`."""
        return _FOLDER_PREFIX + self.repo_id.replace("/", "--")

    def __str__(self) -> str:
        return self.repo_id if self.revision == DEFAULT_REVISION else f"{self.repo_id}@{self.revision}"


def parse_name(text: str) -> HubName | None:
    """`owner/name[@revision]` as a `HubName`, or None when `text` is not of that form (docs/sam3-bundle.md 14)."""
    repo, at, revision = text.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(_PART.fullmatch(p) for p in parts):
        return None
    if "--" in repo or ".." in repo or repo.endswith(".git"):
        return None
    if at and not _revision_ok(revision):
        return None
    return HubName(repo, revision if at else DEFAULT_REVISION)


def _revision_ok(revision: str) -> bool:
    """A revision names a file under `refs/` or a folder under `snapshots/`: it may hold `/` (as `refs/pr/1`), but no
    empty, `.` or `..` component, so it cannot name a path out of the repository's folder."""
    return "\0" not in revision and all(p not in ("", ".", "..") for p in revision.split("/"))


def cache_dir() -> Path:
    """The hub cache directory: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `HF_HOME/hub`, else
    `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; `~` and `$VAR` expanded
    (docs/sam3-bundle.md 14)."""
    env = os.environ
    home = _expand(env.get("HF_HOME", os.path.join(env.get("XDG_CACHE_HOME", _expand("~/.cache")), "huggingface")))
    return Path(_expand(env.get("HF_HUB_CACHE", env.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))))


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))


def offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) asks for no network: `1`, `ON`, `YES` or `TRUE`."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def resolve(name: HubName, cache: Path | None = None) -> Path:
    """The snapshot directory of `name` in the hub cache (`cache_dir()` unless given): `refs/<revision>` names the
    commit when it is a file, else the revision is the commit; `snapshots/<commit>` must be a directory.

    Raises:
        HubError: "owner/name: not a bundle directory, and ... not in the Hugging Face cache (looked for ...);
            fetch it with `sam3 download owner/name`", or the ref file cannot be read.
    """
    repo = (cache_dir() if cache is None else cache) / name.folder
    ref = repo / "refs" / name.revision
    commit = _read_ref(ref) if ref.is_file() else None
    folder = name.revision if commit is None else commit
    snapshot = repo / "snapshots" / folder
    if folder not in ("", ".", "..") and "/" not in folder and snapshot.is_dir():
        return snapshot
    via = f"{files.shown(ref)} (commit {files.shown(folder)})" if commit is not None else files.shown(ref)
    fetch = name.repo_id if name.revision == DEFAULT_REVISION else f"{name.repo_id} --revision {name.revision}"
    raise HubError(f"{name}: not a bundle directory, and revision {name.revision} of {name.repo_id} is not in the "
                   f"Hugging Face cache (looked for {via} and {files.shown(snapshot)}); fetch it with "
                   f"`sam3 download {fetch}`")


def _read_ref(ref: Path) -> str:
    """The commit a ref file names (surrounding whitespace dropped)."""
    try:
        return files.read_text(ref, "text", limit=_REF_LIMIT).strip()
    except (OSError, ValueError) as e:
        raise HubError(f"{files.shown(ref)}: cannot read the ref ({e})") from e


def locate(bundle: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """The directory a bundle argument (a str or a path) names: `bundle` itself when it is a directory or not a hub
    name, else the snapshot `resolve` finds for it (docs/sam3-bundle.md 14).

    Raises:
        HubError: `bundle` is a hub name that is not in the cache (see `resolve`).
    """
    text = os.fspath(bundle)
    if not isinstance(text, str) or os.path.isdir(text):
        return bundle
    name = parse_name(text)
    return bundle if name is None else resolve(name)


def download(repo: str, revision: str | None = None) -> Path:
    """Fetch the repository `repo` (`owner/name[@revision]`) into the hub cache with huggingface_hub's
    `snapshot_download` and return its snapshot directory. The cache is `cache_dir()`; with `offline()` no
    network is used and the cached snapshot is returned.

    Raises:
        HubError: `repo` is not a repository name, the revision is given twice, huggingface_hub is not installed
            ("... pip install 'amdxdna-direct[hub]'"), or the download failed (the reason on one line).
    """
    name = parse_name(repo)
    if name is None:
        raise HubError(f"{files.shown(repo)}: not a Hugging Face repository name (owner/name[@revision])")
    if revision is not None:
        if "@" in repo:
            raise HubError(f"{repo}: the revision is given twice (@ and --revision)")
        name = parse_name(f"{repo}@{revision}")
        if name is None:
            raise HubError(f"{files.shown(revision)}: not a revision (an empty, '.' or '..' component)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise HubError(f"downloading needs huggingface_hub, which is not installed: {EXTRA}") from e
    try:
        where = snapshot_download(name.repo_id, revision=name.revision, cache_dir=cache_dir(),
                                  local_files_only=offline())
    except (OSError, ValueError) as e:  # huggingface_hub's errors derive from one of them
        raise HubError(f"{name}: download failed: {type(e).__name__}: {' '.join(str(e).split())}") from e
    return Path(where)
