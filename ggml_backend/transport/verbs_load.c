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
#ifndef __APPLE__
    OPTIONAL(query_gid_ex, "_ibv_query_gid_ex");   // the exported entry of the header's inline ibv_query_gid_ex
#endif
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
const char * tb_gid_type_name(int type) {
    switch (type) {
    case TB_GID_ROCE_V1: return "RoCE v1";
    case TB_GID_ROCE_V2: return "RoCE v2";
    case TB_GID_IB:      return "IB";
    default:             return "untyped";
    }
}

#ifndef __APPLE__
// The kernel's word for a GID's type: "IB/RoCE v1" or "RoCE v2" (drivers/infiniband/core/sysfs.c).
static int gid_type_from_sysfs(struct ibv_context * ctx, uint8_t port, int index, int link_layer) {
    const char * dev = ctx->device ? ctx->device->ibdev_path : "";
    if (!dev[0]) return TB_GID_UNTYPED;
    char path[sizeof ctx->device->ibdev_path + 64], word[32] = "";
    snprintf(path, sizeof path, "%s/ports/%u/gid_attrs/types/%d", dev, (unsigned) port, index);
    FILE * f = fopen(path, "r");
    if (!f) return TB_GID_UNTYPED;
    const int got = fgets(word, sizeof word, f) != NULL;
    fclose(f);
    if (!got) return TB_GID_UNTYPED;   // an empty entry: the kernel refuses the read
    if (strncmp(word, "RoCE v2", 7) == 0) return TB_GID_ROCE_V2;
    if (strncmp(word, "IB/RoCE v1", 10) == 0) return link_layer == IBV_LINK_LAYER_INFINIBAND ? TB_GID_IB : TB_GID_ROCE_V1;
    return TB_GID_UNTYPED;
}
#endif

int tb_verbs_gid_type(const struct tb_verbs * v, struct ibv_context * ctx, uint8_t port, int index, int link_layer) {
#ifdef __APPLE__
    (void) v; (void) ctx; (void) port; (void) index; (void) link_layer;
    return TB_GID_UNTYPED;   // Apple's GIDs have one kind: nothing to choose between
#else
    if (index < 0) return TB_GID_UNTYPED;
    if (v->query_gid_ex) {
        struct ibv_gid_entry e;
        memset(&e, 0, sizeof e);
        if (v->query_gid_ex(ctx, port, (uint32_t) index, &e, 0, sizeof e) == 0) {
            switch (e.gid_type) {
            case IBV_GID_TYPE_IB:      return link_layer == IBV_LINK_LAYER_INFINIBAND ? TB_GID_IB : TB_GID_ROCE_V1;
            case IBV_GID_TYPE_ROCE_V1: return TB_GID_ROCE_V1;
            case IBV_GID_TYPE_ROCE_V2: return TB_GID_ROCE_V2;
            default:                   return TB_GID_UNTYPED;
            }
        }
        // refused (an empty entry, a kernel without the query): sysfs may still know
    }
    return gid_type_from_sysfs(ctx, port, index, link_layer);
#endif
}

const char * tb_verbs_wanted(void) {
    const char * forced = getenv("TBRPC_VERBS_LIB");
    return forced && *forced ? forced : system_libs[0];
}
#else
const char * tb_verbs_wanted(void) { return "none (built without verbs headers)"; }
#endif
