// The gpuguard dashboard in plain jsonnet (no grafonnet: jsonnet-bundler cannot reach
// git hosts from every build machine). Every query selects the exporters or remediators
// with _config's selectors; thresholds, tags, uid and the data source variable come from
// _config too.
{
  local c = $._config,
  local datasource = { type: 'prometheus', uid: '${%s}' % c.datasourceVariable },

  grafanaDashboards+:: {
    'gpuguard.json': {
      uid: c.dashboardUID,
      title: c.dashboardTitle,
      description: "GPU memory, orphaned GPU process trees, scan cost and remediation (gpuguard exporter + remediator).",
      tags: c.dashboardTags,
      schemaVersion: 38,
      version: 1,
      editable: true,
      graphTooltip: 1,
      time: {
        from: "now-6h",
        to: "now"
      },
      timepicker: {},
      timezone: "",
      refresh: c.dashboardRefresh,
      liveNow: false,
      fiscalYearStartMonth: 0,
      links: [],
      annotations: {
        list: [
          {
            builtIn: 1,
            datasource: {
              type: "grafana",
              uid: "-- Grafana --"
            },
            enable: true,
            hide: true,
            iconColor: "rgba(0, 211, 255, 1)",
            name: "Annotations & Alerts",
            type: "dashboard"
          }
        ]
      },
      templating: {
        list: [
          {
            name: c.datasourceVariable,
            label: c.datasourceLabel,
            type: "datasource",
            query: "prometheus",
            current: {},
            hide: 0,
            includeAll: false,
            multi: false,
            options: [],
            refresh: 1,
            regex: "",
            skipUrlSync: false
          },
          {
            name: "instance",
            label: "Instance",
            type: "query",
            datasource: datasource,
            definition: "label_values(gpuguard_host_info{%(exporterSelector)s}, instance)" % c,
            query: {
              query: "label_values(gpuguard_host_info{%(exporterSelector)s}, instance)" % c,
              refId: "PrometheusVariableQueryEditor-VariableQuery"
            },
            current: {},
            hide: 0,
            includeAll: true,
            allValue: ".*",
            multi: true,
            options: [],
            refresh: 2,
            regex: "",
            sort: 1,
            skipUrlSync: false
          }
        ]
      },
      panels: [
        {
          type: "row",
          title: "Overview",
          id: 1,
          collapsed: false,
          gridPos: {
            h: 1,
            w: 24,
            x: 0,
            y: 0
          },
          panels: []
        },
        {
          type: "stat",
          title: "Orphan trees",
          description: "Orphaned GPU-holding process trees seen by the last scan (all selected instances).",
          id: 2,
          datasource: datasource,
          gridPos: {
            h: 4,
            w: 4,
            x: 0,
            y: 1
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum(gpuguard_orphan_trees{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              mappings: [],
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "green",
                    value: null
                  },
                  {
                    color: "orange",
                    value: 1
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            reduceOptions: {
              calcs: [
                "lastNotNull"
              ],
              fields: "",
              values: false
            },
            colorMode: "background",
            graphMode: "none",
            textMode: "auto",
            justifyMode: "auto",
            orientation: "auto"
          }
        },
        {
          type: "stat",
          title: "Exporter up",
          description: "Prometheus scrape status of each exporter.",
          id: 3,
          datasource: datasource,
          gridPos: {
            h: 4,
            w: 4,
            x: 4,
            y: 1
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "up{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}}",
              range: false,
              instant: true,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              mappings: [
                {
                  type: "value",
                  options: {
                    "0": {
                      text: "DOWN",
                      color: "red"
                    },
                    "1": {
                      text: "UP",
                      color: "green"
                    }
                  }
                }
              ],
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "red",
                    value: null
                  },
                  {
                    color: "green",
                    value: 1
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            reduceOptions: {
              calcs: [
                "lastNotNull"
              ],
              fields: "",
              values: false
            },
            colorMode: "background",
            graphMode: "none",
            textMode: "auto",
            justifyMode: "auto",
            orientation: "auto"
          }
        },
        {
          type: "stat",
          title: "NVML up",
          description: "1 when the exporter's last NVML calls succeeded.",
          id: 4,
          datasource: datasource,
          gridPos: {
            h: 4,
            w: 4,
            x: 8,
            y: 1
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_nvml_up{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}}",
              range: false,
              instant: true,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              mappings: [
                {
                  type: "value",
                  options: {
                    "0": {
                      text: "DOWN",
                      color: "red"
                    },
                    "1": {
                      text: "UP",
                      color: "green"
                    }
                  }
                }
              ],
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "red",
                    value: null
                  },
                  {
                    color: "green",
                    value: 1
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            reduceOptions: {
              calcs: [
                "lastNotNull"
              ],
              fields: "",
              values: false
            },
            colorMode: "background",
            graphMode: "none",
            textMode: "auto",
            justifyMode: "auto",
            orientation: "auto"
          }
        },
        {
          type: "stat",
          title: "Last scan age",
          description: "Seconds since the last completed scan (alert GPUGuardScanStale above 60 s).",
          id: 5,
          datasource: datasource,
          gridPos: {
            h: 4,
            w: 4,
            x: 12,
            y: 1
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "time() - gpuguard_last_scan_timestamp_seconds{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}}",
              range: false,
              instant: true,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "s",
              mappings: [],
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "green",
                    value: null
                  },
                  {
                    color: "red",
                    value: c.scanStaleThresholdSeconds
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            reduceOptions: {
              calcs: [
                "lastNotNull"
              ],
              fields: "",
              values: false
            },
            colorMode: "background",
            graphMode: "none",
            textMode: "auto",
            justifyMode: "auto",
            orientation: "auto"
          }
        },
        {
          type: "stat",
          title: "Scan duration",
          description: "Duration of the last scan (alert GPUGuardScanSlow when it averages over 1 s).",
          id: 6,
          datasource: datasource,
          gridPos: {
            h: 4,
            w: 4,
            x: 16,
            y: 1
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_scan_duration_seconds{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}}",
              range: false,
              instant: true,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "s",
              mappings: [],
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "green",
                    value: null
                  },
                  {
                    color: "orange",
                    value: c.scanSlowThresholdSeconds
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            reduceOptions: {
              calcs: [
                "lastNotNull"
              ],
              fields: "",
              values: false
            },
            colorMode: "background",
            graphMode: "none",
            textMode: "auto",
            justifyMode: "auto",
            orientation: "auto"
          }
        },
        {
          type: "stat",
          title: "Proc reads per scan",
          description: "/proc reads per scan over 5 minutes; compare with the lower bound (distinct chain members + session leaders).",
          id: 7,
          datasource: datasource,
          gridPos: {
            h: 4,
            w: 4,
            x: 20,
            y: 1
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance) (rate(gpuguard_inspector_proc_reads_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))\n/\nsum by (instance) (rate(gpuguard_scans_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}}",
              range: false,
              instant: true,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              mappings: [],
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "green",
                    value: null
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            reduceOptions: {
              calcs: [
                "lastNotNull"
              ],
              fields: "",
              values: false
            },
            colorMode: "background",
            graphMode: "none",
            textMode: "auto",
            justifyMode: "auto",
            orientation: "auto"
          }
        },
        {
          type: "row",
          title: "Orphans",
          id: 8,
          collapsed: false,
          gridPos: {
            h: 1,
            w: 24,
            x: 0,
            y: 5
          },
          panels: []
        },
        {
          type: "table",
          title: "Orphan trees",
          description: "One row per orphaned tree: how long it has been orphaned, the GPU memory it holds, its process count, and how long its least idle holder has gone without using an SM (empty where NVML cannot say). GPUOrphanTree fires after 300 s + 1 m.",
          id: 9,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 24,
            x: 0,
            y: 6
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "max by (instance, root_pid, root_start_time, comm, user, reason) (gpuguard_orphan_tree_age_seconds{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "max by (instance, root_pid, root_start_time, comm, user, reason) (gpuguard_orphan_tree_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            },
            {
              datasource: datasource,
              refId: "C",
              expr: "max by (instance, root_pid, root_start_time, comm, user, reason) (gpuguard_orphan_tree_processes{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            },
            {
              datasource: datasource,
              refId: "D",
              expr: "max by (instance, root_pid, root_start_time, comm, user, reason) (gpuguard_orphan_tree_idle_seconds{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            }
          ],
          transformations: [
            {
              id: "merge",
              options: {}
            },
            {
              id: "organize",
              options: {
                excludeByName: {
                  Time: true
                },
                indexByName: {
                  instance: 0,
                  root_pid: 1,
                  root_start_time: 2,
                  comm: 3,
                  user: 4,
                  reason: 5,
                  "Value #A": 6,
                  "Value #B": 7,
                  "Value #C": 8,
                  "Value #D": 9
                },
                renameByName: {
                  "Value #A": "Orphaned for",
                  "Value #B": "GPU memory",
                  "Value #C": "Processes",
                  "Value #D": "Idle for"
                }
              }
            }
          ],
          fieldConfig: {
            defaults: {
              custom: {
                align: "auto",
                filterable: true
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byRegexp",
                  options: "Orphaned for|Idle for"
                },
                properties: [
                  {
                    id: "unit",
                    value: "s"
                  }
                ]
              },
              {
                matcher: {
                  id: "byName",
                  options: "GPU memory"
                },
                properties: [
                  {
                    id: "unit",
                    value: "bytes"
                  }
                ]
              }
            ]
          },
          options: {
            showHeader: true,
            footer: {
              show: false,
              reducer: [
                "sum"
              ],
              fields: ""
            }
          }
        },
        {
          type: "table",
          title: "GPU processes and verdicts",
          description: "Every GPU process with the classifier's verdict, reason and tree root, the container and Kubernetes pod its cgroup names (empty when none), and how long it has gone without using an SM (empty where NVML cannot say).",
          id: 10,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 24,
            x: 0,
            y: 14
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_gpu_process_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"}\n* on (instance, pid) group_left (verdict, reason, comm, user, root_pid, container_id, pod_uid)\ngpuguard_gpu_process_info{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "gpuguard_gpu_process_idle_seconds{%(exporterSelector)s, instance=~\"$instance\"}\n* on (instance, pid) group_left (verdict, reason, comm, user, root_pid, container_id, pod_uid)\ngpuguard_gpu_process_info{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            }
          ],
          transformations: [
            {
              id: "merge",
              options: {}
            },
            {
              id: "organize",
              options: {
                excludeByName: {
                  Time: true,
                  __name__: true,
                  job: true,
                  Hostname: true  // dcgm-exporter's spelling of instance's host: said once
                },
                indexByName: {
                  instance: 0,
                  gpu: 1,
                  UUID: 2,
                  pid: 3,
                  comm: 4,
                  user: 5,
                  verdict: 6,
                  reason: 7,
                  root_pid: 8,
                  "Value #A": 11,
                  "Value #B": 12,
                  container_id: 9,
                  pod_uid: 10
                },
                renameByName: {
                  "Value #A": "GPU memory",
                  "Value #B": "Idle for"
                }
              }
            }
          ],
          fieldConfig: {
            defaults: {
              custom: {
                align: "auto",
                filterable: true
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byName",
                  options: "GPU memory"
                },
                properties: [
                  {
                    id: "unit",
                    value: "bytes"
                  }
                ]
              },
              {
                matcher: {
                  id: "byName",
                  options: "Idle for"
                },
                properties: [
                  {
                    id: "unit",
                    value: "s"
                  }
                ]
              }
            ]
          },
          options: {
            showHeader: true,
            footer: {
              show: false,
              reducer: [
                "sum"
              ],
              fields: ""
            }
          }
        },
        {
          type: "timeseries",
          title: "Orphan tree count",
          description: "gpuguard_orphan_trees per instance.",
          id: 11,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 22
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_orphan_trees{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "GPU memory per process",
          description: "GPU memory per process, labelled with its verdict.",
          id: 12,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 22
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, pid, comm, verdict, reason) (\n  gpuguard_gpu_process_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"}\n  * on (instance, pid) group_left (verdict, reason, comm, user, root_pid)\n  gpuguard_gpu_process_info{%(exporterSelector)s, instance=~\"$instance\"}\n)" % c,
              legendFormat: "{{instance}} {{comm}} pid {{pid}} ({{verdict}}/{{reason}})",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "bytes",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "normal",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "row",
          title: "GPUs",
          id: 13,
          collapsed: false,
          gridPos: {
            h: 1,
            w: 24,
            x: 0,
            y: 30
          },
          panels: []
        },
        {
          type: "timeseries",
          title: "GPU memory used / total",
          description: "Used and total memory per GPU.",
          id: 14,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 31
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_gpu_memory_used_bytes{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} GPU {{vendor}}:{{gpu}} used",
              range: true,
              instant: false,
              format: "time_series"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "gpuguard_gpu_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} GPU {{vendor}}:{{gpu}} total",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "bytes",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byFrameRefID",
                  options: "B"
                },
                properties: [
                  {
                    id: "custom.lineStyle",
                    value: {
                      fill: "dash",
                      dash: [
                        10,
                        10
                      ]
                    }
                  },
                  {
                    id: "custom.fillOpacity",
                    value: 0
                  }
                ]
              }
            ]
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "GPU utilization",
          description: "Utilization per GPU (0..1).",
          id: 15,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 31
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_gpu_utilization_ratio{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} GPU {{vendor}}:{{gpu}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "percentunit",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              },
              min: 0,
              max: 1
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Temperature and power",
          description: "Temperature (left axis) and power draw (right axis) per GPU.",
          id: 16,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 39
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_gpu_temperature_celsius{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} GPU {{vendor}}:{{gpu}} °C",
              range: true,
              instant: false,
              format: "time_series"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "gpuguard_gpu_power_watts{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} GPU {{vendor}}:{{gpu}} W",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "celsius",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byFrameRefID",
                  options: "B"
                },
                properties: [
                  {
                    id: "unit",
                    value: "watt"
                  },
                  {
                    id: "custom.axisPlacement",
                    value: "right"
                  }
                ]
              }
            ]
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "GPU back-ends up",
          description: "1 when the exporter's calls to a GPU back-end (nvml, amdsmi, drm) succeed; one line per back-end that runs (docs/gpu-vendors.md).",
          id: 17,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 39
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_gpu_backend_up{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} {{backend}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              },
              min: 0,
              max: 1
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "table",
          title: "GPU recovery action",
          description: "What each GPU's driver asks for before the GPU can be used again (NVML's recovery action): none, or gpu-reset, node-reboot, drain-p2p, drain-and-reset, ... A GPU whose driver cannot say (older than the field, another vendor) has no row. Anything but none pages (GPUGuardGPURecoveryAction); its runbook says what to do.",
          id: 35,
          datasource: datasource,
          gridPos: {
            h: 6,
            w: 24,
            x: 0,
            y: 47
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, gpu, UUID, vendor, action) (gpuguard_gpu_recovery_action{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            }
          ],
          transformations: [
            {
              id: "organize",
              options: {
                excludeByName: {
                  Time: true,
                  Value: true
                },
                indexByName: {
                  instance: 0,
                  gpu: 1,
                  UUID: 2,
                  vendor: 3,
                  action: 4
                },
                renameByName: {}
              }
            }
          ],
          fieldConfig: {
            defaults: {
              custom: {
                align: "auto",
                filterable: true
              }
            },
            overrides: []
          },
          options: {
            showHeader: true,
            footer: {
              show: false,
              reducer: [
                "sum"
              ],
              fields: ""
            }
          }
        },
        {
          type: "row",
          title: "Accounting",
          id: 31,
          collapsed: false,
          gridPos: {
            h: 1,
            w: 24,
            x: 0,
            y: 53
          },
          panels: []
        },
        {
          type: "timeseries",
          title: "GPU memory per user vs quota",
          description: "GPU memory held by each user's processes (all GPUs), the part of it held by processes idle for accounting.idle_after_seconds, and the quota the config's quotas: section gives them (absent where none applies). GPUUserOverQuota opens a ticket after 15 m over.",
          id: 32,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 54
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, user) (gpuguard_user_gpu_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "{{user}} used ({{instance}})",
              range: true
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "max by (instance, user) (gpuguard_user_gpu_memory_quota_bytes{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "{{user}} quota ({{instance}})",
              range: true
            },
            {
              datasource: datasource,
              refId: "C",
              expr: "sum by (instance, user) (gpuguard_user_gpu_idle_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"})" % c,
              legendFormat: "{{user}} idle ({{instance}})",
              range: true
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "bytes",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                spanNulls: false
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byFrameRefID",
                  options: "B"
                },
                properties: [
                  {
                    id: "custom.lineStyle",
                    value: {
                      fill: "dash",
                      dash: [
                        10,
                        10
                      ]
                    }
                  },
                  {
                    id: "custom.fillOpacity",
                    value: 0
                  }
                ]
              }
            ]
          },
          options: {
            legend: {
              displayMode: "list",
              placement: "bottom",
              showLegend: true
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Unattributed GPU memory",
          description: "Memory in use on a GPU (without the driver's reserved memory) that no process NVML lists accounts for: processes NVML cannot list (other PID namespaces without hostPID) or contexts the driver has not freed. No line while a process's usage is unavailable (the figure would be a guess). GPUMemoryUnattributed opens a ticket above 1 GiB for 10 m. The second line: memory NVML says pids hold that the exporter's /proc does not show (exited since, or another PID namespace); gpuguard_gpu_unlisted_holder_info names who has the device files open.",
          id: 33,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 54
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_gpu_memory_unattributed_bytes{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "GPU {{vendor}}:{{gpu}} ({{instance}})",
              range: true
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "gpuguard_gpu_unseen_process_memory_bytes{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "GPU {{vendor}}:{{gpu}} ({{instance}}): listed pids /proc lacks",
              range: true
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "bytes",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                spanNulls: false,
                thresholdsStyle: {
                  mode: "line"
                }
              },
              thresholds: {
                mode: "absolute",
                steps: [
                  {
                    color: "green",
                    value: null
                  },
                  {
                    color: "orange",
                    value: c.unattributedMemoryThresholdBytes
                  }
                ]
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "list",
              placement: "bottom",
              showLegend: true
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "table",
          title: "Suspect GPU processes",
          description: "GPU-holding processes that look like miners: why is comm-pattern or cmdline-pattern (an audit.suspect_names entry as the program it runs, or an audit.suspect_patterns match such as a mining pool URL) or sustained-utilization (the only holder of a GPU kept busy for the configured window). Reported, never reaped; GPUSuspectProcess pages after 2 m, GPUSuspectProcessSustained opens a ticket.",
          id: 34,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 24,
            x: 0,
            y: 62
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_suspect_process_info{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "__auto",
              range: false,
              instant: true,
              format: "table"
            }
          ],
          transformations: [
            {
              id: "organize",
              options: {
                excludeByName: {
                  Time: true,
                  __name__: true,
                  job: true,
                  Value: true
                },
                indexByName: {
                  instance: 0,
                  pid: 1,
                  start_time: 2,
                  user: 3,
                  comm: 4,
                  why: 5
                },
                renameByName: {}
              }
            }
          ],
          fieldConfig: {
            defaults: {
              custom: {
                align: "auto",
                filterable: true
              }
            },
            overrides: []
          },
          options: {
            showHeader: true,
            footer: {
              show: false,
              reducer: [
                "sum"
              ],
              fields: ""
            }
          }
        },
        {
          type: "row",
          title: "Scans and inspection cost",
          id: 18,
          collapsed: false,
          gridPos: {
            h: 1,
            w: 24,
            x: 0,
            y: 70
          },
          panels: []
        },
        {
          type: "timeseries",
          title: "Scan duration and last-scan age",
          description: "Duration of the last scan (left) and seconds since it completed (right).",
          id: 19,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 71
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "gpuguard_scan_duration_seconds{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} duration",
              range: true,
              instant: false,
              format: "time_series"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "time() - gpuguard_last_scan_timestamp_seconds{%(exporterSelector)s, instance=~\"$instance\"}" % c,
              legendFormat: "{{instance}} last scan age",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "s",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byFrameRefID",
                  options: "B"
                },
                properties: [
                  {
                    id: "custom.axisPlacement",
                    value: "right"
                  }
                ]
              }
            ]
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Scan errors by stage",
          description: "Scan errors per second, by stage.",
          id: 20,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 71
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, stage) (rate(gpuguard_scan_errors_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}} {{stage}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "ops",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Inspector calls per callsite",
          description: "NVML and /proc calls per second, by callsite.",
          id: 21,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 8,
            x: 0,
            y: 79
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, callsite) (rate(gpuguard_inspector_calls_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}} {{callsite}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "ops",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Inspector time per callsite",
          description: "Seconds spent per second of wall time, by callsite.",
          id: 22,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 8,
            x: 8,
            y: 79
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, callsite) (rate(gpuguard_inspector_seconds_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}} {{callsite}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "s",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "/proc reads per callsite",
          description: "/proc file reads per second, by callsite.",
          id: 23,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 8,
            x: 16,
            y: 79
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, callsite) (rate(gpuguard_inspector_proc_reads_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}} {{callsite}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "ops",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "/proc reads per scan",
          description: "Average /proc reads per scan. Divide by the lower bound (one stat per distinct chain member + one per session leader) for the waste ratio; the goal is 1.0 on a warm cache.",
          id: 24,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 87
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance) (rate(gpuguard_inspector_proc_reads_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))\n/\nsum by (instance) (rate(gpuguard_scans_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Scans per second",
          description: "Completed scans per second.",
          id: 25,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 87
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance) (rate(gpuguard_scans_total{%(exporterSelector)s, instance=~\"$instance\"}[%(dashboardRateInterval)s]))" % c,
              legendFormat: "{{instance}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "ops",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "row",
          title: "Remediator",
          id: 26,
          collapsed: false,
          gridPos: {
            h: 1,
            w: 24,
            x: 0,
            y: 95
          },
          panels: []
        },
        {
          type: "timeseries",
          title: "Remediator decisions by action and reason",
          description: "Decisions per hour; remediator instances on the hosts of the selected exporters.",
          id: 27,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 96
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (action, reason) (\nlabel_replace(increase(gpuguard_remediator_decisions_total{%(remediatorSelector)s}[1h]), \"node\", \"$1\", \"instance\", \"([^:]+).*\")\n  * on (node) group_left ()\n  group by (node) (label_replace(gpuguard_host_info{%(exporterSelector)s, instance=~\"$instance\"}, \"node\", \"$1\", \"instance\", \"([^:]+).*\"))\n)" % c,
              legendFormat: "{{action}} / {{reason}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Reclaimed GPU memory",
          description: "GPU memory freed by reaps, per hour.",
          id: 28,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 96
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance) (\nlabel_replace(increase(gpuguard_remediator_reclaimed_bytes_total{%(remediatorSelector)s}[1h]), \"node\", \"$1\", \"instance\", \"([^:]+).*\")\n  * on (node) group_left ()\n  group by (node) (label_replace(gpuguard_host_info{%(exporterSelector)s, instance=~\"$instance\"}, \"node\", \"$1\", \"instance\", \"([^:]+).*\"))\n)" % c,
              legendFormat: "{{instance}}",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "bytes",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Reaped processes and reap failures",
          description: "Per hour.",
          id: 29,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 0,
            y: 104
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance) (\nlabel_replace(increase(gpuguard_remediator_reaped_processes_total{%(remediatorSelector)s}[1h]), \"node\", \"$1\", \"instance\", \"([^:]+).*\")\n  * on (node) group_left ()\n  group by (node) (label_replace(gpuguard_host_info{%(exporterSelector)s, instance=~\"$instance\"}, \"node\", \"$1\", \"instance\", \"([^:]+).*\"))\n)" % c,
              legendFormat: "{{instance}} reaped",
              range: true,
              instant: false,
              format: "time_series"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "sum by (instance) (\nlabel_replace(increase(gpuguard_remediator_reap_failures_total{%(remediatorSelector)s}[1h]), \"node\", \"$1\", \"instance\", \"([^:]+).*\")\n  * on (node) group_left ()\n  group by (node) (label_replace(gpuguard_host_info{%(exporterSelector)s, instance=~\"$instance\"}, \"node\", \"$1\", \"instance\", \"([^:]+).*\"))\n)" % c,
              legendFormat: "{{instance}} failed",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: []
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        },
        {
          type: "timeseries",
          title: "Rejected requests and queue depth",
          description: "Webhook requests rejected per hour by cause (left) and the work queue depth (right).",
          id: 30,
          datasource: datasource,
          gridPos: {
            h: 8,
            w: 12,
            x: 12,
            y: 104
          },
          targets: [
            {
              datasource: datasource,
              refId: "A",
              expr: "sum by (instance, cause) (\nlabel_replace(increase(gpuguard_remediator_rejected_requests_total{%(remediatorSelector)s}[1h]), \"node\", \"$1\", \"instance\", \"([^:]+).*\")\n  * on (node) group_left ()\n  group by (node) (label_replace(gpuguard_host_info{%(exporterSelector)s, instance=~\"$instance\"}, \"node\", \"$1\", \"instance\", \"([^:]+).*\"))\n)" % c,
              legendFormat: "{{instance}} rejected {{cause}}",
              range: true,
              instant: false,
              format: "time_series"
            },
            {
              datasource: datasource,
              refId: "B",
              expr: "max by (instance) (\nlabel_replace(gpuguard_remediator_queue_depth{%(remediatorSelector)s}, \"node\", \"$1\", \"instance\", \"([^:]+).*\")\n  * on (node) group_left ()\n  group by (node) (label_replace(gpuguard_host_info{%(exporterSelector)s, instance=~\"$instance\"}, \"node\", \"$1\", \"instance\", \"([^:]+).*\"))\n)" % c,
              legendFormat: "{{instance}} queue",
              range: true,
              instant: false,
              format: "time_series"
            }
          ],
          fieldConfig: {
            defaults: {
              unit: "short",
              custom: {
                drawStyle: "line",
                lineWidth: 1,
                fillOpacity: 10,
                showPoints: "never",
                stacking: {
                  mode: "none",
                  group: "A"
                }
              }
            },
            overrides: [
              {
                matcher: {
                  id: "byFrameRefID",
                  options: "B"
                },
                properties: [
                  {
                    id: "custom.axisPlacement",
                    value: "right"
                  }
                ]
              }
            ]
          },
          options: {
            legend: {
              displayMode: "table",
              placement: "bottom",
              calcs: [
                "lastNotNull",
                "max"
              ]
            },
            tooltip: {
              mode: "multi",
              sort: "desc"
            }
          }
        }
      ]
    },
  },
}
