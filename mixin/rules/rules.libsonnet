// Recording rules for the joins people ask for. gpuguard's per-GPU and per-process series
// carry dcgm-exporter's label names (UUID, gpu, modelName), so they join its series on
// UUID without label_replace; dcgm-exporter is its own scrape target (its own instance
// and job), so those joins match on UUID alone. Units differ: gpuguard exports bytes,
// dcgm-exporter's DCGM_FI_DEV_FB_USED / _FB_FREE are MiB (multiply by 2^20 to compare).
{
  local c = $._config,
  local braces(selector) = if selector == '' then '' else '{%s}' % selector,
  local s = c { dcgm: braces(c.dcgmExporterSelector) },

  prometheusRules+:: {
    groups+: [{
      name: 'gpuguard-joins',
      rules: [
        // GPU memory held by orphaned processes, per GPU (UUID).
        {
          record: 'gpuguard:orphan_gpu_memory_bytes:by_uuid',
          expr: |||
            sum by (instance, UUID) (
                gpuguard_gpu_process_memory_bytes{%(exporterSelector)s}
              * on (instance, pid) group_left ()
                gpuguard_gpu_process_info{%(exporterSelector)s, verdict="orphan"}
            )
          ||| % s,
        },
        // ... per GPU model: modelName from gpuguard_gpu_info or, for a GPU it has no
        // series of (the exporter with --no-collector.gpu beside dcgm-exporter), from
        // dcgm-exporter's. One side per GPU (`or on (UUID)`), and one model per GPU
        // (`topk by (UUID)`): the two may name a model differently (NVML's name against
        // DCGM's), and two models for one UUID failed the whole join (many-to-many).
        {
          record: 'gpuguard:orphan_gpu_memory_bytes:by_model',
          expr: |||
            sum by (instance, modelName) (
                gpuguard:orphan_gpu_memory_bytes:by_uuid
              * on (UUID) group_left (modelName)
                topk by (UUID) (1,
                    group by (UUID, modelName) (gpuguard_gpu_info{%(exporterSelector)s})
                  or on (UUID)
                    group by (UUID, modelName) (DCGM_FI_DEV_FB_USED%(dcgm)s)
                )
            )
          ||| % s,
        },
        // ... per Kubernetes pod of the orphaned process (from its cgroup).
        {
          record: 'gpuguard:orphan_gpu_memory_bytes:by_pod_uid',
          expr: |||
            sum by (instance, pod_uid) (
                gpuguard_gpu_process_memory_bytes{%(exporterSelector)s}
              * on (instance, pid) group_left (pod_uid)
                gpuguard_gpu_process_info{%(exporterSelector)s, verdict="orphan", pod_uid!=""}
            )
          ||| % s,
        },
        // ... per GPU with dcgm-exporter's pod, namespace and model for that GPU (the pod
        // the kubelet assigned the GPU to), joined on UUID alone. A GPU dcgm-exporter
        // reports for several pods (MIG, time-slicing) is left out: which pod holds the
        // orphan's memory cannot be told from the GPU (by_uuid has it).
        {
          record: 'gpuguard:orphan_gpu_memory_bytes:by_dcgm_pod',
          expr: |||
            sum by (UUID) (gpuguard:orphan_gpu_memory_bytes:by_uuid)
            * on (UUID) group_left (modelName, namespace, pod)
              (
                group by (UUID, modelName, namespace, pod) (DCGM_FI_DEV_FB_USED%(dcgm)s)
                and on (UUID)
                count by (UUID) (group by (UUID, modelName, namespace, pod) (DCGM_FI_DEV_FB_USED%(dcgm)s)) == 1
              )
          ||| % s,
        },
      ],
    }],
  },
}
