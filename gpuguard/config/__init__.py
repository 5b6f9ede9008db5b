"""The one YAML config file shared by exporter and remediator.

Validation is strict because a typo in a kill policy must never be silently
ignored: unknown keys, wrong types and bad regexes are errors that name the
file, the key and the problem. Both daemons validate the whole file, so each
section's schema is a shared module of this package (classify.py, remediate.py,
accounting.py for quotas:, audit: and accounting:), never a daemon's: the exporter reads the file
without importing the remediator, and neither daemon is imported back from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpuguard.base.validation import CONFIG_FILE, At, ConfigError, mapping, parse_yaml
from gpuguard.config.accounting import (
    AccountingSection,
    Audit,
    Quotas,
    parse_accounting,
    parse_audit,
    parse_quotas,
)
from gpuguard.config.classify import default_rules, parse_classify
from gpuguard.config.remediate import Remediate, default_remediate, parse_remediate
from gpuguard.host.backend import Defaults
from gpuguard.host.platform import PLATFORM
from gpuguard.orphans.rules_config import Rules


def platform_rules() -> Rules:
    """The `classify:` defaults of the platform this runs on (Windows' or Linux')."""
    return default_rules(PLATFORM.defaults)


def platform_remediate() -> Remediate:
    """The `remediate:` defaults of the platform this runs on (its paths differ)."""
    return default_remediate(PLATFORM.defaults)


@dataclass(frozen=True)
class Config:
    classify: Rules = field(default_factory=platform_rules)
    remediate: Remediate = field(default_factory=platform_remediate)
    quotas: Quotas = field(default_factory=Quotas)  # read by the exporter (and `status`)
    audit: Audit = field(default_factory=Audit)  # read by the exporter (and `status`)
    #: read by the exporter (and `status`, `node-check`): idle memory, unlisted holders
    accounting: AccountingSection = field(default_factory=AccountingSection)
    source: str = "<defaults>"


def parse_config(text: str, *, source: str = "<string>",
                 defaults: Defaults = PLATFORM.defaults) -> Config:
    """The config file's text, validated; `defaults`: the platform's `classify:` and
    `remediate:` defaults (patterns, adopters, paths) that fill in the keys it leaves
    out (the one this runs on, unless told)."""
    data = parse_yaml(text, source=source)
    got = mapping(At(CONFIG_FILE, source=source), data, {
        "classify": lambda at, v: parse_classify(at, v, defaults=defaults),
        "remediate": lambda at, v: parse_remediate(at, v, defaults=defaults),
        "quotas": parse_quotas, "audit": parse_audit, "accounting": parse_accounting})
    return Config(
        classify=got.get("classify", default_rules(defaults)),
        remediate=got.get("remediate", default_remediate(defaults)),
        quotas=got.get("quotas", Quotas()),
        audit=got.get("audit", Audit()),
        accounting=got.get("accounting", AccountingSection()),
        source=source,
    )


def load_config(path: str | Path | None) -> Config:
    """Load and validate `path`; None means the built-in defaults."""
    if path is None:
        return Config()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(path), "(file)", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "(file)", f"cannot read: {exc}") from None
    return parse_config(text, source=str(path))
