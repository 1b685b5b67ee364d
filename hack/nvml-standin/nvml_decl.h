/* The subset of the public NVML C API the stand-in implements, declared from nvml.h's documented
 * types and struct layouts (field order and sizes must match what pynvml and go-nvml pass in). */
#ifndef STANDIN_NVML_DECL_H
#define STANDIN_NVML_DECL_H

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4, NVML_ERROR_ALREADY_INITIALIZED = 5, NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7, NVML_ERROR_INSUFFICIENT_POWER = 8, NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10, NVML_ERROR_IRQ_ISSUE = 11, NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13, NVML_ERROR_CORRUPTED_INFOROM = 14, NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16, NVML_ERROR_OPERATING_SYSTEM = 17, NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19, NVML_ERROR_MEMORY = 20, NVML_ERROR_NO_DATA = 21, NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23, NVML_ERROR_FREQ_NOT_SUPPORTED = 24,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25, NVML_ERROR_DEPRECATED = 26, NVML_ERROR_NOT_READY = 27,
    NVML_ERROR_GPU_NOT_FOUND = 28, NVML_ERROR_INVALID_STATE = 29, NVML_ERROR_UNKNOWN = 999
};

/* Opaque handles: the stand-in's own structs behind the pointers. */
typedef struct standin_handle *nvmlDevice_t;
typedef struct standin_handle *nvmlGpuInstance_t;
typedef struct standin_handle *nvmlComputeInstance_t;
typedef struct standin_eventset *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef union {
    double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal; long long sllVal; int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType; /* nvmlValueType_t */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct { unsigned int start, size; } nvmlGpuInstancePlacement_t;
typedef struct { unsigned int start, size; } nvmlComputeInstancePlacement_t;

typedef struct {
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount,
        encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
} nvmlGpuInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id, isP2pSupported, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount,
        encoderCount, jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, copyEngineCount, decoderCount, encoderCount,
        jpegCount, ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
    unsigned int capabilities;
} nvmlGpuInstanceProfileInfo_v3_t;

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
} nvmlComputeInstanceProfileInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[96];
} nvmlComputeInstanceProfileInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned int id, sliceCount, instanceCount, multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount,
        sharedEncoderCount, sharedJpegCount, sharedOfaCount;
    char name[96];
    unsigned int capabilities;
} nvmlComputeInstanceProfileInfo_v3_t;

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id;
    unsigned int profileId;
    nvmlComputeInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

typedef struct {
    unsigned int multiprocessorCount, sharedCopyEngineCount, sharedDecoderCount, sharedEncoderCount, sharedJpegCount,
        sharedOfaCount, gpuInstanceSliceCount, computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state; /* nvmlGpuFabricState_t */
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;
typedef nvmlGpuFabricInfo_v3_t nvmlGpuFabricInfoV_t;

/* nvmlProcessInfo_t (the _v2/_v3 process calls' element; not versioned) and the versioned detail list. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
    unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct {
    unsigned int version;
    unsigned int mode; /* nvmlProcessMode_t */
    unsigned int numProcArrayEntries;
    nvmlProcessDetail_v1_t *procArray;
} nvmlProcessDetailList_v1_t;

#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)
#define nvmlGpuFabricInfo_v2 NVML_STRUCT_VERSION(GpuFabricInfo, 2)
#define nvmlGpuFabricInfo_v3 NVML_STRUCT_VERSION(GpuFabricInfo, 3)
#define nvmlGpuInstanceProfileInfo_v2 NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 2)
#define nvmlGpuInstanceProfileInfo_v3 NVML_STRUCT_VERSION(GpuInstanceProfileInfo, 3)
#define nvmlComputeInstanceProfileInfo_v2 NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 2)
#define nvmlComputeInstanceProfileInfo_v3 NVML_STRUCT_VERSION(ComputeInstanceProfileInfo, 3)
#define nvmlProcessDetailList_v1 NVML_STRUCT_VERSION(ProcessDetailList, 1)

#define NVML_PROCESS_MODE_COMPUTE 0
#define NVML_PROCESS_MODE_ALL 3
#define NVML_PROCESS_MODE_MAX 4
#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ULL)

/* nvml.h: "#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml ## data ## _v ## ver ## _t) |
 * (ver << 24U))": the whole word is the version, the struct's size in the low bits. */
#define NVML_STRUCT_VERSION(data, ver) ((unsigned int)(sizeof(nvml##data##_v##ver##_t) | ((unsigned int)(ver) << 24U)))

/* nvmlEventType* bits */
#define NVML_EVENT_SINGLE_BIT_ECC 0x1ULL
#define NVML_EVENT_DOUBLE_BIT_ECC 0x2ULL
#define NVML_EVENT_XID 0x8ULL

#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_INVALID_ID 0xFFFFFFFFu /* GI/CI id of an event that concerns the whole GPU */

/* The layouts above must be nvml.h's, byte for byte: the version words the callers pass say their sizes
 * (pynvml: nvmlMemory_v2 = 0x02000028, nvmlGpuInstanceProfileInfo_v2 = 0x02000098,
 * nvmlComputeInstanceProfileInfo_v2 = 0x02000088, nvmlProcessDetailList_v1 = 0x1000018). */
_Static_assert(sizeof(nvmlMemory_v2_t) == 0x28, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v2_t) == 0x98, "nvmlGpuInstanceProfileInfo_v2_t");
_Static_assert(sizeof(nvmlGpuInstanceProfileInfo_v3_t) == 0x98, "nvmlGpuInstanceProfileInfo_v3_t");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v2_t) == 0x88, "nvmlComputeInstanceProfileInfo_v2_t");
_Static_assert(sizeof(nvmlComputeInstanceProfileInfo_v3_t) == 0x8C, "nvmlComputeInstanceProfileInfo_v3_t");
_Static_assert(sizeof(nvmlGpuFabricInfo_v2_t) == 0x24, "nvmlGpuFabricInfo_v2_t");
_Static_assert(sizeof(nvmlGpuFabricInfo_v3_t) == 0x28, "nvmlGpuFabricInfo_v3_t");
_Static_assert(sizeof(nvmlProcessDetailList_v1_t) == 0x18, "nvmlProcessDetailList_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 0x18, "nvmlProcessInfo_t");

#endif
