/* Pinning the core's host buffers for zero-copy access from the GPU.
 *
 * cudaHostRegister on memory the core already owns, never a pinned copy:
 * torch's pin_memory() would copy the table and round the allocation up to
 * a power of two (a 20 GiB table would pin 32 GiB). Mapped: kernels read and
 * write the rows in place over PCIe. Portable: the mapping is valid in every
 * CUDA context of the process, not only the current device's. */
#include "he_cuda_common.cuh"

unsigned long long he_cuda_devices_used = 0;

static void unregister_prefix(char *base, size_t done)
{
    for (size_t off = 0; off < done; off += HE_CUDA_REGISTER_CHUNK)
        (void)cudaHostUnregister(base + off);
    (void)cudaGetLastError();
}

extern "C" he_status he_cuda_register(void *ptr, size_t bytes, int device, void **device_ptr)
{
    *device_ptr = NULL;
    if (ptr == NULL || bytes == 0)
        return he_fail(HE_ERR_VALUE, "cannot register an empty host buffer (%zu bytes at %p)", bytes, ptr);
    he_cuda_device_scope scope;
    he_status st = scope.enter(device);
    if (st != HE_OK)
        return st;

    char *base = (char *)ptr;
    char *device_base = NULL;
    size_t done = 0;
    while (done < bytes) {
        size_t len = bytes - done < HE_CUDA_REGISTER_CHUNK ? bytes - done : HE_CUDA_REGISTER_CHUNK;
        cudaError_t err = cudaHostRegister(base + done, len, cudaHostRegisterMapped | cudaHostRegisterPortable);
        if (err != cudaSuccess) {
            st = he_cuda_fail(err, "cudaHostRegister(Mapped | Portable)", __FILE__, __LINE__);
            goto done;
        }
        done += len;
        void *chunk_device = NULL;
        err = cudaHostGetDevicePointer(&chunk_device, base + done - len, 0);
        if (err != cudaSuccess) {
            st = he_cuda_fail(err, "cudaHostGetDevicePointer", __FILE__, __LINE__);
            goto done;
        }
        /* Kernels address the whole buffer from its first byte's device
         * address. With unified addressing (every 64-bit Linux system) each
         * chunk maps at its host address, so this holds; refuse rather than
         * index into the wrong memory if a platform ever does otherwise. */
        if (done == len)
            device_base = (char *)chunk_device;
        else if ((char *)chunk_device != device_base + (done - len)) {
            st = he_fail(HE_ERR_CUDA,
                         "CUDA mapped the %zu-byte host buffer at %p to non-contiguous device addresses "
                         "(chunk at offset %zu maps to %p, expected %p)",
                         bytes, ptr, done - len, chunk_device, (void *)(device_base + (done - len)));
            goto done;
        }
    }
    *device_ptr = device_base;
done:
    if (st != HE_OK)
        unregister_prefix(base, done);
    return st;
}

extern "C" void he_cuda_unregister(void *ptr, size_t bytes, int device)
{
    if (ptr == NULL || bytes == 0)
        return;
    /* A kernel queued on any stream of any device we launched on (the
     * registering device need not be the one whose kernels read the rows)
     * may still be reading these rows; the buffer is about to be unmapped.
     * Freeing a table or optimizer state is rare, so device-wide waits here
     * cost nothing on the hot path. The caller's current device is restored
     * after each: this runs from a deallocator, anywhere in torch code. */
    unsigned long long used = __atomic_load_n(&he_cuda_devices_used, __ATOMIC_RELAXED) | he_cuda_device_bit(device);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess)
        count = 0;
    for (int d = 0; d < count; d++) {
        if (!(used & he_cuda_device_bit(d)))
            continue;
        he_cuda_device_scope scope;
        if (scope.enter(d) == HE_OK)
            (void)cudaDeviceSynchronize();
    }
    unregister_prefix((char *)ptr, bytes);
}
