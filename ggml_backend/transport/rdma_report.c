// transport/rdma_report.c - the RDMA devices as the verbs library sees them (rdma_report.h).
#include "rdma_report.h"
#include "rdma.h"
#include "verbs_load.h"

#include <stdio.h>
#include <string.h>

#if !TB_HAVE_VERBS

int tb_rdma_report(struct tb_rdma_report * out, int qp_probe) {
    (void) qp_probe;
    memset(out, 0, sizeof *out);
    out->kind = TB_RDMA_NO_HEADERS;
    snprintf(out->text, sizeof out->text, "built without verbs headers (install libibverbs-dev, or the macOS SDK, and rebuild)");
    snprintf(out->library, sizeof out->library, "%s", tb_verbs_wanted());
    snprintf(out->profile, sizeof out->profile, "%s", tb_rdma_profile_name(tb_rdma_profile_default()));
    return out->kind;
}

#else

#include <arpa/inet.h>
#include <errno.h>

_Static_assert(sizeof ((struct tb_rdma_device_report *) 0)->gids == TB_RDMA_REPORT_GIDS * 48, "gids");
_Static_assert(sizeof ((struct tb_rdma_report *) 0)->devices ==
               TB_RDMA_REPORT_DEVICES * sizeof(struct tb_rdma_device_report), "devices");

static const char * port_state_name(int state) {
    switch (state) {
    case IBV_PORT_DOWN:         return "DOWN";
    case IBV_PORT_INIT:         return "INIT";
    case IBV_PORT_ARMED:        return "ARMED";
    case IBV_PORT_ACTIVE:       return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default:                    return "NOP";
    }
}

static int is_ip_gid(const union ibv_gid * g) {   // IPv4-mapped, or IPv6 that is not link-local
    static const uint8_t mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };
    if (memcmp(g->raw, mapped, 12) == 0) return 1;
    return !(g->raw[0] == 0xfe && (g->raw[1] & 0xc0) == 0x80);
}

// How many QPs (of the profile's type, RESET state) this device still grants, up to `limit`.
static int count_free_qps(const struct tb_verbs * v, struct ibv_context * ctx, int profile, int limit) {
    struct ibv_pd * pd = v->alloc_pd(ctx);
    if (!pd) return 0;
    struct ibv_cq * cq = v->create_cq(ctx, 2, NULL, NULL, 0);
    struct ibv_qp * made[64];
    int n = 0;
    if (limit > 64) limit = 64;
    while (cq && n < limit) {
        struct ibv_qp_init_attr qa = {
            .send_cq = cq, .recv_cq = cq,
            .cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
            .qp_type = profile == TB_RDMA_LINUX_RC ? IBV_QPT_RC : IBV_QPT_UC,
        };
        if (!(made[n] = v->create_qp(pd, &qa))) break;
        n++;
    }
    for (int i = 0; i < n; i++) v->destroy_qp(made[i]);
    if (cq) v->destroy_cq(cq);
    v->dealloc_pd(pd);
    return n;
}

static void report_device(const struct tb_verbs * v, struct ibv_device * dev, int profile, int qp_probe,
                          struct tb_rdma_device_report * r) {
    snprintf(r->name, sizeof r->name, "%s", v->get_device_name(dev));
    r->port = 1;
    r->qp_free = -1;
    errno = 0;
    struct ibv_context * ctx = v->open_device(dev);
    if (!ctx) {
        r->error_number = errno ? errno : EIO;
        r->kind = TB_RDMA_OPEN_FAILED;
        snprintf(r->text, sizeof r->text, "cannot open %s: %s", r->name, strerror(r->error_number));
        return;
    }
    int ports = 2;
    struct ibv_device_attr da;
    memset(&da, 0, sizeof da);
    if (v->query_device && v->query_device(ctx, &da) == 0) {
        r->max_qp = da.max_qp;
        if (da.phys_port_cnt > 0) ports = da.phys_port_cnt;
    }
    struct ibv_port_attr pa, first;
    memset(&first, 0, sizeof first);
    int have_first = 0, active = 0;
    for (int port = 1; port <= ports && !active; port++) {
        memset(&pa, 0, sizeof pa);
        if (v->query_port(ctx, (uint8_t) port, &pa) != 0) break;
        if (!have_first) { first = pa; have_first = 1; }
        if (pa.state == IBV_PORT_ACTIVE) { active = port; first = pa; }
    }
    r->port = active ? active : 1;
    if (have_first) {
        r->port_state = first.state;
        r->link_layer = first.link_layer;
        r->active_mtu = first.active_mtu ? 128 << first.active_mtu : 0;
        int ip_gids = 0, tbl = first.gid_tbl_len < 64 ? first.gid_tbl_len : 64;
        for (int g = 0; g < tbl; g++) {
            union ibv_gid gid;
            static const union ibv_gid zero;
            if (v->query_gid(ctx, (uint8_t) r->port, g, &gid) != 0 || memcmp(&gid, &zero, sizeof gid) == 0) continue;
            ip_gids += is_ip_gid(&gid);
            const int k = r->n_gids;
            if (k < TB_RDMA_REPORT_GIDS && inet_ntop(AF_INET6, gid.raw, r->gids[k], sizeof r->gids[0])) {
                r->gid_index[k] = g;
                r->gid_types[k] = tb_verbs_gid_type(v, ctx, (uint8_t) r->port, g, first.link_layer);
                int type;   // the entry a connection from this address takes, by the rule rdma.c uses
                r->gid_chosen[k] = tb_rdma_find_gid(v, ctx, (uint8_t) r->port, first.gid_tbl_len, first.link_layer, &gid,
                                                    &type) == g;
                r->n_gids++;
            }
        }
        if (first.link_layer == IBV_LINK_LAYER_INFINIBAND) {
            r->kind = TB_RDMA_INFINIBAND;
            snprintf(r->text, sizeof r->text, "%s port %d is InfiniBand: tbrpc does not support RDMA over InfiniBand "
                     "(it finds a peer by its address's RoCE GID; IB GIDs hold no address), so this link stays on TCP",
                     r->name, r->port);
        } else if (!active) {
            r->kind = TB_RDMA_PORT_DOWN;
            snprintf(r->text, sizeof r->text, "%s port 1 is %s, not ACTIVE", r->name, port_state_name(first.state));
        } else if (ip_gids == 0) {
            r->kind = TB_RDMA_NO_GID;
            snprintf(r->text, sizeof r->text, "%s port %d has no IP address GID (its interface has no IPv4 address)",
                     r->name, r->port);
        }
    } else {
        r->kind = TB_RDMA_PORT_DOWN;
        snprintf(r->text, sizeof r->text, "%s: ibv_query_port failed", r->name);
    }
    if (qp_probe > 0) {
        r->qp_free = count_free_qps(v, ctx, profile, qp_probe);
        if (r->kind == TB_RDMA_USABLE && r->qp_free == 0) {
            r->kind = TB_RDMA_QP_BUDGET;
            snprintf(r->text, sizeof r->text, "%s grants no more QPs (%d at most)", r->name, r->max_qp);
        }
    }
    if (r->kind == TB_RDMA_USABLE) {
        snprintf(r->text, sizeof r->text, "%s port %d ACTIVE, %d GID(s)", r->name, r->port, r->n_gids);
    }
    v->close_device(ctx);
}

int tb_rdma_report(struct tb_rdma_report * out, int qp_probe) {
    memset(out, 0, sizeof *out);
    int profile = tb_rdma_profile_default();
    uint32_t slots, stride;
    tb_rdma_geometry(profile, &slots, &stride);
    snprintf(out->profile, sizeof out->profile, "%s", tb_rdma_profile_name(profile));
    out->ring_bytes = 2ull * slots * stride;
    out->host_id = tb_rdma_host_id();
    snprintf(out->library, sizeof out->library, "%s", tb_verbs_wanted());
    const struct tb_verbs * v = tb_verbs_load(out->text, sizeof out->text);
    if (!v) return out->kind = TB_RDMA_NO_LIBRARY;
    snprintf(out->library, sizeof out->library, "%s", v->path);
    int n = 0;
    struct ibv_device ** list = v->get_device_list(&n);
    if (!list || n <= 0) {
        if (list) v->free_device_list(list);
        snprintf(out->text, sizeof out->text, "%s lists no RDMA device", v->path);
        return out->kind = TB_RDMA_NO_DEVICE;
    }
    for (int i = 0; i < n && i < TB_RDMA_REPORT_DEVICES; i++) {
        report_device(v, list[i], profile, qp_probe, &out->devices[i]);
        out->n_devices++;
    }
    v->free_device_list(list);
    snprintf(out->text, sizeof out->text, "%s: %d device(s)", v->path, n);
    return out->kind = TB_RDMA_USABLE;
}

#endif
