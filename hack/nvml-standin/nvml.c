/* A stand-in libnvidia-ml.so.1: the NVML C ABI served from a mock profile, for hosts without a GPU.
 *
 * Written from the public nvml.h declarations (nvml_decl.h); no NVIDIA code.  It exists so that the real
 * pynvml binding and go-nvml (nvidia-ctk) run their production paths against C-level semantics that a
 * Python fake reproduces only by construction: the nvmlNvlinkVersion_t enum, GPU_IS_LOST from event waits
 * and every per-device call of a lost GPU, event GI/CI ids (0xFFFFFFFF = whole GPU), GPU-instance ids fixed
 * by placement as on real GPUs, NOT_SUPPORTED with MIG off (placements excepted), the GPU recovery-action
 * field, whole-word struct versions, NO_PERMISSION for unprivileged MIG changes, IN_USE while a registered
 * process (the MPS server stand-in) runs on a compute instance, and MIG device indices with holes.  It is as
 * strict as nvml.h: no switch makes it lenient; its inputs are facts a host has (privilege, MIG mode, faults).
 *
 * Inputs (see docs/real-node.md): the config JSON (TOPODRA_NVML_STANDIN_CONFIG, else nvml-standin.json next
 * to this library), the faults file it names (re-read when it changes, same format as FakeNvml's), and a
 * state file holding MIG instances, compute modes and time-slice levels: hardware state that outlives a
 * process, so every process of the node shares it under flock.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "nvml_decl.h"

#define API __attribute__((visibility("default")))
#define MAX_GPUS 64
#define MAX_GIS 16
#define MAX_CIS 8
#define MAX_EVENTSETS 64

/* ---------------------------------------------------------------------------------------------- handles */

enum hkind { H_GPU = 1, H_MIG, H_GI, H_CI };

struct standin_handle {
    int magic;
    enum hkind kind;
    int gpu, gi, ci;
};

#define MAGIC 0x5717D1

static struct standin_handle gpu_handles[MAX_GPUS];
/* MIG device, GI and CI handles are interned per (gpu, gi, ci) so the same instance has the same pointer. */
static struct standin_handle mig_handles[MAX_GPUS][MAX_GIS][MAX_CIS];
static struct standin_handle gi_handles[MAX_GPUS][MAX_GIS];
static struct standin_handle ci_handles[MAX_GPUS][MAX_GIS][MAX_CIS];

/* ---------------------------------------------------------------------------------------------- config */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static jval *config;
static char config_dir[PATH_MAX];
static char faults_path[PATH_MAX];
static char state_path[PATH_MAX];
static char caps_dir[PATH_MAX];
static char procs_dir[PATH_MAX];
static int init_count;
static int ngpus;
static const jval *gpus[MAX_GPUS];

static const struct { const char *name; nvmlReturn_t code; } error_names[] = {
    {"Uninitialized", 1}, {"InvalidArgument", 2}, {"NotSupported", 3}, {"NoPermission", 4},
    {"AlreadyInitialized", 5}, {"NotFound", 6}, {"InsufficientSize", 7}, {"InsufficientPower", 8},
    {"DriverNotLoaded", 9}, {"Timeout", 10}, {"IrqIssue", 11}, {"LibraryNotFound", 12}, {"FunctionNotFound", 13},
    {"CorruptedInforom", 14}, {"GpuIsLost", 15}, {"ResetRequired", 16}, {"OperatingSystem", 17},
    {"LibRmVersionMismatch", 18}, {"InUse", 19}, {"Memory", 20}, {"NoData", 21}, {"VgpuEccNotSupported", 22},
    {"InsufficientResources", 23}, {"FreqNotSupported", 24}, {"ArgumentVersionMismatch", 25}, {"Deprecated", 26},
    {"NotReady", 27}, {"GpuNotFound", 28}, {"InvalidState", 29}, {"Unknown", 999},
};

static nvmlReturn_t error_code(const char *name) {
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++)
        if (!strcmp(error_names[i].name, name)) return error_names[i].code;
    return NVML_ERROR_UNKNOWN;
}

/* A config answer: the value, or why there is none (absent = NOT_SUPPORTED, {"error": Name} = that error). */
static nvmlReturn_t answer(const jval *obj, const char *key, const jval **out) {
    const jval *v = json_get(obj, key);
    if (!v || v->type == J_NULL) return NVML_ERROR_NOT_SUPPORTED;
    if (v->type == J_OBJ && json_get(v, "error")) return error_code(json_str(v, "error", "Unknown"));
    *out = v;
    return NVML_SUCCESS;
}

static void warn(const char *fmt, const char *arg) {
    fprintf(stderr, "nvml-standin: ");
    fprintf(stderr, fmt, arg);
    fputc('\n', stderr);
}

static void resolve(char *out, const char *p) {
    if (!p || !*p) { out[0] = 0; return; }
    if (p[0] == '/') snprintf(out, PATH_MAX, "%s", p);
    else snprintf(out, PATH_MAX, "%s/%s", config_dir, p);
}

static nvmlReturn_t load_config(void) {
    if (config) return NVML_SUCCESS;
    char path[PATH_MAX];
    const char *env = getenv("TOPODRA_NVML_STANDIN_CONFIG");
    if (env && *env) {
        snprintf(path, sizeof path, "%s", env);
    } else {
        Dl_info info;
        if (!dladdr((void *)load_config, &info) || !info.dli_fname) return NVML_ERROR_LIBRARY_NOT_FOUND;
        char self[PATH_MAX];
        if (!realpath(info.dli_fname, self)) snprintf(self, sizeof self, "%s", info.dli_fname);
        char *slash = strrchr(self, '/');
        if (slash) *slash = 0; else snprintf(self, sizeof self, ".");
        snprintf(path, sizeof path, "%s/nvml-standin.json", self);
    }
    char err[200];
    config = json_read_file(path, err, sizeof err);
    if (!config || config->type != J_OBJ) {
        warn("no usable config: %s", config ? "not an object" : err);
        json_free(config);
        config = NULL;
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    snprintf(config_dir, sizeof config_dir, "%s", path);
    char *slash = strrchr(config_dir, '/');
    if (slash) *slash = 0; else snprintf(config_dir, sizeof config_dir, ".");
    const char *fe = getenv("TOPODRA_NVML_STANDIN_FAULTS");
    resolve(faults_path, fe && *fe ? fe : json_str(config, "faultsFile", NULL));
    const char *se = getenv("TOPODRA_NVML_STANDIN_STATE");
    resolve(state_path, se && *se ? se : json_str(config, "stateFile", NULL));
    const char *ce = getenv("TOPODRA_NVML_STANDIN_CAPS");
    resolve(caps_dir, ce && *ce ? ce : json_str(config, "capabilitiesDir", NULL));
    /* Where the MPS server stand-in registers itself (mps.c: <its dir>/../lib/x86_64-linux-gnu/ in a tree). */
    const char *pe = getenv("TOPODRA_NVML_STANDIN_PROCESSES");
    resolve(procs_dir, pe && *pe ? pe : "nvml-standin-processes");
    const jval *list = json_get(config, "gpus");
    ngpus = 0;
    if (list && list->type == J_ARR)
        for (int i = 0; i < list->n && i < MAX_GPUS; i++) gpus[ngpus++] = list->items[i];
    for (int i = 0; i < MAX_GPUS; i++) gpu_handles[i] = (struct standin_handle){MAGIC, H_GPU, i, -1, -1};
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- faults */

struct gpu_faults {
    int lost;
    unsigned long long clocks_event_reasons;
    unsigned int recovery_action;
    unsigned int links_down[64];
    int nlinks_down;
    unsigned int remapped[4]; /* corrected, uncorrected, pending, failure */
};

static jval *faults;
static struct timespec faults_mtime;
static off_t faults_size = -1;

/* The faults file, re-read when its mtime or size changed; a bad file keeps the previous faults. */
static void refresh_faults(void) {
    if (!faults_path[0]) return;
    struct stat st;
    if (stat(faults_path, &st) != 0) {
        json_free(faults);
        faults = NULL;
        faults_size = -1;
        return;
    }
    if (st.st_size == faults_size && st.st_mtim.tv_sec == faults_mtime.tv_sec &&
        st.st_mtim.tv_nsec == faults_mtime.tv_nsec)
        return;
    char err[200];
    jval *next = json_read_file(faults_path, err, sizeof err);
    faults_size = st.st_size;
    faults_mtime = st.st_mtim;
    if (!next || next->type != J_OBJ) {
        warn("faults file unusable, keeping the previous faults: %s", next ? "not an object" : err);
        json_free(next);
        return;
    }
    json_free(faults);
    faults = next;
}

static int gpu_ref_index(const jval *ref) {
    if (!ref) return -1;
    if (ref->type == J_NUM) return ref->inum >= 0 && ref->inum < ngpus ? (int)ref->inum : -1;
    if (ref->type != J_STR) return -1;
    for (int i = 0; i < ngpus; i++)
        if (!strcmp(json_str(gpus[i], "uuid", ""), ref->str)) return i;
    char *end;
    long n = strtol(ref->str, &end, 10);
    if (*ref->str && !*end && n >= 0 && n < ngpus) return (int)n;
    return -1;
}

static struct gpu_faults gpu_faults(int index) {
    struct gpu_faults f;
    memset(&f, 0, sizeof f);
    const jval *map = json_get(faults, "gpus");
    if (!map || map->type != J_OBJ) return f;
    for (int i = 0; i < map->n; i++) {
        const jval *ref = &(jval){.type = J_STR, .str = map->keys[i]};
        if (gpu_ref_index(ref) != index) continue;
        const jval *g = map->items[i];
        f.lost = json_bool(g, "lost", 0);
        f.clocks_event_reasons = (unsigned long long)json_int(g, "clocksEventReasons", 0);
        f.recovery_action = (unsigned int)json_int(g, "recoveryAction", 0);
        const jval *down = json_get(g, "nvlinksDown");
        for (int k = 0; down && down->type == J_ARR && k < down->n && k < 64; k++)
            f.links_down[f.nlinks_down++] = (unsigned int)down->items[k]->inum;
        const jval *rr = json_get(g, "remappedRows");
        f.remapped[0] = (unsigned int)json_int(rr, "corrected", 0);
        f.remapped[1] = (unsigned int)json_int(rr, "uncorrected", 0);
        f.remapped[2] = (unsigned int)json_bool(rr, "pending", 0);
        f.remapped[3] = (unsigned int)json_bool(rr, "failure", 0);
        break;
    }
    return f;
}

static int event_count(void) {
    const jval *ev = json_get(faults, "events");
    return ev && ev->type == J_ARR ? ev->n : 0;
}

/* ---------------------------------------------------------------------------------------------- state */

struct ci_state { int id, profile_id, slices, mig_index; }; /* mig_index: its MIG device index */
struct gi_state { int id, profile_id, start, size, slices, sms; int nci; struct ci_state ci[MAX_CIS]; };
struct gpu_state { int ngi; struct gi_state gi[MAX_GIS]; int compute_mode; int timeslice; };
static struct gpu_state mem_state[MAX_GPUS];
static struct gpu_state state[MAX_GPUS];
static int state_fd = -1;

static int uuid_index(const char *uuid) {
    for (int i = 0; i < ngpus; i++)
        if (!strcmp(json_str(gpus[i], "uuid", ""), uuid)) return i;
    return -1;
}

/* Lock and read the state (file or memory) into `state`; pair with state_end. */
static nvmlReturn_t state_begin(void) {
    if (!state_path[0]) { memcpy(state, mem_state, sizeof state); return NVML_SUCCESS; }
    state_fd = open(state_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (state_fd < 0) state_fd = open(state_path, O_RDONLY | O_CLOEXEC);
    memset(state, 0, sizeof state);
    if (state_fd < 0) return errno == ENOENT ? NVML_SUCCESS : NVML_ERROR_NO_PERMISSION;
    if (flock(state_fd, LOCK_EX) != 0) { close(state_fd); state_fd = -1; return NVML_ERROR_OPERATING_SYSTEM; }
    FILE *f = fdopen(dup(state_fd), "r");
    char line[256];
    while (f && fgets(line, sizeof line, f)) {
        char uuid[128];
        int a, b, c, d, e, g;
        if (sscanf(line, "gi %127s %d %d %d %d %d %d", uuid, &a, &b, &c, &d, &e, &g) == 7) {
            int i = uuid_index(uuid);
            if (i >= 0 && state[i].ngi < MAX_GIS) state[i].gi[state[i].ngi++] = (struct gi_state){a, b, c, d, e, g, 0, {{0}}};
        } else if (sscanf(line, "ci %127s %d %d %d %d %d", uuid, &a, &b, &c, &d, &e) == 6) {
            int i = uuid_index(uuid);
            for (int k = 0; i >= 0 && k < state[i].ngi; k++) {
                struct gi_state *gi = &state[i].gi[k];
                if (gi->id == a && gi->nci < MAX_CIS) gi->ci[gi->nci++] = (struct ci_state){b, c, d, e};
            }
        } else if (sscanf(line, "mode %127s %d %d", uuid, &a, &b) == 3) {
            int i = uuid_index(uuid);
            if (i >= 0) { state[i].compute_mode = a; state[i].timeslice = b; }
        }
    }
    if (f) fclose(f);
    return NVML_SUCCESS;
}

static nvmlReturn_t state_end(int write) {
    nvmlReturn_t rc = NVML_SUCCESS;
    if (!state_path[0]) {
        if (write) memcpy(mem_state, state, sizeof state);
        return rc;
    }
    if (state_fd < 0) return write ? NVML_ERROR_NO_PERMISSION : rc;
    if (write) {
        char tmp[PATH_MAX + 16];
        snprintf(tmp, sizeof tmp, "%s.tmp%d", state_path, (int)getpid());
        FILE *f = fopen(tmp, "w");
        if (!f) rc = NVML_ERROR_NO_PERMISSION;
        for (int i = 0; f && i < ngpus; i++) {
            const char *uuid = json_str(gpus[i], "uuid", "?");
            if (state[i].compute_mode || state[i].timeslice)
                fprintf(f, "mode %s %d %d\n", uuid, state[i].compute_mode, state[i].timeslice);
            for (int k = 0; k < state[i].ngi; k++) {
                struct gi_state *gi = &state[i].gi[k];
                fprintf(f, "gi %s %d %d %d %d %d %d\n", uuid, gi->id, gi->profile_id, gi->start, gi->size, gi->slices,
                        gi->sms);
                for (int c = 0; c < gi->nci; c++)
                    fprintf(f, "ci %s %d %d %d %d %d\n", uuid, gi->id, gi->ci[c].id, gi->ci[c].profile_id,
                            gi->ci[c].slices, gi->ci[c].mig_index);
            }
        }
        if (f && (fclose(f) != 0 || rename(tmp, state_path) != 0)) rc = NVML_ERROR_NO_PERMISSION;
    }
    flock(state_fd, LOCK_UN);
    close(state_fd);
    state_fd = -1;
    return rc;
}

/* ---------------------------------------------------------------------------------------------- checks */

#define LOCKED(expr)                                                                                              \
    do {                                                                                                          \
        pthread_mutex_lock(&mu);                                                                                  \
        nvmlReturn_t rc_ = (expr);                                                                                \
        pthread_mutex_unlock(&mu);                                                                                \
        return rc_;                                                                                               \
    } while (0)

static nvmlReturn_t live(void) { return init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED; }

/* The GPU behind a whole-GPU or MIG-device handle, refusing a lost GPU as the driver does. */
static nvmlReturn_t gpu_of(nvmlDevice_t h, int *index) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!h || h->magic != MAGIC || (h->kind != H_GPU && h->kind != H_MIG) || h->gpu < 0 || h->gpu >= ngpus)
        return NVML_ERROR_INVALID_ARGUMENT;
    refresh_faults();
    if (gpu_faults(h->gpu).lost) return NVML_ERROR_GPU_IS_LOST;
    *index = h->gpu;
    return NVML_SUCCESS;
}

static nvmlReturn_t whole_gpu(nvmlDevice_t h, int *index) {
    nvmlReturn_t rc = gpu_of(h, index);
    if (rc) return rc;
    return h->kind == H_GPU ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

static int mig_enabled(int index) {
    const jval *mode;
    if (answer(gpus[index], "migMode", &mode) || mode->type != J_ARR || mode->n < 1) return 0;
    return mode->items[0]->inum == 1;
}

static nvmlReturn_t mig_gpu(nvmlDevice_t h, int *index) {
    nvmlReturn_t rc = whole_gpu(h, index);
    if (rc) return rc;
    return mig_enabled(*index) ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

/* Whether NVML's device supports MIG at all (nvmlDeviceGetMigMode answers), whatever its mode. */
static int mig_capable(int index) {
    const jval *mode;
    return answer(gpus[index], "migMode", &mode) == NVML_SUCCESS;
}

/* nvml.h marks the MIG create, destroy, placement and capacity calls "Requires privileged user." and lists
 * "NVML_ERROR_NO_PERMISSION     If user doesn't have permission to perform the operation".  Privileged is what
 * it is on a host: root, or a user the driver's MIG config capability is readable by
 * (/proc/driver/nvidia/capabilities/mig/config, mode 0400 root as the driver makes it; an admin may grant it).
 * No switch turns this off. */
static int privileged(void) {
    if (geteuid() == 0) return 1;
    if (!caps_dir[0]) return 0;
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/mig/config", caps_dir);
    return euidaccess(path, R_OK) == 0;
}

/* ---------------------------------------------------------------------------------------------- processes */

/* Processes with a GPU context, as the MPS server stand-in (mps.c) registers them: one file per process in
 * procs_dir, named by its pid, holding "devices <CUDA_VISIBLE_DEVICES>" and flock'ed by it for its life, so a
 * process that died (even by kill -9) is seen gone at once.  A device is a GPU or MIG UUID, an index, or
 * "all" (CUDA_VISIBLE_DEVICES unset). */
#define MAX_PROCS 64
#define MAX_PROC_DEVS 8
struct gpu_proc { unsigned int pid; int ndev; char dev[MAX_PROC_DEVS][96]; };

static int live_procs(struct gpu_proc *out, int max) {
    int n = 0;
    DIR *d = procs_dir[0] ? opendir(procs_dir) : NULL;
    struct dirent *e;
    while (d && (e = readdir(d)) && n < max) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue; /* ".", "..", a registration not renamed yet */
        char path[PATH_MAX + 300];
        snprintf(path, sizeof path, "%s/%s", procs_dir, e->d_name);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        if (flock(fd, LOCK_SH | LOCK_NB) == 0) { close(fd); continue; } /* its holder is gone */
        FILE *f = fdopen(fd, "r");
        if (!f) { close(fd); continue; }
        struct gpu_proc *p = &out[n];
        memset(p, 0, sizeof *p);
        p->pid = (unsigned int)strtoul(e->d_name, NULL, 10);
        char line[1024];
        if (fgets(line, sizeof line, f) && !strncmp(line, "devices ", 8)) {
            for (char *t = strtok(line + 8, ", \n"); t && p->ndev < MAX_PROC_DEVS; t = strtok(NULL, ", \n"))
                snprintf(p->dev[p->ndev++], sizeof p->dev[0], "%s", t);
            n++;
        }
        fclose(f);
    }
    if (d) closedir(d);
    return n;
}

static void mig_uuid(int gpu, int gi, int ci, char *out, size_t len);

/* Whether process p runs on MIG device (gpu, gi, ci), or, with gi < 0, on the whole GPU gpu. */
static int proc_on(const struct gpu_proc *p, int gpu, int gi, int ci) {
    char want[96], idx[16];
    if (gi >= 0) mig_uuid(gpu, gi, ci, want, sizeof want);
    else snprintf(want, sizeof want, "%s", json_str(gpus[gpu], "uuid", "?"));
    snprintf(idx, sizeof idx, "%d", gpu);
    for (int k = 0; k < p->ndev; k++)
        if (!strcmp(p->dev[k], want) || (gi < 0 && (!strcmp(p->dev[k], "all") || !strcmp(p->dev[k], idx)))) return 1;
    return 0;
}

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------- system */

static nvmlReturn_t do_init(void) {
    nvmlReturn_t rc = load_config();
    if (rc) return rc;
    const jval *init = json_get(config, "init");
    if (init && init->type == J_OBJ && json_get(init, "error")) return error_code(json_str(init, "error", "Unknown"));
    init_count++;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { LOCKED(do_init()); }
API nvmlReturn_t nvmlInit(void) { LOCKED(do_init()); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; LOCKED(do_init()); }

static nvmlReturn_t do_shutdown(void) {
    if (init_count <= 0) return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlShutdown(void) { LOCKED(do_shutdown()); }

API const char *nvmlErrorString(nvmlReturn_t result) {
    for (size_t i = 0; i < sizeof error_names / sizeof error_names[0]; i++)
        if (error_names[i].code == result) return error_names[i].name;
    return result == NVML_SUCCESS ? "Success" : "Unknown Error";
}

static nvmlReturn_t str_answer(const jval *obj, const char *key, char *buf, unsigned int len) {
    const jval *v;
    nvmlReturn_t rc = load_config();
    if (rc) return rc;
    rc = answer(obj, key, &v);
    if (rc) return rc;
    return copy_str(buf, len, v->type == J_STR ? v->str : "");
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    LOCKED(live() ? live() : str_answer(config, "driverVersion", version, length));
}
API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    LOCKED(live() ? live() : str_answer(config, "nvmlVersion", version, length));
}

static nvmlReturn_t cuda_version(int *v) {
    const jval *a;
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    rc = answer(config, "cudaDriverVersion", &a);
    if (rc) return rc;
    *v = (int)a->inum;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { LOCKED(cuda_version(v)); }
API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { LOCKED(cuda_version(v)); }

static nvmlReturn_t device_count(unsigned int *count) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)ngpus; /* a lost GPU is still counted */
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { LOCKED(device_count(count)); }
API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { LOCKED(device_count(count)); }

static nvmlReturn_t handle_by_index(unsigned int index, nvmlDevice_t *out) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!out || index >= (unsigned int)ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    int i;
    rc = gpu_of(&gpu_handles[index], &i);
    if (rc) return rc;
    *out = &gpu_handles[index];
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *out) { LOCKED(handle_by_index(index, out)); }
API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *out) { LOCKED(handle_by_index(index, out)); }

static struct standin_handle *mig_handle(int gpu, int gi, int ci);

/* nvml.h, nvmlDeviceGetHandleByUUID: "uuid  The UUID of the target GPU or MIG instance" and "device  Reference
 * in which to return the device handle or MIG device handle". */
static nvmlReturn_t handle_by_uuid(const char *uuid, nvmlDevice_t *out) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!uuid || !out) return NVML_ERROR_INVALID_ARGUMENT;
    int i = uuid_index(uuid);
    if (i >= 0) return handle_by_index((unsigned int)i, out);
    if (strncmp(uuid, "MIG-", 4)) return NVML_ERROR_NOT_FOUND;
    rc = state_begin();
    int found = 0;
    for (int g = 0; !rc && g < ngpus && !found; g++)
        for (int k = 0; k < state[g].ngi && !found; k++)
            for (int c = 0; c < state[g].gi[k].nci && !found; c++) {
                char u[96];
                mig_uuid(g, state[g].gi[k].id, state[g].gi[k].ci[c].id, u, sizeof u);
                if (!strcmp(u, uuid) && !gpu_faults(g).lost) {
                    *out = mig_handle(g, state[g].gi[k].id, state[g].gi[k].ci[c].id);
                    found = 1;
                }
            }
    nvmlReturn_t rc2 = state_end(0);
    return rc ? rc : rc2 ? rc2 : found ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}
API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out) { LOCKED(handle_by_uuid(uuid, out)); }

static void parse_bus_id(const char *bus, nvmlPciInfo_t *p) {
    unsigned int dom = 0, b = 0, d = 0, f = 0;
    sscanf(bus, "%x:%x:%x.%x", &dom, &b, &d, &f);
    p->domain = dom;
    p->bus = b;
    p->device = d;
    snprintf(p->busId, sizeof p->busId, "%08X:%02X:%02X.%X", dom, b, d, f);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%04X:%02X:%02X.%X", dom & 0xFFFF, b, d, f);
}

static nvmlReturn_t pci_info(nvmlDevice_t h, nvmlPciInfo_t *p) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!p) return NVML_ERROR_INVALID_ARGUMENT;
    const jval *bus;
    rc = answer(gpus[i], "busId", &bus);
    if (rc) return rc;
    memset(p, 0, sizeof *p);
    parse_bus_id(bus->str ? bus->str : "", p);
    p->pciDeviceId = (unsigned int)json_int(gpus[i], "pciDeviceId", 0);
    p->pciSubSystemId = (unsigned int)json_int(gpus[i], "pciSubSystemId", 0);
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *p) { LOCKED(pci_info(h, p)); }
API nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t h, nvmlPciInfo_t *p) { LOCKED(pci_info(h, p)); }
API nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t h, nvmlPciInfo_t *p) { LOCKED(pci_info(h, p)); }

static nvmlReturn_t handle_by_pci(const char *bus, nvmlDevice_t *out) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!bus || !out) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlPciInfo_t want, have;
    memset(&want, 0, sizeof want);
    parse_bus_id(bus, &want);
    for (int i = 0; i < ngpus; i++) {
        memset(&have, 0, sizeof have);
        parse_bus_id(json_str(gpus[i], "busId", ""), &have);
        if (!strcmp(want.busId, have.busId)) return handle_by_index((unsigned int)i, out);
    }
    return NVML_ERROR_NOT_FOUND;
}
API nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *bus, nvmlDevice_t *out) { LOCKED(handle_by_pci(bus, out)); }
API nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *bus, nvmlDevice_t *out) { LOCKED(handle_by_pci(bus, out)); }

/* ---------------------------------------------------------------------------------------------- MIG ids */

/* GPU-instance ids are fixed by the placement on A100/H100: the 8 memory slices form a binary tree numbered
 * level by level from the root, the upper half of each level first.  nvml.h says only "GPU instance IDs are
 * unique per device and remain valid until the GPU instance is destroyed"; the numbers are what nvidia-smi
 * prints on real GPUs (`nvidia-smi mig -lgi`): A100 3g.20gb at 4:4 is GI 1 and at 0:4 GI 2 (the MIG user
 * guide's example, e.g. seansiddens/mps-test README.md); H100 1g.10gb at 4:1, 5:1, 6:1 are GI 7, 8, 9 and at
 * 0:1..3:1 GI 11..14.  Size 8 is GI 0; size 2 follows the same rule (4:2 -> 3, 6:2 -> 4, 0:2 -> 5, 2:2 -> 6),
 * inferred, not seen. */
static int gi_id_for(int start, int size) {
    if (size != 8 && size != 4 && size != 2 && size != 1) return 15 + start; /* sizes no profile declares */
    int nodes = 8 / size;                                                 /* placements of this size */
    return nodes - 1 + (start / size + nodes / 2) % nodes;
}

/* Compute-instance profile ids: on A100/H100 the id nvmlGpuInstanceGetComputeInstanceProfileInfo returns for
 * NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE equals that index (`nvidia-smi mig -cgi 9 -C`: "using profile MIG
 * 3g.20gb (ID  2)", the 3-slice index; NVIDIA/go-nvml pkg/nvml/mock/gpus/a100.go declares Id =
 * COMPUTE_INSTANCE_PROFILE_*).  nvml.h does not promise it, so a profile may set "ciProfileIdBase" to model a
 * GPU where they differ. */
static const int ci_index_slices[] = {1, 2, 3, 4, 7, 8, 6};
#define CI_INDEXES ((int)(sizeof ci_index_slices / sizeof ci_index_slices[0]))

static int ci_profile_base(void) { return (int)json_int(config, "ciProfileIdBase", 0); }

static const jval *gi_profile(int gpu, const char *key, long long want) {
    const jval *list = json_get(gpus[gpu], "migProfiles");
    for (int i = 0; list && list->type == J_ARR && i < list->n; i++)
        if (json_int(list->items[i], key, -1) == want) return list->items[i];
    return NULL;
}

static int max_slices(int gpu) {
    int m = 0;
    const jval *list = json_get(gpus[gpu], "migProfiles");
    for (int i = 0; list && list->type == J_ARR && i < list->n; i++) {
        int s = (int)json_int(list->items[i], "sliceCount", 0);
        if (s > m) m = s;
    }
    return m;
}

static struct gi_state *find_gi(int gpu, int id) {
    for (int k = 0; k < state[gpu].ngi; k++)
        if (state[gpu].gi[k].id == id) return &state[gpu].gi[k];
    return NULL;
}

static void mig_uuid(int gpu, int gi, int ci, char *out, size_t len) {
    /* Stable per (parent UUID, GI, CI): FNV-1a spread over 16 bytes in the UUID layout NVML prints. */
    char key[192];
    snprintf(key, sizeof key, "%s/%d/%d", json_str(gpus[gpu], "uuid", ""), gi, ci);
    unsigned char b[16];
    unsigned long long hsh = 1469598103934665603ULL;
    for (int r = 0; r < 16; r++) {
        for (const char *p = key; *p; p++) hsh = (hsh ^ (unsigned char)*p) * 1099511628211ULL;
        hsh = (hsh ^ (unsigned long long)r) * 1099511628211ULL;
        b[r] = (unsigned char)(hsh >> 32);
    }
    snprintf(out, len, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* ---------------------------------------------------------------------------------------------- per GPU */

static nvmlReturn_t get_uuid(nvmlDevice_t h, char *buf, unsigned int len) {
    int i;
    nvmlReturn_t rc = gpu_of(h, &i);
    if (rc) return rc;
    if (h->kind == H_MIG) {
        char u[96];
        mig_uuid(i, h->gi, h->ci, u, sizeof u);
        return copy_str(buf, len, u);
    }
    return str_answer(gpus[i], "uuid", buf, len);
}
API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *buf, unsigned int len) { LOCKED(get_uuid(h, buf, len)); }

static nvmlReturn_t get_name(nvmlDevice_t h, char *buf, unsigned int len) {
    int i;
    nvmlReturn_t rc = gpu_of(h, &i);
    if (rc) return rc;
    if (h->kind == H_MIG) {
        rc = state_begin();
        struct gi_state *gi = rc ? NULL : find_gi(i, h->gi);
        const jval *p = gi ? gi_profile(i, "id", gi->profile_id) : NULL;
        state_end(0);
        char name[200];
        snprintf(name, sizeof name, "%s MIG %s", json_str(gpus[i], "name", "?"), p ? json_str(p, "name", "?") : "?");
        return copy_str(buf, len, name);
    }
    return str_answer(gpus[i], "name", buf, len);
}
API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *buf, unsigned int len) { LOCKED(get_name(h, buf, len)); }

static nvmlReturn_t int_answer(nvmlDevice_t h, const char *key, long long *out, int mig_ok) {
    int i;
    nvmlReturn_t rc = mig_ok ? gpu_of(h, &i) : whole_gpu(h, &i);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    const jval *v;
    rc = answer(gpus[i], key, &v);
    if (rc) return rc;
    *out = v->inum;
    return NVML_SUCCESS;
}

#define INT_GETTER(fn, key, type, mig_ok)                                                                         \
    static nvmlReturn_t fn##_impl(nvmlDevice_t h, type *out) {                                                    \
        long long v;                                                                                              \
        if (!out) return NVML_ERROR_INVALID_ARGUMENT;                                                             \
        nvmlReturn_t rc = int_answer(h, key, &v, mig_ok);                                                         \
        if (!rc) *out = (type)v;                                                                                  \
        return rc;                                                                                                \
    }                                                                                                             \
    API nvmlReturn_t fn(nvmlDevice_t h, type *out) { LOCKED(fn##_impl(h, out)); }

INT_GETTER(nvmlDeviceGetMinorNumber, "minor", unsigned int, 0)
INT_GETTER(nvmlDeviceGetBrand, "brand", int, 1)
INT_GETTER(nvmlDeviceGetArchitecture, "architecture", unsigned int, 1)
INT_GETTER(nvmlDeviceGetNumaNodeId, "numaNodeId", unsigned int, 0)

static nvmlReturn_t get_index(nvmlDevice_t h, unsigned int *out) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = (unsigned int)i;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *out) { LOCKED(get_index(h, out)); }

static nvmlReturn_t compute_capability(nvmlDevice_t h, int *major, int *minor) {
    int i;
    nvmlReturn_t rc = gpu_of(h, &i);
    if (rc) return rc;
    if (!major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    const jval *v;
    rc = answer(gpus[i], "computeCapability", &v);
    if (rc) return rc;
    if (v->type != J_ARR || v->n != 2) return NVML_ERROR_UNKNOWN;
    *major = (int)v->items[0]->inum;
    *minor = (int)v->items[1]->inum;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t h, int *major, int *minor) {
    LOCKED(compute_capability(h, major, minor));
}

/* telemetry.inc: bytes in use from the scenario; the NVLink throughput fields. */
static unsigned long long memory_used(nvmlDevice_t h, int index, unsigned long long total);
static int nvlink_field(int index, nvmlFieldValue_t *v);

static nvmlReturn_t memory(nvmlDevice_t h, unsigned long long *total, unsigned long long *used) {
    int i;
    nvmlReturn_t rc = gpu_of(h, &i);
    if (rc) return rc;
    const jval *v;
    rc = answer(gpus[i], "memoryTotal", &v);
    if (rc) return rc;
    *total = (unsigned long long)v->inum;
    if (h->kind == H_MIG) {
        rc = state_begin();
        struct gi_state *gi = rc ? NULL : find_gi(i, h->gi);
        const jval *p = gi ? gi_profile(i, "id", gi->profile_id) : NULL;
        state_end(0);
        if (!p) return NVML_ERROR_NOT_FOUND;
        *total = (unsigned long long)json_int(p, "memorySizeMB", 0) << 20;
    } else if (mig_enabled(i) && !privileged()) {
        /* nvml.h: "In MIG mode, if device handle is provided, the API returns aggregate information, only if the
         * caller has appropriate privileges" (NVML_ERROR_NO_PERMISSION "if the user doesn't have permission"). */
        return NVML_ERROR_NO_PERMISSION;
    }
    *used = memory_used(h, i, *total);
    return NVML_SUCCESS;
}

static nvmlReturn_t memory_v1(nvmlDevice_t h, nvmlMemory_t *m) {
    unsigned long long total, used;
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = memory(h, &total, &used);
    if (!rc) *m = (nvmlMemory_t){total, total - used, used};
    return rc;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m) { LOCKED(memory_v1(h, m)); }

static nvmlReturn_t memory_v2(nvmlDevice_t h, nvmlMemory_v2_t *m) {
    unsigned long long total, used;
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    /* nvml.h: "#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)", and NVML_ERROR_ARGUMENT_VERSION_MISMATCH
     * is "The provided version is invalid/unsupported" (the call's own list is silent): the whole word, so a
     * version 2 with another struct's size is refused too. */
    if (m->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t rc = memory(h, &total, &used);
    if (!rc) { m->total = total; m->reserved = 0; m->free = total - used; m->used = used; }
    return rc;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m) { LOCKED(memory_v2(h, m)); }

static nvmlReturn_t mig_mode(nvmlDevice_t h, unsigned int *current, unsigned int *pending) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    const jval *v;
    rc = answer(gpus[i], "migMode", &v);
    if (rc) return rc;
    if (v->type != J_ARR || v->n != 2) return NVML_ERROR_UNKNOWN;
    *current = (unsigned int)v->items[0]->inum;
    *pending = (unsigned int)v->items[1]->inum;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current, unsigned int *pending) {
    LOCKED(mig_mode(h, current, pending));
}

/* ---------------------------------------------------------------------------------------------- NVLink */

static nvmlReturn_t link_of(nvmlDevice_t h, unsigned int link, int *gpu, const jval **out) {
    nvmlReturn_t rc = whole_gpu(h, gpu);
    if (rc) return rc;
    const jval *links;
    rc = answer(gpus[*gpu], "nvlinks", &links);
    if (rc) return rc;
    if (links->type != J_ARR || link >= (unsigned int)links->n) return NVML_ERROR_INVALID_ARGUMENT;
    *out = links->items[link];
    return NVML_SUCCESS;
}

static nvmlReturn_t link_int(nvmlDevice_t h, unsigned int link, const char *key, unsigned int *out) {
    int gpu;
    const jval *l, *v;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = link_of(h, link, &gpu, &l);
    if (rc) return rc;
    rc = answer(l, key, &v);
    if (rc) return rc;
    *out = (unsigned int)v->inum;
    if (!strcmp(key, "state")) {
        struct gpu_faults f = gpu_faults(gpu);
        for (int k = 0; k < f.nlinks_down; k++)
            if (f.links_down[k] == link) *out = 0; /* NVML_FEATURE_DISABLED */
    }
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t h, unsigned int link, unsigned int *isActive) {
    LOCKED(link_int(h, link, "state", isActive));
}
/* The nvmlNvlinkVersion_t enum (A100: 5 = 3_1, H100: 6 = 4_0, B200: 7 = 5_0), not the NVLink generation. */
API nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t h, unsigned int link, unsigned int *version) {
    LOCKED(link_int(h, link, "version", version));
}
API nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t h, unsigned int link, unsigned int *type) {
    LOCKED(link_int(h, link, "remoteType", type));
}

static nvmlReturn_t remote_pci(nvmlDevice_t h, unsigned int link, nvmlPciInfo_t *p) {
    int gpu;
    const jval *l, *v;
    if (!p) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = link_of(h, link, &gpu, &l);
    if (rc) return rc;
    rc = answer(l, "remoteBusId", &v);
    if (rc) return rc;
    memset(p, 0, sizeof *p);
    parse_bus_id(v->str ? v->str : "", p);
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t h, unsigned int link, nvmlPciInfo_t *p) {
    LOCKED(remote_pci(h, link, p));
}
API nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t h, unsigned int link, nvmlPciInfo_t *p) {
    LOCKED(remote_pci(h, link, p));
}

/* ---------------------------------------------------------------------------------------------- fabric */

static void uuid_bytes(const char *s, unsigned char out[16]) {
    int k = 0;
    memset(out, 0, 16);
    for (const char *p = s; *p && k < 32; p++) {
        int d = (*p >= '0' && *p <= '9') ? *p - '0' : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
              : (*p >= 'A' && *p <= 'F') ? *p - 'A' + 10 : -1;
        if (d < 0) continue;
        out[k / 2] = (unsigned char)(out[k / 2] | (k % 2 ? d : d << 4));
        k++;
    }
}

static nvmlReturn_t fabric(nvmlDevice_t h, void *ptr, int versioned) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!ptr) return NVML_ERROR_INVALID_ARGUMENT;
    const jval *f;
    rc = answer(gpus[i], "fabric", &f);
    if (rc) return rc;
    int api = (int)json_int(f, "api", 3);
    unsigned char uuid[16];
    uuid_bytes(json_str(f, "clusterUuid", ""), uuid);
    if (!versioned) {
        nvmlGpuFabricInfo_t *o = ptr;
        memcpy(o->clusterUuid, uuid, 16);
        o->status = (nvmlReturn_t)json_int(f, "status", 0);
        o->cliqueId = (unsigned int)json_int(f, "cliqueId", 0);
        o->state = (unsigned int)json_int(f, "state", 3);
        return NVML_SUCCESS;
    }
    if (api < 2) return NVML_ERROR_FUNCTION_NOT_FOUND;
    nvmlGpuFabricInfoV_t *o = ptr;
    /* nvml.h: "#define nvmlGpuFabricInfo_v2 NVML_STRUCT_VERSION(GpuFabricInfo, 2)" (and _v3): the whole word;
     * NVML_ERROR_ARGUMENT_VERSION_MISMATCH is "The provided version is invalid/unsupported". */
    unsigned int ver = o->version == nvmlGpuFabricInfo_v2 ? 2 : o->version == nvmlGpuFabricInfo_v3 ? 3 : 0;
    if (!ver || (int)ver > api) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memcpy(o->clusterUuid, uuid, 16);
    o->status = (nvmlReturn_t)json_int(f, "status", 0);
    o->cliqueId = (unsigned int)json_int(f, "cliqueId", 0);
    o->state = (unsigned int)json_int(f, "state", 3);
    o->healthMask = (unsigned int)json_int(f, "healthMask", 0);
    if (ver == 3) o->healthSummary = 0;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t h, nvmlGpuFabricInfo_t *info) { LOCKED(fabric(h, info, 0)); }
API nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t h, nvmlGpuFabricInfoV_t *info) { LOCKED(fabric(h, info, 1)); }

/* ---------------------------------------------------------------------------------------------- health */

static nvmlReturn_t clock_reasons(nvmlDevice_t h, unsigned long long *out) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = gpu_faults(i).clocks_event_reasons;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t h, unsigned long long *r) { LOCKED(clock_reasons(h, r)); }
API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h, unsigned long long *r) { LOCKED(clock_reasons(h, r)); }

static nvmlReturn_t field_values(nvmlDevice_t h, int count, nvmlFieldValue_t *values) {
    int i;
    nvmlReturn_t rc = gpu_of(h, &i);
    if (rc) return rc;
    if (count < 0 || (count > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    struct gpu_faults f = gpu_faults(i);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int k = 0; k < count; k++) {
        values[k].timestamp = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
        values[k].latencyUsec = 0;
        if (values[k].fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) {
            values[k].valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            values[k].nvmlReturn = NVML_SUCCESS;
            values[k].value.ullVal = 0;
            values[k].value.uiVal = f.recovery_action;
        } else if (nvlink_field(i, &values[k])) {
            continue;
        } else {
            values[k].nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t h, int count, nvmlFieldValue_t *values) {
    LOCKED(field_values(h, count, values));
}

static nvmlReturn_t remapped_rows(nvmlDevice_t h, unsigned int *corr, unsigned int *unc, unsigned int *pend,
                                  unsigned int *fail) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!corr || !unc || !pend || !fail) return NVML_ERROR_INVALID_ARGUMENT;
    struct gpu_faults f = gpu_faults(i);
    *corr = f.remapped[0];
    *unc = f.remapped[1];
    *pend = f.remapped[2];
    *fail = f.remapped[3];
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *c, unsigned int *u, unsigned int *p,
                                           unsigned int *f) {
    LOCKED(remapped_rows(h, c, u, p, f));
}

/* ---------------------------------------------------------------------------------------------- events */

struct standin_eventset {
    int magic;
    int used;
    int cursor;                           /* next index into the faults file's "events" */
    unsigned long long mask[MAX_GPUS];    /* registered event types per GPU */
};
static struct standin_eventset eventsets[MAX_EVENTSETS];

static const unsigned long long supported_events = NVML_EVENT_SINGLE_BIT_ECC | NVML_EVENT_DOUBLE_BIT_ECC | NVML_EVENT_XID;

static nvmlReturn_t supported_event_types(nvmlDevice_t h, unsigned long long *out) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    *out = supported_events;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, unsigned long long *out) {
    LOCKED(supported_event_types(h, out));
}

static nvmlReturn_t eventset_create(nvmlEventSet_t *out) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    for (int k = 0; k < MAX_EVENTSETS; k++) {
        if (eventsets[k].used) continue;
        memset(&eventsets[k], 0, sizeof eventsets[k]);
        eventsets[k].magic = MAGIC;
        eventsets[k].used = 1;
        refresh_faults();
        eventsets[k].cursor = event_count(); /* only events injected from now on */
        *out = &eventsets[k];
        return NVML_SUCCESS;
    }
    return NVML_ERROR_MEMORY;
}
API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *out) { LOCKED(eventset_create(out)); }

static int valid_set(nvmlEventSet_t s) { return s && s->magic == MAGIC && s->used; }

static nvmlReturn_t register_events(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~supported_events) return NVML_ERROR_NOT_SUPPORTED;
    set->mask[i] |= types;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
    LOCKED(register_events(h, types, set));
}

static nvmlReturn_t eventset_free(nvmlEventSet_t set) {
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    set->used = 0;
    set->magic = 0;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { LOCKED(eventset_free(set)); }

/* One step of a wait: an event, GPU_IS_LOST if a registered GPU is lost, or TIMEOUT (= nothing yet). */
static nvmlReturn_t next_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    nvmlReturn_t rc = live();
    if (rc) return rc;
    if (!valid_set(set) || !data) return NVML_ERROR_INVALID_ARGUMENT;
    refresh_faults();
    for (int i = 0; i < ngpus; i++)
        if (set->mask[i] && gpu_faults(i).lost) return NVML_ERROR_GPU_IS_LOST;
    const jval *events = json_get(faults, "events");
    int n = event_count();
    if (set->cursor > n) set->cursor = n;
    while (set->cursor < n) {
        const jval *ev = events->items[set->cursor++];
        int i = gpu_ref_index(json_get(ev, "gpu"));
        const char *type = json_str(ev, "type", "");
        unsigned long long bit = !strcmp(type, "xid") ? NVML_EVENT_XID : !strcmp(type, "dbe") ? NVML_EVENT_DOUBLE_BIT_ECC
                               : !strcmp(type, "sbe") ? NVML_EVENT_SINGLE_BIT_ECC : 0;
        if (i < 0 || !(set->mask[i] & bit)) continue;
        data->device = &gpu_handles[i];
        data->eventType = bit;
        data->eventData = bit == NVML_EVENT_XID ? (unsigned long long)json_int(ev, "data", 0) : 0;
        /* nvml.h: the ids are valid only for an XID attributable to an instance while MIG is enabled. */
        int mig_xid = bit == NVML_EVENT_XID && mig_enabled(i);
        data->gpuInstanceId = mig_xid ? (unsigned int)json_int(ev, "gpuInstanceId", NVML_VALUE_INVALID_ID)
                                      : NVML_VALUE_INVALID_ID;
        data->computeInstanceId = mig_xid ? (unsigned int)json_int(ev, "computeInstanceId", NVML_VALUE_INVALID_ID)
                                          : NVML_VALUE_INVALID_ID;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_TIMEOUT;
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&mu);
        nvmlReturn_t rc = next_event(set, data);
        pthread_mutex_unlock(&mu);
        if (rc != NVML_ERROR_TIMEOUT) return rc;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long left_ms = (long long)timeoutms - ((now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000);
        if (left_ms <= 0) return NVML_ERROR_TIMEOUT;
        struct timespec nap = {0, (left_ms < 20 ? left_ms : 20) * 1000000L};
        nanosleep(&nap, NULL);
    }
}
API nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

/* ---------------------------------------------------------------------------------------------- compute mode */

static nvmlReturn_t get_mode(nvmlDevice_t h, int *mode) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    rc = state_begin();
    *mode = state[i].compute_mode;
    nvmlReturn_t rc2 = state_end(0);
    return rc ? rc : rc2;
}
API nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t h, int *mode) { LOCKED(get_mode(h, mode)); }

static nvmlReturn_t set_mode(nvmlDevice_t h, int mode) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (mode != 0 && mode != 2 && mode != 3) return NVML_ERROR_INVALID_ARGUMENT; /* DEFAULT, PROHIBITED, EXCLUSIVE_PROCESS */
    rc = state_begin();
    if (!rc) state[i].compute_mode = mode;
    nvmlReturn_t rc2 = state_end(!rc);
    return rc ? rc : rc2;
}
API nvmlReturn_t nvmlDeviceSetComputeMode(nvmlDevice_t h, int mode) { LOCKED(set_mode(h, mode)); }

/* Not NVML: the time-slice level nvidia-smi compute-policy keeps (the stand-in nvidia-smi calls these). */
static nvmlReturn_t timeslice(nvmlDevice_t h, int *get, int set) {
    int i;
    nvmlReturn_t rc = whole_gpu(h, &i);
    if (rc) return rc;
    if (!get && (set < 0 || set > 3)) return NVML_ERROR_INVALID_ARGUMENT;
    rc = state_begin();
    if (!rc) { if (get) *get = state[i].timeslice; else state[i].timeslice = set; }
    nvmlReturn_t rc2 = state_end(!rc && !get);
    return rc ? rc : rc2;
}
API nvmlReturn_t topodraStandinGetTimeslice(nvmlDevice_t h, int *level) { LOCKED(timeslice(h, level, 0)); }
API nvmlReturn_t topodraStandinSetTimeslice(nvmlDevice_t h, int level) { LOCKED(timeslice(h, NULL, level)); }

#include "mig.inc"
#include "telemetry.inc"
