// The mixin's settings. Override any of them with
//   (import 'github.com/gpuguard/gpuguard/mixin/mixin.libsonnet') +
//   { _config+:: { exporterSelector: 'job="node-gpuguard"' } }
// Every selector, threshold, duration and link in the rendered rules and dashboard comes
// from here (docs/mixin.md describes each key).
{
  _config+:: {
    // Label matchers (without braces) of the exporters' and the remediators' scrape jobs.
    exporterSelector: 'job="gpuguard"',
    remediatorSelector: 'job="gpuguard-remediator"',
    // dcgm-exporter's targets (empty: every DCGM_FI_DEV_FB_USED series), for the
    // recording rules that join its series on UUID.
    dcgmExporterSelector: '',

    // Each alert's runbook_url: this pattern with %s replaced by the alert's name in lower
    // case (as node-mixin does), e.g. 'https://runbooks.example.com/gpuguard/%s'. Empty:
    // no runbook_url annotation (as shipped; the pages are docs/runbooks/<name>.md).
    runbookURLPattern: '',

    // GPUOrphanTree: the orphan age a tree must reach, then how long it must stay orphaned.
    // The remediator reaps only what this alert reports: together they are the grace period.
    orphanAgeThresholdSeconds: 300,
    orphanTreeFor: '1m',
    // ... and how long it keeps firing after its expression empties (Prometheus 2.42+):
    // a scrape that fails while the exporter restarts marks the tree's series stale, and
    // without it the alert resolved and re-pended for `for:` (people notified twice).
    // As long as GPUGuardExporterDown's `for:`: a shorter gap is a restart, a longer one
    // an outage that alert reports. It costs as much: a tree gone (reaped, exited) keeps
    // its alert firing this much longer, which the remediator re-checks and refuses
    // (`duplicate`, `root-gone`, `root-replaced`). '0s': off.
    orphanTreeKeepFiringFor: '5m',

    exporterDownFor: '5m',
    exporterAbsentFor: '10m',
    nvmlDownFor: '5m',
    scanStaleThresholdSeconds: 60,
    scanStaleFor: '2m',
    scanErrorsWindow: '10m',
    scanErrorsFor: '5m',
    scanSlowThresholdSeconds: 1,
    scanSlowWindow: '10m',
    scanSlowFor: '15m',
    configReloadFailedFor: '5m',
    processEventsDownFor: '5m',
    launcherEvidenceEvictedWindow: '15m',

    remediatorDownFor: '5m',
    remediatorAbsentFor: '10m',
    remediatorRejectingWindow: '10m',
    reapFailuresWindow: '15m',
    remediatorStuckFor: '2m',
    // A manual reap holds the host's reap lock for seconds; recovery waiting longer has a
    // holder that is stuck, and processes left stopped meanwhile.
    recoveryWaitingFor: '5m',
    alertmanagerUnreachableWindow: '10m',
    alertmanagerUnreachableFor: '5m',

    userOverQuotaFor: '15m',
    // GPUIdleHolder: a process holding GPU memory without using an SM for this long (the
    // exporter's accounting.idle_after_seconds default, so the alert and the idle memory
    // per user agree), then for this long more.
    idleHolderThresholdSeconds: 3600,
    idleHolderFor: '5m',
    suspectProcessFor: '2m',
    // 1 GiB: well above rounding between the driver's used figure and its per-process ones.
    unattributedMemoryThresholdBytes: 1073741824,
    unattributedMemoryFor: '10m',

    // GPUGuardGPURecoveryAction: how long a GPU's driver must ask for a recovery (anything
    // but none) before people are paged; it stays until someone acts, so a minute only
    // rides out one odd scrape.
    gpuRecoveryActionFor: '1m',

    // Grafana.
    dashboardUID: 'gpuguard',
    dashboardTitle: 'gpuguard',
    dashboardTags: ['gpuguard', 'gpu'],
    dashboardRefresh: '30s',
    dashboardRateInterval: '5m',
    // The dashboard's data source variable: its name (panels use ${name}) and label.
    datasourceVariable: 'datasource',
    datasourceLabel: 'Data source',
  },
}
