// gpuguard's alerts. GPUOrphanTree is the only one that may lead to a reap: it carries
// remediate="true" and Alertmanager routes exactly that (alertname + label) to the
// remediator, which re-checks the tree locally and applies its policy. Every other alert
// is for people and never carries the remediate label. Severities follow kube-prometheus:
// critical (act now), warning (act soon); GPUOrphanTree stays warning (an inhibited alert
// is never reaped).
{
  local c = $._config,
  // Durations as the descriptions say them: '5m' -> '5 minutes' (others as written).
  local units = { s: 'second', m: 'minute', h: 'hour', d: 'day' },
  local human(d) =
    local n = std.length(d);
    local digits = d[0:n - 1];
    if n > 1 && std.objectHas(units, d[n - 1])
       && std.all([std.member('0123456789', ch) for ch in std.stringChars(digits)])
    then '%s %s%s' % [digits, units[d[n - 1]], if digits == '1' then '' else 's']
    else d,
  local t = c + { [k]: human(c[k]) for k in std.objectFields(c)
                  if std.endsWith(k, 'For') || std.endsWith(k, 'Window') },
  local withRunbook(rule) =
    if c.runbookURLPattern == '' || !std.objectHas(rule, 'alert') then rule
    else rule { annotations+: { runbook_url: c.runbookURLPattern % std.asciiLower(rule.alert) } },
  local group(name, rules) = { name: name, rules: [withRunbook(r) for r in rules] },

  prometheusAlerts+:: {
    groups+: [
      group('gpuguard-orphans', [
        // Grace period = orphanAgeThresholdSeconds of orphan age (counted by the exporter
        // from the first scan that saw the tree orphaned) + orphanTreeFor. `and` keeps the
        // left-hand value (the age); multiplying by the info metric (always 1) keeps it too,
        // and group_left copies `hostname`, which the remediator compares with its own.
        {
          alert: 'GPUOrphanTree',
          expr: |||
            (
                gpuguard_orphan_tree_age_seconds{%(exporterSelector)s} > %(orphanAgeThresholdSeconds)s
              and on (job, instance, root_pid, root_start_time)
                gpuguard_orphan_tree_memory_bytes{%(exporterSelector)s} > 0
            )
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.orphanTreeFor,
          // Across an exporter restart the series go stale for a scrape or two: the alert
          // stays firing (the same alert, the same startsAt) instead of resolving.
          [if c.orphanTreeKeepFiringFor != '0s' then 'keep_firing_for']:
            c.orphanTreeKeepFiringFor,
          labels: { severity: 'warning', remediate: 'true' },
          annotations: {
            summary: 'Orphaned GPU process tree {{ $labels.comm }} (pid {{ $labels.root_pid }}, user {{ $labels.user }}) on {{ $labels.hostname }}',
            description: 'The process tree rooted at pid {{ $labels.root_pid }} (comm {{ $labels.comm }}, user {{ $labels.user }}, start_time {{ $labels.root_start_time }}) on {{ $labels.hostname }} has been orphaned ({{ $labels.reason }}) for {{ $value | humanizeDuration }} and holds {{ with printf "gpuguard_orphan_tree_memory_bytes{instance=%q,root_pid=%q,root_start_time=%q}" $labels.instance $labels.root_pid $labels.root_start_time | query }}{{ . | first | value | humanize1024 }}B{{ else }}an unknown amount{{ end }} of GPU memory in {{ with printf "gpuguard_orphan_tree_processes{instance=%q,root_pid=%q,root_start_time=%q}" $labels.instance $labels.root_pid $labels.root_start_time | query }}{{ . | first | value }}{{ else }}an unknown number of{{ end }} process(es). If the remediator policy allows this reason and user it will reap the tree; to keep it, silence this alert (matchers hostname, root_pid, root_start_time) and ask the owner to restart it with GPUGUARD_KEEP=1.',
          },
        },
      ]),

      group('gpuguard-health', [
        {
          alert: 'GPUGuardExporterDown',
          expr: 'up{%(exporterSelector)s} == 0' % c,
          'for': c.exporterDownFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard exporter {{ $labels.instance }} is down',
            description: 'Prometheus has failed to scrape the gpuguard exporter at {{ $labels.instance }} for more than %(exporterDownFor)s. Orphaned GPU process trees on that node are neither reported nor reaped.' % t,
          },
        },
        {
          alert: 'GPUGuardExporterAbsent',
          expr: 'absent(up{%(exporterSelector)s})' % c,
          'for': c.exporterAbsentFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'No gpuguard exporter target is being scraped',
            description: 'Prometheus has had no target matching {%(exporterSelector)s} for more than %(exporterAbsentFor)s (scrape config or service discovery lost them, or never had them). No GPU node is being watched for orphaned process trees.' % t,
          },
        },
        {
          alert: 'GPUGuardNVMLDown',
          expr: 'gpuguard_nvml_up{%(exporterSelector)s} == 0' % c,
          'for': c.nvmlDownFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard on {{ $labels.instance }} cannot talk to NVML',
            description: 'The exporter at {{ $labels.instance }} has reported gpuguard_nvml_up == 0 for more than %(nvmlDownFor)s: it sees no GPUs and no GPU processes, so it cannot find orphaned trees. Check the NVIDIA driver and the exporter\'s access to libnvidia-ml.so.1.' % t,
          },
        },
        {
          alert: 'GPUGuardGPUBackendDown',
          expr: 'gpuguard_gpu_backend_up{%(exporterSelector)s, backend!="nvml"} == 0' % c,
          'for': c.nvmlDownFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard on {{ $labels.instance }} cannot read its {{ $labels.backend }} GPUs',
            description: 'The exporter at {{ $labels.instance }} has reported gpuguard_gpu_backend_up{backend="{{ $labels.backend }}"} == 0 for more than %(nvmlDownFor)s: it sees none of that back-end\'s GPUs or processes, and while any back-end is down no tree on the host is reaped (its holders may be on those GPUs). Check the driver and the exporter\'s access (docs/gpu-vendors.md). NVML has GPUGuardNVMLDown.' % t,
          },
        },
        {
          alert: 'GPUGuardScanStale',
          expr: 'time() - gpuguard_last_scan_timestamp_seconds{%(exporterSelector)s} > %(scanStaleThresholdSeconds)s' % c,
          'for': c.scanStaleFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard on {{ $labels.instance }} has not completed a scan recently',
            description: 'The last completed scan on {{ $labels.instance }} is {{ $value | humanizeDuration }} old. The scan thread is stuck or dead; the exporter keeps serving the last snapshot, so orphan data from this node is stale.',
          },
        },
        {
          alert: 'GPUGuardScanErrors',
          expr: 'increase(gpuguard_scan_errors_total{%(exporterSelector)s}[%(scanErrorsWindow)s]) > 0' % c,
          'for': c.scanErrorsFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard scans on {{ $labels.instance }} fail in stage {{ $labels.stage }}',
            description: 'Scans on {{ $labels.instance }} failed in stage {{ $labels.stage }} {{ $value | printf "%%.0f" }} time(s) in the last %(scanErrorsWindow)s. Read the exporter\'s log for the stage\'s error.' % t,
          },
        },
        {
          alert: 'GPUGuardScanSlow',
          expr: 'avg_over_time(gpuguard_scan_duration_seconds{%(exporterSelector)s}[%(scanSlowWindow)s]) > %(scanSlowThresholdSeconds)s' % c,
          'for': c.scanSlowFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard scans on {{ $labels.instance }} are slow',
            description: 'Scans on {{ $labels.instance }} have averaged {{ $value | humanizeDuration }} over %(scanSlowWindow)s for more than %(scanSlowFor)s (budget: %(scanSlowThresholdSeconds)ss). Look at the dashboard\'s inspector panels for the callsite whose calls or /proc reads grew.' % t,
          },
        },
        // Both daemons export the reload gauge: a failed reload keeps the old config
        // running, so the edit someone made is not in force.
        {
          alert: 'GPUGuardConfigReloadFailed',
          expr: 'gpuguard_config_last_reload_successful{%(exporterSelector)s} == 0 or gpuguard_config_last_reload_successful{%(remediatorSelector)s} == 0' % c,
          'for': c.configReloadFailedFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard on {{ $labels.instance }} failed to reload its config',
            description: 'The last config reload of the gpuguard daemon at {{ $labels.instance }} (the exporter or the remediator: see the job label) failed, for more than %(configReloadFailedFor)s: it still runs the config it had before, not the edited file. Check the file with `gpuguard config check FILE` and read the daemon\'s log for the error, then reload again (SIGHUP).' % t,
          },
        },
        // Both daemons hear launchers die through their own listener: without it a killed
        // launcher's tree reads session-ended, which the default policy does not reap.
        // Absent (not 0) where a platform has none (Windows).
        {
          alert: 'GPUGuardProcessEventsDown',
          expr: 'gpuguard_process_events_up{%(exporterSelector)s} == 0 or gpuguard_process_events_up{%(remediatorSelector)s} == 0' % c,
          'for': c.processEventsDownFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard on {{ $labels.instance }} does not hear processes exit',
            description: 'The gpuguard daemon at {{ $labels.instance }} (the exporter or the remediator: see the job label) has had no process-event listener for more than %(processEventsDownFor)s: it cannot tell a killed launcher from one that exited, so orphaned trees read session-ended, which the default policy does not reap. Its start-up warning "process events unavailable" says why: EPERM is a missing CAP_NET_ADMIN (the shipped units and DaemonSet grant it), a child PID namespace or ECONNREFUSED a container without hostPID or hostNetwork.' % t,
          },
        },
        // Both daemons keep the exits of their GPU holders' chains apart from the general
        // ring (issue 48), bounded by a store no other exit takes room in: a record lost
        // from it is launcher evidence lost (the tree then reads launcher-unrecorded, which
        // the default reasons do not reap). Impossible by design; counted, and said here.
        {
          alert: 'GPUGuardLauncherEvidenceEvicted',
          expr: 'increase(gpuguard_process_events_evicted_total{%(exporterSelector)s, store="watched"}[%(launcherEvidenceEvictedWindow)s]) > 0 or increase(gpuguard_process_events_evicted_total{%(remediatorSelector)s, store="watched"}[%(launcherEvidenceEvictedWindow)s]) > 0' % c,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard on {{ $labels.instance }} lost exit records of GPU holders\' chains',
            description: 'The gpuguard daemon at {{ $labels.instance }} (the exporter or the remediator: see the job label) dropped {{ $value | printf "%%.0f" }} exit record(s) of its GPU holders\' chains and session leaders in the last %(launcherEvidenceEvictedWindow)s to make room: more such processes than its watched store holds. Trees whose launcher died then read launcher-unrecorded (not reaped by default) instead of how it died. Read the runbook: count the holders and their chains, and the daemon\'s gpuguard_process_events_watched_pids.' % t,
          },
        },
      ]),

      group('gpuguard-remediation', [
        {
          alert: 'GPUGuardRemediatorDown',
          expr: 'up{%(remediatorSelector)s} == 0' % c,
          'for': c.remediatorDownFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} is down',
            description: 'Prometheus has failed to scrape the gpuguard remediator at {{ $labels.instance }} for more than %(remediatorDownFor)s. Alertmanager\'s deliveries to it fail, so orphaned trees on that node are reported but not reaped.' % t,
          },
        },
        // The remediator listens on 127.0.0.1 by default: a Prometheus that cannot reach it
        // has no target, so the alert above (and every alert on its metrics) never fires.
        {
          alert: 'GPUGuardRemediatorAbsent',
          expr: 'absent(up{%(remediatorSelector)s})' % c,
          'for': c.remediatorAbsentFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'No gpuguard remediator target is being scraped',
            description: 'Prometheus has had no target matching {%(remediatorSelector)s} for more than %(remediatorAbsentFor)s, so GPUGuardReapFailed, GPUGuardAuditLogFailing and GPUGuardRemediatorDown cannot fire. Scrape the remediators (docs/deployment.md: its --web.listen-address must be reachable from Prometheus, with TLS and authentication) or, on a fleet that only reports, drop this alert.' % t,
          },
        },
        {
          alert: 'GPUGuardRemediatorRejecting',
          expr: 'increase(gpuguard_remediator_rejected_requests_total{%(remediatorSelector)s}[%(remediatorRejectingWindow)s]) > 0' % c,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} rejects webhook requests ({{ $labels.cause }})',
            description: 'The remediator at {{ $labels.instance }} rejected {{ $value | printf "%%.0f" }} request(s) with cause {{ $labels.cause }} in the last %(remediatorRejectingWindow)s. A rejected notification is not acted on: check the bearer token (credentials_file) and the Alertmanager webhook configuration.' % t,
          },
        },
        {
          alert: 'GPUGuardReapFailed',
          expr: 'increase(gpuguard_remediator_reap_failures_total{%(remediatorSelector)s}[%(reapFailuresWindow)s]) > 0' % c,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} failed to reap a process tree',
            description: 'The remediator at {{ $labels.instance }} recorded {{ $value | printf "%%.0f" }} failed reap(s) in the last %(reapFailuresWindow)s. Members of the tree may be left stopped (SIGSTOP) or still hold GPU memory: read the audit log and inspect the tree by hand.' % t,
          },
        },
        {
          alert: 'GPUGuardRemediatorStuck',
          expr: 'max by (job, instance) (gpuguard_remediator_worker_stuck{%(remediatorSelector)s} == 1 or gpuguard_remediator_alertmanager_poller_stalled{%(remediatorSelector)s} == 1)' % c,
          'for': c.remediatorStuckFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} is stuck',
            description: 'The remediator at {{ $labels.instance }} has been busy with one item for longer than any may take, or (pull mode) has completed no poll for three intervals, for more than %(remediatorStuckFor)s. A stuck reap may hold a tree stopped (SIGSTOP): read its /healthz and log, and the tree\'s state in /proc.' % t,
          },
        },
        {
          alert: 'GPUGuardRecoveryWaiting',
          expr: 'gpuguard_remediator_recovery_waiting{%(remediatorSelector)s} == 1' % c,
          'for': c.recoveryWaitingFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} cannot continue what a crashed reap left stopped',
            description: 'The remediator at {{ $labels.instance }} has waited more than %(recoveryWaitingFor)s for the host\'s reap lock to continue (SIGCONT) the processes a reap cut short by a crash left stopped: another reaper (gpuguard reap --apply, an agent\'s gpu_reap) holds the lock. Those processes stay stopped until it lets go: GET /state names the holder.' % t,
          },
        },
        {
          alert: 'GPUGuardAuditLogFailing',
          expr: 'gpuguard_remediator_audit_ok{%(remediatorSelector)s} == 0' % c,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} cannot write its audit log',
            description: 'The remediator at {{ $labels.instance }} failed to write an audit record. No process is signalled without a record naming it first, so every reap on that node is refused until the audit log is writable again (disk full, read-only file system, permissions).',
          },
        },
        {
          alert: 'GPUGuardAlertmanagerUnreachable',
          expr: |||
            sum by (job, instance) (increase(gpuguard_remediator_alertmanager_requests_total{%(remediatorSelector)s, result!="ok"}[%(alertmanagerUnreachableWindow)s])) > 0
            unless on (job, instance)
            sum by (job, instance) (increase(gpuguard_remediator_alertmanager_requests_total{%(remediatorSelector)s, result="ok"}[%(alertmanagerUnreachableWindow)s])) > 0
          ||| % c,
          'for': c.alertmanagerUnreachableFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'gpuguard remediator {{ $labels.instance }} cannot reach Alertmanager',
            description: 'Every request the remediator at {{ $labels.instance }} made to Alertmanager\'s API in the last %(alertmanagerUnreachableWindow)s failed. Reaps there are refused (alertmanager-unreachable: nothing is killed without Alertmanager\'s confirmation) and, in pull mode, no alert reaches the remediator at all.' % t,
          },
        },
      ]),

      // Accounting: for people only, never remediate="true" (nothing here leads to a reap).
      group('gpuguard-accounting', [
        {
          alert: 'GPUUserOverQuota',
          expr: |||
            (
                gpuguard_user_gpu_memory_bytes{%(exporterSelector)s}
              > on (job, instance, user)
                gpuguard_user_gpu_memory_quota_bytes{%(exporterSelector)s}
            )
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.userOverQuotaFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'User {{ $labels.user }} holds more GPU memory than their quota on {{ $labels.hostname }}',
            description: 'The processes of user {{ $labels.user }} on {{ $labels.hostname }} have held {{ $value | humanize1024 }}B of GPU memory for more than %(userOverQuotaFor)s, over their quota of {{ with printf "gpuguard_user_gpu_memory_quota_bytes{instance=%%q,user=%%q}" $labels.instance $labels.user | query }}{{ . | first | value | humanize1024 }}B{{ else }}an unknown amount{{ end }} (config quotas:). gpuguard reports this and never kills for it: ask the user to free memory.' % t,
          },
        },
        // For people: an idle holder may be a notebook between cells. Never remediate:
        // remediate.require_idle_seconds is how idleness takes part in a reap.
        {
          alert: 'GPUIdleHolder',
          expr: |||
            (
                max without (Hostname) (gpuguard_gpu_process_idle_seconds{%(exporterSelector)s})
                  > %(idleHolderThresholdSeconds)s
              and on (job, instance, gpu, UUID, pid)
                gpuguard_gpu_process_memory_bytes{%(exporterSelector)s} > 0
            )
            * on (job, instance, pid) group_left (start_time, user, comm)
              gpuguard_gpu_process_info{%(exporterSelector)s}
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.idleHolderFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'GPU process {{ $labels.comm }} (pid {{ $labels.pid }}, user {{ $labels.user }}) holds GPU {{ $labels.gpu }} memory without using it on {{ $labels.hostname }}',
            description: 'Process {{ $labels.pid }} (comm {{ $labels.comm }}, user {{ $labels.user }}, start_time {{ $labels.start_time }}) on {{ $labels.hostname }} has held memory on GPU {{ $labels.gpu }} ({{ $labels.UUID }}) without using an SM for {{ $value | humanizeDuration }} (NVML\'s per-process samples, as the exporter watched them). gpuguard never kills for it: ask the user whether it is still needed.',
          },
        },
        // Critical: by default only strong signals make a suspect (a known miner's
        // executable name, a mining pool's stratum URL in its command line). The opt-in
        // utilization heuristic also fits long training runs: a warning.
        {
          alert: 'GPUSuspectProcess',
          expr: |||
            gpuguard_suspect_process_info{%(exporterSelector)s, why!="sustained-utilization"}
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.suspectProcessFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'Suspect GPU process {{ $labels.comm }} (pid {{ $labels.pid }}, user {{ $labels.user }}) on {{ $labels.hostname }}',
            description: 'Process {{ $labels.pid }} (comm {{ $labels.comm }}, user {{ $labels.user }}, start_time {{ $labels.start_time }}) on {{ $labels.hostname }} holds GPU memory and looks like a miner ({{ $labels.why }}: its comm or the program its command line runs is an audit.suspect_names entry, or its comm or command line matches an audit.suspect_patterns entry such as a mining pool\'s stratum URL). gpuguard never kills it: check it by hand.',
          },
        },
        {
          alert: 'GPUSuspectProcessSustained',
          expr: |||
            gpuguard_suspect_process_info{%(exporterSelector)s, why="sustained-utilization"}
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.suspectProcessFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'GPU process {{ $labels.comm }} (pid {{ $labels.pid }}, user {{ $labels.user }}) alone kept a GPU busy on {{ $labels.hostname }}',
            description: 'Process {{ $labels.pid }} (comm {{ $labels.comm }}, user {{ $labels.user }}, start_time {{ $labels.start_time }}) on {{ $labels.hostname }} has been the only holder of a GPU kept at or above audit.sustained_utilization.ratio for the configured window: what a miner does, and also what a long training run does. gpuguard never kills it: check it by hand.',
          },
        },
        // Drivers without the _v2 memory call (whose "used" includes reserved memory)
        // export no unattributed series at all.
        {
          alert: 'GPUMemoryUnattributed',
          expr: |||
            (
              max without (Hostname) (gpuguard_gpu_memory_unattributed_bytes{%(exporterSelector)s})
                > %(unattributedMemoryThresholdBytes)s
            )
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.unattributedMemoryFor,
          labels: { severity: 'warning' },
          annotations: {
            summary: 'GPU {{ $labels.gpu }} on {{ $labels.hostname }} has memory no listed process accounts for',
            description: 'GPU {{ $labels.gpu }} ({{ $labels.UUID }}) on {{ $labels.hostname }} has had {{ $value | humanize1024 }}B in use for more than %(unattributedMemoryFor)s that no process NVML lists accounts for: processes NVML does not list (those in other PID namespaces when the exporter runs without the host PID namespace), or contexts the driver has not freed.' % t,
          },
        },
      ]),
      // The GPUs themselves, for people: what a GPU's driver asks for before the GPU can
      // be used again. gpuguard never resets or reboots anything (NVML has no reset call):
      // the runbook says how.
      group('gpuguard-gpus', [
        {
          alert: 'GPUGuardGPURecoveryAction',
          expr: |||
            max without (Hostname) (gpuguard_gpu_recovery_action{%(exporterSelector)s, action!="none"})
            * on (job, instance) group_left (hostname)
              gpuguard_host_info{%(exporterSelector)s}
          ||| % c,
          'for': c.gpuRecoveryActionFor,
          labels: { severity: 'critical' },
          annotations: {
            summary: 'GPU {{ $labels.gpu }} on {{ $labels.hostname }} needs {{ $labels.action }}',
            description: 'The driver of GPU {{ $labels.gpu }} ({{ $labels.UUID }}, {{ $labels.vendor }}) on {{ $labels.hostname }} has asked for {{ $labels.action }} for more than %(gpuRecoveryActionFor)s (NVML\'s recovery action, after an uncorrectable error): work on that GPU fails or is wrong until it is done. gpuguard resets and reboots nothing: drain the node\'s jobs, see who still holds the GPU with `gpuguard status`, then, as root, `nvidia-smi -r -i {{ $labels.UUID }}` for gpu-reset or drain-and-reset (after draining peer-to-peer traffic), or reboot the node for node-reboot (see the runbook for each action and nvidia-smi -r\'s preconditions).' % t,
          },
        },
      ]),
    ],
  },
}
