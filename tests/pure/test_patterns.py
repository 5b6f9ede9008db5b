"""Protect and suspect patterns (gpuguard/orphans/rules_config.py, Pattern): the answer is
RE2's wherever RE2 is skipped, and RE2 stays unloaded for the defaults.

RE2 itself is the oracle here: each pattern is also compiled with RE2's own options and
both must agree on every text. A Pattern that trusted a word a match does not need
would miss a protect pattern, and so leave a protected process reapable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import re2
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.config.accounting import DEFAULT_SUSPECT_PATTERNS
from gpuguard.orphans.rules_config import (
    DEFAULT_PROTECT,
    WINDOWS_PROTECT,
    Pattern,
    ProtectPatternError,
    compile_protect,
)


def re2_search(pattern: str, text: str) -> bool | None:
    """RE2's answer, case-insensitive as every protect pattern; None if RE2 refuses it."""
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False
    try:
        return re2.compile(pattern, options).search(text) is not None
    except re2.error:
        return None


#: Pieces patterns are built from: words, RE2's syntax, and what this module's scan of
#: alternations must not be fooled by (quoting, classes with ] or [: in them, escapes).
PIECES = ["jupyter", "Stratum", "tcp", "a", "K", "s", "-", "/", " ", "|", "(", ")", "(?:",
          "(?i)", "(?-i)", "[", "]", "[12]", "[^a]", "[]a]", "[[:alpha:]]", "[(]", "[)]",
          "[|]", "?", "*", "+", "{2}", "{0}", "{1,3}", ".", "^", "$", "\\", "\\|", "\\(",
          "\\)", "\\Q", "\\E", "\\+", "\\.", "\\d", "\\b", "\\pL", "ſ", "\u212a",
          "(?s)", "(?U)", "(?m)", "(?i:", "(?P<n>", "{,2}", "{2,}", "??", "\\x00", "\x00",
          "\\x{61}", "\\A", "\\z", "\\C", "#", "<", "!", "="]
#: Texts: the pieces again (as literal characters), and the case and Unicode folds RE2
#: makes (the Kelvin sign is a k, the long s an s).
TEXT_PIECES = ["jupyter", "JUPYTER", "stratum", "stratum1+tcp://", "Stratum2+TLS://", "a",
               "k", "K", "\u212a", "s", "ſ", "x", " ", "-", "/", "|", "(", ")", "[", "]",
               ".", "+", "1", "2", "é", "\x00", "\n", "#"]

patterns = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)
texts = st.lists(st.sampled_from(TEXT_PIECES), max_size=8).map("".join)


@settings(max_examples=3000, deadline=None)
@given(patterns, st.lists(texts, min_size=1, max_size=6))
def test_a_pattern_answers_what_re2_answers(pattern: str, some: list[str]) -> None:
    try:
        matcher = compile_protect(pattern)
    except ProtectPatternError:
        assert re2_search(pattern, "") is None  # refused exactly where RE2 refuses
        return
    for text in some:
        assert matcher.search(text) == re2_search(pattern, text), (pattern, text)


@pytest.mark.parametrize("pattern, text, expected", [
    ("jupyter", "/usr/bin/JUPYTER-lab", True),
    ("code-server", "node /home/u/.vscode/bin/x", False),
    ("code-server", "/usr/lib/code-server/lib/node", True),
    ("tmux", "tmu", False),
    ("kernel", "\u212aernel", True),  # RE2 folds the Kelvin sign: a non-ASCII text is RE2's
    (r"stratum[12]?\+(tcp|ssl|tls)://", "xmrig -o STRATUM2+tls://pool:443", True),
    (r"stratum[12]?\+(tcp|ssl|tls)://", "stratum+udp://", False),
    ("stratum|xmrig", "xmrig", True),  # an alternation: "stratum" is not required
    ("abc?", "ab", True),  # a quantified last letter is not required
    ("ab(?i)?", "a", True),  # nor one before a flag group: the ? is the b's
    (r"ab\Q(\E|x\Q)\E", "ab(|x)", True),  # quoting: left to RE2
    ("ab[[:alpha:](]|x[[:alpha:])]", "xa", True),  # a bracket's ( is no group
    ("", "python train.py", True),  # the empty pattern matches everything, as RE2's
    ("ab(?i)(?i)?", "a", True),  # two flag groups: the ? is still the b's
    ("ab(?-i)c", "ABc", True),  # (?-i) after the word: the word stays case-blind
    ("ab(?-i)c", "ABC", False),
    ("tmux{0}", "tmu", True),
    ("tmux*?", "tmu", True),
    ("jupyter", "x\x00JUPYTER", True),  # a NUL is an ASCII character like another
    ("k", "\u212a", True),  # a plain word on a non-ASCII text is RE2's: it folds these
    ("s", "\u017f", True),
])
def test_words_and_required_words(pattern: str, text: str, expected: bool) -> None:
    assert compile_protect(pattern).search(text) is expected
    assert re2_search(pattern, text) is expected


@pytest.mark.parametrize("pattern", [*DEFAULT_PROTECT, *WINDOWS_PROTECT,
                                     *DEFAULT_SUSPECT_PATTERNS])
def test_every_shipped_default_is_a_pattern_re2_accepts(pattern: str) -> None:
    # Audit() does not check its patterns (the config reader checks a file's): the
    # defaults are checked here instead.
    compile_protect(pattern)


def test_a_bad_pattern_is_refused_when_checked_and_when_first_needed() -> None:
    with pytest.raises(ProtectPatternError, match="invalid"):
        compile_protect("(a)\\1")
    lazy = Pattern("(a)\\1")  # unchecked: RE2 refuses it on first use, never matches
    with pytest.raises(ProtectPatternError):
        lazy.search("aa")


def test_the_exporter_loads_no_re2_web_config_or_windows_table_for_the_defaults() -> None:
    """2.8 MiB (RE2 and libstdc++), 0.4 MiB and 0.15 MiB of the exporter's memory
    (benchmarks/RESULTS.md, nvitop_footprint): its entry module, its config with every
    default, and the defaults' patterns run on plain and on miner-like command lines."""
    script = textwrap.dedent("""
        import sys
        import gpuguard.exporter.cli
        from gpuguard.config import load_config
        config = load_config(None)
        for text in ("python train.py", "jupyter-lab", "xmrig --donate-level 1"):
            config.classify.protects(text)
            config.audit.suspect(text.split()[0], text)
        heavy = {"re2", "yaml", "bcrypt", "asyncio", "gpuguard.web.webconfig",
                 "gpuguard.web.webauth", "gpuguard.host.windows.processes",
                 "gpuguard.remediator"}
        print(sorted(heavy & set(sys.modules)))
        config.audit.suspect("x", "x -o stratum+tcp://pool:3333")  # the required word
        print("re2" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1] == "True"  # the default suspect pattern still runs on RE2 when it may match
