/* Status codes and the error message of the calling thread.
 *
 * The core never raises and never aborts: every fallible function returns a
 * he_status and, on failure, leaves a message (what was expected, what was
 * found) that the binding turns into the matching Python exception.
 * Shared by the core (csrc/), the kernels (cuda/) and the binding. */
#ifndef HE_STATUS_H
#define HE_STATUS_H

typedef enum he_status {
    HE_OK = 0,
    HE_ERR_NOMEM,  /* an allocation failed: MemoryError */
    HE_ERR_INDEX,  /* an id outside [0, num_rows): IndexError */
    HE_ERR_VALUE,  /* a bad argument: ValueError */
    HE_ERR_SYSTEM, /* the OS refused something (threads, mmap flags): OSError */
    HE_ERR_CUDA    /* a CUDA call failed: RuntimeError, as torch raises for its own */
} he_status;

#if defined(__GNUC__)
#define HE_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define HE_PRINTF(f, a)
#endif

/* Records a message for the calling thread and returns code, so call sites
 * read `return he_fail(HE_ERR_VALUE, "...", ...);`. */
he_status he_fail(he_status code, const char *fmt, ...) HE_PRINTF(2, 3);

/* The message of the last failure on this thread ("" if none). */
const char *he_last_error(void);

#endif
