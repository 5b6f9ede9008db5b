"""The kill policy in force, in one line, and the combinations worth a second look.

`config check` and `policy check` print both: a file can be valid and still reap more than
its author meant (enforce with root-owned members allowed, every user allowed and none
denied, a reason that reads the same for a job kept on purpose allowed while it still
computes). Pure: a `Remediate` in, text out; a warning never changes the exit status.
"""

from __future__ import annotations

from gpuguard.config.remediate import Mode, Remediate
from gpuguard.orphans.vocabulary import Reason, reapability

#: Below this `remediate.min_age_seconds` a tree may be reaped within a minute of its
#: alert firing: the exporter's next scans and the launcher's exit event need that long.
SHORT_MIN_AGE_SECONDS = 60.0
#: Above this many reaps an hour (`rate_limit`), a wrong policy kills that many jobs
#: before anyone reads the audit log (the default is 5).
MANY_REAPS_PER_HOUR = 20.0


def span(seconds: float) -> str:
    """A duration as a person writes it: `1h`, `30m`, `90s`, `2d`, `1.5h`."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and (seconds / size * 10).is_integer():
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def policy_line(rem: Remediate) -> str:
    """`policy: enforce; reaps launcher-killed; when idle: launcher-exited 1h; ...`."""
    idle_any = rem.require_idle_seconds
    plain = [str(r) for r in rem.reasons if rem.idle_requirement(r)[0] <= 0]
    idle = [f"{r} {span(rem.idle_requirement(r)[0])}" for r in rem.allowed_reasons
            if rem.idle_requirement(r)[0] > 0]
    parts = [f"policy: {rem.mode}",
             f"alerts {', '.join(rem.alerts) or 'none'}",
             f"reaps {', '.join(plain) or 'nothing without an idle requirement'}"]
    if idle:
        parts.append(f"when idle: {', '.join(idle)}"
                     + (f" (require_idle_seconds {span(idle_any)} for all)"
                        if idle_any > 0 else ""))
    users = rem.users
    parts += [f"min age {span(rem.min_age_seconds)}",
              f"users allow {', '.join(users.allow) or 'none'} "
              f"deny {', '.join(users.deny) or 'none'}",
              f"root-owned {'allowed' if rem.allow_root_owned else 'never'}",
              f"at most {rem.rate_limit.max_reaps} reaps per "
              f"{span(rem.rate_limit.per_seconds)} ({rem.rate_limit.user_share} per user)"]
    return "; ".join(parts)


def risks(rem: Remediate) -> list[str]:
    """One line for each risky combination in the policy; [] when there is none."""
    out = []
    if rem.mode == Mode.ENFORCE and rem.allow_root_owned:
        out.append("remediate.mode is enforce with allow_root_owned: true: root-owned "
                   "processes (system services, containers running as root) may be "
                   "signalled")
    if "*" in rem.users.allow and not rem.users.deny:
        out.append('remediate.users allows "*" and denies nobody: every owner may be '
                   "reaped, also one NSS cannot name (deny root, or uid:0, to keep root out)")
    killed = Reason.LAUNCHER_KILLED.reapability
    for reason in rem.reasons:
        if reapability(reason) < killed and rem.idle_requirement(reason)[0] <= 0:
            out.append(f"remediate.reasons allows {reason} with no idle requirement: a job "
                       "left running on purpose can read the same and is reaped while it "
                       f"still computes; allow it only when idle (remediate.idle_reasons: "
                       f"{{{reason}: 1h}})")
    if rem.min_age_seconds < SHORT_MIN_AGE_SECONDS:
        out.append(f"remediate.min_age_seconds is {rem.min_age_seconds:g}: a tree may be "
                   f"reaped within a minute of its alert (under {SHORT_MIN_AGE_SECONDS:g} "
                   "leaves no time to notice a wrong verdict)")
    limit = rem.rate_limit
    per_hour = limit.max_reaps * 3600.0 / limit.per_seconds
    if per_hour > MANY_REAPS_PER_HOUR:
        out.append(f"remediate.rate_limit allows {limit.max_reaps} reaps per "
                   f"{span(limit.per_seconds)} ({per_hour:g} an hour, over "
                   f"{MANY_REAPS_PER_HOUR:g}): a wrong policy reaps that many jobs before "
                   "anyone reads the audit log")
    return out
