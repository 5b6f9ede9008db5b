"""The alert rules, the Grafana dashboard, the systemd units and the example config,
shipped inside the wheel as package data.

A user who installed only the wheel has no checkout: `gpuguard assets` lists these files,
prints one, or writes them all into a folder, in the same layout as the source tree. The
rules and the dashboard ship rendered from the monitoring mixin (mixin/, also shipped)
with its default _config: no runbook URLs, the jobs gpuguard and gpuguard-remediator;
with the user's runbook site and job names they are rendered again from the same source
(the `mixin` extra's jsonnet package), and their unit tests rewritten to match. The units start
the console scripts of /opt/gpuguard/venv (docs/install.md); render_unit writes a copy
that starts those of another folder.
"""

from __future__ import annotations

import copy
import functools
import json
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gpuguard import monitoring_mixin

#: Every shipped file, by its path in the source tree (and under the written folder).
ASSETS: tuple[str, ...] = (
    "alerts/rules.yml",
    "alerts/rules.test.yml",
    "alerts/joins.yml",
    "alerts/joins.test.yml",
    "alerts/alertmanager.yml",
    "alerts/alertmanager-routed.yml",
    "grafana/dashboard.json",
    "grafana/provisioning/dashboards/gpuguard.yml",
    "grafana/provisioning/datasources/prometheus.yml",
    "deploy/systemd/gpuguard-exporter.service",
    "deploy/systemd/gpuguard-exporter.service.d/no-capabilities.conf",
    "deploy/systemd/gpuguard-remediator.service",
    "deploy/systemd/gpuguard.sysusers.conf",
    "deploy/systemd/gpuguard.yml",
    "deploy/systemd/gpuguard-lab.yml",
    *monitoring_mixin.SOURCES,
)
RULES = "alerts/rules.yml"
RULES_TEST = "alerts/rules.test.yml"
JOINS_TEST = "alerts/joins.test.yml"
#: The scrape jobs the shipped rules select: the exporters' and the remediators'.
EXPORTER_JOB = "gpuguard"
REMEDIATOR_JOB = "gpuguard-remediator"
#: The systemd units, and the folder whose console scripts their ExecStart= names.
UNITS: tuple[str, ...] = ("deploy/systemd/gpuguard-exporter.service",
                          "deploy/systemd/gpuguard-remediator.service")
UNIT_BIN_DIR = "/opt/gpuguard/venv/bin"

_JOB_SELECTOR = re.compile(r'(?<![\w.])job="(gpuguard|gpuguard-remediator)"')
_EXP_JOB_LABEL = re.compile(r"^(\s*)job: (gpuguard|gpuguard-remediator)[ \t]*$", re.MULTILINE)
_ALERTNAME_LINE = re.compile(r"^\s*(?:- )?alertname:\s*(\S+)\s*$")
_EXP_ANNOTATIONS_LINE = re.compile(r"^(\s*)exp_annotations:\s*$")
# RFC 3986 characters less "?" and "#": no spaces, quotes, braces (Go templates) or YAML
# comment starts, so the URL stays one plain scalar and reaches the alert verbatim.
_URL_TEXT = re.compile(r"[A-Za-z0-9\-._~:/@!$&'()*+,;=%\[\]]+")
# A folder name systemd takes verbatim in ExecStart=: none of its specifiers (%), variables
# ($), quoting or escapes, and no whitespace.
_BIN_DIR_TEXT = re.compile(r"(/[A-Za-z0-9._+\-@:,~]+)+")
_EXEC_START = re.compile(r"^ExecStart=(\S+)/(gpuguard-[a-z]+)( |$)", re.MULTILINE)


class AssetError(Exception):
    """An unknown asset name, or a write that would overwrite a different file."""


@dataclass(frozen=True)
class _Rendering:
    """Validated settings: the runbook base (no trailing slash) and old -> new job names."""

    base: str | None = None
    jobs: dict[str, str] = field(default_factory=dict)

    def url(self, alertname: str) -> str:
        return f"{self.base}/{alertname.lower()}"

    def sub_jobs(self, text: str) -> str:
        return _JOB_SELECTOR.sub(lambda m: f'job="{self.jobs.get(m[1], m[1])}"', text)


def _check_base(base: str) -> str:
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"runbook URL base {base!r} is not an absolute http(s) URL "
                         "(e.g. https://runbooks.example.com/gpuguard)")
    if "?" in base or "#" in base:
        raise ValueError(f"runbook URL base {base!r} has a query or fragment: the alert's "
                         "name is appended to it as a last path segment")
    if not _URL_TEXT.fullmatch(base):
        raise ValueError(f"runbook URL base {base!r} holds characters a URL does not "
                         "(spaces, quotes, braces): percent-encode them")
    return base.rstrip("/")


def _check_job(value: str, what: str) -> str:
    if not value:
        raise ValueError(f"{what} must not be empty")
    bad = next((c for c in value if c in '"\\' or not c.isprintable()), None)
    if bad is not None:
        raise ValueError(f"{what} {value!r} contains {bad!r}: a job name in a PromQL "
                         "selector cannot hold a quote, a backslash or a control character")
    return value


def _rendering(runbook_url_base: str | None, job: str | None,
               remediator_job: str | None) -> _Rendering:
    """Validate the settings. remediator_job defaults to JOB-remediator when job is given;
    without job, only the remediators' selectors change (if remediator_job is given)."""
    base = None if runbook_url_base is None else _check_base(runbook_url_base)
    jobs: dict[str, str] = {}
    if job is not None:
        jobs[EXPORTER_JOB] = _check_job(job, "job")
        jobs[REMEDIATOR_JOB] = f"{job}-remediator"
    if remediator_job is not None:
        jobs[REMEDIATOR_JOB] = _check_job(remediator_job, "remediator job")
    if jobs.get(EXPORTER_JOB, EXPORTER_JOB) == jobs.get(REMEDIATOR_JOB, REMEDIATOR_JOB):
        raise ValueError(f"job and remediator job are both {jobs.get(REMEDIATOR_JOB)!r}: "
                         "the exporters' and the remediators' targets need their own jobs")
    return _Rendering(base, jobs)


def _insert_first_keys(text: str, owner: re.Pattern[str], block: re.Pattern[str],
                       line_for: Callable[[str], str]) -> str:
    """Before the first key under each `block` line, insert line_for(the owner's name),
    the owner being the last line matching `owner` above it (the rule, the test case)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    name: str | None = None
    for i, line in enumerate(lines):
        out.append(line)
        if found := owner.match(line):
            name = found[1]
            continue
        if not (opened := block.match(line)):
            continue
        following = (n for n in lines[i + 1:] if n.strip() and not n.lstrip().startswith("#"))
        first = next(following, "")
        indent = first[:len(first) - len(first.lstrip())]
        if name is None or len(indent) <= len(opened[1]):
            raise ValueError(f"line {i + 1}: {line.strip()} has no alert name above it or "
                             "no keys below it")
        out.append(f"{indent}{line_for(name)}\n")
    return "".join(out)


def _sub_strings(node: Any, sub: Callable[[str], str]) -> Any:
    """The YAML document with sub applied to every string value (keys kept)."""
    if isinstance(node, dict):
        return {key: _sub_strings(value, sub) for key, value in node.items()}
    if isinstance(node, list):
        return [_sub_strings(value, sub) for value in node]
    return sub(node) if isinstance(node, str) else node


def _parse(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{what}: not YAML: {exc}") from None


def _same_meaning(rendered: str, expected: Any, what: str) -> None:
    if _parse(rendered, what) != expected:
        raise ValueError(f"{what}: rendering changed more than the runbook URLs and job "
                         "selectors (a job name YAML cannot hold as written, such as one "
                         "with ' #' or a quote?)")


def _yaml_scalar(value: str) -> str:
    """value as a YAML scalar: plain where that reads back as the same string."""
    if _parse(f"k: {value}", "job name") == {"k": value}:
        return value
    return json.dumps(value)  # JSON strings are YAML double-quoted scalars


def render_rules_test(text: str, *, runbook_url_base: str | None = None,
                      job: str | None = None, remediator_job: str | None = None) -> str:
    """The promtool unit tests `text` rendered like render_rules renders the rules, so the
    written pair still passes `promtool test rules`: selectors and expected job labels
    renamed, each expected alert's annotations given its runbook_url."""
    how = _rendering(runbook_url_base, job, remediator_job)
    original = _parse(text, "rule tests")
    expected = _sub_strings(copy.deepcopy(original), how.sub_jobs)
    out = how.sub_jobs(text)
    out = _EXP_JOB_LABEL.sub(
        lambda m: f"{m[1]}job: {_yaml_scalar(how.jobs.get(m[2], m[2]))}", out)
    for test in expected.get("tests", []) if isinstance(expected, dict) else []:
        for case in test.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                labels = alert.get("exp_labels") or {}
                if labels.get("job") in how.jobs:
                    labels["job"] = how.jobs[labels["job"]]
                if how.base is not None and "exp_annotations" in alert:
                    alert["exp_annotations"] = {"runbook_url": how.url(case["alertname"]),
                                                **(alert["exp_annotations"] or {})}
    if how.base is not None:
        out = _insert_first_keys(out, _ALERTNAME_LINE, _EXP_ANNOTATIONS_LINE,
                                 lambda name: f"runbook_url: {how.url(name)}")
    _same_meaning(out, expected, "rendered rule tests")
    return out


def render_unit(text: str, bin_dir: str) -> str:
    """A systemd unit whose ExecStart= starts the console script of the same name in
    bin_dir (an absolute folder) instead of UNIT_BIN_DIR. ValueError on a bin_dir systemd
    would not take verbatim, or a unit whose ExecStart= names no gpuguard script."""
    folder = bin_dir.rstrip("/") or "/"
    if not _BIN_DIR_TEXT.fullmatch(folder) or posixpath.normpath(folder) != folder:
        raise ValueError(f"bin dir {bin_dir!r} is not an absolute, normalised folder of "
                         "plain characters (no spaces, quotes, %, $ or backslashes)")
    found = _EXEC_START.findall(text)
    if len(found) != 1:
        raise ValueError(f"unit: expected one ExecStart= of a gpuguard script, found "
                         f"{len(found)}")
    return _EXEC_START.sub(lambda m: f"ExecStart={folder}/{m[2]}{m[3]}", text)


def read(name: str) -> bytes:
    """The shipped bytes of one asset (a name from ASSETS)."""
    if name not in ASSETS:
        raise AssetError(f"no asset {name!r}; one of: {', '.join(ASSETS)}")
    return files("gpuguard").joinpath(name).read_bytes()


@functools.lru_cache(maxsize=4)
def _mixin_files(config: tuple[tuple[str, str], ...]) -> Mapping[str, bytes]:
    """The mixin's rendering for one config (about 2 s of jsonnet: write_all asks three
    times)."""
    return monitoring_mixin.render(dict(config)).files


def _mixin_config(how: _Rendering) -> dict[str, str]:
    """The mixin's _config keys for the settings given (the others keep their defaults)."""
    config = {}
    if EXPORTER_JOB in how.jobs:
        config["exporterSelector"] = f'job="{how.jobs[EXPORTER_JOB]}"'
    if REMEDIATOR_JOB in how.jobs:
        config["remediatorSelector"] = f'job="{how.jobs[REMEDIATOR_JOB]}"'
    if how.base is not None:
        config["runbookURLPattern"] = how.base.replace("%", "%%") + "/%s"
    return config


def render(name: str, *, runbook_url_base: str | None = None, job: str | None = None,
           remediator_job: str | None = None, bin_dir: str | None = None) -> bytes:
    """One asset as written: the rules, recording rules and dashboard rendered from the
    monitoring mixin with the settings (gpuguard.monitoring_mixin), their unit tests
    rendered to match (see render_rules_test), the units with bin_dir (see render_unit),
    every other file as shipped. ValueError on bad settings; MixinUnavailable when a
    setting needs the mixin and the jsonnet package is not installed."""
    data = read(name)
    if name in UNITS:
        if bin_dir is None:
            return data
        return render_unit(data.decode("utf-8"), bin_dir).encode("utf-8")
    if runbook_url_base is None and job is None and remediator_job is None:
        return data
    how = _rendering(runbook_url_base, job, remediator_job)
    if name in monitoring_mixin.RENDERED:
        if not monitoring_mixin.available():
            raise monitoring_mixin.MixinUnavailable(
                f"--job, --remediator-job and --runbook-url-base render the rules and "
                f"dashboard from the monitoring mixin, which needs {monitoring_mixin.EXTRA_HINT}"
                "; without them the shipped defaults are written")
        return _mixin_files(tuple(sorted(_mixin_config(how).items())))[name]
    if name in (RULES_TEST, JOINS_TEST):
        return render_rules_test(data.decode("utf-8"), runbook_url_base=runbook_url_base,
                                 job=job, remediator_job=remediator_job).encode("utf-8")
    return data


def _planned(dest: Path, **rendering: str | None) -> list[tuple[Path, bytes]]:
    """(path under dest, content) of every asset rendered with the settings; an existing
    path that is not a file stops it."""
    planned = [(dest / name, render(name, **rendering)) for name in ASSETS]
    blocked = [path for path, _ in planned if path.exists() and not path.is_file()]
    if blocked:
        raise AssetError(f"{blocked[0]} exists and is not a file")
    return planned


@dataclass(frozen=True)
class Difference:
    """One asset whose file under a folder is not what would be written: `old` is the
    file's content (None: there is no such file), `new` the asset's."""

    name: str
    old: bytes | None
    new: bytes


def differences(dest: Path, *, runbook_url_base: str | None = None, job: str | None = None,
                remediator_job: str | None = None,
                bin_dir: str | None = None) -> list[Difference]:
    """What `write_all` with force would change under dest, in ASSETS order (after an
    upgrade: what the new version ships that the installed copies lack). Reads only."""
    planned = _planned(dest, runbook_url_base=runbook_url_base, job=job,
                       remediator_job=remediator_job, bin_dir=bin_dir)
    out = []
    for name, (path, data) in zip(ASSETS, planned, strict=True):
        old = path.read_bytes() if path.is_file() else None
        if old != data:
            out.append(Difference(name, old, data))
    return out


def write_all(dest: Path, *, force: bool = False, runbook_url_base: str | None = None,
              job: str | None = None, remediator_job: str | None = None,
              bin_dir: str | None = None) -> list[Path]:
    """Write every asset under dest, rendered with the settings (see render); return the
    paths written.

    Nothing is lost: unless force, an existing file with other content stops the write
    before anything is written (an identical one is left as it is). Bad settings raise
    ValueError before anything is written.
    """
    planned = _planned(dest, runbook_url_base=runbook_url_base, job=job,
                       remediator_job=remediator_job, bin_dir=bin_dir)
    clash = [path for path, data in planned
             if path.is_file() and path.read_bytes() != data]
    if clash and not force:
        raise AssetError(f"{clash[0]} exists with other content ({len(clash)} such file(s)); "
                         "see how with --diff, then choose an empty folder or pass --force "
                         "to overwrite")
    written = []
    for path, data in planned:
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written
