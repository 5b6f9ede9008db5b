"""The checkout as others get it: a copy of the working tree, or a git clone of it.

A build's version comes from git (setuptools-scm), so the tests that build or install
gpuguard work on a clone with its own commits and tags, never on this checkout's: a clone
of the repository with the working tree's files committed on top, so that what is tested
is the code in front of you, uncommitted edits included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.support.servers import REPO

#: The identity of the tests' own commits (a CI machine may have no git identity).
GIT_IDENTITY = {"GIT_AUTHOR_NAME": "gpuguard tests", "GIT_AUTHOR_EMAIL": "tests@invalid",
                "GIT_COMMITTER_NAME": "gpuguard tests", "GIT_COMMITTER_EMAIL": "tests@invalid"}


def git(where: Path, *args: str) -> str:
    """`git -C where ARGS`, checked; its stdout, stripped."""
    done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **GIT_IDENTITY})
    assert done.returncode == 0, (args, done.stderr[-2000:])
    return done.stdout.strip()


def working_tree_files() -> list[str]:
    """The working tree's files a fresh clone would have: tracked and untracked ones that
    git does not ignore (deleted ones left out)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, timeout=60,
                            check=True).stdout.decode().split("\0")
    return [name for name in listed if name and ((REPO / name).is_symlink() or
                                                 (REPO / name).is_file())]


def checkout_copy(dest: Path) -> Path:
    """The working tree's files (symbolic links kept) at `dest`, nothing built, no .git."""
    for name in working_tree_files():
        source, target = REPO / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # a folder the commit had where the tree has a link now
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return dest


#: What a release commit writes under CHANGELOG.md's `## [Unreleased]`.
UNRELEASED = "## [Unreleased]\n"


def committed_clone(dest: Path, *, tag: str | None = None, release: str | None = None) -> str:
    """A `git clone` of this repository at `dest` whose HEAD is the working tree as it is
    (its edits committed in the clone), tagged `tag` if given; with `release`, that commit
    is the release as a maintainer makes it: CHANGELOG.md's Unreleased section becomes
    `## [release] - DATE` (the build's version: build_backend/gpuguard_release.py). The
    HEAD commit's hash."""
    done = subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(dest)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in git(dest, "ls-files", "-z").split("\0"):
        if name:  # the working tree's files replace the committed ones (deletions included)
            (dest / name).unlink(missing_ok=True)
    checkout_copy(dest)
    if release is not None:
        changelog = dest / "CHANGELOG.md"
        text = changelog.read_text()
        assert UNRELEASED in text
        changelog.write_text(text.replace(UNRELEASED, f"{UNRELEASED}\n## [{release}] - "
                                          "2099-01-01\n", 1))
    git(dest, "add", "--all")
    git(dest, "commit", "--quiet", "--allow-empty", "--no-verify",
        "-m", "the working tree under test")
    if tag is not None:
        git(dest, "tag", tag)
    return git(dest, "rev-parse", "HEAD")
