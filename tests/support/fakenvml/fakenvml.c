/*
 * fakenvml.c: a fake libnvidia-ml.so.1 for gpuguard's tests.
 *
 * The real, unmodified pynvml (nvidia-ml-py >= 13) loads this library and sees
 * the GPUs, processes and failures described by a text file whose path is in
 * FAKE_NVML_STATE. The file is re-read on every call (getenv each time), so a
 * test can change the world between two calls. No file means no driver: init
 * answers NVML_ERROR_DRIVER_NOT_LOADED, other calls the same.
 *
 * State file, one directive a line, '#' starts a comment line:
 *   driver VERSION                       driver version string (default 550.54.15)
 *   init_error CODE                      nvmlInit* answers CODE
 *   runtime_error CODE                   every other call answers CODE
 *   delay_ms MS                          every call sleeps MS milliseconds
 *   gpu IDX UUID TOTAL USED UTILGPU UTILMEM TEMPC POWERMW NAME...
 *                                        one GPU; NAME is the rest of the line
 *   reserved IDX BYTES                   GPU IDX's driver-reserved memory (default 0): the
 *                                        memory _v2 answers total, reserved, USED and
 *                                        free = total - USED - reserved; _v1 (which has
 *                                        no reserved field) answers used = USED + reserved
 *   minor IDX N                          GPU IDX's minor number, /dev/nvidiaN (default IDX)
 *   pci IDX DOMAIN BUS DEVICE            GPU IDX's PCI address, hex (default 0 IDX+1 0): busId
 *                                        "%08X:%02X:%02X.0", busIdLegacy "%04X:%02X:%02X.0"
 *   lost IDX                             every call on GPU IDX answers 15 (GPU is lost)
 *   error IDX FIELD CODE                 FIELD on GPU IDX answers CODE; FIELD is one of
 *                                        name uuid memory utilization temperature power
 *                                        compute graphics minor pci mig recovery
 *                                        (recovery: that value's own nvmlReturn)
 *   proc IDX C|G PID BYTES|na            a running process; na = 2**64-1 (not available);
 *                                        the same pid twice in one list is two entries
 *                                        (as MIG lists one per instance)
 *   missing FUNCTION                     FUNCTION answers 13 (FUNCTION_NOT_FOUND), what
 *                                        pynvml raises for a symbol an older driver lacks;
 *                                        for nvmlDeviceGetMemoryInfo_v2,
 *                                        nvmlDeviceGetTemperatureV and
 *                                        nvmlDeviceGetProcessesUtilizationInfo (the calls
 *                                        with a fallback), nvmlDeviceGetMigMode and
 *                                        nvmlDeviceGetFieldValues
 *   sample IDX PID TS SM MEM [ENC DEC]   one utilization sample of PID on GPU IDX, taken at
 *                                        TS (microseconds since the epoch, as the driver's);
 *                                        ENC and DEC (encoder, decoder) default to 0
 *   busy IDX PID SM MEM [ENC DEC]        PID keeps GPU IDX busy: every call sees a fresh
 *                                        sample taken now (the driver samples a running
 *                                        kernel every few hundred ms)
 *   clock_us US                          the driver's wall clock reads US (microseconds
 *                                        since the epoch): `busy` samples are stamped US
 *                                        rather than CLOCK_REALTIME's now, so a test can
 *                                        step the clock NVML stamps its samples with
 *   mig IDX CURRENT PENDING              GPU IDX's MIG mode (nvmlDeviceGetMigMode; default
 *                                        0 0, an H100 with MIG off). It changes nothing
 *                                        else here: the utilization calls answer as
 *                                        without MIG, so a caller cannot lean on a driver
 *                                        that refuses them under MIG. Its FIELD is mig
 *   recovery IDX ACTION                  GPU IDX's NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230)
 *                                        through nvmlDeviceGetFieldValues: ACTION as an
 *                                        unsigned int (nvmlDeviceGpuRecoveryAction_t, 0 none
 *                                        ... 7). Without the line the field answers
 *                                        NOT_SUPPORTED, as a driver older than the field
 *                                        does; so does every other field id. `error IDX
 *                                        recovery CODE` makes the field's own nvmlReturn
 *                                        CODE (the call itself still answers SUCCESS, as
 *                                        NVML does when it fills any value)
 *
 * Per-process utilization (nvmlDeviceGetProcessUtilization, the legacy call, and
 * nvmlDeviceGetProcessesUtilizationInfo, R550's versioned one) answers as the driver:
 * only samples newer than lastSeenTimeStamp, only processes with a sample (NVML keeps
 * none for a process that used nothing), NOT_FOUND when there is none, and the two-pass
 * size protocol (NULL buffer or too small a count: INSUFFICIENT_SIZE with the count).
 * Their FIELDs for `error` are process_utilization and processes_utilization.
 *
 * Concurrency probe: every entry point counts itself in flight from entry until it
 * returns (the injected delay included); fakenvml_max_in_flight() answers the most
 * calls seen in flight at once since fakenvml_reset_in_flight(). The library's own
 * mutex only guards its state, so a caller that does not serialise its NVML calls
 * shows up here as a maximum above 1 (try it with a delay_ms).
 *
 * Build: gcc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 \
 *        fakenvml.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_PROCS 1024
#define NAME_LEN 96
#define UUID_LEN 96
#define VERSION_LEN 80
#define MAX_MISSING 8
#define FUNCTION_LEN 64
#define MAX_SAMPLES 1024

#define NVML_MEMORY_V2 0x02000028u
#define NVML_TEMPERATURE_V1 0x0100000Cu
#define NVML_PROCESSES_UTILIZATION_INFO_V1 0x01000018u
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_VALUE_TYPE_UNSIGNED_INT 1

enum field { F_NAME, F_UUID, F_MEMORY, F_UTILIZATION, F_TEMPERATURE, F_POWER, F_COMPUTE,
             F_GRAPHICS, F_PROCESS_UTILIZATION, F_PROCESSES_UTILIZATION, F_MINOR, F_PCI,
             F_MIG, F_RECOVERY, F_COUNT };
static const char *const field_names[F_COUNT] = {
    "name", "uuid", "memory", "utilization", "temperature", "power", "compute", "graphics",
    "process_utilization", "processes_utilization", "minor", "pci", "mig", "recovery"};

typedef int nvmlReturn_t;

struct gpu {
    int present;
    int lost;
    char uuid[UUID_LEN];
    char name[NAME_LEN];
    unsigned long long total, used, reserved;
    unsigned int util_gpu, util_mem, temp_c, power_mw;
    int field_error[F_COUNT];
    int has_minor, has_pci; /* set by a minor / pci line; else the defaults */
    unsigned int minor, pci_domain, pci_bus, pci_device;
    unsigned int mig_current, mig_pending;
    int has_recovery; /* a recovery line: the field is supported */
    unsigned int recovery;
};

struct proc {
    int gpu;
    char kind; /* 'C' or 'G' */
    unsigned int pid;
    unsigned long long used;
};

struct sample {
    int gpu;
    int fresh; /* busy: taken at the time of each call */
    unsigned int pid;
    unsigned long long ts; /* microseconds since the epoch */
    unsigned int sm, mem, enc, dec;
};

struct state {
    int file_ok;
    char driver[VERSION_LEN];
    int init_error, runtime_error;
    long delay_ms;
    int gpu_count;
    struct gpu gpus[MAX_GPUS];
    int proc_count;
    struct proc procs[MAX_PROCS];
    int missing_count;
    char missing[MAX_MISSING][FUNCTION_LEN];
    int sample_count;
    struct sample samples[MAX_SAMPLES];
    int has_clock; /* a clock_us line: the time `busy` samples are stamped with */
    unsigned long long clock_us;
};

/* Layouts match pynvml's ctypes structures. */
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned int version; unsigned int sensorType; int temperature; } nvmlTemperature_t;
/* nvmlPciInfo_t as nvmlDeviceGetPciInfo_v3 fills it: busId moved to the end in NVML 9. */
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

/* pynvml's c_nvmlProcessUtilizationSample_t (legacy call). */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
/* pynvml's c_nvmlProcessUtilizationInfo_v1_t and c_nvmlProcessesUtilizationInfo_v1_t. */
typedef struct {
    unsigned long long timeStamp;
    unsigned int pid, smUtil, memUtil, encUtil, decUtil, jpgUtil, ofaUtil;
} nvmlProcessUtilizationInfo_v1_t;
typedef struct {
    unsigned int version;
    unsigned int processSamplesCount;
    unsigned long long lastSeenTimeStamp;
    nvmlProcessUtilizationInfo_v1_t *procUtilArray;
} nvmlProcessesUtilizationInfo_t;

/* pynvml's c_nvmlFieldValue_t: the value is a union of at most 8 bytes. */
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    union { double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal;
            long long sllVal; int siVal; unsigned short usVal; } value;
} nvmlFieldValue_t;

/* A handle points at one slot; the slot number is the GPU index. */
struct fake_device { int index; };
typedef struct fake_device *nvmlDevice_t;
static struct fake_device devices[MAX_GPUS];

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct state st;
static int init_refcount;

_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t must be 40 bytes");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t must be 24 bytes");
_Static_assert(sizeof(nvmlTemperature_t) == 12, "nvmlTemperature_t must be 12 bytes");
_Static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "legacy sample must be 32 bytes");
_Static_assert(sizeof(nvmlProcessUtilizationInfo_v1_t) == 40, "v1 info must be 40 bytes");
_Static_assert(sizeof(nvmlProcessesUtilizationInfo_t) == 24, "v1 header must be 24 bytes");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t must be 68 bytes");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t must be 40 bytes");

static int parse_field(const char *s) {
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(s, field_names[i]) == 0) return i;
    return -1;
}

static void bad_line(int lineno, const char *line) {
    fprintf(stderr, "fakenvml: ignoring bad state line %d: %s\n", lineno, line);
}

/* Re-read the state file into `st`. Caller holds `lock`. */
static void load_state(void) {
    memset(&st, 0, sizeof st);
    strcpy(st.driver, "550.54.15");
    const char *path = getenv("FAKE_NVML_STATE");
    if (path == NULL || *path == '\0') return;
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    st.file_ok = 1;
    char line[1024];
    int lineno = 0;
    while (fgets(line, sizeof line, f) != NULL) {
        lineno++;
        line[strcspn(line, "\r\n")] = '\0';
        char word[32];
        int off = 0;
        if (line[0] == '#' || sscanf(line, "%31s %n", word, &off) < 1) continue;
        const char *rest = line + off;
        int idx, code, n = 0;
        if (strcmp(word, "driver") == 0) {
            snprintf(st.driver, sizeof st.driver, "%s", rest);
        } else if (strcmp(word, "init_error") == 0) {
            if (sscanf(rest, "%d", &st.init_error) != 1) bad_line(lineno, line);
        } else if (strcmp(word, "runtime_error") == 0) {
            if (sscanf(rest, "%d", &st.runtime_error) != 1) bad_line(lineno, line);
        } else if (strcmp(word, "delay_ms") == 0) {
            if (sscanf(rest, "%ld", &st.delay_ms) != 1) bad_line(lineno, line);
        } else if (strcmp(word, "gpu") == 0) {
            struct gpu g;
            memset(&g, 0, sizeof g);
            if (sscanf(rest, "%d %95s %llu %llu %u %u %u %u %n", &idx, g.uuid, &g.total, &g.used,
                       &g.util_gpu, &g.util_mem, &g.temp_c, &g.power_mw, &n) < 8 ||
                idx < 0 || idx >= MAX_GPUS || n == 0) {
                bad_line(lineno, line);
                continue;
            }
            snprintf(g.name, sizeof g.name, "%s", rest + n);
            g.present = 1;
            g.lost = st.gpus[idx].lost; /* keep directives that came before */
            g.reserved = st.gpus[idx].reserved;
            memcpy(g.field_error, st.gpus[idx].field_error, sizeof g.field_error);
            g.has_minor = st.gpus[idx].has_minor;
            g.minor = st.gpus[idx].minor;
            g.has_pci = st.gpus[idx].has_pci;
            g.pci_domain = st.gpus[idx].pci_domain;
            g.pci_bus = st.gpus[idx].pci_bus;
            g.pci_device = st.gpus[idx].pci_device;
            g.mig_current = st.gpus[idx].mig_current;
            g.mig_pending = st.gpus[idx].mig_pending;
            g.has_recovery = st.gpus[idx].has_recovery;
            g.recovery = st.gpus[idx].recovery;
            if (!st.gpus[idx].present) st.gpu_count++;
            st.gpus[idx] = g;
        } else if (strcmp(word, "reserved") == 0) {
            unsigned long long bytes;
            if (sscanf(rest, "%d %llu", &idx, &bytes) != 2 || idx < 0 || idx >= MAX_GPUS)
                bad_line(lineno, line);
            else st.gpus[idx].reserved = bytes;
        } else if (strcmp(word, "minor") == 0) {
            unsigned int minor;
            if (sscanf(rest, "%d %u", &idx, &minor) != 2 || idx < 0 || idx >= MAX_GPUS)
                bad_line(lineno, line);
            else st.gpus[idx].has_minor = 1, st.gpus[idx].minor = minor;
        } else if (strcmp(word, "pci") == 0) {
            unsigned int domain, bus, device;
            if (sscanf(rest, "%d %x %x %x", &idx, &domain, &bus, &device) != 4 || idx < 0 ||
                idx >= MAX_GPUS || bus > 0xff || device > 0x1f) {
                bad_line(lineno, line);
                continue;
            }
            st.gpus[idx].has_pci = 1;
            st.gpus[idx].pci_domain = domain;
            st.gpus[idx].pci_bus = bus;
            st.gpus[idx].pci_device = device;
        } else if (strcmp(word, "mig") == 0) {
            unsigned int current, pending;
            if (sscanf(rest, "%d %u %u", &idx, &current, &pending) != 3 || idx < 0 ||
                idx >= MAX_GPUS || current > 1 || pending > 1)
                bad_line(lineno, line);
            else st.gpus[idx].mig_current = current, st.gpus[idx].mig_pending = pending;
        } else if (strcmp(word, "recovery") == 0) {
            unsigned int action;
            if (sscanf(rest, "%d %u", &idx, &action) != 2 || idx < 0 || idx >= MAX_GPUS)
                bad_line(lineno, line);
            else st.gpus[idx].has_recovery = 1, st.gpus[idx].recovery = action;
        } else if (strcmp(word, "missing") == 0) {
            if (st.missing_count >= MAX_MISSING ||
                sscanf(rest, "%63s", st.missing[st.missing_count]) != 1)
                bad_line(lineno, line);
            else st.missing_count++;
        } else if (strcmp(word, "lost") == 0) {
            if (sscanf(rest, "%d", &idx) != 1 || idx < 0 || idx >= MAX_GPUS) bad_line(lineno, line);
            else st.gpus[idx].lost = 1;
        } else if (strcmp(word, "error") == 0) {
            char fname[32];
            int fi;
            if (sscanf(rest, "%d %31s %d", &idx, fname, &code) != 3 || idx < 0 ||
                idx >= MAX_GPUS || (fi = parse_field(fname)) < 0)
                bad_line(lineno, line);
            else st.gpus[idx].field_error[fi] = code;
        } else if (strcmp(word, "sample") == 0 || strcmp(word, "busy") == 0) {
            struct sample sm;
            memset(&sm, 0, sizeof sm);
            sm.fresh = word[0] == 'b';
            int got = sm.fresh
                ? sscanf(rest, "%d %u %u %u %u %u", &idx, &sm.pid, &sm.sm, &sm.mem, &sm.enc,
                         &sm.dec) + 1
                : sscanf(rest, "%d %u %llu %u %u %u %u", &idx, &sm.pid, &sm.ts, &sm.sm,
                         &sm.mem, &sm.enc, &sm.dec);
            if (got == 5) sm.enc = sm.dec = 0; /* the older form, without ENC DEC */
            if (st.sample_count >= MAX_SAMPLES || (got != 5 && got != 7) || idx < 0 ||
                idx >= MAX_GPUS) {
                bad_line(lineno, line);
                continue;
            }
            sm.gpu = idx;
            st.samples[st.sample_count++] = sm;
        } else if (strcmp(word, "clock_us") == 0) {
            if (sscanf(rest, "%llu", &st.clock_us) != 1) bad_line(lineno, line);
            else st.has_clock = 1;
        } else if (strcmp(word, "proc") == 0) {
            char kind[4], bytes[32];
            struct proc p;
            if (st.proc_count >= MAX_PROCS ||
                sscanf(rest, "%d %3s %u %31s", &idx, kind, &p.pid, bytes) != 4 || idx < 0 ||
                idx >= MAX_GPUS || (strcmp(kind, "C") != 0 && strcmp(kind, "G") != 0)) {
                bad_line(lineno, line);
                continue;
            }
            p.gpu = idx;
            p.kind = kind[0];
            p.used = strcmp(bytes, "na") == 0 ? ~0ULL : strtoull(bytes, NULL, 10);
            st.procs[st.proc_count++] = p;
        } else {
            bad_line(lineno, line);
        }
    }
    fclose(f);
}

/* Whether the state file says this driver lacks FUNCTION. Caller holds `lock`. */
static int missing(const char *function) {
    for (int i = 0; i < st.missing_count; i++)
        if (strcmp(st.missing[i], function) == 0) return 1;
    return 0;
}

static void sleep_ms(long ms) {
    if (ms <= 0) return;
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static int in_flight, max_in_flight;

static void call_begins(void) {
    int now = __atomic_add_fetch(&in_flight, 1, __ATOMIC_SEQ_CST);
    int seen = __atomic_load_n(&max_in_flight, __ATOMIC_SEQ_CST);
    while (now > seen &&
           !__atomic_compare_exchange_n(&max_in_flight, &seen, now, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {}
}

static void call_ends(void) { __atomic_sub_fetch(&in_flight, 1, __ATOMIC_SEQ_CST); }

/* Test hooks (not NVML): the concurrency probe described at the top. */
int fakenvml_max_in_flight(void) { return __atomic_load_n(&max_in_flight, __ATOMIC_SEQ_CST); }
void fakenvml_reset_in_flight(void) { __atomic_store_n(&max_in_flight, 0, __ATOMIC_SEQ_CST); }

/* Every entry point: count in, lock, re-read, answer, unlock, sleep the injected delay,
 * count out. */
#define ENTER long delay_; nvmlReturn_t ret_; call_begins(); pthread_mutex_lock(&lock); \
    load_state(); delay_ = st.delay_ms;
#define LEAVE(code) do { ret_ = (code); goto out_; } while (0)
#define EXIT out_: pthread_mutex_unlock(&lock); sleep_ms(delay_); call_ends(); return ret_;

/* Common checks for calls made after init. Caller holds `lock`. */
static nvmlReturn_t runtime_check(void) {
    if (!st.file_ok) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (init_refcount == 0) return NVML_ERROR_UNINITIALIZED;
    if (st.runtime_error) return st.runtime_error;
    return NVML_SUCCESS;
}

/* Resolve a handle to its GPU, applying "lost" and per-field errors. */
static nvmlReturn_t device_check(nvmlDevice_t dev, int field, struct gpu **out) {
    nvmlReturn_t r = runtime_check();
    if (r != NVML_SUCCESS) return r;
    if (dev == NULL || dev < devices || dev >= devices + MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    struct gpu *g = &st.gpus[dev - devices];
    if (!g->present) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->lost) return NVML_ERROR_GPU_IS_LOST;
    if (field >= 0 && g->field_error[field]) return g->field_error[field];
    *out = g;
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src) {
    if (dst == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    ENTER
    if (!st.file_ok) LEAVE(NVML_ERROR_DRIVER_NOT_LOADED);
    if (st.init_error) LEAVE(st.init_error);
    init_refcount++;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t r = NVML_SUCCESS;
    call_begins();
    pthread_mutex_lock(&lock);
    if (init_refcount == 0) r = NVML_ERROR_UNINITIALIZED;
    else init_refcount--;
    pthread_mutex_unlock(&lock);
    call_ends();
    return r;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER
    nvmlReturn_t r = runtime_check();
    if (r != NVML_SUCCESS) LEAVE(r);
    LEAVE(copy_string(version, length, st.driver));
    EXIT
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER
    nvmlReturn_t r = runtime_check();
    if (r != NVML_SUCCESS) LEAVE(r);
    if (count == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)st.gpu_count;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER
    nvmlReturn_t r = runtime_check();
    if (r != NVML_SUCCESS) LEAVE(r);
    if (device == NULL || index >= MAX_GPUS || !st.gpus[index].present)
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (st.gpus[index].lost) LEAVE(NVML_ERROR_GPU_IS_LOST);
    devices[index].index = (int)index;
    *device = &devices[index];
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, -1, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (index == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)(device - devices);
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_NAME, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    LEAVE(copy_string(name, length, g->name));
    EXIT
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_UUID, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    LEAVE(copy_string(uuid, length, g->uuid));
    EXIT
}

/* The minor number names the device node, /dev/nvidiaN. */
nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_MINOR, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (missing("nvmlDeviceGetMinorNumber")) LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    if (minor == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *minor = g->has_minor ? g->minor : (unsigned int)(device - devices);
    LEAVE(NVML_SUCCESS);
    EXIT
}

/* MIG mode, current and pending (1: enabled), as an H100 answers it. */
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode) {
    ENTER
    if (missing("nvmlDeviceGetMigMode")) LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_MIG, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (currentMode == NULL || pendingMode == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *currentMode = g->mig_current;
    *pendingMode = g->mig_pending;
    LEAVE(NVML_SUCCESS);
    EXIT
}

/* As the driver fills it: busId with an 8-digit domain (what nvidia-smi and dcgm-exporter's
 * pci_bus_id show), busIdLegacy with a 4-digit one, function 0. */
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_PCI, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (pci == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci->domain = g->has_pci ? g->pci_domain : 0;
    pci->bus = g->has_pci ? g->pci_bus : (unsigned int)(device - devices) + 1;
    pci->device = g->has_pci ? g->pci_device : 0;
    pci->pciDeviceId = 0x233010DEu; /* H100 SXM5, vendor 10DE */
    pci->pciSubSystemId = 0x16C110DEu;
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", pci->domain, pci->bus,
             pci->device);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0",
             pci->domain & 0xffffu, pci->bus, pci->device);
    LEAVE(NVML_SUCCESS);
    EXIT
}

/* pynvml calls only _v3; the older entry points take smaller structs, so this
 * fake leaves them out rather than overrun a caller's buffer. */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_MEMORY, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (memory == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long taken = g->used + g->reserved;
    memory->total = g->total;
    memory->used = taken; /* _v1 counts the reserved memory as used */
    memory->free = g->total > taken ? g->total - taken : 0;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    ENTER
    if (missing("nvmlDeviceGetMemoryInfo_v2")) LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_MEMORY, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (memory == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != NVML_MEMORY_V2) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long taken = g->used + g->reserved;
    memory->total = g->total;
    memory->reserved = g->reserved;
    memory->used = g->used;
    memory->free = g->total > taken ? g->total - taken : 0;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_UTILIZATION, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (util == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    util->gpu = g->util_gpu;
    util->memory = g->util_mem;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor,
                                      unsigned int *temp) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_TEMPERATURE, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (temp == NULL || sensor != 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = g->temp_c;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temp) {
    ENTER
    if (missing("nvmlDeviceGetTemperatureV")) LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_TEMPERATURE, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (temp == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (temp->version != NVML_TEMPERATURE_V1) LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (temp->sensorType != 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    temp->temperature = (int)g->temp_c;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_POWER, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (power == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *power = g->power_mw;
    LEAVE(NVML_SUCCESS);
    EXIT
}

/* NVML's two-pass protocol: too small a buffer answers INSUFFICIENT_SIZE with the count. */
static nvmlReturn_t running_processes(nvmlDevice_t device, int field, char kind,
                                      unsigned int *count, nvmlProcessInfo_t *infos) {
    struct gpu *g;
    nvmlReturn_t r = device_check(device, field, &g);
    if (r != NVML_SUCCESS) return r;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int index = (int)(device - devices);
    unsigned int n = 0;
    for (int i = 0; i < st.proc_count; i++)
        if (st.procs[i].gpu == index && st.procs[i].kind == kind) n++;
    if (n == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (infos == NULL || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (int i = 0; i < st.proc_count; i++) {
        if (st.procs[i].gpu != index || st.procs[i].kind != kind) continue;
        infos[k].pid = st.procs[i].pid;
        infos[k].usedGpuMemory = st.procs[i].used;
        infos[k].gpuInstanceId = 0xFFFFFFFFu; /* no MIG */
        infos[k].computeInstanceId = 0xFFFFFFFFu;
        k++;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    ENTER
    LEAVE(running_processes(device, F_COMPUTE, 'C', count, infos));
    EXIT
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    ENTER
    LEAVE(running_processes(device, F_GRAPHICS, 'G', count, infos));
    EXIT
}

/* pynvml 13 gives _v2 the same 24-byte struct as _v3. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *count,
                                                      nvmlProcessInfo_t *infos) {
    return nvmlDeviceGetGraphicsRunningProcesses_v3(device, count, infos);
}

/* The samples of GPU `index` newer than `last_seen`, a fresh one for each busy process
 * stamped `now_us`. Caller holds `lock`; `out` has MAX_SAMPLES slots. */
static unsigned int samples_since(int index, unsigned long long last_seen,
                                  unsigned long long now_us, struct sample *out) {
    unsigned int n = 0;
    for (int i = 0; i < st.sample_count; i++) {
        struct sample s = st.samples[i];
        if (s.gpu != index) continue;
        if (s.fresh) s.ts = now_us;
        if (s.ts > last_seen) out[n++] = s;
    }
    return n;
}

/* The driver's wall clock: the state file's clock_us, else CLOCK_REALTIME. Caller holds
 * `lock`. */
static unsigned long long now_microseconds(void) {
    if (st.has_clock) return st.clock_us;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000ULL;
}

static struct sample found[MAX_SAMPLES]; /* guarded by `lock` */

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device,
                                             nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount,
                                             unsigned long long lastSeenTimeStamp) {
    ENTER
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_PROCESS_UTILIZATION, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (processSamplesCount == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = samples_since((int)(device - devices), lastSeenTimeStamp,
                                   now_microseconds(), found);
    if (n == 0) {
        *processSamplesCount = 0;
        LEAVE(NVML_ERROR_NOT_FOUND);
    }
    if (utilization == NULL || *processSamplesCount < n) {
        *processSamplesCount = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int k = 0; k < n; k++) {
        utilization[k].pid = found[k].pid;
        utilization[k].timeStamp = found[k].ts;
        utilization[k].smUtil = found[k].sm;
        utilization[k].memUtil = found[k].mem;
        utilization[k].encUtil = found[k].enc;
        utilization[k].decUtil = found[k].dec;
    }
    *processSamplesCount = n;
    LEAVE(NVML_SUCCESS);
    EXIT
}

nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device,
                                                   nvmlProcessesUtilizationInfo_t *info) {
    ENTER
    if (missing("nvmlDeviceGetProcessesUtilizationInfo")) LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    struct gpu *g;
    nvmlReturn_t r = device_check(device, F_PROCESSES_UTILIZATION, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (info == NULL) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (info->version != NVML_PROCESSES_UTILIZATION_INFO_V1)
        LEAVE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned int n = samples_since((int)(device - devices), info->lastSeenTimeStamp,
                                   now_microseconds(), found);
    if (n == 0) {
        info->processSamplesCount = 0;
        LEAVE(NVML_ERROR_NOT_FOUND);
    }
    if (info->procUtilArray == NULL || info->processSamplesCount < n) {
        info->processSamplesCount = n;
        LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int k = 0; k < n; k++) {
        nvmlProcessUtilizationInfo_v1_t *u = &info->procUtilArray[k];
        memset(u, 0, sizeof *u);
        u->timeStamp = found[k].ts;
        u->pid = found[k].pid;
        u->smUtil = found[k].sm;
        u->memUtil = found[k].mem;
        u->encUtil = found[k].enc;
        u->decUtil = found[k].dec;
    }
    info->processSamplesCount = n;
    LEAVE(NVML_SUCCESS);
    EXIT
}

/* Each value answers alone (its own nvmlReturn), as NVML fills them: the recovery action
 * where the state file gives one, NOT_SUPPORTED for it otherwise and for any other field. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                      nvmlFieldValue_t *values) {
    ENTER
    if (missing("nvmlDeviceGetFieldValues")) LEAVE(NVML_ERROR_FUNCTION_NOT_FOUND);
    struct gpu *g;
    nvmlReturn_t r = device_check(device, -1, &g);
    if (r != NVML_SUCCESS) LEAVE(r);
    if (values == NULL || valuesCount < 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long now = now_microseconds();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)now;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId != NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else if (g->field_error[F_RECOVERY])
            v->nvmlReturn = g->field_error[F_RECOVERY];
        else if (!g->has_recovery)
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        else {
            v->nvmlReturn = NVML_SUCCESS;
            v->value.uiVal = g->recovery;
        }
    }
    LEAVE(NVML_SUCCESS);
    EXIT
}
