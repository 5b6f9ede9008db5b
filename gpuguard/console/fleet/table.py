"""`gpuguard fleet` for people: the orphan trees with their alerts, then the hosts."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gpuguard.console.fleet.series import Silence
from gpuguard.console.fleet.view import AlertState, FleetView, TreeAlert, TreeRow
from gpuguard.console.render import fmt_age, fmt_bytes

STATE_STYLE = {AlertState.FIRING: "bold red", AlertState.PENDING: "yellow",
               AlertState.SILENCED: "cyan", AlertState.INHIBITED: "cyan"}


def _who(silence: Silence | str) -> str:
    if isinstance(silence, str):
        return f"silence {silence}"
    until = f" until {silence.ends_at}" if silence.ends_at else ""
    return f"by {silence.created_by or '?'}{until}: {silence.comment}"[:120]


def alert_text(tree: TreeRow, *, alertmanager_known: bool) -> Text:
    """The tree's alert in a few words: its state, and for a silence who set it, until when."""
    state = tree.state
    text = Text(str(state), style=STATE_STYLE.get(state, ""))
    shown: TreeAlert | None = next((a for a in tree.alerts if a.state == state), None)
    if shown is not None and len(tree.alerts) > 1:
        text.append(f" ({shown.alertname})")
    if shown is not None and state == AlertState.SILENCED:
        text.append(" " + "; ".join(_who(s) for s in shown.silences))
    elif shown is not None and state == AlertState.INHIBITED:
        text.append(" by " + ", ".join(shown.inhibited_by))
    elif state in (AlertState.FIRING, AlertState.PENDING) and not alertmanager_known:
        text.append(" (silences unknown)", style="dim")
    return text


def _up(up: bool | None) -> Text:
    if up is None:
        return Text("?", style="magenta")
    return Text("up", style="green") if up else Text("DOWN", style="bold red")


def fleet_renderable(view: FleetView, *, alertmanager: str | None,
                     errors: list[str]) -> RenderableType:
    known = alertmanager is not None and view.alertmanager_error is None
    trees = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("HOST", "left"), ("ROOT", "right"), ("START TIME", "right"),
                          ("USER", "left"), ("PROCESS", "left"), ("REASON", "left"),
                          ("AGE", "right"), ("GPU MEM", "right"), ("IDLE", "right"),
                          ("PROCS", "right"), ("ALERT", "left")):
        trees.add_column(name, justify=justify)  # type: ignore[arg-type]
    for t in view.trees:
        trees.add_row(t.hostname or f"? ({t.instance})", str(t.root_pid), str(t.root_start_time),
                      t.user, t.comm, t.reason, fmt_age(t.age_seconds), fmt_bytes(t.memory_bytes),
                      fmt_age(t.idle_seconds), "?" if t.processes is None else str(t.processes),
                      alert_text(t, alertmanager_known=known))
    hosts = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("HOST", "EXPORTER", "REMEDIATOR", "MODE", "ORPHAN TREES"):
        hosts.add_column(name)
    for h in view.hosts:
        exporter = Text(" ").join(_up(d.up) for d in h.exporters) if h.exporters else Text("-")
        remediator = (Text(" ").join(_up(d.up) for d in h.remediators) if h.remediators
                      else Text("none", style="dim"))
        modes = ", ".join(d.mode or "?" for d in h.remediators if d.up) or "-"
        name = h.hostname or "? (" + ", ".join(d.instance for d in h.exporters
                                                + h.remediators) + ")"
        hosts.add_row(name, exporter, remediator, modes, str(h.trees))
    parts: list[RenderableType] = []
    if view.trees:
        parts += [Text(f"{len(view.trees)} orphan tree(s)", style="bold"), trees, Text("")]
    else:
        parts += [Text("No orphan trees on any host.", style="bold"), Text("")]
    for key, a in view.stray_alerts:
        parts.append(Text(f"{a.alertname} {a.state} for {key['hostname']} root {key['root_pid']} "
                          f"(start time {key['root_start_time']}): no exporter shows that tree "
                          "now (its exporter is down, or the tree is gone and the alert has "
                          "yet to resolve)", style="yellow"))
    parts += [hosts]
    if alertmanager is None:
        parts.append(Text("No Alertmanager asked (--alertmanager): whether an alert is "
                          "silenced or inhibited is not shown.", style="dim"))
    elif view.alertmanager_error is not None:
        parts.append(Text(f"Alertmanager did not answer: {view.alertmanager_error}; silences "
                          "and inhibitions unknown.", style="bold yellow"))
    parts += [Text(e, style="yellow") for e in [*errors, *view.malformed]]
    return Group(*parts)
