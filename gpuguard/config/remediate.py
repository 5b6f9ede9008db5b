"""The `remediate:` section of the config file: what the remediator may kill, and how.

The kill policy's schema and its reader. Strict, because a typo in a kill policy must
never be silently ignored: unknown keys and wrong types are errors naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gpuguard.base.compat import StrEnum
from gpuguard.base.validation import (
    At,
    boolean,
    choice,
    choice_list,
    duration,
    integer,
    mapping,
    number,
    of_type,
    string,
    string_list,
)
from gpuguard.host.backend import Defaults
from gpuguard.orphans.vocabulary import ORPHAN_REASONS as VOCABULARY_ORPHAN_REASONS
from gpuguard.orphans.vocabulary import Reason


class Mode(StrEnum):
    DRY_RUN = "dry-run"  # everything a reap does but the signals
    ENFORCE = "enforce"


#: The orphan reasons (classify rule 6) `remediate.reasons` may name, in the order its
#: errors list them: the launcher killed by a signal, gone where no listener runs, exited
#: by itself, gone with its exit not recorded by the listener that runs; or only a parent
#: in between died; or the holder's own session lives under a process whose launcher is gone;
#: then Windows' (gpuguard/host/windows/tree.py): the parent pid is in no process table, or
#: names a later process. A config on Linux may name those two: they never occur there.
#: The default (Remediate.reasons) names neither: Windows cannot say how a launcher went.
#: Reason declares them in this order (gpuguard.orphans.vocabulary.ORPHAN_REASONS).
ORPHAN_REASONS = VOCABULARY_ORPHAN_REASONS

#: A `remediate.users` entry naming a uid, not a user name pattern: `uid:1001`.
UID_RULE = "uid:"
#: The largest uid (uid_t is 32 bits; 4294967295, (uid_t)-1, means "no uid").
MAX_UID = 2**32 - 2


@dataclass(frozen=True)
class UserFilter:
    """`remediate.users`: glob patterns on user names and `uid:N` rules (policy.user_refusal)."""

    allow: tuple[str, ...] = ("*",)
    deny: tuple[str, ...] = ("root",)


def uid_rule(entry: str) -> int | None:
    """The uid a `uid:N` entry names; None for a user name pattern."""
    digits = entry.removeprefix(UID_RULE)
    if digits == entry or not (digits.isascii() and digits.isdigit()) or len(digits) > 10:
        return None
    return int(digits)


@dataclass(frozen=True)
class RateLimit:
    max_reaps: int = 5
    per_seconds: float = 3600.0
    #: The most reaps of one owner's trees in the same window; None: half of max_reaps,
    #: rounded up, so one user's orphans never spend every other user's budget.
    per_user: int | None = None

    @property
    def user_share(self) -> int:
        """The per-user share in force (per_user, or its default)."""
        return self.per_user if self.per_user is not None else -(-self.max_reaps // 2)


@dataclass(frozen=True)
class AlertmanagerConfig:
    """The `remediate.alertmanager:` section: where to double-check alerts before a reap.

    Several URLs are the peers of one HA cluster, asked in order until one answers
    (they share silences, and Prometheus sends every alert to each of them).
    """

    url: tuple[str, ...]
    credentials_file: str | None = None  # bearer token, re-read when it changes
    timeout_seconds: float = 3.0  # per request; one confirmation takes at most this * len(url)
    pull: bool = False  # also poll Alertmanager for this host's alerts, not only the webhook
    pull_interval_seconds: float = 15.0
    ca_file: str | None = None  # https: trust only this CA (a private one), not the system's
    # credentials_file over http:// sends the token in clear, to whoever holds the port.
    insecure_credentials_over_http: bool = False

    def plain_http(self) -> tuple[str, ...]:
        """The URLs a request would go to in clear."""
        return tuple(u for u in self.url if u.lower().startswith("http://"))

    def token_in_clear(self) -> str | None:
        """Why this section's token would go out in clear and is not allowed to, or None.

        A port on 127.0.0.1 is no proof of who answers: while Alertmanager is not
        listening (a restart, a crash, before it starts) any local user can bind it and
        receive `Authorization: Bearer ...` on every request, then answer the kill-time
        confirmation as she likes. On any other host the path is open to the network.
        """
        plain = self.plain_http()
        if self.credentials_file is None or not plain or self.insecure_credentials_over_http:
            return None
        return (f"would be sent in clear to {', '.join(plain)}: whoever holds that port (any "
                "local user who binds it while Alertmanager is not listening, for one) gets "
                "the token and can answer the confirmations; use https:// (ca_file for a "
                "private CA), or set insecure_credentials_over_http: true")


@dataclass(frozen=True)
class BasicAuth:
    """`remediate.prometheus.basic_auth`: what Prometheus's own web config checks."""

    username: str
    password_file: str  # private, re-read when it changes, like credentials_file


@dataclass(frozen=True)
class PrometheusConfig:
    """The `remediate.prometheus:` section: poll Prometheus's ALERTS series for this host's
    firing alerts instead of Alertmanager (pull mode whose cost follows what it finds);
    the kill-time confirmation still asks `remediate.alertmanager`, which it requires.
    Several URLs are the peers of an HA pair (each evaluates the same rules)."""

    url: tuple[str, ...]
    credentials_file: str | None = None  # bearer token (a proxy, a query frontend)
    basic_auth: BasicAuth | None = None  # or a user and password (Prometheus's web config)
    timeout_seconds: float = 3.0
    pull_interval_seconds: float = 15.0
    ca_file: str | None = None
    insecure_credentials_over_http: bool = False

    def secret_in_clear(self) -> str | None:
        """Why this section's secret would go out in clear and is not allowed to, or None
        (AlertmanagerConfig.token_in_clear says why a port on 127.0.0.1 is no excuse)."""
        plain = tuple(u for u in self.url if u.lower().startswith("http://"))
        secret = self.credentials_file is not None or self.basic_auth is not None
        if not secret or not plain or self.insecure_credentials_over_http:
            return None
        return (f"credentials would be sent in clear to {', '.join(plain)}: whoever holds "
                "that port gets them and can answer the polls; use https:// (ca_file for a "
                "private CA), or set insecure_credentials_over_http: true")


@dataclass(frozen=True)
class Remediate:
    """The `remediate:` section: what the remediator may kill, and how."""

    mode: str = Mode.DRY_RUN  # a Mode; its plain string is accepted too
    alerts: tuple[str, ...] = ("GPUOrphanTree",)
    reasons: tuple[Reason, ...] = (Reason.LAUNCHER_KILLED,)
    min_age_seconds: float = 300.0
    #: Every holder idle (no SM use, as the remediator's own IdleWatch saw) this long, or
    #: no reap; 0 is off. Off by default: docs/configuration.md says why.
    require_idle_seconds: float = 0.0
    #: Orphan reasons allowed only for a tree idle this long (seconds, > 0), each its own:
    #: `launcher-exited` may be a job left on purpose, and a job still computing is one
    #: someone may want finished; an idle one is memory nobody uses (the "lab" preset).
    idle_reasons: tuple[tuple[Reason, float], ...] = ()
    users: UserFilter = field(default_factory=UserFilter)
    rate_limit: RateLimit = field(default_factory=RateLimit)
    term_timeout_seconds: float = 10.0
    allow_root_owned: bool = False
    allow_without_pidfd: bool = False
    worker_timeout_seconds: float = 60.0
    max_pending: int = 256
    #: The most pending trees of one owner (the alert's `user` label); None: half of
    #: max_pending, rounded up.
    max_pending_per_user: int | None = None
    state_dir: str = "/var/lib/gpuguard"
    audit_log: str = "/var/log/gpuguard/audit.jsonl"
    alertmanager: AlertmanagerConfig | None = None
    prometheus: PrometheusConfig | None = None

    @property
    def allowed_reasons(self) -> tuple[Reason, ...]:
        """Every reason a reap may rest on: `reasons`, then those `idle_reasons` adds."""
        return self.reasons + tuple(r for r, _ in self.idle_reasons if r not in self.reasons)

    def rederivable(self, checked: float, decided: str = "") -> tuple[Reason, ...]:
        """The orphan reasons a verdict derived again at kill time may carry when the
        decision checked `checked` seconds of idleness (the worker: its decision's
        `idle_checked`; a one-read manual reap: 0): the allowed ones whose idle
        requirement is no stricter, and the allowed reason `decided` on itself (the
        same verdict as decided). A tree decided as launcher-killed (no idle
        requirement) that reads session-ended under freeze, where `idle_reasons` asks
        session-ended for 10 idle minutes nobody checked, is not killed on the other
        reason's evidence."""
        return tuple(r for r in self.allowed_reasons
                     if r == decided or self.idle_requirement(r)[0] <= checked)

    def idle_requirement(self, reason: str) -> tuple[float, str]:
        """How long a tree of this reason must be idle, and the key that says so: the
        longer of `require_idle_seconds` and the reason's `idle_reasons` entry (0: none).
        A reason named in both `reasons` and `idle_reasons` keeps its idle requirement."""
        own = next((seconds for r, seconds in self.idle_reasons if r == reason), 0.0)
        if own > self.require_idle_seconds:
            return own, f"remediate.idle_reasons.{reason}"
        return self.require_idle_seconds, "remediate.require_idle_seconds"

    @property
    def idle_watch_seconds(self) -> float:
        """The shortest idle requirement in force (0: none, and no watch is kept): the
        remediator's IdleWatch reads often enough for it."""
        asked = [s for s in (self.require_idle_seconds, *(s for _, s in self.idle_reasons))
                 if s > 0]
        return min(asked, default=0.0)

    @property
    def pending_share(self) -> int:
        """The per-user share of the pending queue in force."""
        return (self.max_pending_per_user if self.max_pending_per_user is not None
                else -(-self.max_pending // 2))


def default_paths(defaults: Defaults) -> dict[str, Any]:
    """The `remediate:` path defaults of a platform (`Platform.defaults`: Linux's are
    Remediate's own, Windows' lie under C:\\ProgramData\\gpuguard). The loader passes
    gpuguard.host.platform.PLATFORM's; this module never asks which platform it runs on."""
    return {"state_dir": defaults.state_dir, "audit_log": defaults.audit_log}


def default_remediate(defaults: Defaults) -> Remediate:
    """The `remediate:` section a config leaves out, on a platform."""
    return Remediate(**default_paths(defaults))


def _user_entries(at: At, value: Any) -> tuple[str, ...]:
    """User name patterns and `uid:N` rules; a bare number is neither, and says so."""
    for i, item in enumerate(value if isinstance(value, list) else ()):
        if isinstance(item, int) and not isinstance(item, bool):
            raise at.item(i).error(f"{item} is a number: write \"uid:{item}\" to name a uid "
                                   "(user names are strings)")
    entries = string_list(at, value)
    for i, entry in enumerate(entries):
        if entry.startswith(UID_RULE):
            uid = uid_rule(entry)
            if uid is None or uid > MAX_UID:
                raise at.item(i).error(f"{entry!r} is not a uid rule: write uid: and a decimal "
                                       f"uid from 0 to {MAX_UID}, e.g. uid:1001")
        elif entry.isascii() and entry.isdigit():
            raise at.item(i).error(f"{entry!r} is a number, which no user name is: write "
                                   f"\"uid:{entry}\" to name a uid")
        elif not entry:
            raise at.item(i).error("an empty pattern matches no user")
    return entries


def _users(at: At, value: Any) -> UserFilter:
    return UserFilter(**mapping(at, value, {"allow": _user_entries, "deny": _user_entries}))


def _share(at: At, value: Any) -> int | None:
    """A per-user share: a count, or null for the default (half, rounded up)."""
    return None if value is None else integer(at, value, minimum=1)


def _rate_limit(at: At, value: Any) -> RateLimit:
    return RateLimit(**mapping(at, value, {
        "max_reaps": lambda at, v: integer(at, v, minimum=0),
        "per_seconds": lambda at, v: number(at, v, minimum=1),
        "per_user": _share,
    }))


def _idle_reasons(at: At, value: Any) -> tuple[tuple[Reason, float], ...]:
    """`{reason: duration}`: each an orphan reason, each a time above 0 (seconds or `1h`)."""
    if value is None:
        return ()
    out = []
    for name, raw in of_type(at, value, dict).items():
        if name not in ORPHAN_REASONS:
            raise at.child(name).error(f"not an orphan reason (orphan reasons: "
                                       f"{', '.join(ORPHAN_REASONS)})")
        out.append((choice(at, name, ORPHAN_REASONS), duration(at.child(name), raw)))
    return tuple(out)


def _alertmanager_url(at: At, value: Any) -> str:
    text = string(at, value, non_empty=True)
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise at.error(f"not a valid URL {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise at.error(f"must be an http:// or https:// URL with a host, got {text!r}")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise at.error(f"must not contain spaces or control characters: {text!r}")
    if parts.query or parts.fragment:
        raise at.error(f"must not have a query or fragment, got {text!r}")
    if parts.username is not None or parts.password is not None:
        raise at.error("must not carry credentials (use credentials_file)")
    return text


def _alertmanager_urls(at: At, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_alertmanager_url(at, value),)
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else at.format.describe(value)
        raise at.error(f"must be a URL or a non-empty list of URLs, got {got}")
    return tuple(_alertmanager_url(at.item(i), item) for i, item in enumerate(value))


def _alertmanager(at: At, value: Any) -> AlertmanagerConfig:
    got = mapping(at, value, {
        "url": _alertmanager_urls,
        "credentials_file": lambda at, v: string(at, v, non_empty=True),
        "timeout_seconds": lambda at, v: number(at, v, above=0),
        "pull": boolean,
        "pull_interval_seconds": lambda at, v: number(at, v, minimum=1),
        "ca_file": lambda at, v: string(at, v, non_empty=True),
        "insecure_credentials_over_http": boolean,
    })
    if "url" not in got:
        raise at.child("url").error("required when the alertmanager section is present")
    config = AlertmanagerConfig(**got)
    if (problem := config.token_in_clear()) is not None:
        raise at.child("credentials_file").error(problem)
    if config.ca_file is not None and len(config.plain_http()) == len(config.url):
        raise at.child("ca_file").error("only https:// URLs use it, and every url is http://")
    return config


def _basic_auth(at: At, value: Any) -> BasicAuth:
    got = mapping(at, value, {
        "username": lambda at, v: string(at, v, non_empty=True),
        "password_file": lambda at, v: string(at, v, non_empty=True),
    })
    for key in ("username", "password_file"):
        if key not in got:
            raise at.child(key).error("required in basic_auth")
    if ":" in got["username"] or not got["username"].isprintable():
        raise at.child("username").error("must not contain ':' or control characters "
                                         "(basic auth cannot carry them)")
    return BasicAuth(**got)


def _prometheus(at: At, value: Any) -> PrometheusConfig:
    got = mapping(at, value, {
        "url": _alertmanager_urls,
        "credentials_file": lambda at, v: string(at, v, non_empty=True),
        "basic_auth": _basic_auth,
        "timeout_seconds": lambda at, v: number(at, v, above=0),
        "pull_interval_seconds": lambda at, v: number(at, v, minimum=1),
        "ca_file": lambda at, v: string(at, v, non_empty=True),
        "insecure_credentials_over_http": boolean,
    })
    if "url" not in got:
        raise at.child("url").error("required when the prometheus section is present")
    if "credentials_file" in got and "basic_auth" in got:
        raise at.child("basic_auth").error("credentials_file (a bearer token) and basic_auth "
                                           "exclude each other; pick one")
    config = PrometheusConfig(**got)
    if (problem := config.secret_in_clear()) is not None:
        key = "basic_auth" if config.basic_auth is not None else "credentials_file"
        raise at.child(key).error(problem)
    if config.ca_file is not None and all(u.lower().startswith("http://") for u in config.url):
        raise at.child("ca_file").error("only https:// URLs use it, and every url is http://")
    return config


def _pull_sources(at: At, got: dict[str, Any]) -> None:
    """Prometheus pull needs Alertmanager (the kill-time confirmation), and one pull only."""
    prometheus = got.get("prometheus")
    if prometheus is None:
        return
    alertmanager = got.get("alertmanager")
    if alertmanager is None:
        raise at.child("prometheus").error(
            "needs remediate.alertmanager: every reap asks Alertmanager right before its "
            "first signal (silences, inhibitions, still firing), which Prometheus cannot say")
    if alertmanager.pull:
        raise at.child("prometheus").error(
            "it and remediate.alertmanager.pull: true both poll for this host's alerts; "
            "choose one (set alertmanager.pull: false: Alertmanager still confirms every reap)")


def parse_remediate(at: At, value: Any, *, defaults: Defaults) -> Remediate:
    """The `remediate:` section; `defaults`: the platform's, whose paths fill in the keys
    it leaves out."""
    got = mapping(at, value, {
        "mode": lambda at, v: choice(at, v, tuple(Mode)),
        "alerts": string_list,
        "reasons": lambda at, v: choice_list(at, v, ORPHAN_REASONS),
        "min_age_seconds": number,
        "require_idle_seconds": lambda at, v: number(at, v, minimum=0),
        "idle_reasons": _idle_reasons,
        "users": _users,
        "rate_limit": _rate_limit,
        "term_timeout_seconds": lambda at, v: number(at, v, minimum=0.1),
        "worker_timeout_seconds": lambda at, v: number(at, v, minimum=1),
        "max_pending": lambda at, v: integer(at, v, minimum=1),
        "max_pending_per_user": _share,
        "allow_root_owned": boolean,
        "allow_without_pidfd": boolean,
        "state_dir": lambda at, v: string(at, v, non_empty=True),
        "audit_log": lambda at, v: string(at, v, non_empty=True),
        "alertmanager": _alertmanager,
        "prometheus": _prometheus,
    })
    _pull_sources(at, got)
    return Remediate(**{**default_paths(defaults), **got})
