/* The few CUDA driver API calls the probe makes and the stand-in libcuda.so.1 answers, as
 * NVIDIA's cuda.h declares them (CUDA 12; the *_v2 names are what cuda.h's macros turn
 * cuMemAlloc and cuMemFree into). Declared here so that neither needs the CUDA toolkit,
 * and so that the stand-in cannot drift from what the probe calls. */
#ifndef CUDAWRAP_CUDA_ABI_H
#define CUDAWRAP_CUDA_ABI_H

#include <stddef.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_DEVICES_UNAVAILABLE 46
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev);
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);

#endif
