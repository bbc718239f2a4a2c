#include "he_status.h"

#include <stdarg.h>
#include <stdio.h>

/* Thread-local so that two Python threads calling the core with the GIL
 * released never read each other's message. */
static _Thread_local char last_error[512];

he_status he_fail(he_status code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

const char *he_last_error(void)
{
    return last_error;
}
