// transport.c - what every transport shares: recording a failure.
#include "transport.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

int tb_fail(struct tb_transport * t, int kind, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->error, sizeof t->error, fmt, ap);
    va_end(ap);
    t->error_kind = kind;
    return -1;
}

const char * tb_io_error_name(int kind) {
    switch (kind) {
        case TB_IO_OK:      return "ok";
        case TB_IO_CLOSED:  return "closed";
        case TB_IO_TIMEOUT: return "timeout";
        case TB_IO_REFUSED: return "refused";
        case TB_IO_BROKEN:  return "broken";
    }
    return "unknown";
}

int64_t tb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int64_t tb_now_ms(void) { return tb_now_ns() / 1000000; }
