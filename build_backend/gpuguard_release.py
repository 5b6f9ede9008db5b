"""Which release a build of gpuguard is: CHANGELOG.md's newest `## [X.Y.Z] - DATE` heading,
and how many commits came after the commit that wrote it. Tags need not travel with a clone
(a mirror, a fork, `git clone --no-tags`, a CI checkout), the CHANGELOG always does: so a
clone without tags still names the release its code was made from. A tag, where there is
one, must agree with the CHANGELOG or the build stops.

The versions (PEP 440), the scheme setuptools-scm calls `no-guess-dev`:

- the commit that wrote the heading, clean: `X.Y.Z`;
- N commits after it: `X.Y.Z.post1.devN+gHASH`, which sorts after `X.Y.Z` and before any
  later release, and guesses no next version (the next heading says which it is);
- uncommitted edits add `.dYYYYMMDD` to the local part; where the history cannot say N (a
  shallow clone, a `git archive`), `.dev0` (never the bare release).

This is also the PEP 517 build backend (pyproject.toml's [build-system], `backend-path`): it
is setuptools' own, imported here only so that setuptools-scm finds the scheme below.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

from setuptools.build_meta import *  # noqa: F403 (the backend's hooks, unchanged)

#: A release heading in Keep a Changelog's layout; `## [Unreleased]` is not one.
HEADING = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})[ \t]*$", re.MULTILINE)
#: A release tag.
TAG = re.compile(r"^v(\d+\.\d+\.\d+)$")
CHANGELOG = "CHANGELOG.md"


class ReleaseError(RuntimeError):
    """The CHANGELOG names no release, or a tag contradicts it: no version is guessed."""


def newest_release(changelog: str) -> tuple[str, str]:
    """(version, heading line) of the first release heading: the newest one."""
    found = HEADING.search(changelog)
    if found is None:
        raise ReleaseError(f"{CHANGELOG} has no release heading `## [X.Y.Z] - YYYY-MM-DD`")
    return found.group(1), found.group(0).rstrip()


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def check_tags(release: str, on_head: list[str], newest_reachable: str | None) -> None:
    """A release tag on the commit built must be the CHANGELOG's release; a reachable tag
    newer than it means a release the CHANGELOG does not record."""
    for tag in on_head:
        matched = TAG.match(tag)
        if matched and matched.group(1) != release:
            raise ReleaseError(f"tag {tag} is on the commit built, but {CHANGELOG}'s newest "
                               f"release is {release}: add its section or move the tag")
    matched = TAG.match(newest_reachable or "")
    if matched and _key(matched.group(1)) > _key(release):
        raise ReleaseError(f"tag {matched.group(0)} is newer than {CHANGELOG}'s newest release "
                           f"{release}: add its section")


def public_version(release: str, distance: int | None, dirty: bool) -> str:
    """The version without its local part, as the module docstring lays out."""
    if distance == 0 and not dirty:
        return release
    return f"{release}.post1.dev{distance or 0}"


def local_part(distance: int | None, dirty: bool, node: str | None, day: str) -> str:
    """`+gHASH` (and `.dYYYYMMDD` when dirty) for anything but the release itself."""
    if distance == 0 and not dirty:
        return ""
    parts = [node] if node else []
    if dirty:
        parts.append(f"d{day}")
    return "+" + ".".join(parts) if parts else ""


def _git(root: str, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def _release_at(root: str) -> tuple[str, int | None]:
    """(release, commits since the commit that wrote its heading, None where the history
    cannot say), the tags checked against it. A tag vX.Y.Z on HEAD that agrees makes HEAD
    the release: the maintainer said so."""
    release, heading = newest_release((Path(root) / CHANGELOG).read_text(encoding="utf-8"))
    if _git(root, "rev-parse", "--is-inside-work-tree") != "true":
        return release, None
    on_head = (_git(root, "tag", "--points-at", "HEAD") or "").split()
    check_tags(release, on_head,
               _git(root, "describe", "--tags", "--abbrev=0", "--match", "v[0-9]*"))
    if f"v{release}" in on_head:
        return release, 0
    if _git(root, "rev-parse", "--is-shallow-repository") != "false":
        return release, None  # a shallow history's first commit seems to write every line
    # The newest commit that changed how often the heading occurs: the one that wrote it.
    wrote = _git(root, "log", "-1", "--format=%H", f"-S{heading}", "--", CHANGELOG)
    if not wrote:
        return release, None
    count = _git(root, "rev-list", "--count", f"{wrote}..HEAD")
    return release, int(count) if count and count.isdigit() else None


def _built(root: str) -> str | None:
    """The version an sdist was built with (its PKG-INFO), outside a git work tree: a wheel
    built from the sdist keeps it (setuptools-scm reads the sdist's .git_archival.txt
    first, which knows the commit but not the CHANGELOG's distance)."""
    pkginfo = Path(root) / "PKG-INFO"
    if not pkginfo.is_file() or _git(root, "rev-parse", "--is-inside-work-tree") == "true":
        return None
    found = re.search(r"^Version: (\S+)$", pkginfo.read_text(encoding="utf-8"), re.MULTILINE)
    return found.group(1) if found else None


def version_scheme(version: Any) -> str:
    """setuptools-scm's version_scheme: the public version (`version` is its ScmVersion)."""
    root = version.config.absolute_root
    built = _built(root)
    if built is not None:
        return built.partition("+")[0]
    release, distance = _release_at(root)
    return public_version(release, distance, bool(version.dirty))


def local_scheme(version: Any) -> str:
    """setuptools-scm's local_scheme: the commit (and the day, when dirty)."""
    root = version.config.absolute_root
    built = _built(root)
    if built is not None:
        return "+" + built.partition("+")[2] if "+" in built else ""
    _, distance = _release_at(root)
    return local_part(distance, bool(version.dirty), version.short_node,
                      version.time.strftime("%Y%m%d"))
