/*
 * fakeamdsmi.c: a fake libamd_smi.so for gpuguard's tests.
 *
 * The real, unmodified PyPI `amdsmi` wrapper loads this library (from $ROCM_PATH/lib) and
 * sees the GPUs, processes and failures a text file describes; its path is in
 * FAKE_AMDSMI_STATE, re-read on every call, so a test changes the world between two calls.
 * No file means no driver: amdsmi_init answers AMDSMI_STATUS_DRIVER_NOT_LOADED (34), and
 * so does every other call.
 *
 * The wrapper binds every one of its symbols at import (an older library fails there with
 * AttributeError): the calls gpuguard makes have real bodies here; the build adds a stub
 * answering AMDSMI_STATUS_NOT_SUPPORTED for every other symbol the installed wrapper binds
 * (tests/support/fakeamdsmi/__init__.py generates them from the wrapper's source).
 *
 * State file, one directive a line, '#' starts a comment line:
 *   driver VERSION                   amdsmi_get_gpu_driver_info's version (default 6.10.5)
 *   init_error CODE                  amdsmi_init answers CODE
 *   runtime_error CODE               every other call answers CODE
 *   reset_log PATH                   amdsmi_reset_gpu appends "reset UUID" to PATH
 *   gpu IDX UUID TOTAL_MIB USED_MIB GFX_PCT TEMP_C POWER_W BDF NAME...
 *                                    one GPU (BDF as 0000:03:00.0; NAME is the rest)
 *   error IDX FIELD CODE             FIELD on GPU IDX answers CODE; FIELD is one of
 *                                    uuid asic vram activity temp power driver bdf
 *                                    processes reset
 *   proc IDX PID VRAM_BYTES GFX_NS NAME
 *                                    a process on GPU IDX (memory_usage.vram_mem and
 *                                    engine_usage.gfx of amdsmi_proc_info_t)
 *
 * The process list answers as the library: in, *max_processes is the room in the buffer;
 * out, the number of processes; AMDSMI_STATUS_OUT_OF_RESOURCES when they do not fit.
 * amdsmi_init counts references; a call before it (or after the last amdsmi_shut_down)
 * answers AMDSMI_STATUS_NOT_INIT (32).
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define AMDSMI_STATUS_SUCCESS 0
#define AMDSMI_STATUS_INVAL 1
#define AMDSMI_STATUS_NOT_SUPPORTED 2
#define AMDSMI_STATUS_OUT_OF_RESOURCES 15
#define AMDSMI_STATUS_NOT_FOUND 31
#define AMDSMI_STATUS_NOT_INIT 32
#define AMDSMI_STATUS_DRIVER_NOT_LOADED 34

#define AMDSMI_TEMPERATURE_TYPE_EDGE 0

#define MAX_GPUS 16
#define MAX_PROCS 1024
#define TEXT_LEN 256

enum field { F_UUID, F_ASIC, F_VRAM, F_ACTIVITY, F_TEMP, F_POWER, F_DRIVER, F_BDF,
             F_PROCESSES, F_RESET, F_COUNT };
static const char *const field_names[F_COUNT] = {
    "uuid", "asic", "vram", "activity", "temp", "power", "driver", "bdf", "processes",
    "reset"};

typedef uint32_t amdsmi_status_t;

struct gpu {
    int present;
    char uuid[TEXT_LEN];
    char name[TEXT_LEN];
    uint32_t total_mib, used_mib, gfx_pct, power_w;
    int64_t temp_c;
    unsigned int domain, bus, device, function;
    int field_error[F_COUNT];
};

struct proc {
    int gpu;
    uint32_t pid;
    uint64_t vram, gfx_ns;
    char name[TEXT_LEN];
};

struct state {
    int file_ok;
    char driver[TEXT_LEN];
    char reset_log[1024];
    int init_error, runtime_error;
    struct gpu gpus[MAX_GPUS];
    int proc_count;
    struct proc procs[MAX_PROCS];
};

/* The wrapper's ctypes structures (_pack_ = 1), the fields gpuguard reads. */
#pragma pack(push, 1)
typedef struct {
    uint32_t vram_total, vram_used;
    uint32_t reserved[2];
} amdsmi_vram_usage_t;
typedef struct {
    uint32_t gfx_activity, umc_activity, mm_activity;
    uint32_t reserved[13];
} amdsmi_engine_usage_t;
typedef struct {
    char driver_version[256], driver_date[256], driver_name[256];
} amdsmi_driver_info_t;
typedef struct {
    char market_name[256];
    uint32_t vendor_id;
    char vendor_name[256];
    uint32_t subvendor_id;
    uint64_t device_id;
    uint32_t rev_id;
    char asic_serial[256];
    uint32_t oam_id, num_of_compute_units;
    uint8_t padding0[4];
    uint64_t target_graphics_version;
    uint32_t subsystem_id;
    uint32_t reserved[21];
} amdsmi_asic_info_t;
typedef struct {
    uint64_t socket_power;
    uint32_t current_socket_power, average_socket_power;
    uint64_t gfx_voltage, soc_voltage, mem_voltage;
    uint32_t power_limit;
    uint8_t padding0[4];
    uint64_t reserved[18];
} amdsmi_power_info_t;
typedef struct {
    char name[256];
    uint32_t pid;
    uint8_t padding0[4];
    uint64_t mem;
    struct { uint64_t gfx, enc; uint32_t reserved[12]; } engine_usage;
    struct { uint64_t gtt_mem, cpu_mem, vram_mem; uint32_t reserved[10]; } memory_usage;
    char container_name[256];
    uint32_t cu_occupancy;
    uint32_t reserved[11];
} amdsmi_proc_info_t;
#pragma pack(pop)

/* A processor handle points at one slot; the slot number is the GPU's index. */
struct fake_device { int index; };
static struct fake_device devices[MAX_GPUS];
static int socket_token; /* the one socket's handle points here */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct state st;
static int init_refcount;

static int parse_field(const char *s) {
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(s, field_names[i]) == 0) return i;
    return -1;
}

static void bad_line(int lineno, const char *line) {
    fprintf(stderr, "fakeamdsmi: ignoring bad state line %d: %s\n", lineno, line);
}

/* Re-read the state file into `st`. Caller holds `lock`. */
static void load_state(void) {
    memset(&st, 0, sizeof st);
    strcpy(st.driver, "6.10.5");
    const char *path = getenv("FAKE_AMDSMI_STATE");
    if (path == NULL || *path == '\0') return;
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    st.file_ok = 1;
    char line[2048];
    int lineno = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        lineno++;
        line[strcspn(line, "\r\n")] = '\0';
        char word[32];
        int off = 0, idx, code, n = 0;
        if (line[0] == '#' || sscanf(line, "%31s %n", word, &off) < 1) continue;
        const char *rest = line + off;
        if (strcmp(word, "driver") == 0) {
            snprintf(st.driver, sizeof st.driver, "%s", rest);
        } else if (strcmp(word, "reset_log") == 0) {
            snprintf(st.reset_log, sizeof st.reset_log, "%s", rest);
        } else if (strcmp(word, "init_error") == 0) {
            if (sscanf(rest, "%d", &st.init_error) != 1) bad_line(lineno, line);
        } else if (strcmp(word, "runtime_error") == 0) {
            if (sscanf(rest, "%d", &st.runtime_error) != 1) bad_line(lineno, line);
        } else if (strcmp(word, "gpu") == 0) {
            struct gpu g;
            memset(&g, 0, sizeof g);
            long long temp;
            if (sscanf(rest, "%d %255s %u %u %u %lld %u %x:%x:%x.%x %n", &idx, g.uuid,
                       &g.total_mib, &g.used_mib, &g.gfx_pct, &temp, &g.power_w, &g.domain,
                       &g.bus, &g.device, &g.function, &n) < 11 ||
                idx < 0 || idx >= MAX_GPUS || n == 0) {
                bad_line(lineno, line);
                continue;
            }
            g.temp_c = temp;
            snprintf(g.name, sizeof g.name, "%s", rest + n);
            memcpy(g.field_error, st.gpus[idx].field_error, sizeof g.field_error);
            g.present = 1;
            st.gpus[idx] = g;
        } else if (strcmp(word, "error") == 0) {
            char fname[32];
            int fi;
            if (sscanf(rest, "%d %31s %d", &idx, fname, &code) != 3 || idx < 0 ||
                idx >= MAX_GPUS || (fi = parse_field(fname)) < 0)
                bad_line(lineno, line);
            else st.gpus[idx].field_error[fi] = code;
        } else if (strcmp(word, "proc") == 0) {
            struct proc p;
            memset(&p, 0, sizeof p);
            if (st.proc_count >= MAX_PROCS ||
                sscanf(rest, "%d %" SCNu32 " %" SCNu64 " %" SCNu64 " %n", &p.gpu, &p.pid,
                       &p.vram, &p.gfx_ns, &n) < 4 ||
                p.gpu < 0 || p.gpu >= MAX_GPUS) {
                bad_line(lineno, line);
                continue;
            }
            if (n > 0) snprintf(p.name, sizeof p.name, "%s", rest + n);
            st.procs[st.proc_count++] = p;
        } else {
            bad_line(lineno, line);
        }
    }
    fclose(f);
}

/* Enter a call: lock, reload the world, and answer what stops every call. */
static amdsmi_status_t enter(void) {
    pthread_mutex_lock(&lock);
    load_state();
    if (!st.file_ok) return AMDSMI_STATUS_DRIVER_NOT_LOADED;
    if (init_refcount == 0) return AMDSMI_STATUS_NOT_INIT;
    if (st.runtime_error) return (amdsmi_status_t)st.runtime_error;
    return AMDSMI_STATUS_SUCCESS;
}

static amdsmi_status_t leave(amdsmi_status_t rc) {
    pthread_mutex_unlock(&lock);
    return rc;
}

/* The GPU a handle names, or an error (an unknown handle, a GPU gone, a broken field). */
static amdsmi_status_t gpu_of(void *handle, enum field what, struct gpu **out) {
    struct fake_device *d = handle;
    if (d < devices || d >= devices + MAX_GPUS) return AMDSMI_STATUS_INVAL;
    struct gpu *g = &st.gpus[d->index];
    if (!g->present) return AMDSMI_STATUS_NOT_FOUND;
    if (g->field_error[what]) return (amdsmi_status_t)g->field_error[what];
    *out = g;
    return AMDSMI_STATUS_SUCCESS;
}

static void copy_text(char *dest, size_t size, const char *src) {
    memset(dest, 0, size);
    snprintf(dest, size, "%s", src);
}

amdsmi_status_t amdsmi_init(uint64_t flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    load_state();
    amdsmi_status_t rc = !st.file_ok ? AMDSMI_STATUS_DRIVER_NOT_LOADED
                         : st.init_error ? (amdsmi_status_t)st.init_error
                         : AMDSMI_STATUS_SUCCESS;
    if (rc == AMDSMI_STATUS_SUCCESS) init_refcount++;
    return leave(rc);
}

amdsmi_status_t amdsmi_shut_down(void) {
    pthread_mutex_lock(&lock);
    if (init_refcount == 0) return leave(AMDSMI_STATUS_NOT_INIT);
    init_refcount--;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_socket_handles(uint32_t *count, void **handles) {
    amdsmi_status_t rc = enter();
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    if (count == NULL) return leave(AMDSMI_STATUS_INVAL);
    if (handles != NULL && *count >= 1) handles[0] = &socket_token;
    *count = 1;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_processor_handles(void *socket, uint32_t *count, void **handles) {
    amdsmi_status_t rc = enter();
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    if (socket != &socket_token || count == NULL) return leave(AMDSMI_STATUS_INVAL);
    uint32_t found = 0;
    for (int i = 0; i < MAX_GPUS; i++) {
        if (!st.gpus[i].present) continue;
        devices[i].index = i;
        if (handles != NULL && found < *count) handles[found] = &devices[i];
        found++;
    }
    *count = found;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_device_uuid(void *handle, uint32_t *len, char *uuid) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_UUID, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    if (len == NULL || uuid == NULL || *len <= strlen(g->uuid))
        return leave(AMDSMI_STATUS_INVAL);
    copy_text(uuid, *len, g->uuid);
    *len = (uint32_t)strlen(g->uuid);
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_asic_info(void *handle, amdsmi_asic_info_t *info) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_ASIC, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    memset(info, 0, sizeof *info);
    copy_text(info->market_name, sizeof info->market_name, g->name);
    copy_text(info->vendor_name, sizeof info->vendor_name, "Advanced Micro Devices Inc.");
    info->vendor_id = 0x1002;
    info->device_id = 0x74a1;
    info->oam_id = 0xffffffffu;
    info->num_of_compute_units = 304;
    info->target_graphics_version = 0x942;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_vram_usage(void *handle, amdsmi_vram_usage_t *usage) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_VRAM, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    memset(usage, 0, sizeof *usage);
    usage->vram_total = g->total_mib; /* MiB, as the library answers */
    usage->vram_used = g->used_mib;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_activity(void *handle, amdsmi_engine_usage_t *usage) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_ACTIVITY, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    memset(usage, 0, sizeof *usage);
    usage->gfx_activity = g->gfx_pct;
    usage->umc_activity = 0xffff; /* N/A, as on GPUs that do not report it */
    usage->mm_activity = 0xffff;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_temp_metric(void *handle, uint32_t sensor, uint32_t metric,
                                       int64_t *value) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_TEMP, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    if (sensor != AMDSMI_TEMPERATURE_TYPE_EDGE || metric != 0)
        return leave(AMDSMI_STATUS_NOT_SUPPORTED);
    *value = g->temp_c;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_power_info(void *handle, amdsmi_power_info_t *info) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_POWER, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    memset(info, 0, sizeof *info);
    info->current_socket_power = g->power_w;
    info->average_socket_power = 0xffff; /* N/A: MI300 reports the current one only */
    info->power_limit = 750;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_driver_info(void *handle, amdsmi_driver_info_t *info) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_DRIVER, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    memset(info, 0, sizeof *info);
    copy_text(info->driver_version, sizeof info->driver_version, st.driver);
    copy_text(info->driver_date, sizeof info->driver_date, "2025/01/01 00:00");
    copy_text(info->driver_name, sizeof info->driver_name, "amdgpu");
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_device_bdf(void *handle, uint64_t *bdf) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_BDF, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    /* amdsmi_bdf_t: function 3 bits, device 5, bus 8, domain 48, from the low bit up */
    *bdf = (uint64_t)(g->function & 0x7) | (uint64_t)(g->device & 0x1f) << 3
           | (uint64_t)(g->bus & 0xff) << 8 | (uint64_t)g->domain << 16;
    return leave(AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_get_gpu_process_list(void *handle, uint32_t *max_processes,
                                            amdsmi_proc_info_t *list) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_PROCESSES, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    if (max_processes == NULL) return leave(AMDSMI_STATUS_INVAL);
    int index = (int)(g - st.gpus);
    uint32_t found = 0;
    for (int i = 0; i < st.proc_count; i++) {
        struct proc *p = &st.procs[i];
        if (p->gpu != index) continue;
        if (list != NULL && found < *max_processes) {
            amdsmi_proc_info_t *out = &list[found];
            memset(out, 0, sizeof *out);
            copy_text(out->name, sizeof out->name, p->name);
            out->pid = p->pid;
            out->mem = p->vram;
            out->engine_usage.gfx = p->gfx_ns;
            out->memory_usage.vram_mem = p->vram;
            out->cu_occupancy = 0xffffffffu;
        }
        found++;
    }
    uint32_t room = *max_processes;
    *max_processes = found;
    return leave(found > room ? AMDSMI_STATUS_OUT_OF_RESOURCES : AMDSMI_STATUS_SUCCESS);
}

amdsmi_status_t amdsmi_reset_gpu(void *handle) {
    struct gpu *g = NULL;
    amdsmi_status_t rc = enter();
    if (rc == AMDSMI_STATUS_SUCCESS) rc = gpu_of(handle, F_RESET, &g);
    if (rc != AMDSMI_STATUS_SUCCESS) return leave(rc);
    if (st.reset_log[0] != '\0') {
        FILE *f = fopen(st.reset_log, "a");
        if (f == NULL) return leave(AMDSMI_STATUS_NOT_SUPPORTED);
        fprintf(f, "reset %s\n", g->uuid);
        fclose(f);
    }
    return leave(AMDSMI_STATUS_SUCCESS);
}

/* Where the fields this library writes lie, for the test that compares them with the
 * installed wrapper's ctypes structures (their layout changes between releases). */
long fakeamdsmi_offset(const char *what) {
    static const struct { const char *name; long offset; } known[] = {
        {"amdsmi_proc_info_t.pid", offsetof(amdsmi_proc_info_t, pid)},
        {"amdsmi_proc_info_t.mem", offsetof(amdsmi_proc_info_t, mem)},
        {"amdsmi_proc_info_t.engine_usage", offsetof(amdsmi_proc_info_t, engine_usage)},
        {"amdsmi_proc_info_t.memory_usage", offsetof(amdsmi_proc_info_t, memory_usage)},
        {"amdsmi_proc_info_t.cu_occupancy", offsetof(amdsmi_proc_info_t, cu_occupancy)},
        {"amdsmi_proc_info_t", sizeof(amdsmi_proc_info_t)},
        {"amdsmi_vram_usage_t", sizeof(amdsmi_vram_usage_t)},
        {"amdsmi_engine_usage_t", sizeof(amdsmi_engine_usage_t)},
        {"amdsmi_driver_info_t", sizeof(amdsmi_driver_info_t)},
        {"amdsmi_asic_info_t", sizeof(amdsmi_asic_info_t)},
        {"amdsmi_asic_info_t.target_graphics_version",
         offsetof(amdsmi_asic_info_t, target_graphics_version)},
        {"amdsmi_power_info_t", sizeof(amdsmi_power_info_t)},
        {"amdsmi_power_info_t.current_socket_power",
         offsetof(amdsmi_power_info_t, current_socket_power)},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strcmp(what, known[i].name) == 0) return known[i].offset;
    return -1;
}
