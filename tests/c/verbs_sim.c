// verbs_sim.c - an honest stand-in verbs provider for CI (no RDMA hardware,
// no kernel modules). Built as a shared library by tests (build_verbs_sim in
// tbrpc/_build.py) and loaded through TBRPC_VERBS_LIB, exactly where the real
// libibverbs or Apple's librdma would be: it exports the setup verbs and
// fills ctx->ops.post_send/post_recv/poll_cq/req_notify_cq, which the
// header's inlines call.
//
// Two PROCESSES talk through it: each QP listens on an abstract Unix socket
// named after TBVSIM_DIR, its GID and its number; RTR connects to the peer's.
// Per context a "NIC" made of two threads: tx reads each posted send buffer
// late (after a short random delay, comparing with a hash taken at post time:
// a buffer reused before its completion is reported on stderr and its late
// bytes are what travels, as on hardware) and writes it; rx matches arrivals
// to posted receives in FIFO order and writes completions, which callers see
// only through poll_cq.
//
// Rules per profile (TBVSIM_PROFILE):
//   apple-uc  UC QPs only (RC: EINVAL); at most TBVSIM_MAX_QPS (10) per device,
//             counted over every process that uses the device (its address);
//             only IBV_WR_SEND, one SGE; queues counted in 4 KiB frames (at most
//             4095); messages up to 16,773,120 B; sender and receiver must use
//             the same number of frames, else the receive completes with
//             IBV_WC_LOC_LEN_ERR and the QP goes to ERR; an unmatched SEND is
//             held until a receive is posted; post_recv before RTS is EINVAL;
//             an RTR to the device's own GID is EINVAL (no loopback).
//   linux-uc  UC only (RC: EOPNOTSUPP); an unmatched SEND is silently DROPPED
//             and the sender still sees success.
//   linux-rc  RC and UC; an unmatched SEND on RC is held (RNR retry forever);
//             a receive may be larger than the send.
// Every profile: each SGE inside a registered MR of the QP's PD with that
// lkey (else IBV_WC_LOC_PROT_ERR and ERR); posts checked against the QP
// state; ERR flushes outstanding WRs with IBV_WC_WR_FLUSH_ERR; a dead peer
// gives no error on UC (apple: the send stays pending; linux-uc: completes);
// on RC it gives IBV_WC_RETRY_EXC_ERR.
//
// GIDs (gid_entry): apple-uc lists one untyped ::ffff: entry at index 1; the
// Linux profiles list each address as RoCE v1 then v2 (mlx5's table), or v1
// only (TBVSIM_GID_TYPES=v1), or an InfiniBand port's subnet-prefix + GUID
// (TBVSIM_LINK=ib). Types answer through _ibv_query_gid_ex (TBVSIM_GID_EX=0:
// it refuses, as a library without it) and, with TBVSIM_SYSFS=DIR, through
// the kernel's gid_attrs/types files written there (ibdev_path). Every frame
// carries the type of the GID its QP sends from: a RoCE v1 frame reaches no
// address outside the sender's subnet (TBVSIM_ADDR=a.b.c.d/NN, /24 unless
// said: no router forwards an Ethernet frame), and a port takes no frame of a
// type it has no GID of (a v1-only NIC does not parse RoCE v2's UDP). RTR
// checks neither, as on hardware: the frames are simply lost.
//
// Configuration (read when the device list is taken): TBVSIM_DIR (required;
// namespaces the sockets), TBVSIM_PROFILE, TBVSIM_DEVICE (name, default
// simbolt0), TBVSIM_DEVICES=0 (the library lists no device), TBVSIM_ADDR (the
// IPv4 address whose ::ffff: GID is index 1, default 127.0.0.1; "none": the
// interface has no IPv4 address, so that GID is empty, as on a Mac whose enN
// has none yet), TBVSIM_PORT=down|init|armed (port 1's state, default
// active), TBVSIM_MAX_QPS (per device), TBVSIM_QPS_USED=N (QPs held on
// the device outside this TBVSIM_DIR: its processes share MAX_QPS - N),
// TBVSIM_OPEN_ERRNO=N (ibv_open_device fails with errno N, as it does with
// EACCES when /dev/infiniband/uverbs* is not accessible), TBVSIM_FAIL_RTR=1,
// TBVSIM_FAULT=drop:N | corrupt:N[:OFFSET] (the Nth message this process
// receives, 1-based; corrupt flips the byte at OFFSET, default 80: the first
// payload byte of a tbrpc frame) | unreachable (RTR accepts the peer's GID but
// nothing this QP sends reaches it, as with a stale APIPA GID, RoCE v1 on one
// end and v2 on the other, or a cable to another machine: no NIC checks the
// path at RTR; UC sends vanish or, on apple, stay pending; RC retries out).
#define _GNU_SOURCE
#include <infiniband/verbs.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#undef ibv_get_device_list
#undef ibv_reg_mr
#undef ibv_query_port

#define EXPORT __attribute__((visibility("default")))
#define FRAME 4096u
#define APPLE_MAX_MSG 16773120u
#define MAX_MRS 100

enum { APPLE_UC = 1, LINUX_RC, LINUX_UC };

static struct {
    int profile;
    char dir[256];
    char device[64];
    struct in_addr addr;
    int prefix;           // the address's subnet (TBVSIM_ADDR=a.b.c.d/NN, default 24)
    int gid_layout;       // 0 apple, 1 RoCE v1 + v2 (mlx5), 2 RoCE v1 only, 3 InfiniBand
    int gid_ex;           // _ibv_query_gid_ex answers (0: refuses, as a library without it)
    char sysfs[200];      // TBVSIM_SYSFS: where this device's sysfs GID types are written (ibdev_path)
    int port_state, max_qps, qps_used, fail_rtr, devices, open_errno, no_addr;
    int fault;            // 0 none, 1 drop, 2 corrupt, 3 unreachable
    unsigned fault_n, fault_off;
} cfg;

static void read_config(void) {
    const char * p = getenv("TBVSIM_PROFILE");
    cfg.profile = p && !strcmp(p, "apple-uc") ? APPLE_UC : p && !strcmp(p, "linux-uc") ? LINUX_UC : LINUX_RC;
    snprintf(cfg.dir, sizeof cfg.dir, "%s", getenv("TBVSIM_DIR") ? getenv("TBVSIM_DIR") : "default");
    snprintf(cfg.device, sizeof cfg.device, "%s", getenv("TBVSIM_DEVICE") ? getenv("TBVSIM_DEVICE") : "simbolt0");
    char addr[64] = "127.0.0.1";
    if (getenv("TBVSIM_ADDR")) snprintf(addr, sizeof addr, "%s", getenv("TBVSIM_ADDR"));
    char * slash = strchr(addr, '/');
    cfg.prefix = slash ? atoi(slash + 1) : 24;
    if (cfg.prefix < 0 || cfg.prefix > 32) cfg.prefix = 24;
    if (slash) *slash = 0;
    cfg.no_addr = !strcmp(addr, "none");
    if (cfg.no_addr) memset(&cfg.addr, 0, sizeof cfg.addr);
    else if (inet_pton(AF_INET, addr, &cfg.addr) != 1) inet_pton(AF_INET, "127.0.0.1", &cfg.addr);
    const char * types = getenv("TBVSIM_GID_TYPES");
    const char * link = getenv("TBVSIM_LINK");
    cfg.gid_layout = link && !strcmp(link, "ib") ? 3 : cfg.profile == APPLE_UC ? 0 : types && !strcmp(types, "v1") ? 2 : 1;
    cfg.gid_ex = cfg.profile != APPLE_UC && !(getenv("TBVSIM_GID_EX") && !atoi(getenv("TBVSIM_GID_EX")));
    snprintf(cfg.sysfs, sizeof cfg.sysfs, "%s", cfg.profile != APPLE_UC && getenv("TBVSIM_SYSFS") ? getenv("TBVSIM_SYSFS") : "");
    const char * port = getenv("TBVSIM_PORT");
    cfg.port_state = !port ? IBV_PORT_ACTIVE : !strcmp(port, "down") ? IBV_PORT_DOWN : !strcmp(port, "init") ? IBV_PORT_INIT
                   : !strcmp(port, "armed") ? IBV_PORT_ARMED : IBV_PORT_ACTIVE;
    cfg.max_qps = getenv("TBVSIM_MAX_QPS") ? atoi(getenv("TBVSIM_MAX_QPS")) : (cfg.profile == APPLE_UC ? 10 : 64);
    cfg.qps_used = getenv("TBVSIM_QPS_USED") ? atoi(getenv("TBVSIM_QPS_USED")) : 0;
    cfg.devices = getenv("TBVSIM_DEVICES") ? atoi(getenv("TBVSIM_DEVICES")) != 0 : 1;
    cfg.open_errno = getenv("TBVSIM_OPEN_ERRNO") ? atoi(getenv("TBVSIM_OPEN_ERRNO")) : 0;
    cfg.fail_rtr = getenv("TBVSIM_FAIL_RTR") && atoi(getenv("TBVSIM_FAIL_RTR"));
    cfg.fault = 0;
    cfg.fault_off = 80;
    const char * f = getenv("TBVSIM_FAULT");
    if (f && !strncmp(f, "drop:", 5)) { cfg.fault = 1; cfg.fault_n = (unsigned) atoi(f + 5); }
    if (f && !strcmp(f, "unreachable")) cfg.fault = 3;   // RTR takes the peer's GID, but no path leads there
    if (f && !strncmp(f, "corrupt:", 8)) {
        cfg.fault = 2;
        cfg.fault_n = (unsigned) atoi(f + 8);
        const char * o = strchr(f + 8, ':');
        if (o) cfg.fault_off = (unsigned) atoi(o + 1);
    }
}

struct sim_wr { uint64_t wr_id; uintptr_t addr; uint32_t len; uint64_t hash; struct sim_qp * qp; struct sim_wr * next; };
struct sim_msg { uint32_t len; uint8_t * data; struct sim_msg * next; };

struct sim_cq {
    struct ibv_cq cq;
    struct ibv_wc * q;
    int cap, head, count, armed;
};

struct sim_channel { struct ibv_comp_channel ch; int wfd; struct sim_cq * cq; };

struct sim_qp {
    struct ibv_qp qp;
    int dead;
    int listen_fd, in_fd, out_fd;
    int budget_fd;                     // holds one of the device's QP places (claim_qp_place)
    union ibv_gid dgid;
    int sgid_type;                     // the type of the GID it sends from (RTR's sgid_index): its frames' encapsulation
    uint32_t max_send, max_recv;       // in frames (apple) or WRs
    uint32_t send_used, recv_used;
    struct sim_wr * rq_head, * rq_tail;
    struct sim_msg * held_head, * held_tail;
    struct sim_qp * next;
};

struct sim_ctx {
    struct ibv_context ctx;
    pthread_mutex_t lock;              // everything of this context
    pthread_cond_t tx_cond;
    pthread_t rx_thread, tx_thread;
    int wake[2];                       // tells rx to rebuild its poll set
    int stop;
    struct sim_qp * qps;
    int live_qps, mrs;
    struct sim_wr * tx_head, * tx_tail;
    unsigned msgs_in;
    uint32_t rng;
};

static struct ibv_device sim_device;
static struct ibv_device * sim_list[2];
static uint32_t qp_counter;

static int frames(uint32_t len) { return len == 0 ? 1 : (int) ((len + FRAME - 1) / FRAME); }
static int apple(void) { return cfg.profile == APPLE_UC; }

static uint64_t hash_bytes(const void * p, size_t n) {
    const uint8_t * b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

// The port's GID table, as each layout lists it:
//   apple  [0] fe80::a.b.c.d, [1] ::ffff:a.b.c.d (TN3205's index 1), no types
//   v1v2   [0] fe80 v1, [1] fe80 v2, [2] ::ffff v1, [3] ::ffff v2 (mlx5: every address twice, v1 first)
//   v1     [0] fe80 v1, [1] ::ffff v1 (a NIC or kernel that speaks RoCE v1 only)
//   ib     [0] fe80::<port GUID> (subnet prefix + GUID: no address in it)
// An interface without an IPv4 address has no ::ffff: entry (all zero).
// 0 and the entry, or -1 past the table.
static int table_len(void) { return cfg.gid_layout == 1 ? 4 : cfg.gid_layout == 3 ? 1 : 2; }

static int gid_entry(int index, union ibv_gid * g, int * type) {
    memset(g, 0, sizeof *g);
    *type = IBV_GID_TYPE_IB;
    if (index < 0 || index >= table_len()) return -1;
    if (cfg.gid_layout == 3) {
        g->raw[0] = 0xfe; g->raw[1] = 0x80;
        g->raw[8] = 0x0c; g->raw[9] = 0x42; g->raw[10] = 0xa1;   // a GUID that holds no IP address
        memcpy(g->raw + 12, &cfg.addr, 4);
        g->raw[11] = 0x5e;
        return 0;
    }
    const int mapped = cfg.gid_layout == 1 ? index >= 2 : index == 1;
    *type = cfg.gid_layout == 1 && index % 2 == 1 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1;
    if (!mapped) {
        g->raw[0] = 0xfe; g->raw[1] = 0x80;
        memcpy(g->raw + 12, &cfg.addr, 4);
    } else if (!cfg.no_addr) {
        g->raw[10] = g->raw[11] = 0xff;
        memcpy(g->raw + 12, &cfg.addr, 4);
    }
    return 0;
}

// The GID that names this port's QPs to peers (their sockets, the device's QP places).
static void port_gid(union ibv_gid * g) {
    int type;
    gid_entry(cfg.gid_layout == 1 ? 2 : cfg.gid_layout == 3 ? 0 : 1, g, &type);
}

// What a port speaks on the wire: a frame of a GID type it has no entry of is not taken
// (a v1-only NIC does not parse RoCE v2's UDP; Apple's frames have no type to differ in).
static int port_speaks(int type) {
    if (cfg.gid_layout == 0 || cfg.gid_layout == 3) return 1;
    return type == IBV_GID_TYPE_ROCE_V1 || (type == IBV_GID_TYPE_ROCE_V2 && cfg.gid_layout == 1);
}

// Whether a RoCE v1 frame from this port reaches `dgid`: v1 is an Ethernet frame
// (ethertype 0x8915) that no router forwards, so only an address in this port's
// own subnet is reached. v2 is UDP/IP and goes anywhere IP goes.
static int v1_reaches(const union ibv_gid * dgid) {
    static const uint8_t mapped[12] = { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff };
    if (memcmp(dgid->raw, mapped, 12) != 0) return 1;   // link-local or IPv6: not modelled
    uint32_t a, b;
    memcpy(&a, dgid->raw + 12, 4);
    memcpy(&b, &cfg.addr, 4);
    const uint32_t mask = cfg.prefix == 0 ? 0 : htonl(~0u << (32 - cfg.prefix));
    return (a & mask) == (b & mask);
}

// The kernel's GID type files (/sys/class/infiniband/<dev>/ports/1/gid_attrs/types/<i>),
// under TBVSIM_SYSFS, for a library that reads them (ibdev_path points there).
static void write_sysfs(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s/ports/1/gid_attrs/types", cfg.sysfs, cfg.device);
    for (char * p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        mkdir(path, 0755);
        *p = '/';
    }
    mkdir(path, 0755);
    for (int i = 0; i < table_len(); i++) {
        union ibv_gid g;
        int type;
        static const union ibv_gid zero;
        char file[600];
        snprintf(file, sizeof file, "%s/%d", path, i);
        if (gid_entry(i, &g, &type) != 0 || !memcmp(&g, &zero, sizeof g)) { unlink(file); continue; }
        FILE * f = fopen(file, "w");
        if (!f) continue;
        fputs(type == IBV_GID_TYPE_ROCE_V2 ? "RoCE v2\n" : "IB/RoCE v1\n", f);
        fclose(f);
    }
}

// A device's QPs are counted over every process that uses it, as hardware
// counts them: each live QP holds one of max_qps places, an abstract Unix
// socket name per device and index, which the kernel frees when the QP's
// process dies. The descriptor holding the place, or -1 when all are taken.
static int claim_qp_place(const union ibv_gid * gid) {
    for (int k = 0; k < cfg.max_qps - cfg.qps_used; k++) {   // TBVSIM_QPS_USED: held outside this fabric
        struct sockaddr_un a;
        memset(&a, 0, sizeof a);
        a.sun_family = AF_UNIX;
        int n = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "tbvsim-%016llx-%08x-qp-place-%d",
                         (unsigned long long) hash_bytes(cfg.dir, strlen(cfg.dir)), (unsigned) hash_bytes(gid->raw, 16), k);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) return -1;
        if (bind(fd, (struct sockaddr *) &a, (socklen_t) (offsetof(struct sockaddr_un, sun_path) + 1 + n)) == 0) return fd;
        close(fd);
    }
    return -1;
}

static void sock_name(struct sockaddr_un * a, socklen_t * len, const union ibv_gid * gid, uint32_t qpn) {
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "tbvsim-%016llx-%08x-%06x",
                     (unsigned long long) hash_bytes(cfg.dir, strlen(cfg.dir)),
                     (unsigned) hash_bytes(gid->raw, 16), qpn);
    *len = (socklen_t) (offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

// --- completions ---------------------------------------------------------------

static void fire(struct sim_cq * cq) {   // an armed CQ with a channel signals it once
    if (cq->armed && cq->cq.channel) {
        cq->armed = 0;
        struct sim_channel * ch = (struct sim_channel *) cq->cq.channel;
        char b = 1;
        if (write(ch->wfd, &b, 1) < 0) {}
    }
}

static void push_cqe(struct sim_cq * cq, uint64_t wr_id, enum ibv_wc_status st, enum ibv_wc_opcode op, uint32_t len, uint32_t qpn) {
    if (cq->count == cq->cap) { fprintf(stderr, "verbs_sim: CQ overrun (%d entries)\n", cq->cap); return; }
    struct ibv_wc * w = &cq->q[(cq->head + cq->count) % cq->cap];
    memset(w, 0, sizeof *w);
    w->wr_id = wr_id;
    w->status = st;
    w->opcode = op;
    w->byte_len = len;
    w->qp_num = qpn;
    cq->count++;
    fire(cq);
}

static void to_error(struct sim_qp * q) {   // ctx lock held
    q->qp.state = IBV_QPS_ERR;
    for (struct sim_wr * w = q->rq_head, * n; w; w = n) {
        n = w->next;
        push_cqe((struct sim_cq *) q->qp.recv_cq, w->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, q->qp.qp_num);
        free(w);
    }
    q->rq_head = q->rq_tail = NULL;
    q->recv_used = 0;
}

static int sim_poll_cq(struct ibv_cq * cq_, int n, struct ibv_wc * wc) {
    struct sim_cq * cq = (struct sim_cq *) cq_;
    struct sim_ctx * c = (struct sim_ctx *) cq_->context;
    pthread_mutex_lock(&c->lock);
    int k = 0;
    while (k < n && cq->count > 0) {
        wc[k++] = cq->q[cq->head];
        cq->head = (cq->head + 1) % cq->cap;
        cq->count--;
    }
    pthread_mutex_unlock(&c->lock);
    return k;
}

static int sim_req_notify_cq(struct ibv_cq * cq_, int solicited) {
    struct sim_cq * cq = (struct sim_cq *) cq_;
    struct sim_ctx * c = (struct sim_ctx *) cq_->context;
    pthread_mutex_lock(&c->lock);
    cq->armed = 1;
    if (cq->count > 0) fire(cq);   // entries wait already: wake the sleeper at once
    pthread_mutex_unlock(&c->lock);
    return 0;
}

// --- memory checks -------------------------------------------------------------

struct sim_mr { struct ibv_mr mr; struct sim_mr * next; };
static struct sim_mr * all_mrs;   // guarded by mr_lock
static pthread_mutex_t mr_lock = PTHREAD_MUTEX_INITIALIZER;

static int sge_ok(struct ibv_pd * pd, const struct ibv_sge * s) {
    int ok = 0;
    pthread_mutex_lock(&mr_lock);
    for (struct sim_mr * m = all_mrs; m && !ok; m = m->next) {
        ok = m->mr.lkey == s->lkey && m->mr.pd == pd && s->addr >= (uintptr_t) m->mr.addr &&
             s->addr + s->length <= (uintptr_t) m->mr.addr + m->mr.length;
    }
    pthread_mutex_unlock(&mr_lock);
    return ok;
}

// --- receive matching (ctx lock held) -------------------------------------------

static void deliver(struct sim_qp * q, struct sim_msg * m) {
    struct sim_wr * w = q->rq_head;
    q->rq_head = w->next;
    if (!q->rq_head) q->rq_tail = NULL;
    q->recv_used -= apple() ? (uint32_t) frames(w->len) : 1;
    struct sim_cq * cq = (struct sim_cq *) q->qp.recv_cq;
    int bad_len = apple() ? frames(m->len) != frames(w->len) : m->len > w->len;
    if (bad_len) {
        push_cqe(cq, w->wr_id, IBV_WC_LOC_LEN_ERR, IBV_WC_RECV, 0, q->qp.qp_num);
        free(w);
        to_error(q);
        return;
    }
    memcpy((void *) w->addr, m->data, m->len);
    push_cqe(cq, w->wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, m->len, q->qp.qp_num);
    free(w);
}

// Held SENDs meet the receives posted, in order, while the QP lives.
static void deliver_held(struct sim_qp * q) {
    while (q->held_head && q->rq_head && q->qp.state != IBV_QPS_ERR) {
        struct sim_msg * h = q->held_head;
        q->held_head = h->next;
        if (!q->held_head) q->held_tail = NULL;
        deliver(q, h);
        free(h->data);
        free(h);
    }
}

static void arrive(struct sim_ctx * c, struct sim_qp * q, struct sim_msg * m) {
    c->msgs_in++;
    if (cfg.fault && c->msgs_in == cfg.fault_n) {
        if (cfg.fault == 1) { free(m->data); free(m); return; }   // lost on the wire
        if (m->len > 0) m->data[cfg.fault_off < m->len ? cfg.fault_off : m->len - 1] ^= 0x5a;
    }
    if (q->qp.state != IBV_QPS_RTR && q->qp.state != IBV_QPS_RTS) { free(m->data); free(m); return; }
    if (!q->rq_head && q->qp.qp_type == IBV_QPT_UC && !apple()) { free(m->data); free(m); return; }   // linux UC: dropped
    if (!q->rq_head || q->held_head) {   // held (RC: RNR retry; Apple: credit-based flow control)
        m->next = NULL;
        if (q->held_tail) q->held_tail->next = m; else q->held_head = m;
        q->held_tail = m;
        deliver_held(q);
        return;
    }
    deliver(q, m);
    free(m->data);
    free(m);
}

static int read_full(int fd, void * p, size_t n) {
    uint8_t * b = p;
    while (n > 0) {
        ssize_t k = read(fd, b, n);
        if (k > 0) { b += k; n -= (size_t) k; continue; }
        if (k < 0 && errno == EINTR) continue;
        return -1;
    }
    return 0;
}

static void * rx_main(void * arg) {
    struct sim_ctx * c = arg;
    for (;;) {
        struct pollfd p[130];
        struct sim_qp * who[130];
        int n = 0;
        pthread_mutex_lock(&c->lock);
        if (c->stop) { pthread_mutex_unlock(&c->lock); return NULL; }
        p[n] = (struct pollfd) { .fd = c->wake[0], .events = POLLIN }; who[n++] = NULL;
        for (struct sim_qp * q = c->qps; q && n < 128; q = q->next) {
            if (q->dead) continue;
            if (q->in_fd >= 0) { p[n] = (struct pollfd) { .fd = q->in_fd, .events = POLLIN }; who[n++] = q; }
            else if (q->listen_fd >= 0) { p[n] = (struct pollfd) { .fd = q->listen_fd, .events = POLLIN }; who[n++] = q; }
        }
        pthread_mutex_unlock(&c->lock);
        if (poll(p, (nfds_t) n, 100) <= 0) continue;
        if (p[0].revents) { char b[64]; if (read(c->wake[0], b, sizeof b) < 0) {} }
        for (int i = 1; i < n; i++) {
            if (!p[i].revents) continue;
            struct sim_qp * q = who[i];
            if (p[i].fd == q->listen_fd) {
                int fd = accept(q->listen_fd, NULL, NULL);
                pthread_mutex_lock(&c->lock);
                if (fd >= 0 && q->in_fd < 0 && !q->dead) q->in_fd = fd; else if (fd >= 0) close(fd);
                pthread_mutex_unlock(&c->lock);
                continue;
            }
            uint32_t len, type;
            struct sim_msg * m = NULL;
            if (read_full(q->in_fd, &len, 4) == 0 && read_full(q->in_fd, &type, 4) == 0 && (m = calloc(1, sizeof *m)) &&
                (m->data = malloc(len ? len : 1)) && read_full(q->in_fd, m->data, len) == 0) {
                m->len = len;
                pthread_mutex_lock(&c->lock);
                // a frame this port does not speak never reaches a QP (UC: gone; RC: no ACK, the sender retries out)
                if (!q->dead && port_speaks((int) type)) arrive(c, q, m); else { free(m->data); free(m); }
                pthread_mutex_unlock(&c->lock);
            } else {   // the peer is gone: UC says nothing
                if (m) { free(m->data); free(m); }
                pthread_mutex_lock(&c->lock);
                shutdown(q->in_fd, SHUT_RDWR);
                q->in_fd = -2;   // closed at close_device
                pthread_mutex_unlock(&c->lock);
            }
        }
    }
}

static void * tx_main(void * arg) {
    struct sim_ctx * c = arg;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        while (!c->stop && !c->tx_head) pthread_cond_wait(&c->tx_cond, &c->lock);
        if (c->stop) break;
        struct sim_wr * w = c->tx_head;
        c->tx_head = w->next;
        if (!c->tx_head) c->tx_tail = NULL;
        struct sim_qp * q = w->qp;
        pthread_mutex_unlock(&c->lock);
        c->rng = c->rng * 1103515245u + 12345u;
        struct timespec ts = { 0, (long) ((c->rng >> 16) % 30) * 1000 };   // the NIC reads late
        nanosleep(&ts, NULL);
        uint8_t * copy = malloc(w->len + 8);
        const uint32_t type = (uint32_t) q->sgid_type;
        memcpy(copy, &w->len, 4);
        memcpy(copy + 4, &type, 4);
        memcpy(copy + 8, (void *) w->addr, w->len);
        if (hash_bytes(copy + 8, w->len) != w->hash) {
            fprintf(stderr, "verbs_sim: QP %06x: send buffer %llu changed before its completion\n", q->qp.qp_num,
                    (unsigned long long) w->wr_id);
        }
        int sent = 0;
        if (q->out_fd >= 0 && !q->dead && q->qp.state == IBV_QPS_RTS) {
            size_t off = 0, total = w->len + 8;
            while (off < total) {
                ssize_t k = send(q->out_fd, copy + off, total - off, MSG_NOSIGNAL);
                if (k > 0) { off += (size_t) k; continue; }
                if (k < 0 && errno == EINTR) continue;
                break;
            }
            sent = off == total;
        }
        free(copy);
        pthread_mutex_lock(&c->lock);
        q->send_used -= apple() ? (uint32_t) frames(w->len) : 1;
        struct sim_cq * cq = (struct sim_cq *) q->qp.send_cq;
        if (q->dead) {}
        else if (q->qp.state == IBV_QPS_ERR) push_cqe(cq, w->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_SEND, 0, q->qp.qp_num);
        else if (sent || cfg.profile == LINUX_UC) push_cqe(cq, w->wr_id, IBV_WC_SUCCESS, IBV_WC_SEND, 0, q->qp.qp_num);
        else if (q->qp.qp_type == IBV_QPT_RC) push_cqe(cq, w->wr_id, IBV_WC_RETRY_EXC_ERR, IBV_WC_SEND, 0, q->qp.qp_num);
        // apple with no peer: the send stays pending forever, as observed
        free(w);
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

// --- posts -----------------------------------------------------------------------

// One work request posted, send or receive: the rules every post obeys, in
// the order they are checked: the QP state (a send only in RTS; a receive in
// any state but RESET, on Apple only in RTS or ERR), one SGE (a send on Linux
// may have none), Apple's largest message, room in the queue (Apple counts
// frames, Linux WRs). A WR they let through is taken: a receive in ERR
// completes flushed; an SGE outside a registered MR of the QP's PD with that
// lkey completes with IBV_WC_LOC_PROT_ERR and puts the QP in ERR; else it is
// queued (a send to the NIC's tx thread, which reads its buffer late).
// 0 (taken), or the errno that refuses it and the WRs after it. ctx lock held.
static int post_one(struct sim_qp * q, int send, uint64_t wr_id, const struct ibv_sge * sge, int num_sge) {
    struct ibv_qp * qp = &q->qp;
    int state_ok = send ? qp->state == IBV_QPS_RTS
                        : qp->state != IBV_QPS_RESET && (!apple() || qp->state == IBV_QPS_RTS || qp->state == IBV_QPS_ERR);
    if (!state_ok) return EINVAL;
    if (num_sge > 1 || (num_sge != 1 && (apple() || !send))) return EINVAL;
    uint32_t len = num_sge ? sge[0].length : 0;
    if (apple() && len > APPLE_MAX_MSG) return EINVAL;
    uint32_t cost = apple() ? (uint32_t) frames(len) : 1;
    uint32_t * used = send ? &q->send_used : &q->recv_used;
    if (*used + cost > (send ? q->max_send : q->max_recv)) return ENOMEM;
    struct sim_cq * cq = (struct sim_cq *) (send ? qp->send_cq : qp->recv_cq);
    enum ibv_wc_opcode op = send ? IBV_WC_SEND : IBV_WC_RECV;
    if (qp->state == IBV_QPS_ERR) {   // a receive: a send in ERR was refused above
        push_cqe(cq, wr_id, IBV_WC_WR_FLUSH_ERR, op, 0, qp->qp_num);
        return 0;
    }
    if (num_sge && !sge_ok(qp->pd, &sge[0])) {
        push_cqe(cq, wr_id, IBV_WC_LOC_PROT_ERR, op, 0, qp->qp_num);
        to_error(q);
        return 0;
    }
    struct sim_wr * w = calloc(1, sizeof *w);
    if (!w) return ENOMEM;
    w->wr_id = wr_id;
    w->addr = num_sge ? (uintptr_t) sge[0].addr : 0;
    w->len = len;
    w->qp = q;
    *used += cost;
    if (!send) {
        if (q->rq_tail) q->rq_tail->next = w; else q->rq_head = w;
        q->rq_tail = w;
        return 0;
    }
    struct sim_ctx * c = (struct sim_ctx *) qp->context;
    w->hash = hash_bytes((void *) w->addr, len);
    if (c->tx_tail) c->tx_tail->next = w; else c->tx_head = w;
    c->tx_tail = w;
    pthread_cond_signal(&c->tx_cond);
    return 0;
}

static int sim_post_recv(struct ibv_qp * qp, struct ibv_recv_wr * wr, struct ibv_recv_wr ** bad) {
    struct sim_qp * q = (struct sim_qp *) qp;
    struct sim_ctx * c = (struct sim_ctx *) qp->context;
    pthread_mutex_lock(&c->lock);
    int rc = 0;
    while (wr && (rc = post_one(q, 0, wr->wr_id, wr->sg_list, wr->num_sge)) == 0) wr = wr->next;
    deliver_held(q);   // held SENDs meet the receives now posted
    pthread_mutex_unlock(&c->lock);
    if (rc && bad) *bad = wr;
    return apple() ? -rc : rc;   // Apple's posts return a negative errno (observed: "ibv_post_recv ... ret=-12")
}

static int sim_post_send(struct ibv_qp * qp, struct ibv_send_wr * wr, struct ibv_send_wr ** bad) {
    struct sim_qp * q = (struct sim_qp *) qp;
    struct sim_ctx * c = (struct sim_ctx *) qp->context;
    pthread_mutex_lock(&c->lock);
    int rc = 0;
    for (; wr; wr = wr->next) {
        int opcode_ok = wr->opcode == IBV_WR_SEND || (!apple() && wr->opcode == IBV_WR_SEND_WITH_IMM);
        rc = opcode_ok ? post_one(q, 1, wr->wr_id, wr->sg_list, wr->num_sge) : EINVAL;
        if (rc) break;
    }
    pthread_mutex_unlock(&c->lock);
    if (rc && bad) *bad = wr;
    return apple() ? -rc : rc;
}

// --- setup verbs -------------------------------------------------------------------

EXPORT struct ibv_device ** ibv_get_device_list(int * num) {
    read_config();
    snprintf(sim_device.name, sizeof sim_device.name, "%s", cfg.device);
    snprintf(sim_device.dev_name, sizeof sim_device.dev_name, "uverbs-sim");
    sim_device.node_type = IBV_NODE_CA;
    sim_device.transport_type = IBV_TRANSPORT_IB;
    sim_device.ibdev_path[0] = 0;
    if (cfg.sysfs[0]) {
        write_sysfs();
        snprintf(sim_device.ibdev_path, sizeof sim_device.ibdev_path, "%s/%s", cfg.sysfs, cfg.device);
    }
    sim_list[0] = cfg.devices ? &sim_device : NULL;
    sim_list[1] = NULL;
    if (num) *num = cfg.devices;
    return sim_list;
}

EXPORT void ibv_free_device_list(struct ibv_device ** list) { (void) list; }
EXPORT const char * ibv_get_device_name(struct ibv_device * d) { return d->name; }
EXPORT int ibv_fork_init(void) { return 0; }

EXPORT struct ibv_context * ibv_open_device(struct ibv_device * dev) {
    if (cfg.open_errno) { errno = cfg.open_errno; return NULL; }
    struct sim_ctx * c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->ctx.device = dev;
    c->ctx.cmd_fd = -1;
    c->ctx.async_fd = -1;
    c->ctx.num_comp_vectors = 1;
    c->ctx.ops.poll_cq = sim_poll_cq;
    c->ctx.ops.req_notify_cq = sim_req_notify_cq;
    c->ctx.ops.post_send = sim_post_send;
    c->ctx.ops.post_recv = sim_post_recv;
    c->rng = (uint32_t) getpid();
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->tx_cond, NULL);
    if (pipe(c->wake) != 0) { free(c); return NULL; }
    fcntl(c->wake[0], F_SETFL, O_NONBLOCK);
    pthread_create(&c->rx_thread, NULL, rx_main, c);
    pthread_create(&c->tx_thread, NULL, tx_main, c);
    return &c->ctx;
}

EXPORT int ibv_close_device(struct ibv_context * ctx) {
    struct sim_ctx * c = (struct sim_ctx *) ctx;
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    pthread_cond_broadcast(&c->tx_cond);
    pthread_mutex_unlock(&c->lock);
    char b = 1;
    if (write(c->wake[1], &b, 1) < 0) {}
    pthread_join(c->rx_thread, NULL);
    pthread_join(c->tx_thread, NULL);
    for (struct sim_qp * q = c->qps, * n; q; q = n) {
        n = q->next;
        if (q->listen_fd >= 0) close(q->listen_fd);
        if (q->in_fd >= 0) close(q->in_fd);
        if (q->out_fd >= 0) close(q->out_fd);
        if (q->budget_fd >= 0) close(q->budget_fd);
        free(q);
    }
    close(c->wake[0]);
    close(c->wake[1]);
    free(c);
    return 0;
}

EXPORT int ibv_query_device(struct ibv_context * ctx, struct ibv_device_attr * a) {
    memset(a, 0, sizeof *a);
    a->max_qp = cfg.max_qps;   // the device's limit, whoever holds them
    a->max_qp_wr = apple() ? 4095 : 16384;
    a->max_sge = 1;
    a->max_cqe = 65536;
    a->max_mr = MAX_MRS;
    a->max_pd = 64;
    a->phys_port_cnt = 1;
    return 0;
}

EXPORT int ibv_query_port(struct ibv_context * ctx, uint8_t port, struct _compat_ibv_port_attr * out) {
    struct ibv_port_attr * a = (struct ibv_port_attr *) out;
    if (port != 1) return EINVAL;
    memset(a, 0, sizeof *a);
    a->state = cfg.port_state;
    a->max_mtu = IBV_MTU_4096;
    a->active_mtu = apple() ? IBV_MTU_4096 : IBV_MTU_1024;
    a->gid_tbl_len = table_len();
    a->max_msg_sz = apple() ? APPLE_MAX_MSG : 1u << 30;
    a->link_layer = cfg.gid_layout == 3 ? IBV_LINK_LAYER_INFINIBAND : IBV_LINK_LAYER_ETHERNET;
    if (cfg.gid_layout == 3) a->lid = (uint16_t) (1 + ((const uint8_t *) &cfg.addr)[3]);   // from the subnet manager
    a->active_width = 8;    // 8X
    a->active_speed = 0x40; // reported as in TN3205's ibv_devinfo; not modelled further
    return 0;
}

EXPORT int ibv_query_gid(struct ibv_context * ctx, uint8_t port, int index, union ibv_gid * gid) {
    int type;
    return port != 1 || gid_entry(index, gid, &type) != 0 ? -1 : 0;
}

// rdma-core v30+'s GID query with its type; Apple's librdma and older libibverbs
// have none (here: it refuses, and a caller falls back as it would without the symbol).
EXPORT int _ibv_query_gid_ex(struct ibv_context * ctx, uint32_t port, uint32_t index, struct ibv_gid_entry * e,
                             uint32_t flags, size_t size) {
    (void) ctx;
    if (!cfg.gid_ex) return EOPNOTSUPP;
    if (port != 1 || flags != 0 || size < sizeof *e) return EINVAL;
    int type;
    union ibv_gid g;
    static const union ibv_gid zero;
    if (gid_entry((int) index, &g, &type) != 0) return EINVAL;
    if (!memcmp(&g, &zero, sizeof g)) return ENODATA;
    memset(e, 0, sizeof *e);
    e->gid = g;
    e->gid_index = index;
    e->port_num = port;
    e->gid_type = (uint32_t) type;
    return 0;
}

EXPORT struct ibv_pd * ibv_alloc_pd(struct ibv_context * ctx) {
    struct ibv_pd * pd = calloc(1, sizeof *pd);
    if (pd) pd->context = ctx;
    return pd;
}

EXPORT int ibv_dealloc_pd(struct ibv_pd * pd) { free(pd); return 0; }

EXPORT struct ibv_mr * ibv_reg_mr(struct ibv_pd * pd, void * addr, size_t len, int access) {
    struct sim_ctx * c = (struct sim_ctx *) pd->context;
    static uint32_t next_key = 0x1000;
    pthread_mutex_lock(&c->lock);
    int full = c->mrs >= MAX_MRS;
    if (!full) c->mrs++;
    pthread_mutex_unlock(&c->lock);
    if (full) { errno = ENOMEM; return NULL; }
    struct sim_mr * m = calloc(1, sizeof *m);
    m->mr.context = pd->context;
    m->mr.pd = pd;
    m->mr.addr = addr;
    m->mr.length = len;
    pthread_mutex_lock(&mr_lock);
    m->mr.lkey = m->mr.rkey = next_key += 0x101;
    m->next = all_mrs;
    all_mrs = m;
    pthread_mutex_unlock(&mr_lock);
    return &m->mr;
}

EXPORT struct ibv_mr * ibv_reg_mr_iova2(struct ibv_pd * pd, void * addr, size_t len, uint64_t iova, unsigned int access) {
    return ibv_reg_mr(pd, addr, len, (int) access);
}

EXPORT int ibv_dereg_mr(struct ibv_mr * mr) {
    struct sim_ctx * c = (struct sim_ctx *) mr->context;
    pthread_mutex_lock(&mr_lock);
    for (struct sim_mr ** p = &all_mrs; *p; p = &(*p)->next) {
        if (&(*p)->mr == mr) { struct sim_mr * m = *p; *p = m->next; free(m); break; }
    }
    pthread_mutex_unlock(&mr_lock);
    pthread_mutex_lock(&c->lock);
    c->mrs--;
    pthread_mutex_unlock(&c->lock);
    return 0;
}

EXPORT struct ibv_comp_channel * ibv_create_comp_channel(struct ibv_context * ctx) {
    struct sim_channel * ch = calloc(1, sizeof *ch);
    int p[2];
    if (!ch || pipe(p) != 0) { free(ch); return NULL; }
    ch->ch.context = ctx;
    ch->ch.fd = p[0];
    ch->wfd = p[1];
    return &ch->ch;
}

EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel * ch_) {
    struct sim_channel * ch = (struct sim_channel *) ch_;
    close(ch->ch.fd);
    close(ch->wfd);
    free(ch);
    return 0;
}

EXPORT int ibv_get_cq_event(struct ibv_comp_channel * ch_, struct ibv_cq ** cq, void ** cq_context) {
    struct sim_channel * ch = (struct sim_channel *) ch_;
    char b;
    if (read(ch->ch.fd, &b, 1) != 1) return -1;
    *cq = &ch->cq->cq;
    *cq_context = ch->cq->cq.cq_context;
    return 0;
}

EXPORT void ibv_ack_cq_events(struct ibv_cq * cq, unsigned int n) { (void) cq; (void) n; }

EXPORT struct ibv_cq * ibv_create_cq(struct ibv_context * ctx, int cqe, void * cq_context, struct ibv_comp_channel * ch, int vec) {
    struct sim_cq * cq = calloc(1, sizeof *cq);
    if (!cq || cqe <= 0) { free(cq); errno = EINVAL; return NULL; }
    cq->cap = cqe;
    cq->q = calloc((size_t) cqe, sizeof *cq->q);
    cq->cq.context = ctx;
    cq->cq.channel = ch;
    cq->cq.cq_context = cq_context;
    cq->cq.cqe = cqe;
    if (ch) ((struct sim_channel *) ch)->cq = cq;
    return &cq->cq;
}

EXPORT int ibv_destroy_cq(struct ibv_cq * cq_) {
    struct sim_cq * cq = (struct sim_cq *) cq_;
    free(cq->q);
    free(cq);
    return 0;
}

EXPORT struct ibv_qp * ibv_create_qp(struct ibv_pd * pd, struct ibv_qp_init_attr * a) {
    struct sim_ctx * c = (struct sim_ctx *) pd->context;
    if (a->qp_type != IBV_QPT_UC && a->qp_type != IBV_QPT_RC) { errno = EINVAL; return NULL; }
    if (a->qp_type == IBV_QPT_RC && apple()) { errno = EINVAL; return NULL; }
    if (a->qp_type == IBV_QPT_RC && cfg.profile == LINUX_UC) { errno = EOPNOTSUPP; return NULL; }
    if (apple() && (a->cap.max_send_wr > 4095 || a->cap.max_recv_wr > 4095 || a->cap.max_send_sge > 1 || a->cap.max_recv_sge > 1)) {
        errno = EINVAL;
        return NULL;
    }
    pthread_mutex_lock(&c->lock);
    union ibv_gid g;
    port_gid(&g);
    int place = claim_qp_place(&g);
    if (place < 0) { pthread_mutex_unlock(&c->lock); errno = ENOMEM; return NULL; }
    struct sim_qp * q = calloc(1, sizeof *q);
    q->budget_fd = place;
    q->qp.context = pd->context;
    q->qp.pd = pd;
    q->qp.send_cq = a->send_cq;
    q->qp.recv_cq = a->recv_cq;
    q->qp.qp_type = a->qp_type;
    q->qp.state = IBV_QPS_RESET;
    q->qp.qp_num = ((uint32_t) (getpid() & 0xffff) << 8 | (++qp_counter & 0xff)) & 0xffffff;
    q->max_send = a->cap.max_send_wr;
    q->max_recv = a->cap.max_recv_wr;
    q->in_fd = q->out_fd = -1;
    q->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa;
    socklen_t sl;
    sock_name(&sa, &sl, &g, q->qp.qp_num);
    if (q->listen_fd < 0 || bind(q->listen_fd, (struct sockaddr *) &sa, sl) != 0 || listen(q->listen_fd, 4) != 0) {
        int e = errno;
        if (q->listen_fd >= 0) close(q->listen_fd);
        close(q->budget_fd);
        free(q);
        pthread_mutex_unlock(&c->lock);
        errno = e;
        return NULL;
    }
    c->live_qps++;
    q->next = c->qps;
    c->qps = q;
    pthread_mutex_unlock(&c->lock);
    char b = 1;
    if (write(c->wake[1], &b, 1) < 0) {}
    return &q->qp;
}

EXPORT int ibv_modify_qp(struct ibv_qp * qp, struct ibv_qp_attr * a, int mask) {
    struct sim_qp * q = (struct sim_qp *) qp;
    struct sim_ctx * c = (struct sim_ctx *) qp->context;
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    pthread_mutex_lock(&c->lock);
    int rc = 0;
    enum ibv_qp_state from = qp->state, to = a->qp_state;
    switch (to) {
    case IBV_QPS_INIT:
        if (from != IBV_QPS_RESET && from != IBV_QPS_INIT) rc = EINVAL;
        else if ((mask & (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) != (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) rc = EINVAL;
        else if (a->port_num != 1) rc = EINVAL;
        break;
    case IBV_QPS_RTR: {
        int need = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
        if (qp->qp_type == IBV_QPT_RC) need |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        union ibv_gid mine, sgid;
        port_gid(&mine);
        int stype;
        if (from != IBV_QPS_INIT || (mask & need) != need || cfg.fail_rtr) { rc = EINVAL; break; }
        if (apple() && memcmp(a->ah_attr.grh.dgid.raw, mine.raw, 16) == 0) { rc = EINVAL; break; }   // no loopback
        static const union ibv_gid zero;
        if (!a->ah_attr.is_global || gid_entry(a->ah_attr.grh.sgid_index, &sgid, &stype) != 0 ||
            !memcmp(&sgid, &zero, sizeof sgid)) { rc = EINVAL; break; }
        q->dgid = a->ah_attr.grh.dgid;
        q->sgid_type = stype;
        struct sockaddr_un sa;
        socklen_t sl;
        sock_name(&sa, &sl, &q->dgid, a->dest_qp_num);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (cfg.fault == 3) { if (fd >= 0) close(fd); fd = -1; }   // RTR checks no path, as no NIC does
        if (cfg.gid_layout != 0 && stype == IBV_GID_TYPE_ROCE_V1 && !v1_reaches(&q->dgid)) {   // no router forwards v1
            if (fd >= 0) close(fd);
            fd = -1;
        }
        if (fd >= 0 && connect(fd, (struct sockaddr *) &sa, sl) == 0) q->out_fd = fd;
        else if (fd >= 0) close(fd);   // nobody there: sends vanish (UC) or retry out (RC), as on a wrong GID
        break;
    }
    case IBV_QPS_RTS: {
        int need = IBV_QP_SQ_PSN;
        if (qp->qp_type == IBV_QPT_RC) need |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
        if (from != IBV_QPS_RTR || (mask & need) != need) rc = EINVAL;
        break;
    }
    case IBV_QPS_ERR:
        break;
    case IBV_QPS_RESET:
        break;
    default:
        rc = EINVAL;
    }
    if (rc == 0) {
        if (to == IBV_QPS_ERR) to_error(q);
        qp->state = to;
    }
    pthread_mutex_unlock(&c->lock);
    return rc;
}

EXPORT int ibv_query_qp(struct ibv_qp * qp, struct ibv_qp_attr * a, int mask, struct ibv_qp_init_attr * init) {
    struct sim_qp * q = (struct sim_qp *) qp;
    memset(a, 0, sizeof *a);
    a->qp_state = qp->state;
    a->cap.max_send_wr = q->max_send;
    a->cap.max_recv_wr = q->max_recv;
    a->cap.max_send_sge = a->cap.max_recv_sge = 1;
    if (init) { memset(init, 0, sizeof *init); init->cap = a->cap; init->qp_type = qp->qp_type; }
    return 0;
}

EXPORT int ibv_destroy_qp(struct ibv_qp * qp) {
    struct sim_qp * q = (struct sim_qp *) qp;
    struct sim_ctx * c = (struct sim_ctx *) qp->context;
    pthread_mutex_lock(&c->lock);
    q->dead = 1;
    c->live_qps--;
    close(q->budget_fd);   // the device's place is free again
    q->budget_fd = -1;
    for (struct sim_wr * w = q->rq_head, * n; w; w = n) { n = w->next; free(w); }
    q->rq_head = q->rq_tail = NULL;
    for (struct sim_msg * m = q->held_head, * n; m; m = n) { n = m->next; free(m->data); free(m); }
    q->held_head = q->held_tail = NULL;
    if (q->listen_fd >= 0) shutdown(q->listen_fd, SHUT_RDWR);
    if (q->in_fd >= 0) shutdown(q->in_fd, SHUT_RDWR);
    if (q->out_fd >= 0) shutdown(q->out_fd, SHUT_RDWR);
    pthread_mutex_unlock(&c->lock);
    char b = 1;
    if (write(c->wake[1], &b, 1) < 0) {}
    return 0;   // the struct and its fds go at close_device: the NIC threads may still hold it
}

EXPORT const char * ibv_wc_status_str(enum ibv_wc_status s) {
    switch (s) {
    case IBV_WC_SUCCESS:       return "success";
    case IBV_WC_LOC_LEN_ERR:   return "local length error";
    case IBV_WC_LOC_PROT_ERR:  return "local protection error";
    case IBV_WC_WR_FLUSH_ERR:  return "Work Request Flushed Error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default:                   return "other error";
    }
}
