/* A stand-in nvidia-smi for the driver-tree fixture: the few commands topodra and NVIDIA's drivers run.
 *
 * Like the real tool it finds libnvidia-ml.so.1 by soname, so under a driver root that is not in the
 * loader's path it works only when the caller preloads the library by absolute path (LD_PRELOAD), which is
 * what NVIDIA's DRA driver does.  Commands: -L, -q [-i ID], -c MODE -i ID, and
 * compute-policy [-i ID] --set-timeslice N | -l.  Anything else exits 2 naming what it did not take.
 * The "--set-timeslice=N" spelling is refused on purpose: only the two-argument form DRA runs is known to
 * work on the real tool (docs/real-node.md).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *dev_t_;
typedef int (*fn0)(void);
static void *lib;

static void *sym(const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "nvidia-smi: libnvidia-ml.so.1 lacks %s\n", name);
        exit(13);
    }
    return f;
}
#define CALL(name, ...) ((int (*)())sym(#name))(__VA_ARGS__)

static const char *err(int rc) { return ((const char *(*)(int))sym("nvmlErrorString"))(rc); }

static int fail(const char *what, int rc) {
    fprintf(stderr, "%s: %s\n", what, err(rc));
    return rc;
}

static int count(void) {
    unsigned int n = 0;
    int rc = CALL(nvmlDeviceGetCount_v2, &n);
    if (rc) exit(fail("Unable to determine the device count", rc));
    return (int)n;
}

/* -i accepts an index, a UUID or a PCI bus id, as the real tool does. */
static int resolve(const char *id, dev_t_ *out) {
    char *end;
    long idx = strtol(id, &end, 10);
    if (*id && !*end) return CALL(nvmlDeviceGetHandleByIndex_v2, (unsigned int)idx, out);
    if (!strncmp(id, "GPU-", 4)) return CALL(nvmlDeviceGetHandleByUUID, id, out);
    return CALL(nvmlDeviceGetHandleByPciBusId_v2, id, out);
}

static int for_each(const char *id, int (*fn)(dev_t_, int, const char *), const char *arg) {
    dev_t_ h;
    if (id) {
        int rc = resolve(id, &h);
        if (rc) { fprintf(stderr, "No devices were found matching the ID %s: %s\n", id, err(rc)); return 6; }
        return fn(h, -1, arg);
    }
    int n = count(), worst = 0;
    for (int i = 0; i < n; i++) {
        int rc = CALL(nvmlDeviceGetHandleByIndex_v2, (unsigned int)i, &h);
        if (rc) { fail("Unable to get the device handle", rc); worst = rc; continue; }
        rc = fn(h, i, arg);
        if (rc) worst = rc;
    }
    return worst;
}

static void text(dev_t_ h, const char *fn, char *buf, unsigned int len) {
    buf[0] = 0;
    int rc = ((int (*)(dev_t_, char *, unsigned int))sym(fn))(h, buf, len);
    if (rc) snprintf(buf, len, "[%s]", err(rc));
}

static int list_one(dev_t_ h, int i, const char *arg) {
    (void)arg;
    char name[128], uuid[96];
    text(h, "nvmlDeviceGetName", name, sizeof name);
    text(h, "nvmlDeviceGetUUID", uuid, sizeof uuid);
    printf("GPU %d: %s (UUID: %s)\n", i, name, uuid);
    unsigned int cur = 0, pend = 0, max = 0;
    if (CALL(nvmlDeviceGetMigMode, h, &cur, &pend) || cur != 1 || CALL(nvmlDeviceGetMaxMigDeviceCount, h, &max)) return 0;
    for (unsigned int k = 0; k < max; k++) {
        dev_t_ m;
        if (CALL(nvmlDeviceGetMigDeviceHandleByIndex, h, k, &m)) continue;
        char mname[160], muuid[96];
        text(m, "nvmlDeviceGetName", mname, sizeof mname);
        text(m, "nvmlDeviceGetUUID", muuid, sizeof muuid);
        const char *prof = strstr(mname, "MIG ");
        printf("  %-16s Device %2u: (UUID: %s)\n", prof ? prof : mname, k, muuid);
    }
    return 0;
}

static int query_one(dev_t_ h, int i, const char *arg) {
    (void)i; (void)arg;
    struct { char legacy[16]; unsigned int d, b, dv, id, sub; char bus[32]; } pci;
    char name[128], uuid[96];
    unsigned int minor = 0, cur = 0, pend = 0;
    int mode = 0;
    CALL(nvmlDeviceGetPciInfo_v3, h, &pci);
    text(h, "nvmlDeviceGetName", name, sizeof name);
    text(h, "nvmlDeviceGetUUID", uuid, sizeof uuid);
    printf("\nGPU %s\n    Product Name                          : %s\n", pci.bus, name);
    printf("    GPU UUID                              : %s\n", uuid);
    if (!CALL(nvmlDeviceGetMinorNumber, h, &minor)) printf("    Minor Number                          : %u\n", minor);
    if (!CALL(nvmlDeviceGetMigMode, h, &cur, &pend))
        printf("    MIG Mode\n        Current                           : %s\n        Pending                           : %s\n",
               cur ? "Enabled" : "Disabled", pend ? "Enabled" : "Disabled");
    if (!CALL(nvmlDeviceGetComputeMode, h, &mode))
        printf("    Compute Mode                          : %s\n",
               mode == 3 ? "Exclusive_Process" : mode == 2 ? "Prohibited" : "Default");
    return 0;
}

static int set_mode(dev_t_ h, int i, const char *arg) {
    (void)i;
    int mode = !strcmp(arg, "0") || !strcasecmp(arg, "DEFAULT") ? 0
             : !strcmp(arg, "2") || !strcasecmp(arg, "PROHIBITED") ? 2
             : !strcmp(arg, "3") || !strcasecmp(arg, "EXCLUSIVE_PROCESS") ? 3 : -1;
    if (mode < 0) { fprintf(stderr, "Invalid compute mode %s\n", arg); return 2; }
    int rc = CALL(nvmlDeviceSetComputeMode, h, mode);
    if (rc) return fail("Unable to set the compute mode", rc);
    struct { char legacy[16]; unsigned int d, b, dv, id, sub; char bus[32]; } pci;
    CALL(nvmlDeviceGetPciInfo_v3, h, &pci);
    printf("Set compute mode to %s for GPU %s.\n", mode == 3 ? "EXCLUSIVE_PROCESS" : mode == 2 ? "PROHIBITED" : "DEFAULT",
           pci.bus);
    return 0;
}

static int set_timeslice(dev_t_ h, int i, const char *arg) {
    (void)i;
    char *end;
    long level = strtol(arg, &end, 10);
    if (!*arg || *end || level < 0 || level > 3) { fprintf(stderr, "Invalid timeslice value %s (0-3)\n", arg); return 2; }
    int rc = CALL(topodraStandinSetTimeslice, h, (int)level);
    if (rc) return fail("Unable to set the timeslice", rc);
    char uuid[96];
    text(h, "nvmlDeviceGetUUID", uuid, sizeof uuid);
    printf("Successfully set timeslice to %ld for GPU %s\n", level, uuid);
    return 0;
}

static int get_timeslice(dev_t_ h, int i, const char *arg) {
    (void)i; (void)arg;
    int level = 0;
    int rc = CALL(topodraStandinGetTimeslice, h, &level);
    if (rc) return fail("Unable to get the timeslice", rc);
    char uuid[96];
    text(h, "nvmlDeviceGetUUID", uuid, sizeof uuid);
    printf("GPU %s: Timeslice: %d\n", uuid, level);
    return 0;
}

static int usage(const char *bad) {
    fprintf(stderr, "nvidia-smi (topodra stand-in): unsupported argument '%s'; see docs/real-node.md\n", bad);
    return 2;
}

int main(int argc, char **argv) {
    lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        fprintf(stderr, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the "
                        "NVIDIA Display Driver is properly installed and present in your system.\n");
        return 12;
    }
    int rc = CALL(nvmlInit_v2);
    if (rc) {
        fprintf(stderr, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver: %s\n", err(rc));
        return 9;
    }
    const char *id = NULL, *cmode = NULL, *timeslice = NULL;
    int list = 0, query = 0, policy = 0, policy_list = 0;
    for (int a = 1; a < argc; a++) {
        const char *s = argv[a];
        if (!strcmp(s, "-L") || !strcmp(s, "--list-gpus")) list = 1;
        else if (!strcmp(s, "-q") || !strcmp(s, "--query")) query = 1;
        else if (!strcmp(s, "compute-policy") && a == 1) policy = 1;
        else if ((!strcmp(s, "-i") || !strcmp(s, "--id")) && a + 1 < argc) id = argv[++a];
        else if (!strncmp(s, "--id=", 5)) id = s + 5;
        else if ((!strcmp(s, "-c") || !strcmp(s, "--compute-mode")) && a + 1 < argc && !policy) cmode = argv[++a];
        else if (!strncmp(s, "--compute-mode=", 15) && !policy) cmode = s + 15;
        else if (policy && !strcmp(s, "--set-timeslice") && a + 1 < argc) timeslice = argv[++a];
        else if (policy && (!strcmp(s, "-l") || !strcmp(s, "--list"))) policy_list = 1;
        else { rc = usage(s); goto out; }
    }
    if (policy && timeslice) rc = for_each(id, set_timeslice, timeslice);
    else if (policy && policy_list) rc = for_each(id, get_timeslice, NULL);
    else if (policy) rc = usage("compute-policy without --set-timeslice N or -l");
    else if (cmode) rc = id ? for_each(id, set_mode, cmode) : for_each(NULL, set_mode, cmode);
    else if (list) rc = for_each(id, list_one, NULL);
    else if (query) {
        char drv[96] = "";
        int cuda = 0;
        CALL(nvmlSystemGetDriverVersion, drv, (unsigned int)sizeof drv);
        CALL(nvmlSystemGetCudaDriverVersion, &cuda);
        printf("==============NVSMI LOG==============\n\nDriver Version                            : %s\n", drv);
        printf("CUDA Version                              : %d.%d\n\nAttached GPUs                             : %d\n",
               cuda / 1000, cuda % 1000 / 10, count());
        rc = for_each(id, query_one, NULL);
    } else rc = for_each(NULL, list_one, NULL);
out:
    CALL(nvmlShutdown);
    return rc;
}
