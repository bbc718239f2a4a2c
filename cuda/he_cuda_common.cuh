/* Helpers shared by the .cu files: checked CUDA calls, launch shapes. */
#ifndef HE_CUDA_COMMON_CUH
#define HE_CUDA_COMMON_CUH

#include <cuda_runtime.h>

#include <stdint.h>

#include "he_cuda.h"

/* Records which call failed and CUDA's words for it. The runtime's last
 * error is cleared so that a later, unrelated check does not report it
 * again (sticky errors such as an illegal address persist regardless). */
static inline he_status he_cuda_fail(cudaError_t err, const char *what, const char *file, int line)
{
    (void)cudaGetLastError();
    return he_fail(err == cudaErrorMemoryAllocation ? HE_ERR_NOMEM : HE_ERR_CUDA, "CUDA: %s failed: %s (%s) [%s:%d]",
                   what, cudaGetErrorName(err), cudaGetErrorString(err), file, line);
}

/* Returns from the enclosing he_status function when `call` fails. */
#define HE_CUDA_TRY_AS(call, what)                                                                                 \
    do {                                                                                                           \
        cudaError_t he_cuda_err_ = (call);                                                                         \
        if (he_cuda_err_ != cudaSuccess)                                                                           \
            return he_cuda_fail(he_cuda_err_, what, __FILE__, __LINE__);                                           \
    } while (0)
#define HE_CUDA_TRY(call) HE_CUDA_TRY_AS(call, #call)

/* After every <<<>>>: a bad launch configuration is reported only here. */
#define HE_CUDA_LAUNCHED(kernel) HE_CUDA_TRY_AS(cudaGetLastError(), "launch of " #kernel)

/* Devices this process has made current for its work (bit d: device d; bit
 * 63 stands for every device from 63 on): he_cuda_unregister waits for all
 * of them, since a table registered from one device may be read by kernels
 * on another. Defined in host_register.cu. */
extern unsigned long long he_cuda_devices_used;

static inline unsigned long long he_cuda_device_bit(int device)
{
    return 1ull << (device < 63 ? device : 63);
}

/* Makes `device` current for the rest of the enclosing scope, then gives
 * the calling thread its previous device back. The current device is
 * per-thread state shared with torch (both runtimes follow the driver's
 * current context), so a call that switched devices and left them switched
 * would send this thread's later torch work to another GPU. Nothing is
 * switched (or restored) when `device` is already current, the case of
 * every call from the Python layer, which runs inside torch.cuda.device().
 * Also drops a stale error left by an earlier failure on this thread, so
 * that HE_CUDA_LAUNCHED blames only the launch it follows. */
class he_cuda_device_scope {
  public:
    he_cuda_device_scope() = default;
    he_cuda_device_scope(const he_cuda_device_scope &) = delete;
    he_cuda_device_scope &operator=(const he_cuda_device_scope &) = delete;
    ~he_cuda_device_scope()
    {
        if (switched_)
            (void)cudaSetDevice(previous_);
    }

    he_status enter(int device)
    {
        (void)cudaGetLastError();
        int current = -1;
        HE_CUDA_TRY_AS(cudaGetDevice(&current), "cudaGetDevice");
        if (current != device) {
            HE_CUDA_TRY_AS(cudaSetDevice(device), "cudaSetDevice");
            previous_ = current;
            switched_ = true;
        }
        __atomic_fetch_or(&he_cuda_devices_used, he_cuda_device_bit(device), __ATOMIC_RELAXED);
        return HE_OK;
    }

  private:
    int previous_ = -1;
    bool switched_ = false;
};

#define HE_CUDA_THREADS 256
#define HE_CUDA_WARP 32
/* Grids stride past this many blocks: far more than enough to fill any GPU
 * (132 SMs x 8 blocks), and far below the 2^31 - 1 limit. */
#define HE_CUDA_MAX_BLOCKS ((int64_t)1 << 20)

/* Blocks for `items` work items of `per_block` each, capped (kernels loop). */
static inline unsigned he_cuda_blocks(int64_t items, int64_t per_block)
{
    int64_t blocks = (items + per_block - 1) / per_block;
    if (blocks < 1)
        blocks = 1;
    return (unsigned)(blocks < HE_CUDA_MAX_BLOCKS ? blocks : HE_CUDA_MAX_BLOCKS);
}

/* Workspace sub-buffers start on 256 bytes: CUB's own alignment for its
 * temporary storage, and whole cache lines for the rest. */
static inline size_t he_cuda_align256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

static inline int he_cuda_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* int64 thread and warp indices: count * dim passes 2^31 for big batches. */
static __device__ __forceinline__ int64_t he_thread_index()
{
    return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}

static __device__ __forceinline__ int64_t he_thread_count()
{
    return (int64_t)gridDim.x * blockDim.x;
}

#endif
