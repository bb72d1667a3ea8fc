// transport/rdma.c - the ring (ring.h) over verbs SEND/RECV (rules in rdma.h).
//
// Memory: one registered mapping per connection, `slots` receive slots then
// `slots` send slots, each `stride` wire bytes:
//   [prefix 64 B: magic, seq, frame bytes, checksum][ring frame: header + payload]
// The ring sees frames of stride - 64 bytes. Receive slot seq % slots gets a
// RECV posted with wr_id = seq, in order, so a lost UC frame shows as the next
// frame landing in its slot: its prefix carries the wrong seq and the
// connection breaks with "RDMA frame lost from <peer> (seq N, expected M)".
// The checksum (header + payload) turns a corrupted frame, or a send buffer
// changed before the NIC read it, into a named error too, never wrong bytes.
//
// Credits are the ring's: a frame is posted only into a receive the peer has
// posted and handed back, so no profile ever relies on the hardware holding
// an unmatched SEND (linux-uc drops it). Send slot seq % slots is reused only
// after its send completion was polled.
//
// Waiting: spin on the CQ ~50 µs, then sleep: on the completion channel and
// the TCP socket together where the library has channels (Linux), else in
// poll() on the TCP socket with a backoff from 20 µs to 1 ms (Apple documents
// no channel). Either way the TCP socket's end of file ends the wait: the
// peer process is gone.
#include "rdma.h"
#include "qp_budget.h"
#include "ring.h"
#include "verbs_load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char * tb_rdma_profile_name(int profile) {
    switch (profile) {
    case TB_RDMA_APPLE_UC: return "apple-uc";
    case TB_RDMA_LINUX_RC: return "linux-rc";
    case TB_RDMA_LINUX_UC: return "linux-uc";
    default:               return "unknown";
    }
}

int tb_rdma_qp_limit(int profile) {
    const char * e = getenv("TBRPC_RDMA_MAX_QPS");
    if (e && *e) return atoi(e) > 0 ? atoi(e) : 0;
    return profile == TB_RDMA_APPLE_UC ? 10 : 0;
}

int tb_rdma_profile_default(void) {
    const char * p = getenv("TBRPC_RDMA_PROFILE");
    if (p && strcmp(p, "apple-uc") == 0) return TB_RDMA_APPLE_UC;
    if (p && strcmp(p, "linux-rc") == 0) return TB_RDMA_LINUX_RC;
    if (p && strcmp(p, "linux-uc") == 0) return TB_RDMA_LINUX_UC;
#ifdef __APPLE__
    return TB_RDMA_APPLE_UC;
#else
    return TB_RDMA_LINUX_RC;
#endif
}

#if !TB_HAVE_VERBS

#define NO_VERBS "built without verbs headers (install libibverbs-dev, or the macOS SDK, and rebuild)"

struct tb_rdma * tb_rdma_prepare(const char * local_host, struct tb_rdma_info * mine) {
    (void) local_host;
    memset(mine, 0, sizeof *mine);
    mine->magic = TB_RDMA_INFO_MAGIC;
    mine->version = TB_RDMA_INFO_VERSION;
    mine->why = TB_WHY_NO_RDMA_HERE;
    snprintf(mine->reason, sizeof mine->reason, "%s", NO_VERBS);
    return NULL;
}
int tb_rdma_connect(struct tb_rdma * d, const struct tb_rdma_info * peer, char * err, size_t err_len) {
    (void) d; (void) peer;
    snprintf(err, err_len, "%s", NO_VERBS);
    return -1;
}
int tb_rdma_probe(struct tb_rdma * d, char * err, size_t err_len) {
    (void) d;
    snprintf(err, err_len, "%s", NO_VERBS);
    return -1;
}
void tb_rdma_discard(struct tb_rdma * d) { (void) d; }
int tb_rdma_available(char * why, size_t why_len) {
    snprintf(why, why_len, "%s", NO_VERBS);
    return 0;
}
struct tb_transport * tb_rdma_upgrade(struct tb_transport * tcp, const char * local_host, int * why, char * reason,
                                      size_t reason_len) {
    (void) tcp; (void) local_host;
    *why = TB_WHY_NO_RDMA_HERE;
    snprintf(reason, reason_len, "%s", NO_VERBS);
    return NULL;
}

#else  // TB_HAVE_VERBS

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#ifdef __APPLE__
#include <uuid/uuid.h>   // gethostuuid's uuid_t
#endif

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0   // macOS: the anchor has SO_NOSIGPIPE (tb_adopt)
#endif

#define WIRE_MAGIC   0x57524254u            // "TBRW"
#define APPLE_FRAME  4096u                  // Apple counts queues in 4 KiB frames
#define APPLE_MAX_MSG 16773120u             // TN3205's largest message
#define SPIN_NS      50000                  // spin on the CQ this long before sleeping
#define EOF_GRACE_MS 30                     // frames posted before the peer closed may still land
#define SEND_TAG     (1ull << 63)           // wr_id of a send: SEND_TAG | seq
#define PROBE_TAG    (1ull << 62)           // wr_id of the bring-up's probe (receive; SEND_TAG | PROBE_TAG: send)
#define PROBE_MS     1000                   // how long the probe may take each way

struct wire_prefix {
    uint32_t magic;
    uint32_t seq;
    uint32_t bytes;      // ring frame bytes (16 + payload)
    uint32_t reserved;
    uint64_t sum;        // checksum of those bytes, seeded with seq
};

struct tb_rdma {
    const struct tb_verbs * v;
    int profile;
    struct ibv_context * ctx;
    struct ibv_pd * pd;
    struct ibv_comp_channel * ch;
    struct ibv_cq * cq;
    struct ibv_qp * qp;
    struct ibv_mr * mr;
    uint8_t * mem;
    size_t mem_len;
    uint32_t slots, stride;      // ours, as offered; after connect: what both agreed
    uint8_t port, gid_index, gid_type;
    union ibv_gid gid;
    enum ibv_mtu mtu;
    uint16_t lid;
    uint32_t psn;
    int access;
    char device[32];
    int qp_place;                // one of the device's QP places (qp_budget.h) while the QP lives; -1 none
};

// What one index of the ring knows about its receive slot and its send slot
// (both counts are `slots`). Each seq is kept as HELD(seq), 0 meaning none:
// seqs wrap after 2^32 frames and 0 is then a frame like any other.
#define HELD(seq)    ((uint64_t) (uint32_t) (seq) | (1ull << 32))
struct slot_state {
    uint64_t rx_arrived;         // HELD(wr_id) of the receive's completion
    uint64_t rx_valid;           // HELD(seq) whose prefix and checksum were checked (until released)
    uint64_t tx_busy;            // HELD(seq) of the send whose completion is not yet polled (no reuse till then)
    uint32_t rx_bytes;           // the receive's byte_len
};

struct rdma_transport {
    struct tb_ring ring;         // must be first
    struct tb_rdma * d;
    struct tb_transport * tcp;   // liveness anchor
    int fd;
    pthread_mutex_t cq_lock;     // the CQ, the channel and `state`
    struct slot_state * state;   // [slots]: entry i is receive slot i and send slot i
    uint8_t * scratch;           // handed to the ring when a send slot cannot be had (then post fails)
    int broken, broken_kind;
    char broken_why[200];
    int eof;
    int64_t eof_at;
    uint64_t wire_bytes;
    uint64_t anchor_bytes;       // heartbeat bytes drained from the anchor (atomic: any waiting thread drains)
    uint64_t anchor_seen;        // anchor_bytes when rdma_peer_alive last looked
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// A fast 64-bit checksum (two multiply-rotate lanes over 8-byte words).
static uint64_t checksum(const uint8_t * p, size_t n, uint64_t seed) {
    const uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t a = seed ^ P1, b = seed + P2 + n;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint64_t x, y;
        memcpy(&x, p + i, 8);
        memcpy(&y, p + i + 8, 8);
        a = ((a ^ x) * P1); a = (a << 31) | (a >> 33);
        b = ((b ^ y) * P2); b = (b << 29) | (b >> 35);
    }
    for (; i < n; i++) a = (a ^ p[i]) * P1;
    uint64_t h = a ^ (b * P1);
    h ^= h >> 33; h *= P2; h ^= h >> 29;
    return h;
}

static uint64_t host_id(void) {
    const char * e = getenv("TBRPC_HOST_ID");
    char buf[128] = "";
    if (e && *e) snprintf(buf, sizeof buf, "%s", e);
    else {
#ifdef __APPLE__
        // macOS has no /etc/machine-id: the hardware UUID (IOPlatformUUID). The
        // host name alone made two Macs set up alike "one host", and RDMA between them was refused.
        uuid_t u;
        struct timespec wait = { 1, 0 };
        if (gethostuuid(u, &wait) == 0) {
            for (int i = 0; i < 16; i++) snprintf(buf + 2 * i, sizeof buf - 2 * (size_t) i, "%02x", u[i]);
        }
#endif
        FILE * f = buf[0] ? NULL : fopen("/etc/machine-id", "r");
        if (f) { if (!fgets(buf, sizeof buf, f)) buf[0] = 0; fclose(f); }
        if (!buf[0]) gethostname(buf, sizeof buf - 1);
    }
    return checksum((const uint8_t *) buf, strlen(buf), 0x7462727063ull) | 1;
}

uint64_t tb_rdma_host_id(void) { return host_id(); }

// A verbs call's failure as an errno: rdma-core returns it, Apple's posts its
// negation (observed: "ibv_post_recv ... ret=-12"), and -1 means errno says.
static int verbs_errno(int rc) {
    if (rc == -1) return errno ? errno : EINVAL;
    return rc < 0 ? -rc : rc;
}

static uint8_t * rx_slot(struct tb_rdma * d, uint32_t i) { return d->mem + (size_t) i * d->stride; }
static uint8_t * tx_slot(struct tb_rdma * d, uint32_t i) { return d->mem + ((size_t) d->slots + i) * d->stride; }

static uint32_t frames_of(uint32_t bytes) { return (bytes + APPLE_FRAME - 1) / APPLE_FRAME; }

static void close_endpoint(struct tb_rdma * d) {
    if (!d) return;
    const struct tb_verbs * v = d->v;
    if (d->qp) {
        if (d->profile != TB_RDMA_APPLE_UC) {   // Linux: ERR flushes every WR before the QP goes
            struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
            v->modify_qp(d->qp, &a, IBV_QP_STATE);
            struct ibv_wc wc[16];
            int64_t until = now_ns() + 100 * 1000000ll;
            while (now_ns() < until && d->cq && ibv_poll_cq(d->cq, 16, wc) > 0) {}
        }
        // Apple: destroy without ERR, as llama.cpp does (ERR made region unmaps fail there)
        v->destroy_qp(d->qp);
    }
    if (d->mr) v->dereg_mr(d->mr);
    if (d->cq) v->destroy_cq(d->cq);
    if (d->ch) v->destroy_comp_channel(d->ch);
    if (d->pd) v->dealloc_pd(d->pd);
    if (d->ctx) v->close_device(d->ctx);
    if (d->mem) munmap(d->mem, d->mem_len);
    tb_qp_give(d->qp_place);   // after the QP is gone
    free(d);
}

void tb_rdma_discard(struct tb_rdma * d) { close_endpoint(d); }

static int env_u32(const char * name, uint32_t fallback) {
    const char * e = getenv(name);
    return e && *e ? (int) strtoul(e, NULL, 0) : (int) fallback;
}

void tb_rdma_geometry(int profile, uint32_t * slots, uint32_t * stride) {
    *slots = (uint32_t) env_u32("TBRPC_RDMA_SLOTS", 16);
    *stride = (uint32_t) env_u32("TBRPC_RDMA_STRIDE", profile == TB_RDMA_APPLE_UC ? 128u * 1024 : 256u * 1024);
}

// The GID an address has on a link: ::ffff:a.b.c.d for IPv4, else the IPv6 address.
static int gid_of_host(const char * host, union ibv_gid * gid) {
    memset(gid, 0, sizeof *gid);
    struct in_addr a4;
    if (inet_pton(AF_INET, host, &a4) == 1) {
        gid->raw[10] = gid->raw[11] = 0xff;
        memcpy(gid->raw + 12, &a4, 4);
        return 0;
    }
    return inet_pton(AF_INET6, host, gid->raw) == 1 ? 0 : -1;
}

int tb_rdma_find_gid(const struct tb_verbs * v, struct ibv_context * ctx, uint8_t port, int tbl_len, int link_layer,
                     const union ibv_gid * want, int * type) {
    int first = -1, first_type = TB_GID_UNTYPED;
    if (tbl_len > 256) tbl_len = 256;
    for (int g = 0; g < tbl_len; g++) {
        union ibv_gid gid;
        if (v->query_gid(ctx, port, g, &gid) != 0 || memcmp(gid.raw, want->raw, 16) != 0) continue;
        const int t = tb_verbs_gid_type(v, ctx, port, g, link_layer);
#ifndef TB_RDMA_BROKEN_FIRST_GID
        if (t == TB_GID_ROCE_V2) { *type = t; return g; }
#endif
        if (first < 0) { first = g; first_type = t; }
    }
    *type = first_type;
    return first;
}

// Find the device, port and GID index for local_host; open it into d.
// InfiniBand ports are not looked at: their GIDs are subnet prefix + GUID,
// never an IP address, and tbrpc addresses a peer by the GID of its TCP
// address (docs/protocol.md, Transports: RDMA, InfiniBand).
static int pick_device(struct tb_rdma * d, const char * local_host, char * why, size_t why_len) {
    const struct tb_verbs * v = d->v;
    union ibv_gid want;
    if (!local_host || gid_of_host(local_host, &want) != 0) {
        snprintf(why, why_len, "no address to find an RDMA device by (%s)", local_host ? local_host : "none");
        return -1;
    }
    const char * named = getenv("TBRPC_RDMA_DEVICE");
    int n = 0;
    struct ibv_device ** list = v->get_device_list(&n);
    if (!list || n == 0) {
        if (list) v->free_device_list(list);
        snprintf(why, why_len, "no RDMA device");
        return -1;
    }
    snprintf(why, why_len, "no RDMA device has a GID for %s", local_host);
    int found = 0, said = 0;   // said: why names something more precise than "no GID"
    char ib_port[64] = "";     // an InfiniBand port seen, "mlx5_0 port 1"
    for (int i = 0; i < n && !found; i++) {
        const char * name = v->get_device_name(list[i]);
        if (named && *named && strcmp(named, name) != 0) continue;
        struct ibv_context * ctx = v->open_device(list[i]);
        if (!ctx) {
            snprintf(why, why_len, "cannot open RDMA device %s: %s", name, strerror(errno));
            said = 1;
            continue;
        }
        for (int port = 1; port <= 2 && !found; port++) {
            struct ibv_port_attr pa;
            memset(&pa, 0, sizeof pa);
            if (v->query_port(ctx, (uint8_t) port, &pa) != 0) break;
            if (pa.link_layer == IBV_LINK_LAYER_INFINIBAND) {
                if (!ib_port[0]) snprintf(ib_port, sizeof ib_port, "%.40s port %d", name, port);
                continue;
            }
            int type = TB_GID_UNTYPED;
            const int g = tb_rdma_find_gid(v, ctx, (uint8_t) port, pa.gid_tbl_len, pa.link_layer, &want, &type);
            if (g < 0 || g > 255) continue;
            if (pa.state != IBV_PORT_ACTIVE) {
                snprintf(why, why_len, "RDMA device %s port %d is not active (peer not enabled or cable out)", name, port);
                said = 1;
                break;
            }
            union ibv_gid gid;
            if (v->query_gid(ctx, (uint8_t) port, g, &gid) != 0) continue;
            d->ctx = ctx;
            d->port = (uint8_t) port;
            d->gid_index = (uint8_t) g;
            d->gid_type = (uint8_t) type;
            d->gid = gid;
            d->lid = pa.lid;
            d->mtu = pa.active_mtu ? pa.active_mtu : IBV_MTU_1024;
            snprintf(d->device, sizeof d->device, "%s", name);
            found = 1;
        }
        if (!found) v->close_device(ctx);
    }
    v->free_device_list(list);
    if (!found && !said && ib_port[0]) {
        snprintf(why, why_len, "RDMA device %s is InfiniBand, which tbrpc does not support (no GID holds %s)",
                 ib_port, local_host);
    }
    return found ? 0 : -1;
}

static int random_u32(uint32_t * out) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t k = read(fd, out, sizeof *out);
    close(fd);
    return k == (ssize_t) sizeof *out ? 0 : -1;
}

// Receives for frames seq .. seq + count - 1 (slot seq % slots each).
static int post_receives(struct tb_rdma * d, uint32_t seq, uint32_t count) {
    for (uint32_t k = 0; k < count; k++, seq++) {
        struct ibv_sge sge = { (uintptr_t) rx_slot(d, seq % d->slots), d->stride, d->mr->lkey };
        struct ibv_recv_wr wr = { .wr_id = seq, .sg_list = &sge, .num_sge = 1 }, * bad = NULL;
        int rc = ibv_post_recv(d->qp, &wr, &bad);
        if (rc != 0) return rc;
    }
    return 0;
}

#ifndef TB_RDMA_BROKEN_POST_RECV_BEFORE_RTS
// The receive the peer's probe frame lands in (rx slot 0, before the ring's receives).
static int post_probe_receive(struct tb_rdma * d) {
    struct ibv_sge sge = { (uintptr_t) rx_slot(d, 0), d->stride, d->mr->lkey };
    struct ibv_recv_wr wr = { .wr_id = PROBE_TAG, .sg_list = &sge, .num_sge = 1 }, * bad = NULL;
    return ibv_post_recv(d->qp, &wr, &bad);
}
#endif

struct tb_rdma * tb_rdma_prepare(const char * local_host, struct tb_rdma_info * mine) {
    memset(mine, 0, sizeof *mine);
    mine->magic = TB_RDMA_INFO_MAGIC;
    mine->version = TB_RDMA_INFO_VERSION;
    mine->host_id = host_id();
    mine->why = TB_WHY_RDMA_FAILED;   // until ok
    char err[200];
    const struct tb_verbs * v = tb_verbs_load(err, sizeof err);
    if (!v) { snprintf(mine->reason, sizeof mine->reason, "%s", err); return NULL; }
    struct tb_rdma * d = calloc(1, sizeof *d);
    if (!d) { snprintf(mine->reason, sizeof mine->reason, "out of memory"); return NULL; }
    d->v = v;
    d->qp_place = -1;
    d->profile = tb_rdma_profile_default();
    mine->profile = (uint16_t) d->profile;
    int apple = d->profile == TB_RDMA_APPLE_UC;
    tb_rdma_geometry(d->profile, &d->slots, &d->stride);
    if (!tb_ring_geometry_ok(d->slots, d->stride - TB_RDMA_PREFIX) || d->stride % APPLE_FRAME != 0 ||
        (apple && d->stride > APPLE_MAX_MSG) || (apple && d->slots * frames_of(d->stride) > 4095)) {
        snprintf(mine->reason, sizeof mine->reason, "no RDMA ring of %u slots of %u bytes", d->slots, d->stride);
        free(d);
        return NULL;
    }
    const char * step = "device";
    if (pick_device(d, local_host, mine->reason, sizeof mine->reason) != 0) { free(d); return NULL; }
    // A device takes so many QPs (Apple: 10) over every process on its host: a place before the QP.
    if (tb_qp_take(host_id(), d->device, tb_rdma_qp_limit(d->profile), &d->qp_place, mine->reason,
                   sizeof mine->reason) != TB_QP_TAKEN) {
        mine->why = TB_WHY_QP_BUDGET;
        v->close_device(d->ctx);
        free(d);
        return NULL;
    }
    d->access = apple ? IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE
                      : IBV_ACCESS_LOCAL_WRITE;
    d->mem_len = 2 * (size_t) d->slots * d->stride;
    d->mem = mmap(NULL, d->mem_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (d->mem == MAP_FAILED) { d->mem = NULL; step = "mmap"; goto fail; }
#ifdef MADV_DONTFORK
    // What ibv_fork_init() does for every MR: a process that forks after this
    // (a head's user code, multiprocessing) must not make the ring copy-on-write,
    // or on kernels before 5.13 the parent's next write moves its page away from
    // the one the NIC reads and writes. The child never uses the ring.
    step = "madvise(MADV_DONTFORK)";
    if (madvise(d->mem, d->mem_len, MADV_DONTFORK) != 0) goto fail;
#endif
    step = "ibv_alloc_pd";
    if (!(d->pd = v->alloc_pd(d->ctx))) goto fail;
    step = "ibv_reg_mr";   // before RTR: an MR registered later may never be mapped on Apple
#ifdef TB_RDMA_BROKEN_REGISTER_RX_ONLY
    // deliberately wrong (tests only): the send slots lie outside the registered memory
    if (!(d->mr = v->reg_mr(d->pd, d->mem, d->mem_len / 2, d->access))) goto fail;
#else
    if (!(d->mr = v->reg_mr(d->pd, d->mem, d->mem_len, d->access))) goto fail;
#endif
    if (!apple && v->create_comp_channel) {
        step = "ibv_create_comp_channel";
        if (!(d->ch = v->create_comp_channel(d->ctx))) goto fail;
        int fl = fcntl(d->ch->fd, F_GETFL);
        fcntl(d->ch->fd, F_SETFL, fl | O_NONBLOCK);   // two threads may both see it readable
    }
    uint32_t depth = apple ? d->slots * frames_of(d->stride) : d->slots;   // Apple: in 4 KiB frames
    step = "ibv_create_cq";
    if (!(d->cq = v->create_cq(d->ctx, (int) (2 * depth + 1), NULL, d->ch, 0))) goto fail;
    struct ibv_qp_init_attr qa = {
        .send_cq = d->cq, .recv_cq = d->cq,
        .cap = { .max_send_wr = depth, .max_recv_wr = depth, .max_send_sge = 1, .max_recv_sge = 1 },
        .qp_type = d->profile == TB_RDMA_LINUX_RC ? IBV_QPT_RC : IBV_QPT_UC,
    };
    step = "ibv_create_qp";
    if (!(d->qp = v->create_qp(d->pd, &qa))) goto fail;
    // SEND/RECV only: the QP grants no remote access (TN3205's INIT: access 0); the MR flags are another matter
    struct ibv_qp_attr init = { .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = d->port, .qp_access_flags = 0 };
    step = "INIT";
    int rc = v->modify_qp(d->qp, &init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0) { errno = verbs_errno(rc); goto fail; }
    step = "random psn";
    if (random_u32(&d->psn) != 0) goto fail;
    d->psn &= 0xffffff;
#ifdef TB_RDMA_BROKEN_POST_RECV_BEFORE_RTS
    // deliberately wrong (tests only): receives posted in INIT, which Apple refuses
    step = "ibv_post_recv before RTS";
    if ((rc = post_receives(d, TB_RING_FIRST_SEQ, d->slots)) != 0) { errno = verbs_errno(rc); goto fail; }
#endif
    mine->ok = 1;
    mine->qpn = d->qp->qp_num;
    mine->psn = d->psn;
    mine->stride = d->stride;
    mine->slots = d->slots;
    mine->mtu = d->mtu;
    mine->lid = d->lid;
    mine->port = d->port;
    mine->gid_index = d->gid_index;
    mine->gid_type = d->gid_type;
    memcpy(mine->gid, d->gid.raw, 16);
    snprintf(mine->device, sizeof mine->device, "%s", d->device);
    return d;
fail:
    snprintf(mine->reason, sizeof mine->reason, "RDMA %s on %s failed: %s", step, d->device, strerror(errno ? errno : EINVAL));
    close_endpoint(d);
    return NULL;
}

int tb_rdma_connect(struct tb_rdma * d, const struct tb_rdma_info * peer, char * err, size_t err_len) {
    const struct tb_verbs * v = d->v;
    int rc_qp = d->profile == TB_RDMA_LINUX_RC;
    uint32_t stride = peer->stride < d->stride ? peer->stride : d->stride;
    uint32_t slots = peer->slots < d->slots ? peer->slots : d->slots;
    if (!tb_ring_geometry_ok(slots, stride - TB_RDMA_PREFIX) || stride % APPLE_FRAME != 0) {
        snprintf(err, err_len, "no RDMA ring of %u slots of %u bytes", slots, stride);
        return -1;
    }
    struct ibv_qp_attr rtr = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = peer->mtu < (uint32_t) d->mtu ? (enum ibv_mtu) peer->mtu : d->mtu,
        .dest_qp_num = peer->qpn,
        .rq_psn = peer->psn,
        // hop_limit is the IP TTL under RoCE v2: 1 (TN3205's value, a cable between two Macs) would have
        // the first router of a routed RoCE fabric drop every packet after an RTR that succeeded
        .ah_attr = { .is_global = 1, .dlid = peer->lid, .port_num = d->port,
                     .grh = { .hop_limit = d->profile == TB_RDMA_APPLE_UC ? 1 : 64, .sgid_index = d->gid_index } },
    };
    memcpy(rtr.ah_attr.grh.dgid.raw, peer->gid, 16);
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    if (rc_qp) {
        rtr.max_dest_rd_atomic = 1;
        rtr.min_rnr_timer = 12;
        mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    }
    int rc = v->modify_qp(d->qp, &rtr, mask);   // once: repeated failed RTRs can wedge an Apple port
    if (rc != 0) { snprintf(err, err_len, "RDMA RTR on %s failed: %s", d->device, strerror(verbs_errno(rc))); return -1; }
    struct ibv_qp_attr rts = { .qp_state = IBV_QPS_RTS, .sq_psn = d->psn };
    mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
    if (rc_qp) {
        rts.timeout = 14;
        rts.retry_cnt = 7;
        rts.rnr_retry = 7;
        rts.max_rd_atomic = 1;
        mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    }
    rc = v->modify_qp(d->qp, &rts, mask);
    if (rc != 0) { snprintf(err, err_len, "RDMA RTS on %s failed: %s", d->device, strerror(verbs_errno(rc))); return -1; }
    // The agreed geometry is at most what we registered, so every slot stays inside our MR.
    d->slots = slots;
    d->stride = stride;
#ifndef TB_RDMA_BROKEN_POST_RECV_BEFORE_RTS
    rc = post_probe_receive(d);   // after RTS: Apple refuses receives before
    if (rc != 0) { snprintf(err, err_len, "RDMA ibv_post_recv on %s failed: %s", d->device, strerror(verbs_errno(rc))); return -1; }
#endif
    return 0;
}

// RTR and RTS check no path: a GID that leads nowhere (a stale APIPA address,
// RoCE v1 on one end and v2 on the other, a cable to another machine) brings
// both QPs up, and then every frame is lost, a UC send stays pending on Apple,
// RC retries out. So once both sides have their probe receive posted (the
// caller's first readiness exchange), each sends one frame and waits for the
// peer's and for its own send's completion; only then the ring's receives go
// up. 0, or -1 with err (the caller tells the peer and both stay on TCP).
int tb_rdma_probe(struct tb_rdma * d, char * err, size_t err_len) {
#ifdef TB_RDMA_BROKEN_POST_RECV_BEFORE_RTS
    (void) d; (void) err; (void) err_len;
    return 0;   // the ring's receives are up already: a probe would land in the first of them
#else
    uint8_t * slot = tx_slot(d, 0);
    struct wire_prefix p = { WIRE_MAGIC, 0, 0, PROBE_TAG >> 32, checksum(slot, 0, PROBE_TAG) };
    memset(slot, 0, TB_RDMA_PREFIX);
    memcpy(slot, &p, sizeof p);
    // Apple: the same number of 4 KiB frames as the receive; elsewhere the prefix will do
    struct ibv_sge sge = { (uintptr_t) slot, d->profile == TB_RDMA_APPLE_UC ? d->stride : TB_RDMA_PREFIX, d->mr->lkey };
    struct ibv_send_wr wr = { .wr_id = SEND_TAG | PROBE_TAG, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                              .send_flags = IBV_SEND_SIGNALED }, * bad = NULL;
    int rc = ibv_post_send(d->qp, &wr, &bad);
    if (rc != 0) { snprintf(err, err_len, "RDMA probe on %s: ibv_post_send failed: %s", d->device, strerror(verbs_errno(rc))); return -1; }
    int sent = 0, got = 0;
    int64_t until = now_ns() + PROBE_MS * 1000000ll;
    while (!(sent && got)) {
        struct ibv_wc wc[4];
        int n = ibv_poll_cq(d->cq, 4, wc);
        if (n < 0) { snprintf(err, err_len, "RDMA probe on %s: ibv_poll_cq failed", d->device); return -1; }
        for (int i = 0; i < n; i++) {
            const char * what = wc[i].wr_id & SEND_TAG ? "send" : "receive";
            if (wc[i].status != IBV_WC_SUCCESS) {
                snprintf(err, err_len, "RDMA probe on %s: %s failed: %s", d->device, what, d->v->wc_status_str(wc[i].status));
                return -1;
            }
            if (wc[i].wr_id == (SEND_TAG | PROBE_TAG)) { sent = 1; continue; }
            struct wire_prefix q;
            memcpy(&q, rx_slot(d, 0), sizeof q);
            if (wc[i].wr_id != PROBE_TAG || wc[i].byte_len < sizeof q || q.magic != WIRE_MAGIC ||
                q.reserved != (uint32_t) (PROBE_TAG >> 32) || q.sum != p.sum) {
                snprintf(err, err_len, "RDMA probe on %s: the peer's frame is not a probe (%u bytes)", d->device,
                         wc[i].byte_len);
                return -1;
            }
            got = 1;
        }
        if (sent && got) break;
        if (now_ns() > until) {
            snprintf(err, err_len, "RDMA probe on %s: %s within %d ms (no path between the two GIDs?)", d->device,
                     !got ? "no frame from the peer" : "our frame not taken", PROBE_MS);
            return -1;
        }
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
    }
    rc = post_receives(d, TB_RING_FIRST_SEQ, d->slots);
    if (rc != 0) { snprintf(err, err_len, "RDMA ibv_post_recv on %s failed: %s", d->device, strerror(verbs_errno(rc))); return -1; }
    return 0;
#endif
}

// --- the wire ------------------------------------------------------------------

// The send slot of frame seq.
static uint32_t tx_index(const struct tb_rdma * d, uint32_t seq) {
#ifdef TB_RDMA_BROKEN_REUSE_SLOT
    return seq % (d->slots / 2);   // deliberately wrong (tests only): two frames in flight share a slot
#else
    return seq % d->slots;
#endif
}

static struct rdma_transport * of(struct tb_ring * r) { return (struct rdma_transport *) r; }

static int set_broken(struct rdma_transport * t, int kind, const char * fmt, ...) __attribute__((format(printf, 3, 4)));
static int set_broken(struct rdma_transport * t, int kind, const char * fmt, ...) {
    if (!t->broken) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->broken_why, sizeof t->broken_why, fmt, ap);
        va_end(ap);
        t->broken = 1;
        t->broken_kind = kind;
    }
    return -1;
}

// Report the recorded failure on the ring's transport.
static int fail_broken(struct rdma_transport * t) {
    return tb_fail(&t->ring.base, t->broken_kind, "%s", t->broken_why);
}

// Whether the TCP socket says the peer is gone (end of file or error); reads
// and drops anything else (nothing travels over TCP once on RDMA).
static int tcp_gone(struct rdma_transport * t) {
    char buf[64];
    for (int reads = 0; reads < 64; reads++) {   // bounded: a peer writing without end must not hold us here
        ssize_t k = recv(t->fd, buf, sizeof buf, MSG_DONTWAIT);
        if (k > 0) { __atomic_add_fetch(&t->anchor_bytes, (uint64_t) k, __ATOMIC_RELAXED); continue; }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        return 1;
    }
    return 0;   // more is waiting: the next look takes it
}

// Poll the CQ once (cq_lock held). Number of completions, or -1 (broken).
static int progress_locked(struct rdma_transport * t) {
    struct ibv_wc wc[16];
    int n = ibv_poll_cq(t->d->cq, 16, wc);
    if (n < 0) return set_broken(t, TB_IO_BROKEN, "%s: RDMA poll_cq failed", t->ring.base.peer);
    for (int i = 0; i < n; i++) {
        uint32_t seq = (uint32_t) wc[i].wr_id;
        uint32_t idx = seq % t->d->slots;
        if (wc[i].wr_id & SEND_TAG) {
            idx = tx_index(t->d, seq);
            if (wc[i].status != IBV_WC_SUCCESS && tcp_gone(t)) {   // RC retries out against a dead peer
                set_broken(t, TB_IO_CLOSED, "%s: connection closed by peer", t->ring.base.peer);
            } else if (wc[i].status != IBV_WC_SUCCESS) {
                set_broken(t, TB_IO_BROKEN, "%s: RDMA send of frame %u failed: %s", t->ring.base.peer, seq,
                           t->d->v->wc_status_str(wc[i].status));
            }
            if (t->state[idx].tx_busy == HELD(seq)) t->state[idx].tx_busy = 0;
            continue;
        }
        if (wc[i].status != IBV_WC_SUCCESS) {
            set_broken(t, TB_IO_BROKEN, "%s: RDMA receive of frame %u failed: %s", t->ring.base.peer, seq,
                       t->d->v->wc_status_str(wc[i].status));
            continue;
        }
        t->state[idx].rx_arrived = HELD(seq);
        t->state[idx].rx_bytes = wc[i].byte_len;
    }
    return t->broken ? -1 : n;
}

static void note_eof(struct rdma_transport * t) {
    if (!t->eof) { t->eof = 1; t->eof_at = tb_now_ms(); }
}

// Whether the wait for `seq` is over: it arrived, or the wire broke.
static int arrived(struct rdma_transport * t, uint32_t seq) {
    pthread_mutex_lock(&t->cq_lock);
    int n = progress_locked(t);
    int done = n < 0 || t->state[seq % t->d->slots].rx_arrived == HELD(seq);
    pthread_mutex_unlock(&t->cq_lock);
    return done;
}

// Sleep up to `us` microseconds, waking for the TCP socket (and the channel).
static void sleep_on(struct rdma_transport * t, int64_t us) {
    __atomic_add_fetch(&t->ring.sleeps, 1, __ATOMIC_RELAXED);
    struct pollfd p[2] = { { .fd = t->fd, .events = POLLIN }, { .fd = t->d->ch ? t->d->ch->fd : -1, .events = POLLIN } };
    int nfds = t->d->ch ? 2 : 1;
    int k;
    if (us < 1000 && !t->d->ch) {
        struct timespec ts = { 0, (long) us * 1000 };
        nanosleep(&ts, NULL);
        k = poll(p, 1, 0);
    } else {
        do { k = poll(p, (nfds_t) nfds, (int) ((us + 999) / 1000)); } while (k < 0 && errno == EINTR);
    }
    if (k > 0 && (p[0].revents & (POLLIN | POLLHUP | POLLERR)) && tcp_gone(t)) note_eof(t);
    if (k > 0 && nfds == 2 && (p[1].revents & POLLIN)) {
        pthread_mutex_lock(&t->cq_lock);
        struct ibv_cq * cq;
        void * cq_ctx;
        if (t->d->v->get_cq_event(t->d->ch, &cq, &cq_ctx) == 0) t->d->v->ack_cq_events(cq, 1);
        pthread_mutex_unlock(&t->cq_lock);
    }
}

static int rdma_wait(struct tb_ring * r, uint32_t seq, int timeout_ms) {
    struct rdma_transport * t = of(r);
    int64_t start = now_ns(), until = start + (int64_t) timeout_ms * 1000000;
    while (now_ns() - start < SPIN_NS) {
        if (arrived(t, seq)) goto done;
    }
    int64_t backoff_us = 20;
    while (now_ns() < until) {
        if (t->eof && tb_now_ms() - t->eof_at >= EOF_GRACE_MS) {
            if (arrived(t, seq)) goto done;
            return tb_fail(&r->base, TB_IO_CLOSED, "%s: connection closed by peer", r->base.peer);
        }
        if (t->d->ch) {   // arm, look once more, then sleep on channel + socket
            pthread_mutex_lock(&t->cq_lock);
            ibv_req_notify_cq(t->d->cq, 0);
            pthread_mutex_unlock(&t->cq_lock);
        }
        if (arrived(t, seq)) goto done;
        int64_t left_us = (until - now_ns()) / 1000;
        int64_t nap = t->d->ch ? 10000 : backoff_us;   // the channel wakes us; 10 ms bounds an EOF check
        if (t->eof) nap = 1000;
        sleep_on(t, nap < left_us ? nap : (left_us > 0 ? left_us : 1));
        if (backoff_us < 1000) backoff_us *= 2;
    }
    if (arrived(t, seq)) goto done;
    return 0;   // the ring checks its own deadline
done:
    if (t->broken) return fail_broken(t);
    return 0;
}

static uint8_t * rdma_tx_frame(struct tb_ring * r, uint32_t seq) {
    struct rdma_transport * t = of(r);
    uint32_t idx = tx_index(t->d, seq);
#ifdef TB_RDMA_BROKEN_REUSE_SLOT
    return tx_slot(t->d, idx) + TB_RDMA_PREFIX;   // and it does not wait for the slot's send to complete
#endif
    int64_t until = tb_now_ms() + (r->base.timeout_ms > 0 ? r->base.timeout_ms : 30000);
    pthread_mutex_lock(&t->cq_lock);
    // The peer handed this slot's credit back, so its previous send has left; its completion follows.
    while (t->state[idx].tx_busy != 0 && !t->broken) {
        if (progress_locked(t) < 0) break;
        if (t->state[idx].tx_busy == 0) break;
        if (tb_now_ms() > until) {
            set_broken(t, TB_IO_TIMEOUT, "%s: RDMA send of frame %u never completed", r->base.peer,
                       (uint32_t) t->state[idx].tx_busy);
            break;
        }
        pthread_mutex_unlock(&t->cq_lock);
        struct timespec ts = { 0, 20000 };
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&t->cq_lock);
    }
    int bad = t->broken;
    pthread_mutex_unlock(&t->cq_lock);
    return (bad ? t->scratch : tx_slot(t->d, idx)) + TB_RDMA_PREFIX;
}

static int rdma_post(struct tb_ring * r, uint32_t seq) {
    struct rdma_transport * t = of(r);
    struct tb_rdma * d = t->d;
    if (t->broken) return fail_broken(t);
    uint32_t idx = tx_index(d, seq);
    uint8_t * slot = tx_slot(d, idx);
    struct tb_frame_header h;
    memcpy(&h, slot + TB_RDMA_PREFIX, sizeof h);
    h.seq = seq;
    memcpy(slot + TB_RDMA_PREFIX, &h, sizeof h);
    uint32_t bytes = TB_FRAME_HEADER + h.len;
    struct wire_prefix p = { WIRE_MAGIC, seq, bytes, 0, checksum(slot + TB_RDMA_PREFIX, bytes, seq) };
    memcpy(slot, &p, sizeof p);
    uint32_t length = TB_RDMA_PREFIX + bytes;
#ifndef TB_RDMA_BROKEN_SHORT_APPLE_SEND
    if (d->profile == TB_RDMA_APPLE_UC) length = d->stride;   // same frame count as the receive
#endif
    struct ibv_sge sge = { (uintptr_t) slot, length, d->mr->lkey };
    struct ibv_send_wr wr = { .wr_id = SEND_TAG | seq, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                              .send_flags = IBV_SEND_SIGNALED }, * bad = NULL;
    pthread_mutex_lock(&t->cq_lock);
    t->state[idx].tx_busy = HELD(seq);
    int rc = ibv_post_send(d->qp, &wr, &bad);
    if (rc != 0) {
        t->state[idx].tx_busy = 0;
        // A QP that an error completion put in the error state refuses posts:
        // take that completion first, so the failure names its cause.
        progress_locked(t);
        set_broken(t, TB_IO_BROKEN, "%s: RDMA post_send of frame %u failed: %s", r->base.peer, seq, strerror(verbs_errno(rc)));
    }
    pthread_mutex_unlock(&t->cq_lock);
    if (rc != 0) return fail_broken(t);
    t->wire_bytes += length;
    return 0;
}

static const uint8_t * rdma_rx_frame(struct tb_ring * r, uint32_t seq, int * broken) {
    struct rdma_transport * t = of(r);
    struct tb_rdma * d = t->d;
    uint32_t idx = seq % d->slots;
    *broken = 0;
    pthread_mutex_lock(&t->cq_lock);
    int n = progress_locked(t);
    uint64_t got = t->state[idx].rx_arrived;
    uint32_t len = t->state[idx].rx_bytes;
    pthread_mutex_unlock(&t->cq_lock);
    if (n < 0) { *broken = 1; return fail_broken(t), NULL; }
    if (got != HELD(seq)) return NULL;
    const uint8_t * slot = rx_slot(d, idx);
    if (t->state[idx].rx_valid == HELD(seq)) return slot + TB_RDMA_PREFIX;
    struct wire_prefix p;
    memcpy(&p, slot, sizeof p);
    struct tb_frame_header h;
    memcpy(&h, slot + TB_RDMA_PREFIX, sizeof h);
    if (p.magic != WIRE_MAGIC || p.seq != seq || h.seq != seq) {
        set_broken(t, TB_IO_BROKEN, "RDMA frame lost from %s (seq %u, expected %u)", r->base.peer,
                   p.magic == WIRE_MAGIC ? p.seq : 0, seq);
    } else if (p.bytes < TB_FRAME_HEADER || p.bytes > d->stride - TB_RDMA_PREFIX || len < TB_RDMA_PREFIX + p.bytes ||
               p.bytes != TB_FRAME_HEADER + h.len || checksum(slot + TB_RDMA_PREFIX, p.bytes, seq) != p.sum) {
        set_broken(t, TB_IO_BROKEN, "RDMA frame from %s is corrupt (seq %u, %u of %u bytes)", r->base.peer, seq,
                   len, TB_RDMA_PREFIX + p.bytes);
    }
    if (t->broken) { *broken = 1; fail_broken(t); return NULL; }
    t->state[idx].rx_valid = HELD(seq);
    return slot + TB_RDMA_PREFIX;
}

static int rdma_release(struct tb_ring * r, uint32_t seq) {
    struct rdma_transport * t = of(r);
    struct tb_rdma * d = t->d;
    uint32_t idx = seq % d->slots;
    pthread_mutex_lock(&t->cq_lock);
    t->state[idx].rx_arrived = 0;
    t->state[idx].rx_valid = 0;
    int rc = post_receives(d, seq + d->slots, 1);
    if (rc != 0) set_broken(t, TB_IO_BROKEN, "%s: RDMA post_recv failed: %s", r->base.peer, strerror(verbs_errno(rc)));
    pthread_mutex_unlock(&t->cq_lock);
    return rc != 0 ? fail_broken(t) : 0;
}

static void rdma_free(struct tb_ring * r) {
    struct rdma_transport * t = of(r);
    // Never tear down under a send in flight: wait a little for the last completions.
    int64_t until = tb_now_ms() + 200;
    for (;;) {
        pthread_mutex_lock(&t->cq_lock);
        int busy = 0;
        if (!t->broken) progress_locked(t);
        for (uint32_t i = 0; i < t->d->slots; i++) busy |= t->state[i].tx_busy != 0;
        pthread_mutex_unlock(&t->cq_lock);
        if (!busy || t->broken || tb_now_ms() > until) break;
        struct timespec ts = { 0, 50000 };
        nanosleep(&ts, NULL);
    }
    tb_ring_destroy(r);
    close_endpoint(t->d);
    tb_close(t->tcp);
    pthread_mutex_destroy(&t->cq_lock);
    free(t->state);
    free(t->scratch);
    free(t);
}

// The heartbeat is a byte on the anchor: it takes no receive slot, so a node
// computing a long graph keeps a peer blocked on its full ring waiting (a
// keepalive frame there would sit unread ahead of the credits the node
// returns). A waiting side drains the anchor anyway (tcp_gone, looking for
// its end of file); what it drained since it last looked is the sign. A full
// socket drops the byte: the next one will do.
static void rdma_heartbeat(struct tb_ring * r) {
    const char beat = 0;
    (void) !send(of(r)->fd, &beat, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
}

static int rdma_peer_alive(struct tb_ring * r) {
    struct rdma_transport * t = of(r);
    if (tcp_gone(t)) note_eof(t);   // drain what came since the last wait; an end of file is the wait's to report
    const uint64_t now = __atomic_load_n(&t->anchor_bytes, __ATOMIC_RELAXED);
    const int moved = now != t->anchor_seen;
    t->anchor_seen = now;
    return moved;
}

static const struct tb_ring_wire rdma_wire = {
    .name = "rdma", .tx_frame = rdma_tx_frame, .post = rdma_post, .rx_frame = rdma_rx_frame,
    .release = rdma_release, .wait = rdma_wait, .free = rdma_free, .heartbeat = rdma_heartbeat,
    .peer_alive = rdma_peer_alive,
};

// The transport's own memory, taken before the last readiness exchange: running
// out of it then leaves both sides on TCP, where taking it after both said
// ready would leave this side on TCP and the peer on RDMA. NULL: out of memory.
static struct rdma_transport * transport_alloc(const struct tb_rdma * d, const struct tb_transport * tcp) {
#ifdef TB_RDMA_TESTING
    if (getenv("RDMA_TEST_RING_ALLOC_FAILS")) return NULL;   // tests only: a process out of memory here
#endif
    struct rdma_transport * t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->state = calloc(d->slots, sizeof *t->state);
    t->scratch = calloc(1, d->stride);
    const bool locked = t->state && t->scratch && pthread_mutex_init(&t->cq_lock, NULL) == 0;
    if (!locked || !tb_ring_init(&t->ring, &rdma_wire, d->slots, d->stride - TB_RDMA_PREFIX, tcp->timeout_ms, tcp->peer)) {
        if (locked) pthread_mutex_destroy(&t->cq_lock);
        free(t->state);
        free(t->scratch);
        free(t);
        return NULL;
    }
    return t;
}

// Undo transport_alloc (the bring-up failed after it).
static void transport_unalloc(struct rdma_transport * t) {
    tb_ring_destroy(&t->ring);
    pthread_mutex_destroy(&t->cq_lock);
    free(t->state);
    free(t->scratch);
    free(t);
}

// The transport over d and tcp (it owns both from now on); nothing here can fail.
static struct tb_transport * transport_bind(struct rdma_transport * t, struct tb_rdma * d, struct tb_transport * tcp) {
#ifdef TB_RDMA_BROKEN_NO_CREDITS
    t->ring.tx_credits = 1u << 30;   // deliberately wrong (tests only): send whether or not a receive waits
#endif
    t->d = d;
    t->tcp = tcp;
    t->fd = tb_tcp_fd(tcp);
    t->ring.base.bytes_sent = tcp->bytes_sent;
    t->ring.base.bytes_received = tcp->bytes_received;
    snprintf(t->ring.base.describe, sizeof t->ring.base.describe, "rdma %s %s %uKx%u", d->device,
             d->profile == TB_RDMA_LINUX_RC ? "RC" : "UC", d->stride / 1024, d->slots);
    return &t->ring.base;
}

// What both sides decide from the two infos (the same on both sides).
// Whether both sides may go on; if not, why, and its kind: ours, or the
// peer's when it is the one refusal kind we act on (its bytes are not trusted further).
static int agree(const struct tb_rdma_info * mine, const struct tb_rdma_info * peer, int * kind, char * why,
                 size_t why_len) {
    *kind = TB_WHY_RDMA_FAILED;
    if (peer->magic != TB_RDMA_INFO_MAGIC || peer->version != TB_RDMA_INFO_VERSION) {
        snprintf(why, why_len, "peer speaks another RDMA bring-up");
        return 0;
    }
    if (!mine->ok) {
        *kind = (int) mine->why;
        snprintf(why, why_len, "%.*s", (int) sizeof mine->reason, mine->reason);
        return 0;
    }
    if (!peer->ok) {
        if (peer->why == TB_WHY_QP_BUDGET) *kind = TB_WHY_QP_BUDGET;
        snprintf(why, why_len, "peer: %.*s", (int) sizeof peer->reason, peer->reason);
        return 0;
    }
    if (mine->profile != peer->profile) {
        snprintf(why, why_len, "profiles differ (%s here, %s on the peer)", tb_rdma_profile_name(mine->profile),
                 tb_rdma_profile_name(peer->profile));
        return 0;
    }
    if (peer->gid_type > TB_GID_IB) {
        snprintf(why, why_len, "peer sent an unknown GID type (%u)", (unsigned) peer->gid_type);
        return 0;
    }
    // RoCE v1 and v2 are different frames (Ethernet, UDP/IP): a NIC that speaks
    // one need not take the other, and v1 crosses no router. Never mixed.
    if (mine->gid_type != peer->gid_type) {
        snprintf(why, why_len, "GID types differ (%s here, %s on the peer)", tb_gid_type_name(mine->gid_type),
                 tb_gid_type_name(peer->gid_type));
        return 0;
    }
    if (mine->host_id == peer->host_id) { snprintf(why, why_len, "peer is on this host"); return 0; }
    return 1;
}

int tb_rdma_available(char * why, size_t why_len) {
    const struct tb_verbs * v = tb_verbs_load(why, why_len);
    if (!v) return 0;
    int n = 0;
    struct ibv_device ** list = v->get_device_list(&n);
    if (list) v->free_device_list(list);
    if (n <= 0) { snprintf(why, why_len, "no RDMA device"); return 0; }
    return 1;
}

// The address this side of a TCP connection has ("a.b.c.d" or an IPv6 literal).
static int local_address(struct tb_transport * tcp, char * out, size_t out_len) {
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    if (getsockname(tb_tcp_fd(tcp), (struct sockaddr *) &a, &len) != 0) return -1;
    if (a.ss_family == AF_INET) return inet_ntop(AF_INET, &((struct sockaddr_in *) &a)->sin_addr, out, (socklen_t) out_len) ? 0 : -1;
    if (a.ss_family != AF_INET6) return -1;
    const struct in6_addr * six = &((struct sockaddr_in6 *) &a)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(six)) return inet_ntop(AF_INET, six->s6_addr + 12, out, (socklen_t) out_len) ? 0 : -1;
    return inet_ntop(AF_INET6, six, out, (socklen_t) out_len) ? 0 : -1;
}

struct tb_transport * tb_rdma_upgrade(struct tb_transport * tcp, const char * local_host, int * kind, char * reason,
                                      size_t reason_len) {
    struct tb_rdma_info mine, peer;
    *kind = TB_WHY_RDMA_FAILED;
    char here[64] = "";
    if (!local_host && local_address(tcp, here, sizeof here) == 0) local_host = here;
    struct tb_rdma * d = tb_rdma_prepare(local_host, &mine);
    char why[200];
    if (tb_send(tcp, &mine, sizeof mine) != 0 || tb_flush(tcp) != 0 || tb_recv(tcp, &peer, sizeof peer) != 0) {
        snprintf(reason, reason_len, "RDMA bring-up: %s", tcp->error);
        tb_rdma_discard(d);
        return NULL;
    }
    peer.reason[sizeof peer.reason - 1] = 0;
    peer.device[sizeof peer.device - 1] = 0;
    if (!agree(&mine, &peer, kind, why, sizeof why)) {
        snprintf(reason, reason_len, "%s", why);
        tb_rdma_discard(d);
        return NULL;
    }
    // Both go RTR/RTS and post the probe's receive, then say whether they are
    // ready; both then send a probe frame and post the ring's receives, and say so again.
    // The transport's memory is taken before the last exchange (transport_alloc).
    struct { uint8_t ready; char why[127]; } me = { 1, "" }, them;
    struct rdma_transport * t = NULL;
    for (int round = 0; round < 2; round++) {
        int rc = round == 0 ? tb_rdma_connect(d, &peer, me.why, sizeof me.why) : tb_rdma_probe(d, me.why, sizeof me.why);
        if (rc == 0 && round == 1 && !(t = transport_alloc(d, tcp))) {
            snprintf(me.why, sizeof me.why, "out of memory for an RDMA ring");
            rc = -1;
        }
        if (rc != 0) me.ready = 0;
        const bool said = tb_send(tcp, &me, sizeof me) == 0 && tb_flush(tcp) == 0 && tb_recv(tcp, &them, sizeof them) == 0;
        them.why[sizeof them.why - 1] = 0;
        if (!said || !me.ready || them.ready != 1) {
            if (!said) snprintf(reason, reason_len, "RDMA bring-up: %s", tcp->error);
            else snprintf(reason, reason_len, "%s%s", me.ready ? "peer: " : "", me.ready ? them.why : me.why);
            if (t) transport_unalloc(t);
            tb_rdma_discard(d);
            return NULL;
        }
    }
    return transport_bind(t, d, tcp);
}

#endif  // TB_HAVE_VERBS
