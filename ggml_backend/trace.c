// trace.c - see trace.h.
#include "trace.h"

#include "transport.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TRACE_BUFFER (1u << 20)   // stdio's buffer: a write() per 64 Ki events, none on most tokens

struct tb_trace {
    FILE *   f;
    uint32_t n;
};

struct tb_trace * tb_trace_open(const char * role, const char * who) {
    const char * dir = getenv("TBRPC_TRACE");
    if (!dir || !*dir) return NULL;
    char path[1024];   // the pid and the clock: two connections of one process never share a name
    if (snprintf(path, sizeof path, "%s/%s-%ld-%lld.trace", dir, role, (long) getpid(), (long long) tb_now_ns()) >=
        (int) sizeof path)
        return NULL;
    struct tb_trace * t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->f = fopen(path, "wb");
    if (!t->f) { free(t); return NULL; }
    setvbuf(t->f, NULL, _IOFBF, TRACE_BUFFER);
    fprintf(t->f, "tbrpc-trace 1 %s %s\n", role, who);
    return t;
}

void tb_trace_mark(struct tb_trace * t, uint16_t what, uint16_t cmd) {
    if (!t || t->n == TB_TRACE_MAX) return;
    const struct tb_trace_event e = { .t_ns = tb_now_ns(), .what = what, .cmd = cmd };
    if (fwrite(&e, sizeof e, 1, t->f) == 1) t->n++;
}

void tb_trace_close(struct tb_trace * t) {
    if (!t) return;
    fclose(t->f);
    free(t);
}
