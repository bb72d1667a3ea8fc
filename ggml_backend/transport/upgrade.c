// transport/upgrade.c - which transport a connection moves to, and why not
// the others (transport.h, "upgrading").
//
// The rules, in the order they are applied by the dialing side:
//   1. asked for TCP (TBRPC_TRANSPORT=tcp, transport = "tcp"): TCP, "asked for";
//   2. the peer is on another host (its address is not ours): RDMA when the
//      peer said it has a device and our own verbs library lists one; else
//      TCP with the reason;
//   3. the peer is on this host: shared memory when the peer offers it and
//      this side may map a peer's segment (a process of its own); else TCP
//      with the reason.
// The answering side may still decline (no device after all, the QP budget,
// no segment): the dialer then says "peer: <its reason>" for RDMA, the
// answer's own words for shared memory. Each reason has a kind (enum tb_why)
// beside its words, carried in the answer and on the link, so whoever shows
// it can attach the fix without reading the words.
#include "../transport.h"
#include "rdma.h"
#include "ring.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define UPGRADE_MAGIC 0x50555442u   // "TBUP"

// Stay on TCP for a reason of kind `kind`.
static uint32_t tcp_for(int kind, int * why_kind) {
    *why_kind = kind;
    return TB_TRANSPORT_TCP;
}

uint32_t tb_upgrade_choose(struct tb_transport * tcp, const struct tb_upgrade_want * want, int * why_kind, char * why,
                           size_t why_len) {
    *why_kind = TB_WHY_NONE;
    if (want->forced_tcp) { snprintf(why, why_len, "asked for"); return tcp_for(TB_WHY_ASKED, why_kind); }
    if (!tb_tcp_same_host(tcp)) {
        if (!want->peer_rdma) { snprintf(why, why_len, "peer has no RDMA device"); return tcp_for(TB_WHY_PEER_NO_RDMA, why_kind); }
        return tb_rdma_available(why, why_len) ? TB_TRANSPORT_RDMA : tcp_for(TB_WHY_NO_RDMA_HERE, why_kind);
    }
    if (!want->peer_shm) { snprintf(why, why_len, "the node offers no shared memory"); return tcp_for(TB_WHY_NO_SHM, why_kind); }
    if (want->no_shm) { snprintf(why, why_len, "%s", want->no_shm); return tcp_for(TB_WHY_NO_SHM, why_kind); }
    return TB_TRANSPORT_SHM;
}

void tb_upgrade_answer(const struct tb_transport_req * req, const char * no_shm, struct tb_transport_reply * rep,
                       struct tb_shm ** offered) {
    memset(rep, 0, sizeof *rep);
    *offered = NULL;
    if (req->kind == TB_TRANSPORT_RDMA) {   // the bring-up follows the answer
        if (tb_rdma_available(rep->declined, sizeof rep->declined)) rep->declined[0] = '\0';
        else if (!rep->declined[0]) snprintf(rep->declined, sizeof rep->declined, "no RDMA here");
        rep->why_kind = TB_WHY_PEER_NO_RDMA;   // what the dialer says, should this be a refusal
    } else if (req->kind != TB_TRANSPORT_SHM) {
        snprintf(rep->declined, sizeof rep->declined, "the node knows no transport of kind %u", req->kind);
        rep->why_kind = TB_WHY_PEER_OLD;
    } else if (no_shm) {
        snprintf(rep->declined, sizeof rep->declined, "%s", no_shm);
        rep->why_kind = TB_WHY_NO_SHM;
    } else if (!tb_ring_geometry_ok(req->slots, req->stride)) {
        snprintf(rep->declined, sizeof rep->declined, "no ring of %u slots of %u bytes", req->slots, req->stride);
        rep->why_kind = TB_WHY_SHM_FAILED;
    } else {
        *offered = tb_shm_create(req->slots, req->stride, &rep->offer, rep->declined, sizeof rep->declined);
        rep->why_kind = TB_WHY_SHM_FAILED;
    }
    if (!rep->declined[0]) rep->why_kind = TB_WHY_NONE;
}

int tb_why_from_peer(uint32_t kind, int otherwise) {
    return kind > TB_WHY_NONE && kind <= TB_WHY_NO_LINK ? (int) kind : otherwise;
}

struct tb_shm * tb_upgrade_attach(const struct tb_transport_reply * rep, int * why_kind, char * why, size_t why_len) {
    if (rep->declined[0]) {   // the peer's words, bounded: they need not end in a NUL
        snprintf(why, why_len, "%.*s", (int) sizeof rep->declined - 1, rep->declined);
        *why_kind = tb_why_from_peer(rep->why_kind, TB_WHY_SHM_FAILED);
        return NULL;
    }
    struct tb_shm * seg = tb_shm_attach(&rep->offer, why, why_len);
    *why_kind = seg ? TB_WHY_NONE : TB_WHY_SHM_FAILED;
    return seg;
}

// The kind an RDMA refusal from the peer is reported as.
int tb_upgrade_rdma_declined(const struct tb_transport_reply * rep) {
    return tb_why_from_peer(rep->why_kind, TB_WHY_PEER_NO_RDMA);
}

// ---- the raw conversation (a peer link) ------------------------------------------

struct upgrade_ask {
    uint32_t magic;
    struct tb_transport_req req;
    uint32_t why_kind;        // kind TCP: enum tb_why of why the dialer stays
    char why[160];            // and in words
};

// Stay on tcp: say why, in its description (words and kind) and to the caller.
static struct tb_transport * stay(struct tb_transport * tcp, int kind, char * why, size_t why_len, const char * fmt, ...)
    __attribute__((format(printf, 5, 6)));
static struct tb_transport * stay(struct tb_transport * tcp, int kind, char * why, size_t why_len, const char * fmt, ...) {
    char text[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    snprintf(why, why_len, "%s", text);
    snprintf(tcp->describe, sizeof tcp->describe, "tcp: %s", text);
    tcp->why = kind;
    return tcp;
}

// The TCP connection itself failed (or the two sides can no longer agree): it is closed.
static struct tb_transport * lost(struct tb_transport * tcp, char * why, size_t why_len, const char * what) {
    snprintf(why, why_len, "%s: %s", what, tcp->error_kind != TB_IO_OK ? tcp->error : "the peer gave up");
    tb_close(tcp);
    return NULL;
}

// Both sides after yes to RDMA: the symmetric bring-up switches both or neither.
static struct tb_transport * follow_rdma(struct tb_transport * tcp, char * why, size_t why_len) {
    int kind;
    struct tb_transport * t = tb_rdma_upgrade(tcp, NULL, &kind, why, why_len);
    if (t) return t;
    if (tcp->error_kind != TB_IO_OK) return lost(tcp, why, why_len, "transport upgrade");
    char reason[256];
    snprintf(reason, sizeof reason, "%s", why);
    return stay(tcp, kind, why, why_len, "%s", reason);
}

struct tb_transport * tb_upgrade_dial(struct tb_transport * tcp, const struct tb_upgrade_want * want, char * why,
                                      size_t why_len) {
    struct upgrade_ask ask;
    memset(&ask, 0, sizeof ask);
    ask.magic = UPGRADE_MAGIC;
    int kind = TB_WHY_NONE;
    ask.req.kind = tb_upgrade_choose(tcp, want, &kind, ask.why, sizeof ask.why);
    ask.why_kind = (uint32_t) kind;
    if (ask.req.kind == TB_TRANSPORT_SHM) { ask.req.slots = TB_SHM_SLOTS; ask.req.stride = TB_SHM_STRIDE; }
    if (tb_send(tcp, &ask, sizeof ask) != 0 || tb_flush(tcp) != 0) return lost(tcp, why, why_len, "transport upgrade");
    if (ask.req.kind == TB_TRANSPORT_TCP) return stay(tcp, kind, why, why_len, "%s", ask.why);
    struct tb_transport_reply rep;
    if (tb_recv(tcp, &rep, sizeof rep) != 0) return lost(tcp, why, why_len, "transport upgrade");
    rep.declined[sizeof rep.declined - 1] = '\0';
    if (ask.req.kind == TB_TRANSPORT_RDMA) {
        if (rep.declined[0]) return stay(tcp, tb_upgrade_rdma_declined(&rep), why, why_len, "peer: %s", rep.declined);
        return follow_rdma(tcp, why, why_len);
    }
    char reason[256] = "";
    struct tb_shm * seg = tb_upgrade_attach(&rep, &kind, reason, sizeof reason);
    if (rep.declined[0]) return stay(tcp, kind, why, why_len, "%s", rep.declined);   // nothing to say back
    uint32_t attached = seg != NULL;
    if (tb_send(tcp, &attached, sizeof attached) != 0 || tb_flush(tcp) != 0) {
        tb_shm_discard(seg);
        return lost(tcp, why, why_len, "transport upgrade");
    }
    if (!seg) return stay(tcp, kind, why, why_len, "%s", reason);
    struct tb_transport * shm = tb_shm_transport(seg, tcp, reason, sizeof reason);
    if (!shm) { snprintf(tcp->error, sizeof tcp->error, "%s", reason); tcp->error_kind = TB_IO_BROKEN; }   // the peer switched
    return shm ? shm : lost(tcp, why, why_len, "transport upgrade");
}

struct tb_transport * tb_upgrade_accept(struct tb_transport * tcp, const char * no_shm, char * why, size_t why_len) {
    struct upgrade_ask ask;
    if (tb_recv(tcp, &ask, sizeof ask) != 0) return lost(tcp, why, why_len, "transport upgrade");
    if (ask.magic != UPGRADE_MAGIC) {
        tb_fail(tcp, TB_IO_BROKEN, "%s: no transport upgrade where one was due", tcp->peer);
        return lost(tcp, why, why_len, "transport upgrade");
    }
    ask.why[sizeof ask.why - 1] = '\0';
    if (ask.req.kind == TB_TRANSPORT_TCP) return stay(tcp, tb_why_from_peer(ask.why_kind, TB_WHY_NONE), why, why_len, "peer: %s", ask.why);
    struct tb_transport_reply rep;
    struct tb_shm * seg = NULL;
    tb_upgrade_answer(&ask.req, no_shm, &rep, &seg);
    if (tb_send(tcp, &rep, sizeof rep) != 0 || tb_flush(tcp) != 0) {
        tb_shm_discard(seg);
        return lost(tcp, why, why_len, "transport upgrade");
    }
    if (rep.declined[0]) return stay(tcp, (int) rep.why_kind, why, why_len, "%s", rep.declined);
    if (ask.req.kind == TB_TRANSPORT_RDMA) return follow_rdma(tcp, why, why_len);
    uint32_t attached = 0;
    if (tb_recv(tcp, &attached, sizeof attached) != 0) {
        tb_shm_discard(seg);
        return lost(tcp, why, why_len, "transport upgrade");
    }
    if (attached != 1) {
        tb_shm_discard(seg);
        return stay(tcp, TB_WHY_SHM_FAILED, why, why_len, "the peer could not map the shared memory");
    }
    char reason[256];
    struct tb_transport * shm = tb_shm_transport(seg, tcp, reason, sizeof reason);
    if (!shm) { snprintf(tcp->error, sizeof tcp->error, "%s", reason); tcp->error_kind = TB_IO_BROKEN; }   // the peer switched
    return shm ? shm : lost(tcp, why, why_len, "transport upgrade");
}
