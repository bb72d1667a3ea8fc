// transport/verbs_load.c - dlopen the verbs library once (verbs_load.h).
#include "verbs_load.h"

#if TB_HAVE_VERBS
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tb_verbs table;
static int loaded;            // 1 ok, -1 failed (reason kept)
static char load_error[256];

#ifdef __APPLE__
static const char * const system_libs[] = { "/usr/lib/librdma.dylib", NULL };
#else
static const char * const system_libs[] = { "libibverbs.so.1", NULL };
#endif

static int load(void) {
    const char * forced = getenv("TBRPC_VERBS_LIB");
    void * h = NULL;
    if (forced && *forced) {
        h = dlopen(forced, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(load_error, sizeof load_error, "cannot load TBRPC_VERBS_LIB=%s: %s", forced, dlerror());
            return -1;
        }
        snprintf(table.path, sizeof table.path, "%s", forced);
    } else {
        for (int i = 0; system_libs[i] && !h; i++) {
            h = dlopen(system_libs[i], RTLD_NOW | RTLD_LOCAL);
            if (h) snprintf(table.path, sizeof table.path, "%s", system_libs[i]);
        }
        if (!h) {
            snprintf(load_error, sizeof load_error, "no verbs library (%s): %s", system_libs[0], dlerror());
            return -1;
        }
    }
    table.handle = h;
#define REQUIRED(field, sym) do { *(void **) &table.field = dlsym(h, sym); \
        if (!table.field) { snprintf(load_error, sizeof load_error, "%.200s lacks %s", table.path, sym); \
                            dlclose(h); table.handle = NULL; return -1; } } while (0)
#define OPTIONAL(field, sym) (*(void **) &table.field = dlsym(h, sym))
    REQUIRED(get_device_list, "ibv_get_device_list");
    REQUIRED(free_device_list, "ibv_free_device_list");
    REQUIRED(get_device_name, "ibv_get_device_name");
    REQUIRED(open_device, "ibv_open_device");
    REQUIRED(close_device, "ibv_close_device");
    REQUIRED(query_port, "ibv_query_port");   // the exported compat entry the header's macro falls back to
    REQUIRED(query_gid, "ibv_query_gid");
    REQUIRED(alloc_pd, "ibv_alloc_pd");
    REQUIRED(dealloc_pd, "ibv_dealloc_pd");
    REQUIRED(reg_mr, "ibv_reg_mr");
    REQUIRED(dereg_mr, "ibv_dereg_mr");
    REQUIRED(create_cq, "ibv_create_cq");
    REQUIRED(destroy_cq, "ibv_destroy_cq");
    REQUIRED(create_qp, "ibv_create_qp");
    REQUIRED(modify_qp, "ibv_modify_qp");
    REQUIRED(destroy_qp, "ibv_destroy_qp");
    REQUIRED(wc_status_str, "ibv_wc_status_str");
    OPTIONAL(create_comp_channel, "ibv_create_comp_channel");
    OPTIONAL(destroy_comp_channel, "ibv_destroy_comp_channel");
    OPTIONAL(get_cq_event, "ibv_get_cq_event");
    OPTIONAL(ack_cq_events, "ibv_ack_cq_events");
    OPTIONAL(query_device, "ibv_query_device");
    if (!table.create_comp_channel || !table.destroy_comp_channel || !table.get_cq_event || !table.ack_cq_events) {
        table.create_comp_channel = NULL;   // all or nothing
    }
#undef REQUIRED
#undef OPTIONAL
    return 0;
}

const struct tb_verbs * tb_verbs_load(char * err, size_t err_len) {
    pthread_mutex_lock(&load_lock);
    if (!loaded) loaded = load() == 0 ? 1 : -1;
    int ok = loaded == 1;
    pthread_mutex_unlock(&load_lock);
    if (!ok) snprintf(err, err_len, "%s", load_error);
    return ok ? &table : NULL;
}
const char * tb_verbs_wanted(void) {
    const char * forced = getenv("TBRPC_VERBS_LIB");
    return forced && *forced ? forced : system_libs[0];
}
#else
const char * tb_verbs_wanted(void) { return "none (built without verbs headers)"; }
#endif
