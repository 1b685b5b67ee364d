/* A stub libcuda.so.1: just enough of the CUDA driver API to tell which GPUs a container was given.
 *
 * cuDeviceGetCount counts the /dev/nvidiaN nodes this process may open.  Without a kernel driver, opening a
 * char device of major 195 fails with ENXIO or ENODEV *after* the device cgroup let it through, so those
 * count as "may open"; EPERM/EACCES (cgroup or mode said no) and ENOENT (no node) do not.  The device
 * directory is /dev, or TOPODRA_CUDA_STANDIN_DEV for tests outside a container.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100,
       CUDA_ERROR_INVALID_DEVICE = 101 };

static int initialized;
static int minors[64];
static int count;

static const char *dev_dir(void) {
    const char *d = getenv("TOPODRA_CUDA_STANDIN_DEV");
    return d && *d ? d : "/dev";
}

static int cmp(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

static void scan(void) {
    count = 0;
    DIR *d = opendir(dev_dir());
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) && count < 64) {
        if (strncmp(e->d_name, "nvidia", 6) || !e->d_name[6]) continue;
        const char *p = e->d_name + 6;
        int ok = 1;
        for (const char *q = p; *q; q++) ok &= isdigit((unsigned char)*q) != 0;
        if (!ok) continue;
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", dev_dir(), e->d_name);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0) close(fd);
        else if (errno != ENXIO && errno != ENODEV) continue;
        minors[count++] = atoi(p);
    }
    closedir(d);
    qsort(minors, (size_t)count, sizeof minors[0], cmp);
}

API CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    scan();
    initialized = 1;
    return count ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
}

API CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("TOPODRA_CUDA_STANDIN_VERSION");
    *version = v && *v ? atoi(v) : 12020;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *n) {
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *n = count;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= count) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

/* Not CUDA: the /dev/nvidiaN minor behind an ordinal, so tests can say which GPUs a container sees. */
API CUresult topodraStandinDeviceMinor(CUdevice dev, int *minor) {
    if (!minor) return CUDA_ERROR_INVALID_VALUE;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= count) return CUDA_ERROR_INVALID_DEVICE;
    *minor = minors[dev];
    return CUDA_SUCCESS;
}
