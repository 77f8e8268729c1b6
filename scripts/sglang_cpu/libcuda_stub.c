/* A no-GPU CUDA driver library (libcuda.so.1) for SGLang's CPU engine.
 *
 * The CPU engine imports the sgl_kernel Python package, whose libraries are linked against the
 * CUDA driver; without a libcuda.so.1 they do not load. This stub exports the driver entry
 * points those libraries import (scripts/sglang_cpu.sh checks the list against
 * `nm -D --undefined-only` of sgl_kernel's .so files) and every one of them answers
 * CUDA_ERROR_NO_DEVICE (100): no CUDA op of sgl_kernel runs on the CPU engine, and anything that
 * asks the driver learns there is no GPU. Build: gcc -shared -fPIC -o libcuda.so.1 libcuda_stub.c
 */

#define CUDA_ERROR_NO_DEVICE 100

/* Entry points that take no argument the stub needs: return CUDA_ERROR_NO_DEVICE. On x86-64 the
 * caller's arguments are left unread, so one signature serves them all. */
#define NO_DEVICE(name) \
    int name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuInit)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuCtxGetCurrent)
NO_DEVICE(cuCtxSetCurrent)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGetDevResource)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuMemAddressFree)
NO_DEVICE(cuMemGetAddressRange_v2)
NO_DEVICE(cuMemRelease)
NO_DEVICE(cuMemRetainAllocationHandle)
NO_DEVICE(cuMemSetAccess)
NO_DEVICE(cuMemUnmap)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)

/* cuGetErrorString(CUresult error, const char **str): callers print *str, so it is set. */
int cuGetErrorString(int error, const char **str)
{
    (void)error;
    if (str)
        *str = "CUDA_ERROR_NO_DEVICE: no CUDA device (no-GPU libcuda stub for SGLang's CPU engine)";
    return CUDA_ERROR_NO_DEVICE;
}
