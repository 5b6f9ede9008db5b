"""Finding and importing AMD SMI: the PyPI `amdsmi` package is a ctypes wrapper with no
library inside. At import it loads libamd_smi.so from, in this order, $ROCM_HOME/lib (else
$ROCM_PATH/lib), the loader's path (LD_LIBRARY_PATH, /etc/ld.so.conf.d), the wrapper's own
folder, and $ROCM_PATH/lib or /opt/rocm/lib; then it binds every symbol it knows. Without a
library it raises KeyError, with an older one AttributeError (never ImportError), after
printing its complaint on stdout. So the probe looks for the library first, where the
wrapper would, and imports the wrapper only when one is there, with stdout kept clean."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from gpuguard.host.events.privilege import read_sets
from gpuguard.host.procfs import CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE

LIBRARY = "libamd_smi.so"
#: Where the package comes from, for a reason that says how to get it.
EXTRA = "pip install 'gpuguard[amd]'"


def candidates(environ: Mapping[str, str], package_dir: Path | None) -> list[str]:
    """The places amdsmi_wrapper.find_smi_library() tries, in its order (amdsmi 7.0.2)."""
    out = []
    rocm = environ.get("ROCM_HOME", environ.get("ROCM_PATH"))
    if rocm:
        out.append(os.path.join(rocm, "lib", LIBRARY))
    out.append(LIBRARY)  # the loader's search path
    if package_dir is not None:
        out.append(str(package_dir / LIBRARY))
    out.append(str(Path(environ.get("ROCM_PATH", "/opt/rocm")) / "lib" / LIBRARY))
    return out


def package_dir() -> Path | None:
    """The installed amdsmi package's folder, found without importing it; None: absent."""
    spec = importlib.util.find_spec("amdsmi")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_library(environ: Mapping[str, str] | None = None) -> str | None:
    """The first of candidates() the loader opens, or None."""
    environ = os.environ if environ is None else environ
    for place in candidates(environ, package_dir()):
        try:
            ctypes.CDLL(place)
        except OSError:
            continue
        return place
    return None


def load() -> ModuleType:
    """The amdsmi module, imported (once per process) with its prints kept off stdout (a
    console's --json is read from there). Raises what the wrapper raises."""
    with contextlib.redirect_stdout(io.StringIO()):
        import amdsmi
    return amdsmi


def why_not(exc: BaseException) -> str:
    """What an exception from `import amdsmi` means, in words."""
    if isinstance(exc, KeyError):
        return f"the amdsmi wrapper found no {LIBRARY}"
    if isinstance(exc, AttributeError):
        return f"{LIBRARY} is older than the amdsmi wrapper ({exc})"
    return f"importing amdsmi failed: {type(exc).__name__}: {exc}"


def probe() -> str | None:
    """Why the AMD back-end cannot run here (None: it can): no amdsmi package, no
    libamd_smi.so where the wrapper looks, or a wrapper that will not bind to it."""
    if package_dir() is None:
        return f"no AMD back-end: the amdsmi package is not installed ({EXTRA})"
    if find_library() is None:
        return (f"no AMD back-end: {LIBRARY} not found ($ROCM_HOME/lib, $ROCM_PATH/lib, the "
                "loader's path, /opt/rocm/lib)")
    try:
        load()
    except Exception as exc:  # KeyError, AttributeError: the wrapper's way of failing
        return f"no AMD back-end: {why_not(exc)}"
    return None


#: The groups ROCm asks a user to be in for /dev/kfd and /dev/dri/renderD*.
GPU_GROUPS = ("render", "video")


def privileges() -> list[str]:
    """What this process lacks to see every user's AMD GPU use (`gpuguard config check`);
    where there are no uids (Windows: AMD SMI is Linux's) nothing."""
    geteuid = getattr(os, "geteuid", None)
    if geteuid is None:
        return []
    import grp  # POSIX only, as the question is

    out = []
    if geteuid() != 0:
        out.append("not root: AMD SMI before ROCm's mid-2026 fix lists only this user's "
                   "processes, so other users' VRAM reads unattributed")
        names = set()
        for gid in os.getgroups():
            with contextlib.suppress(KeyError):
                names.add(grp.getgrgid(gid).gr_name)
        missing = [g for g in GPU_GROUPS if g not in names]
        if missing:
            out.append(f"not in the {' and '.join(missing)} group(s) ROCm asks for: "
                       "/dev/kfd and /dev/dri/renderD* may not open, and AMD SMI then sees no "
                       "GPU")
    sets = read_sets()  # capget(2): config check reads no /proc file
    caps = None if sets is None else sets.effective
    if caps is not None and not (caps >> CAP_SYS_PTRACE & 1 and (
            caps >> CAP_DAC_READ_SEARCH & 1 or caps >> CAP_DAC_OVERRIDE & 1)):
        out.append("AMD SMI reads engine time from other users' /proc/PID/fdinfo, and the KFD "
                   "check their /proc/PID/fd, which this process cannot read: their holders' "
                   "idleness reads unknown, and where /dev/kfd exists their listed pids are "
                   "unverified (no holder)")
    return out
