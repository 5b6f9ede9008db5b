// gpuguard's monitoring mixin: prometheusAlerts, prometheusRules and grafanaDashboards,
// configured by _config (config.libsonnet; docs/mixin.md).
(import 'config.libsonnet') +
(import 'alerts/alerts.libsonnet') +
(import 'rules/rules.libsonnet') +
(import 'dashboards/dashboards.libsonnet')
