"""The classifier's settings (the config file's `classify:` section) and its defaults,
with the protect patterns compiled for RE2 and their matches cached."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from gpuguard.base.counters import COUNTERS

DEFAULT_PROTECT = (
    "jupyter",
    "ipykernel",
    "tmux",
    "screen",
    "code-server",  # also matches VS Code's ~/.vscode-server
    "cursor-server",
    "vscodium-server",
    "windsurf-server",
    "slurmstepd",
    "raylet",
    "containerd-shim",
)
#: Processes that adopt orphans (PID 1 aside): rule 6 trusts E1 under them as proof.
DEFAULT_ADOPTERS = ("systemd", "containerd-shim", "tini", "dumb-init", "docker-init")
#: Windows' defaults (gpuguard/host/windows/tree.py), which the config loader applies on
#: Windows where the config names none (the Windows back-end's `Defaults`).
#: Protect patterns match names and whole command lines, case-insensitively as every
#: protect pattern: notebooks, `nohup` (MSYS, Cygwin), VS Code, the shell, the services
#: (issue 30's six); then what DEFAULT_PROTECT guards on Linux, as Windows spells it:
#: kernels (`ipykernel_launcher`), the editors' own programs (`Code - Insiders.exe`,
#: `Cursor.exe`, `Windsurf.exe`, `VSCodium.exe`) and their remote servers on a Windows
#: host (`%USERPROFILE%\.vscode-server\...`, `.cursor-server`, `.windsurf-server`,
#: `.vscodium-server`), Ray's `raylet.exe`, and Windows containers' shims
#: (`containerd-shim-runhcs-v1.exe`). tmux, screen and slurmstepd have no Windows
#: counterpart (the terminal's own process, explorer.exe, is protected already).
WINDOWS_PROTECT = (
    "jupyter",
    "nohup",
    r"code\.exe",
    r"explorer\.exe",
    r"services\.exe",
    r"svchost\.exe",
    "ipykernel",
    r"code - insiders\.exe",
    r"cursor\.exe",
    r"windsurf\.exe",
    r"vscodium\.exe",
    "code-server",  # also matches VS Code's %USERPROFILE%\.vscode-server
    "cursor-server",
    "vscodium-server",
    "windsurf-server",
    "raylet",
    "containerd-shim",
)
#: Windows' adopters: processes whose parent is normally gone, the top of their chain and
#: never orphans (explorer.exe under a userinit.exe that exited; wininit.exe, csrss.exe and
#: winlogon.exe under a session's smss.exe that exited). Names, case-insensitive.
WINDOWS_ADOPTERS = ("explorer.exe", "wininit.exe", "csrss.exe", "winlogon.exe")
DEFAULT_MAX_DEPTH = 64
#: Keep and run registrations (gpuguard/host/marks.py): what a process cannot erase.
DEFAULT_MARKS_DIR = "/run/gpuguard/marks"
#: Where gpuguard keeps its files on Windows (no /run, /var or /etc there).
WINDOWS_DATA_DIR = "C:\\ProgramData\\gpuguard"
WINDOWS_MARKS_DIR = WINDOWS_DATA_DIR + "\\marks"
KEEP_MARK = "keep"
RUN_MARK = "run"
COMM_LEN = 15  # the kernel truncates comm to 15 bytes


class ProtectPatternError(ValueError):
    """A protect pattern the linear-time matcher (RE2) does not accept."""


#: Characters that stand for themselves in RE2 whatever follows them (no metacharacter,
#: no escape): a pattern of these alone is a plain word, matched without RE2.
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                   " -_/:,;=@%~!#&'\"<>`")


def _required_word(pattern: str) -> str:
    """A word every match of `pattern` contains (case aside), "" when none is known: the
    plain characters it starts with but the last, which what follows may make optional
    (`ab?`, `ab{0}`, and `ab(?i)?` too), and only where no `|` outside brackets and
    parentheses could match without them."""
    end = 0
    while end < len(pattern) and pattern[end] in _PLAIN:
        end += 1
    return pattern[: end - 1] if end > 1 and not _top_level_bar(pattern) else ""


def _top_level_bar(pattern: str) -> bool:
    """Whether an alternation may stand outside every group: True also where this scan
    cannot be sure (unbalanced; `\\Q` quoting, `[:class:]`, a `]` opening a bracket),
    which only leaves one more pattern to RE2."""
    if any(unsure in pattern for unsure in ("\\Q", "[:", "[]", "[^]")):
        return True
    depth, i, in_class = 0, 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                return True
        elif char == "|" and depth == 0:
            return True
        i += 1
    return depth != 0 or in_class


class Pattern:
    """One protect or suspect pattern, case-insensitive, in time linear in the text.

    Any user names their processes and chooses their arguments, so a backtracking
    engine (Python's `re`) would let one `aaaa...!` command line stall every scan on a
    pattern like `(a+)+$` (and `re` holds the GIL while it does): patterns run on RE2.
    RE2 and its C++ runtime are 2.8 MiB of a daemon's memory, so they load only where
    a pattern needs them: a plain word (`jupyter`, every default protect pattern) in an
    ASCII text is a substring test of the lower-cased text, which is what RE2 answers
    there; a pattern's required word (`stratum` of the default suspect pattern) absent
    from an ASCII text is no match, without RE2. Any other case is RE2's (a non-ASCII
    text too: RE2 folds the Kelvin sign to `k`, and `str.lower` does not fold `ſ`).
    RE2 compiles the pattern when it is first needed; `checked()` compiles it now, for
    the config reader, which refuses what RE2 refuses. Patterns are compiled one by
    one, so groups in one cannot change another.
    """

    __slots__ = ("text", "_plain", "_word", "_re2")

    def __init__(self, text: str) -> None:
        self.text = text
        self._plain = all(char in _PLAIN for char in text)
        self._word = (text if self._plain else _required_word(text)).lower()
        self._re2: Any = None

    def checked(self) -> Pattern:
        """This pattern, with RE2's verdict on it now if it needs RE2 (ProtectPatternError
        if RE2 refuses it)."""
        if not self._plain:
            self._compiled()
        return self

    def search(self, text: str) -> bool:
        """Whether the pattern matches anywhere in `text`."""
        if text.isascii():
            if self._word not in text.lower():
                return False
            if self._plain:
                return True
        return self._compiled().search(text) is not None

    def _compiled(self) -> Any:
        if self._re2 is None:
            self._re2 = _compile_re2(self.text)
        return self._re2


def _compile_re2(pattern: str) -> Any:
    import re2  # 2.8 MiB with libstdc++: only for patterns that need it (Pattern)

    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        message = exc.args[0] if exc.args else str(exc)
        if isinstance(message, bytes):
            message = message.decode("utf-8", "replace")
        raise ProtectPatternError(str(message)) from None


def compile_protect(pattern: str) -> Pattern:
    """One protect (or suspect) pattern, checked: ProtectPatternError where RE2 refuses it."""
    return Pattern(pattern).checked()


#: Texts up to this long (comms, short command lines) are cached by text; at 4,096
#: entries the cache holds at most 1 MiB of them, whatever users run (the suspect
#: patterns' cache, gpuguard/config/accounting.py, keeps to the same length).
CACHED_TEXT = 256


@functools.lru_cache(maxsize=4096)
def _protect_hit(pattern: Pattern, text: str) -> bool:
    """One protect pattern on one comm or short command line, cached by text."""
    return protect_search(pattern, text)


def protect_search(pattern: Pattern, text: str) -> bool:
    """One protect pattern on one text (linear time), its time counted."""
    with COUNTERS.track("protect_match"):
        return pattern.search(text)


@dataclass(frozen=True)
class Rules:
    """The `classify:` section of the config file."""

    protect: tuple[str, ...] = DEFAULT_PROTECT
    adopters: tuple[str, ...] = DEFAULT_ADOPTERS
    max_depth: int = DEFAULT_MAX_DEPTH
    marks_dir: str = DEFAULT_MARKS_DIR
    _protect: tuple[Pattern, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_protect", tuple(compile_protect(p) for p in self.protect))

    def protects(self, text: str) -> bool:
        if len(text) > CACHED_TEXT:  # a command line: cached per process (cmdline_protect)
            return any(protect_search(pattern, text) for pattern in self._protect)
        return any(_protect_hit(pattern, text) for pattern in self._protect)

    def is_adopter(self, comm: str) -> bool:
        """A process named like a child subreaper or init (tini, systemd, ...): it adopts
        orphans (the remediator's killer is the `Reaper`; this is not it)."""
        return any(comm == name[:COMM_LEN] for name in self.adopters)

