/*
 * A stand-in libnvidia-ml.so.1 for the tests: the NVML C entry points and structures that the
 * nvidia-ml-py bindings (pynvml) call, answering from a text file of devices instead of a driver.
 *
 * The file is named by the environment variable STAND_IN_NVML_DEVICES and read again by
 * nvmlInitWithFlags and every nvmlDeviceGetCount_v2, so a test can change what the "GPUs" report
 * while the agent runs. One record per line, fields separated by '|', `key=value` after the kind:
 *
 *   system|driver=575.51.03|init_error=9|generation=1
 *   gpu|uuid=GPU-...|name=NVIDIA A100-SXM4-40GB|minor=0|pci=00000000:10:00.0|mig=0|util=50
 *      |mem_total=<bytes>|mem_used=<bytes>|power=<mW>|energy=<mJ>|procs=<pid>:<bytes>,...
 *   mig|gpu=<index of its gpu line>|slot=<n>|uuid=MIG-...|name=... MIG 1g.10gb|gi=11|ci=0
 *      |mem_total=<bytes>|mem_used=<bytes>|procs=...
 *
 * A value left out (or `-`) is one NVML does not support on that device: the call answers
 * NVML_ERROR_NOT_SUPPORTED, as a driver does. `mig=1` puts a GPU in MIG mode (its utilisation is
 * then not supported); a GPU without `mig` is not MIG-capable. MIG devices never report
 * utilisation, power or energy, as on real hardware.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_UNKNOWN = 999
};

#define MAX_GPUS 16
#define MAX_MIG 7
#define MAX_PROCS 32
#define TEXT 96

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

/* A device: a GPU or a MIG device. Handles point into the static tables, so they stay valid
   when the file is read again (a device gone answers NVML_ERROR_GPU_IS_LOST). */
typedef struct Device {
    int present, is_mig, parent;
    char uuid[TEXT], name[TEXT], pci[32];
    long long minor, mig, util, mem_total, mem_used, power, energy, gi, ci; /* -1: not supported */
    int nprocs;
    unsigned int pids[MAX_PROCS];
    unsigned long long proc_mem[MAX_PROCS];
} Device;
typedef Device *nvmlDevice_t;

static Device gpus[MAX_GPUS];
static Device migs[MAX_GPUS][MAX_MIG];
static int gpu_count;
static char driver[TEXT] = "0.0";
static int init_error;
/* The driver's load: a new generation (a driver reloaded) invalidates an NVML started before it,
   whose calls answer NVML_ERROR_UNINITIALIZED until nvmlInit runs again. */
static int generation, started_generation;

static long long number(const char *v) { return (v && *v && strcmp(v, "-") != 0) ? atoll(v) : -1; }

static void copy(char *dst, const char *v, size_t n) { snprintf(dst, n, "%s", v ? v : ""); }

static void parse_procs(Device *d, const char *v) {
    d->nprocs = 0;
    while (v && *v && d->nprocs < MAX_PROCS) {
        unsigned int pid = 0;
        unsigned long long mem = 0;
        if (sscanf(v, "%u:%llu", &pid, &mem) < 1) break;
        d->pids[d->nprocs] = pid;
        d->proc_mem[d->nprocs++] = mem;
        v = strchr(v, ',');
        if (v) v++;
    }
}

/* The value of `key` in a record's fields (NULL when absent). */
static const char *field(char **keys, char **values, int n, const char *key) {
    for (int i = 0; i < n; i++)
        if (strcmp(keys[i], key) == 0) return values[i];
    return NULL;
}

static void fill(Device *d, char **k, char **v, int n, int is_mig) {
    memset(d, 0, sizeof *d);
    d->present = 1;
    d->is_mig = is_mig;
    copy(d->uuid, field(k, v, n, "uuid"), TEXT);
    copy(d->name, field(k, v, n, "name"), TEXT);
    copy(d->pci, field(k, v, n, "pci"), sizeof d->pci);
    d->minor = number(field(k, v, n, "minor"));
    d->mig = number(field(k, v, n, "mig"));
    d->util = number(field(k, v, n, "util"));
    d->mem_total = number(field(k, v, n, "mem_total"));
    d->mem_used = number(field(k, v, n, "mem_used"));
    d->power = number(field(k, v, n, "power"));
    d->energy = number(field(k, v, n, "energy"));
    d->gi = number(field(k, v, n, "gi"));
    d->ci = number(field(k, v, n, "ci"));
    parse_procs(d, field(k, v, n, "procs"));
}

static void record(char *line) {
    char *keys[32], *values[32], *kind = strtok(line, "|"), *part;
    int n = 0;
    while ((part = strtok(NULL, "|")) != NULL && n < 32) {
        char *eq = strchr(part, '=');
        if (!eq) continue;
        *eq = 0;
        keys[n] = part;
        values[n++] = eq + 1;
    }
    if (!kind) return;
    if (strcmp(kind, "system") == 0) {
        copy(driver, field(keys, values, n, "driver"), TEXT);
        init_error = (int)number(field(keys, values, n, "init_error"));
        if (init_error < 0) init_error = 0;
        generation = (int)number(field(keys, values, n, "generation"));
    } else if (strcmp(kind, "gpu") == 0 && gpu_count < MAX_GPUS) {
        fill(&gpus[gpu_count++], keys, values, n, 0);
    } else if (strcmp(kind, "mig") == 0) {
        long long g = number(field(keys, values, n, "gpu")), s = number(field(keys, values, n, "slot"));
        if (g >= 0 && g < MAX_GPUS && s >= 0 && s < MAX_MIG) {
            fill(&migs[g][s], keys, values, n, 1);
            migs[g][s].parent = (int)g;
        }
    }
}

static void load(void) {
    const char *path = getenv("STAND_IN_NVML_DEVICES");
    char line[4096];
    FILE *f = path ? fopen(path, "r") : NULL;
    memset(gpus, 0, sizeof gpus);
    memset(migs, 0, sizeof migs);
    gpu_count = 0;
    init_error = 0;
    generation = 0;
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        record(line);
    }
    fclose(f);
}

static nvmlReturn_t text(const char *value, char *out, unsigned int length) {
    if (!out || strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, value);
    return NVML_SUCCESS;
}

#define DEVICE(d) do { if (!(d)) return NVML_ERROR_INVALID_ARGUMENT; if (!(d)->present) return NVML_ERROR_GPU_IS_LOST; } while (0)
#define SUPPORTED(v) do { if ((v) < 0) return NVML_ERROR_NOT_SUPPORTED; } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    load();
    started_generation = generation;
    return init_error;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case 9: return "Driver Not Loaded";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) { return text(driver, version, length); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    load();
    if (generation != started_generation) return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (index >= (unsigned int)gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) { DEVICE(d); return text(d->uuid, uuid, length); }
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) { DEVICE(d); return text(d->name, name, length); }

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    DEVICE(d);
    if (d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    SUPPORTED(d->minor);
    *minor = (unsigned int)d->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    DEVICE(d);
    if (d->is_mig || !d->pci[0]) return NVML_ERROR_NOT_SUPPORTED;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", d->pci);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    DEVICE(d);
    if (d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    SUPPORTED(d->mig);
    *current = *pending = (unsigned int)d->mig;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
    DEVICE(d);
    if (d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    *count = d->mig >= 0 ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *mig) {
    DEVICE(d);
    if (d->is_mig || d->mig != 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= MAX_MIG) return NVML_ERROR_INVALID_ARGUMENT;
    Device *m = &migs[d - gpus][index];
    if (!m->present) return NVML_ERROR_NOT_FOUND;
    *mig = m;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t d, unsigned int *id) {
    DEVICE(d);
    if (!d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *id = (unsigned int)d->gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t d, unsigned int *id) {
    DEVICE(d);
    if (!d->is_mig) return NVML_ERROR_INVALID_ARGUMENT;
    *id = (unsigned int)d->ci;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) {
    DEVICE(d);
    if (d->is_mig || d->mig == 1) return NVML_ERROR_NOT_SUPPORTED;
    SUPPORTED(d->util);
    u->gpu = (unsigned int)d->util;
    u->memory = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    DEVICE(d);
    SUPPORTED(d->mem_total);
    SUPPORTED(d->mem_used);
    m->total = (unsigned long long)d->mem_total;
    m->used = (unsigned long long)d->mem_used;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) {
    DEVICE(d);
    if (d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    SUPPORTED(d->power);
    *mw = (unsigned int)d->power;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj) {
    DEVICE(d);
    if (d->is_mig) return NVML_ERROR_NOT_SUPPORTED;
    SUPPORTED(d->energy);
    *mj = (unsigned long long)d->energy;
    return NVML_SUCCESS;
}

/* Called first with a NULL buffer: the count, and NVML_ERROR_INSUFFICIENT_SIZE when there are any. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    DEVICE(d);
    if (d->nprocs == 0) {
        *count = 0;
        return NVML_SUCCESS;
    }
    if (!infos || *count < (unsigned int)d->nprocs) {
        *count = (unsigned int)d->nprocs;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < d->nprocs; i++) {
        infos[i].pid = d->pids[i];
        infos[i].usedGpuMemory = d->proc_mem[i];
        infos[i].gpuInstanceId = d->is_mig ? (unsigned int)d->gi : 0xFFFFFFFFu;
        infos[i].computeInstanceId = d->is_mig ? (unsigned int)d->ci : 0xFFFFFFFFu;
    }
    *count = (unsigned int)d->nprocs;
    return NVML_SUCCESS;
}
