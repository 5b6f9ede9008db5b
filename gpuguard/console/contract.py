"""What scripts may rely on: exit codes, JSON schema ids, and the --help text that states them.

Each code and each schema id is defined here once; the epilogs `gpuguard ... --help`
prints are generated from the same constants the commands return and print.
"""

from __future__ import annotations

import signal

PROG = "gpuguard"

EXIT_OK = 0
EXIT_INTERNAL = 1
#: node-check: the node is not clean, or could not be shown clean (fails closed).
EXIT_NOT_CLEAN = 1
#: assets --diff: a file under DIR differs from what this version ships (as diff(1)).
EXIT_DIFFERS = 1
EXIT_USAGE = 2
EXIT_NVML_DOWN = 3
#: fleet: its source of truth, Prometheus, did not answer (status's NVML, for the fleet).
EXIT_SOURCE_DOWN = EXIT_NVML_DOWN
EXIT_NO_PROCESS = 4
EXIT_BAD_PAYLOAD = 5
EXIT_REFUSED = 6
EXIT_REAP_FAILED = 7
EXIT_NOT_AUDITED = 8
#: --remote: a host answered nothing the console can render (no gpuguard there, an older
#: gpuguard's document without a key it renders, not JSON).
EXIT_REMOTE_NO_ANSWER = 9
#: --remote: a host could not be asked (ssh could not connect or log in, or --timeout).
EXIT_REMOTE_UNREACHABLE = 10
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
EXIT_INTERRUPTED = 130

#: What a start time (`--start-time`, `root_start_time`) is, in help and messages: each
#: platform has its one encoding (gpuguard.host.windows.tree.encode_create_time on Windows).
START_TIME_WORDS = ("the start time as gpuguard reports it: clock ticks since boot on Linux, "
                    "milliseconds since the epoch on Windows")

#: Exit codes (stable), as `gpuguard --help` lists them.
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "ok: status shown, pid explained, payload checked, config valid, reap done or "
              "dry-run ok, node clean"),
    (EXIT_INTERNAL, "unexpected internal error (a bug; traceback on stderr); node-check: not "
                    "clean, or not shown clean (NVML down included)"),
    (EXIT_USAGE, f"usage error or invalid config (one line: {PROG}: config error: FILE: KEY: "
                 "PROBLEM); policy check: the payload file cannot be read; mcp: the MCP SDK "
                 "is not installed"),
    (EXIT_NVML_DOWN, "status: NVML unavailable, nothing could be inspected; fleet: "
                     "Prometheus did not answer"),
    (EXIT_NO_PROCESS, "explain, reap, keep: no such process (or not the given start time)"),
    (EXIT_BAD_PAYLOAD, "policy check: malformed alert payload"),
    (EXIT_REFUSED, "reap: refused (not an orphan without --force, identity changed, a guard "
                   "said no); keep: not the process's owner, or the mark cannot be written; "
                   "reset: refused (a process holds the GPU, the reading is incomplete, no "
                   "reset call, no audit record)"),
    (EXIT_REAP_FAILED, "reap --apply: some members survived SIGKILL (see the audit record); "
                       "reset --apply: the driver's reset call failed"),
    (EXIT_NOT_AUDITED, "reap --apply, reset --apply: the final audit record could not be "
                       "written (the intent record was)"),
    (EXIT_REMOTE_NO_ANSWER, "--remote: a host's answer cannot be rendered: no gpuguard there "
                            "(the remote shell's 127), an older gpuguard whose JSON lacks a "
                            "key, not JSON"),
    (EXIT_REMOTE_UNREACHABLE, "--remote: a host could not be asked: ssh could not connect, "
                              "log in or run the command (its 255), or no answer within "
                              "--timeout"),
    (EXIT_CANNOT_EXECUTE, "run: CMD could not be executed (permission denied, not a program)"),
    (EXIT_NOT_FOUND, "run: CMD not found"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C); `status --watch` exits 0 on Ctrl-C; `reap "
                       "--apply` exits 128+N on SIGINT, SIGTERM or SIGHUP, after continuing "
                       "what it stopped and writing its record"),
)
#: Failures that print one line on stderr (`gpuguard: ...`) and no JSON.
ONE_LINE_EXITS = (EXIT_USAGE, EXIT_NO_PROCESS, EXIT_BAD_PAYLOAD, EXIT_CANNOT_EXECUTE,
                  EXIT_NOT_FOUND)

EXIT_TABLE = (
    "exit codes:\n"
    + "".join(f"  {code:<4} {meaning}\n" for code, meaning in EXIT_CODES)
    + f"exits {', '.join(str(c) for c in ONE_LINE_EXITS[:-1])} and {ONE_LINE_EXITS[-1]} print "
      "one line on stderr and no JSON; all others print their --json, except `run`, which "
      "exits with CMD's own status (see `run --help`).\n"
)

STATUS_SCHEMA = "gpuguard.status/v1"
REMOTE_SCHEMA = "gpuguard.remote/v1"
EXPLAIN_SCHEMA = "gpuguard.explain/v1"
POLICY_SCHEMA = "gpuguard.policy-check/v1"
REAP_SCHEMA = "gpuguard.reap/v1"
NODE_CHECK_SCHEMA = "gpuguard.node-check/v1"
FLEET_SCHEMA = "gpuguard.fleet/v1"
RESET_SCHEMA = "gpuguard.reset/v1"

#: `reap --json`'s outcome when the tree was refused before the reaper planned anything
#: (the reaper's own outcomes are gpuguard.engine.reap.outcome.Outcome).
REFUSED = "refused"

# status: "taken_at" is Unix seconds at the end of the scan; "rule" is the rule number of
# docs/design.md, Orphan rules; "processes" counts an orphan's root and all its
# descendants; "members" are the processes classify() walked.
STATUS_EPILOG = f"""\
--json prints one document, schema {STATUS_SCHEMA} (keys are only ever added):
  {{"schema": "{STATUS_SCHEMA}", "hostname": str, "taken_at": float,
   "nvml": {{"up": bool, "driver_version": str|null, "errors": [{{"stage", "message"}}],
            "backends": [{{"name": nvml|amdsmi|drm, "up": bool, "detail": str|null}}]}},
   "errors": [{{"stage": str, "message": str}}],
   "gpus": [{{"index", "uuid", "name", "memory_total_bytes", "memory_used_bytes",
             "utilization_ratio", "temperature_celsius", "power_watts", "vendor",
             "driver_version"}}],
   "trees": [{{"root_pid": int, "root_start_time": int|null, "root_comm", "root_user",
              "root_age_seconds": float|null, "orphan_since": float|null,
              "orphan_age_seconds": float|null,
              "verdict": normal|orphan|protected|unknown, "reason": str, "rule": "1".."7",
              "evidence": {{"rule", "detail", "pids": [int]}}, "gpu_bytes": int,
              "processes": int|null,
              "holders": [{{"pid", "gpu", "uuid", "used_bytes", "kind",
                           "sm_busy": bool|null, "idle_seconds": float|null,
                           "idle_source": exporter|own-scan|null,
                           "container_id": str|null, "pod_uid": str|null,
                           "suspect": {{"why", "detail"}}|null}}],
              "members": [{{"pid", "ppid", "sid", "pgid", "start_time", "state", "uid",
                           "user", "comm"}}],
              "run_launchers": [{{"pid", "start_time", "tier": str|null}}]}}],
   "accounting": {{"users": [{{"user", "used_bytes", "quota_bytes": int|null,
                             "idle_bytes"}}],
     "suspects": [{{"pid", "start_time", "user", "comm",
                   "why": comm-pattern|cmdline-pattern|sustained-utilization, "detail"}}],
     "gpus": [{{"index", "uuid", "used_bytes": int|null, "processes_bytes", "processes",
               "unattributed_bytes": int|null, "why_unknown": str|null}}]}},
   "clocks": {{"source": exporter|own-scan, "exporter_url": str|null,
              "exporter_scan_at": float|null, "detail": str}}}}
  members: holder(s) up to the root, root first. run_launchers: the members that are live
  `gpuguard run` launchers registered in classify.marks_dir, and the tier each holds its
  tree with (cgroup, pidns, subreaper; run --help). accounting.gpus: used memory against the
  sum of the listed processes' usage; unattributed_bytes is null (why_unknown says why)
  when a figure is missing. With --watch and --json, one document per line per scan.
  clocks: where the orphan ages and idle seconds come from: the running exporter's latest
  scan (source exporter, at exporter_scan_at, Unix seconds), asked at --exporter-url, or
  this command's own scan (source own-scan; detail says why). orphan_age_seconds: the
  exporter's gpuguard_orphan_tree_age_seconds for this root at its scan, orphan_since
  that scan's time less it (both null without the exporter's figure).
  sm_busy: NVML's per-process samples in this scan show the holder using an SM (null:
  NVML cannot say, e.g. MIG); idle_seconds: how long it has gone without: the exporter's
  gpuguard_gpu_process_idle_seconds at its scan (idle_source exporter), else counted from
  this command's first scan (own-scan: 0 on one scan); idle_bytes: what holders idle for
  accounting.idle_after_seconds hold.

""" + EXIT_TABLE

EXPLAIN_EPILOG = f"""\
A pid that holds no GPU memory per NVML (or with NVML down) is explained as if it
were a holder, and the output says so.
--json prints {EXPLAIN_SCHEMA}:
  {{"schema", "pid", "start_time", "gpu_holder": bool, "note": str|null,
   "holdings": [{{"pid", "gpu", "uuid", "used_bytes", "kind", "sm_busy": bool|null,
                 "idle_seconds": float|null}}],
   "nvml": {{"up", "driver_version", "errors", "backends"}}, "verdict", "reason", "rule",
   "rule_name", "evidence": {{"rule", "detail", "pids"}}, "root_pid", "root_start_time",
   "chain": [{{"role": holder|ancestor|root|above-root, "pid", "ppid", "sid", "pgid",
              "start_time", "state", "uid", "user", "comm", "age_seconds"}}],
   "sessions": [{{"sid", "leader": alive|zombie|gone, "comm"}}],
   "run_launchers": [{{"pid", "start_time", "tier": str|null}}]}}
  run_launchers: the chain's live `gpuguard run` launchers (as in status --json).
  sm_busy, idle_seconds: as in status --json (one read: idle_seconds is 0 or null).

""" + EXIT_TABLE

POLICY_EPILOG = f"""\
The remediator's ledger (state_dir/remediator-state.json) is read through a private copy
when it exists, so dedupe, first-seen ages and the rate-limit window count as they would.
A decision that defers (too young) also shows what the re-check would decide.
--json prints {POLICY_SCHEMA}:
  {{"schema", "config", "hostname", "ledger": str,
   "remediate": {{"mode", "alerts", "reasons", "idle_reasons": {{reason: seconds}},
                 "require_idle_seconds", "min_age_seconds"}},
   "policy": str (the policy in force, one line, as config check prints it),
   "warnings": [str] (risky combinations, one line each; the exit status ignores them),
   "alerts": [{{"index", "fingerprint", "alertname", "status", "key": str|null,
               "intake": {{"action", "reason", "detail"?}},
               "decision": {{"action", "reason", "detail"?, "recheck_at"?}}|null,
               "then": {{...}}|null,
               "live": {{"root", "tree_found", "verdict", "reason", "gpu_bytes",
                        "nvml_error", "members": [...]}}|null}}]}}
  actions: accept, reap, dry-run, defer, cancel, ignore (remediator.decision.policy).

""" + EXIT_TABLE

REAP_EPILOG = f"""\
Goes through the remediator's own checks: the root's identity (pid + start_time, held
by pidfd), a fresh NVML + classify() that must call the tree an orphan (--force skips
only this), and the reaper's guards, which nothing skips: never PID 1, this command or
its ancestors, kernel threads, root-owned processes (unless remediate.allow_root_owned)
or users outside remediate.users. --apply reaps whatever remediate.mode says (the mode
governs alert-driven reaps only); without it nothing is signalled. --apply needs
--start-time (a dry run prints it): a pid alone names whoever holds it now. With the tree
frozen, NVML is asked again (waited for no longer than remediate.worker_timeout_seconds)
and the tree classified again: anything but the same orphan continues it, unsignalled.
SIGINT, SIGTERM or SIGHUP (Ctrl-Break on Windows) during --apply stop the reap: what it
stopped is continued, the final record says `interrupted`, and the exit is 128+N. Every
run, refused or not, appends the remediator's audit record to remediate.audit_log with
"manual": {{"by": $SUDO_USER or the login name, ...}}; --apply refuses when the log cannot
be written, or when its directory fails the remediator's check (owned by this user,
writable by no one else, no symlink: `audit-unsafe`).
--json prints {REAP_SCHEMA}:
  {{"schema", "exit_code", "key": {{"hostname", "root_pid", "root_start_time"}}, "apply",
   "forced", "decision": {{"action", "reason", "detail"?}}, "live": {{...}},
   "outcome": reaped|failed|dry-run|aborted|{REFUSED}, "reason", "detail", "kill_path",
   "members": [{{"pid", "start_time", "user", "comm"}}],
   "signals": [{{"pid", "signal", "result", "at_ms"}}], "survivors": [int],
   "reclaimed_bytes", "audit_log", "audit_error"}}

""" + EXIT_TABLE

NODE_CHECK_EPILOG = f"""\
Exit {EXIT_OK} when all GPU memory is held by processes of live trees the classifier calls
normal (or protected, with --allow-protected); {EXIT_NOT_CLEAN} when anything else remains (an
orphan, a protected or unknown tree, a
pid NVML lists that /proc lacks, a holder NVML does not list, unattributed memory above
accounting.unlisted_threshold_bytes or of unknown size) and when the node cannot be shown
clean (NVML down or incomplete); {EXIT_USAGE} for a bad config. Never signals anything.
--json prints {NODE_CHECK_SCHEMA}:
  {{"schema", "hostname", "taken_at", "clean": bool, "why": [str], "threshold_bytes",
   "nvml": {{"up", "driver_version", "errors", "backends"}},
   "remaining": {{"trees": [{{"root_pid", "root_start_time", "root_comm", "root_user",
                             "verdict", "reason", "gpu_bytes", "holders": [...]}}],
                 "unattributed": [{{"index", "uuid", "unattributed_bytes": int|null,
                                   "why_unknown": str|null}}],
                 "unlisted": [{{"pid", "start_time", "user", "comm", "device_file",
                               "gpu_index", "gpu_uuid", "verdict", "reason"}}],
                 "unseen": [{{"index", "uuid", "processes", "memory_bytes"}}],
                 "search": {{"active", "passes", "examined", "unreadable", "found",
                            "reported"}}|null}}}}

""" + EXIT_TABLE

#: What `gpuguard --help` says of --remote, after the exit codes.
REMOTE_EPILOG = f"""\
--remote HOST[,HOST...] (or --hosts-file) before status, explain, reap or node-check runs
`gpuguard SUBCOMMAND --json ARGS` on each host over the system ssh (your ~/.ssh/config,
agent and known_hosts; BatchMode, host key checking as ssh has it, never off), at most
--parallel hosts at a time, and renders each host's document here under its name; a
host that gives none is one line (unreachable, timed-out, no-gpuguard, older-gpuguard,
bad-json, failed). ARGS are the remote's (--config names its file); reap keeps every
guard: a dry run unless --apply, which needs --start-time and one host; the remote
policy decides and its audit record is written there. The exit status is the worst
host's, the highest: {EXIT_REMOTE_UNREACHABLE}, then {EXIT_REMOTE_NO_ANSWER}, then each host's own.
--json prints one document, schema {REMOTE_SCHEMA}:
  {{"schema", "command": [str], "exit_code": int,
   "hosts": [{{"host", "exit_code", "failure": {{"kind", "detail"}}|null,
              "document": the host's own --json document|null}}]}}
"""

FLEET_EPILOG = f"""\
Asks Prometheus 10 instant queries (the four gpuguard_orphan_tree_* families,
gpuguard_host_info and gpuguard_remediator_info now and over the last hour, up of
--exporter-job and --remediator-job, ALERTS{{root_pid!=""}}) and Alertmanager two requests
(/api/v2/alerts naming a tree, /api/v2/silences), whatever the number of hosts; every
request within --timeout in all, each answer read up to 32 MiB. Never signals anything.
Alertmanager: --alertmanager, else the --config file's remediate.alertmanager (its URLs,
credentials_file and ca_file). A tree's alert_state: silenced, inhibited, firing, pending or
none, the first that any of its alerts is (a silence stops the remediator whatever a sibling
alert says); without an answer from Alertmanager only firing and pending can be told.
--json prints {FLEET_SCHEMA} (keys are only ever added):
  {{"schema", "taken_at": float,
   "sources": {{"prometheus": str, "alertmanager": str|null,
               "alertmanager_error": str|null}},
   "errors": [str],
   "hosts": [{{"hostname": str|null, "orphan_trees": int,
              "exporters": [{{"job", "instance", "up": bool|null}}],
              "remediators": [{{"job", "instance", "up": bool|null,
                               "mode": dry-run|enforce|null}}]}}],
   "trees": [{{"hostname": str|null, "job", "instance", "root_pid": int,
              "root_start_time": int, "comm", "user", "reason",
              "age_seconds": float|null, "memory_bytes": int|null,
              "idle_seconds": float|null, "processes": int|null,
              "alert_state": silenced|inhibited|firing|pending|none,
              "alerts": [{{"alertname", "state", "prometheus": firing|pending|null,
                          "alertmanager": active|suppressed|unprocessed|null,
                          "starts_at": str|null,
                          "silences": [{{"id", "created_by": str|null,
                                        "comment": str|null, "ends_at": str|null,
                                        "state": str|null}}],
                          "inhibited_by": [str]}}]}}],
   "stray_alerts": [{{"hostname", "root_pid": int|null, "root_start_time": int|null,
                     "alertname", "state", ...as alerts[]}}]}}
  hostname: the exporter's gpuguard_host_info (the last hour's, for one that is down); a
  remediator's host is its gpuguard_remediator_info's, else the exporter's at the same
  address. up: null where Prometheus has no `up` for the target under the job asked for.
  mode: a remediator's remediate.mode while it answers. stray_alerts: alerts that name a
  tree no exporter shows now (its exporter is down, or the tree is gone and the alert has
  yet to resolve). Exit {EXIT_SOURCE_DOWN} when Prometheus does not answer (the document says why).

""" + EXIT_TABLE

RESET_EPILOG = f"""\
GPU is an index or a UUID as `status` lists them, qualified by vendor where two back-ends
number their GPUs alike (amd:0, nvidia:0). A fresh read of every GPU back-end comes first;
the reset is refused (exit {EXIT_REFUSED}) when that read is down or incomplete, when any
process holds the GPU or any other GPU of its vendor (a reset may take its whole hive) as
a back-end sees it, when a pid listed on one names another process than the one listed
(pid-reused) or cannot be verified (unverified), when a listed pid has no process and
this command cannot see every pid (outside the host PID namespace, or without
CAP_SYS_PTRACE), when the GPU's library has no reset call (NVML:
docs/runbooks/gpuguardgpurecoveryaction.md), or when any other process has the GPU's DRM
nodes or /dev/kfd open (one whole look over /proc/*/fd, at most 10 s: refused too when it
cannot finish, read a process's descriptors, find the nodes, or see every process).
Without --apply nothing is reset and nothing written. --apply writes an intent record to
remediate.audit_log before the library's reset call and a final one after; a log that
cannot be written refuses the reset. The back-end checks its process list once more right
before the call.
--json prints {RESET_SCHEMA}:
  {{"schema", "exit_code", "hostname", "apply", "outcome": dry-run|reset|refused|failed,
   "why": str|null, "gpu": {{"vendor", "index", "uuid", "name", "pci_bus_id"}}|null,
   "holders": [int], "not_holding": [{{"pid", "why": no-process|pid-reused|no-kfd|
   unverified, "used_bytes"}}], "blockers": [{{"pid", "why": holder|pid-reused|unverified|
   no-process|device-open, "gpu": "vendor:index"|null, "device": str|null}}],
   "audit_log": str|null, "audit_error": str|null}}

""" + EXIT_TABLE

#: `run`'s own statuses, around CMD's (CMD may itself exit 2, 126, 127 or 130: these mean
#: the launcher's when its one-line message is on stderr).
RUN_EXIT_CODES: tuple[tuple[str, str], ...] = (
    ("CMD's", "CMD exited by itself: its exit status, 128+N if signal N killed it"),
    # Linux's SIGHUP is 1; Windows has none (its `run` holds the tree in a Job Object).
    (str(128 + getattr(signal, "SIGHUP", 1)), "its parent died (exit 129), or SIGHUP (dies "
                                               "of it); reaped"),
    (str(128 + signal.SIGINT), "SIGINT; the tree was reaped, then it dies of SIGINT"),
    (str(128 + signal.SIGTERM), "SIGTERM; the tree was reaped, then it dies of SIGTERM"),
    (str(EXIT_USAGE), "usage error (no CMD, bad --grace), no children file or pidfds "
                      "here, or a --require or --tier this host cannot give; nothing started"),
    (str(EXIT_CANNOT_EXECUTE), "CMD could not be executed; nothing started"),
    (str(EXIT_NOT_FOUND), "CMD not found; nothing started"),
)

RUN_EPILOG = """\
CMD runs in the launcher's process group, with its environment and open files. The
launcher becomes a child subreaper (a descendant that loses its parent is adopted by it,
not by PID 1), asks for a signal when its own parent dies, and gives CMD a parent-death
SIGKILL (so a SIGKILLed launcher takes CMD down). It reaps every descendant with the
remediator's reaper (identity by pidfd, freeze, SIGTERM, --grace, SIGKILL, confirm):
  - when its parent dies, or on SIGHUP or SIGTERM;
  - on SIGINT it first forwards the SIGINT to CMD (unless a terminal's Ctrl-C reached
    CMD already), then reaps on a second SIGINT, when CMD exits, or --grace seconds later;
  - when CMD exits by itself, what CMD left running (unless --keep-leftovers: then it is
    left to the next subreaper or PID 1).
Other signals (SIGUSR1, SIGQUIT, SIGWINCH, ...) are forwarded to CMD, unless they came
from the terminal, which sent them to CMD too; Ctrl-Z stops the launcher with CMD. A
signal ignored when the launcher starts (nohup, a script's background job) stays ignored.
After SIGINT, SIGTERM or SIGHUP the launcher ends by that signal, so a calling script
stops as for a plain command (a shell shows 128+N). A reap prints one line on stderr
naming what it killed and what survived (a process of another user, such as a
setuid-root program, cannot be signalled by an unprivileged launcher: it is left and
named; the exit status is the same). The launcher writes no audit log.
When the launcher itself is SIGKILLed (or its process group, or its session), its tier
decides: cgroup (a cgroup v2 leaf the launcher is in, which a guardian outside its group
and session kills with cgroup.kill; root or a delegated cgroup, kernel 5.14+), pidns
(the launcher is PID 1 of its namespace, which dies with it) or subreaper (CMD dies of
its parent-death SIGKILL, what CMD started lives on). The best the host allows is taken;
--verbose names it, --require refuses to start below one, --tier picks one.
exit codes of run (a shell's view):
""" + "".join(f"  {code:<6} {meaning}\n" for code, meaning in RUN_EXIT_CODES)

MCP_EPILOG = f"""\
Serves the Model Context Protocol on stdin and stdout only (no HTTP transport): an MCP
client (an agent's host, Claude Desktop) starts it as a subprocess. Tools (arguments):
  gpu_status {{}}          read-only: the {STATUS_SCHEMA} document of `status --json`
  gpu_explain {{pid}}      read-only: the {EXPLAIN_SCHEMA} document of `explain --json`
  gpu_fleet {{}}           read-only: the {FLEET_SCHEMA} document of `fleet --json`
                         (with --prometheus; an error without it)
  gpu_reap {{root_pid, root_start_time?, confirm?}}
                         destructive: a dry run unless confirm is true (nothing signalled,
                         nothing written); with confirm and root_start_time it is `reap
                         --apply` (the same checks, guards and audit log; no --force)
Refusals and bad arguments are tool errors (isError) whose text is the one-line reason.
Every call is logged on stderr, one line each (tool, arguments, outcome). Needs the
mcp extra: pip install 'mcp>=2.3,<3' 'anyio>=4' (without it: one line, exit {EXIT_USAGE}).
Run it as the remediator's user (with CAP_KILL), not as root: see docs/mcp.md.
exit codes: {EXIT_OK} when the client closes stdin; {EXIT_USAGE} usage error, invalid config or
no SDK; {EXIT_INTERRUPTED} Ctrl-C; 128+N when SIGTERM or SIGHUP ends it (during a confirmed
reap: after continuing what it stopped and writing its record).
"""


class Failure(Exception):
    """A handled failure: print `message` as one line and exit with `code`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
