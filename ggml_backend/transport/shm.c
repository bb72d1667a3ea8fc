// transport/shm.c - the ring (ring.h) over a shared-memory segment, for a
// head and a node (or two nodes) on one host.
//
// The node creates the segment (shm_open, mode 0600, a random name and a
// random nonce written inside), the head attaches by name and checks the
// nonce and the size, then the node unlinks the name: from then on no other
// process can open it. Layout: a 4 KiB control page, then the node-to-head
// slots, then the head-to-node slots.
//
// Frames are written straight into the receiver's slot; the header's seq is
// stored last with release order, so a reader that sees the seq it expects
// (acquire) sees the whole frame. Waiting spins briefly, then sleeps in
// poll() on the TCP connection the segment was negotiated over: a sleeper
// raises its flag in the control page, and a writer that sees the flag sends
// one byte over TCP. The same poll() sees end of file the moment the peer
// process dies, so a crash is noticed as fast as over TCP, and an idle
// connection costs no CPU.
//
// Spinning pays only when the frame comes within the spin: a reply to a
// small request does, a layer split's next token or activations (a whole
// decode step away) never do, and on a machine with fewer cores than busy
// processes a spinner holds the core its peer needs to produce the frame.
// So each connection keeps an average of how long its recent waits lasted
// and spins fully while that average is short, when the frame awaited
// continues a message (the last one came full: tb_ring_more), or when the
// caller knows it comes soon (base.rendezvous: an all-reduce, whose peer
// computes the same layer, where a sleep costs a wake-up per layer and a
// spin finds the partial within microseconds; that spin yields the core
// every 64 checks, so with more nodes than cores the node still computing
// gets it, and with a core each the yield returns at once); otherwise it checks a
// few times and sleeps at once, but for every 16th wait, which spins fully
// to find out whether replies have become quick again (a wait that slept
// also counts the wake-up, so short replies seen through sleeps alone could
// keep the average long).
#include "ring.h"

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define SHM_MAGIC     0x314d485342525442ull   // "TBRPCSHM1" folded: version 1 of this layout
#define CONTROL_BYTES 4096u
#define SPIN_CHECKS   2000                    // about 20-50 µs of checking before sleeping
#define SPIN_FLOOR    32                      // checks before sleeping when waits run long
#define SPIN_PAYS_NS  40000                   // waits averaging under this are worth the full spin
#define SPIN_PROBE    16                      // while they are not, every 16th wait spins fully anyway

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0   // macOS: SO_NOSIGPIPE on the socket does the same (tb_adopt)
#endif

struct shm_control {
    uint64_t magic;
    uint8_t  nonce[16];
    uint32_t slots, stride;
    _Alignas(64) _Atomic uint32_t sleeping[2];   // [side]: that side sleeps in poll() and wants a doorbell
    _Alignas(64) _Atomic uint64_t alive[2];      // [side]: counts that side's heartbeats (shm_heartbeat)
};

_Static_assert(sizeof(struct shm_control) <= CONTROL_BYTES, "the control page holds the control block");

struct tb_shm {
    uint8_t * base;
    size_t    size;
    uint32_t  slots, stride;   // ours: the copies in the control page are the peer's to scribble on
    int       side;            // 0: creator (node), 1: attacher (head)
    char      name[TB_SHM_NAME_LEN];
    int       named;           // the name still exists (creator only)
};

struct shm_transport {
    struct tb_ring ring;       // must be first
    struct tb_shm  shm;
    struct tb_transport * tcp; // doorbell and liveness
    int       fd;              // its socket
    uint64_t  peer_alive;      // the peer's heartbeat count when last looked at (shm_peer_alive)
    int64_t   wait_avg_ns;     // recent waits, averaged (shm_wait; atomic: a sender may wait for credits meanwhile)
    uint32_t  waits;           // shm_wait calls, for the probing spin
};

static size_t segment_size(uint32_t slots, uint32_t stride) {
    return CONTROL_BYTES + 2 * (size_t) slots * stride;
}

static struct shm_control * control(const struct tb_shm * s) { return (struct shm_control *) s->base; }

// The slots `side` receives in.
static uint8_t * slots_of(const struct tb_shm * s, int side) {
    return s->base + CONTROL_BYTES + (size_t) side * s->slots * s->stride;
}

static int random_bytes(void * out, size_t len) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t k = read(fd, out, len);
    close(fd);
    return k == (ssize_t) len ? 0 : -1;
}

static int map_fd(struct tb_shm * s, int fd, size_t size, char * err, size_t err_len) {
    void * p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, err_len, "cannot map shared memory %s: %s", s->name, strerror(errno));
        return -1;
    }
    s->base = p;
    s->size = size;
    return 0;
}

struct tb_shm * tb_shm_create(uint32_t slots, uint32_t stride, struct tb_shm_offer * offer, char * err, size_t err_len) {
    if (!tb_ring_geometry_ok(slots, stride)) {
        snprintf(err, err_len, "no shared-memory ring of %u slots of %u bytes", slots, stride);
        return NULL;
    }
    struct tb_shm * s = calloc(1, sizeof *s);
    uint8_t id[8];
    if (!s || random_bytes(id, sizeof id) != 0 || random_bytes(offer->nonce, sizeof offer->nonce) != 0) {
        snprintf(err, err_len, "cannot make a shared-memory name: %s", s ? "no /dev/urandom" : "out of memory");
        free(s);
        return NULL;
    }
    snprintf(s->name, sizeof s->name, "/tbrpc-%02x%02x%02x%02x%02x%02x%02x%02x",
             id[0], id[1], id[2], id[3], id[4], id[5], id[6], id[7]);
    int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        snprintf(err, err_len, "cannot create shared memory %s: %s", s->name, strerror(errno));
        free(s);
        return NULL;
    }
    s->named = 1;
    size_t size = segment_size(slots, stride);
    if (ftruncate(fd, (off_t) size) != 0) {
        snprintf(err, err_len, "cannot size shared memory %s to %zu bytes: %s", s->name, size, strerror(errno));
        close(fd);
        tb_shm_discard(s);
        return NULL;
    }
    if (map_fd(s, fd, size, err, err_len) != 0) { tb_shm_discard(s); return NULL; }
    struct shm_control * c = control(s);
    memcpy(c->nonce, offer->nonce, sizeof c->nonce);
    c->slots = slots;
    c->stride = stride;
    c->magic = SHM_MAGIC;
    s->slots = slots;
    s->stride = stride;
    offer->slots = slots;
    offer->stride = stride;
    snprintf(offer->name, sizeof offer->name, "%s", s->name);
    return s;
}

struct tb_shm * tb_shm_attach(const struct tb_shm_offer * offer, char * err, size_t err_len) {
    if (!tb_ring_geometry_ok(offer->slots, offer->stride) || strncmp(offer->name, "/tbrpc-", 7) != 0 ||
        memchr(offer->name, '\0', sizeof offer->name) == NULL) {
        snprintf(err, err_len, "the node offered a shared-memory ring that is not ours");
        return NULL;
    }
    struct tb_shm * s = calloc(1, sizeof *s);
    if (!s) { snprintf(err, err_len, "out of memory"); return NULL; }
    s->side = 1;
    snprintf(s->name, sizeof s->name, "%s", offer->name);
    int fd = shm_open(s->name, O_RDWR, 0);
    if (fd < 0) {
        snprintf(err, err_len, errno == ENOENT ? "the node is on another host (no shared memory %s here)"
                                               : "cannot open shared memory %s: %s", s->name, strerror(errno));
        free(s);
        return NULL;
    }
    struct stat st;
    size_t size = segment_size(offer->slots, offer->stride);
    if (fstat(fd, &st) != 0 || (size_t) st.st_size != size) {
        snprintf(err, err_len, "shared memory %s is not %zu bytes", s->name, size);
        close(fd);
        free(s);
        return NULL;
    }
    // A segment whose owner or anyone else may resize it could be truncated
    // under our mapping: the next frame we touch would kill this process
    // (SIGBUS). The creator makes it 0600 as our own user (tb_shm_create):
    // only that is the peer's segment; anyone else's is a trap.
    if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
        snprintf(err, err_len, "shared memory %s is not this user's alone (owner uid %u, mode %03o)", s->name,
                 (unsigned) st.st_uid, (unsigned) (st.st_mode & 0777));
        close(fd);
        free(s);
        return NULL;
    }
    if (map_fd(s, fd, size, err, err_len) != 0) { free(s); return NULL; }
    const struct shm_control * c = control(s);
    if (c->magic != SHM_MAGIC || memcmp(c->nonce, offer->nonce, sizeof c->nonce) != 0 ||
        c->slots != offer->slots || c->stride != offer->stride) {
        snprintf(err, err_len, "shared memory %s is not the one the node offered", s->name);
        tb_shm_discard(s);
        return NULL;
    }
    s->slots = offer->slots;
    s->stride = offer->stride;
    return s;
}

void tb_shm_discard(struct tb_shm * s) {
    if (!s) return;
    if (s->named) shm_unlink(s->name);
    if (s->base) munmap(s->base, s->size);
    free(s);
}

// --- the wire ------------------------------------------------------------------

static struct shm_transport * of(struct tb_ring * r) { return (struct shm_transport *) r; }

static uint8_t * shm_tx_frame(struct tb_ring * r, uint32_t seq) {
    struct tb_shm * s = &of(r)->shm;
    return slots_of(s, 1 - s->side) + (size_t) (seq % r->slots) * r->stride;
}

static const uint8_t * shm_rx_frame(struct tb_ring * r, uint32_t seq, int * broken) {
    struct tb_shm * s = &of(r)->shm;
    const uint8_t * f = slots_of(s, s->side) + (size_t) (seq % r->slots) * r->stride;
    const _Atomic uint32_t * at = (const _Atomic uint32_t *) (f + offsetof(struct tb_frame_header, seq));
    *broken = 0;
    return atomic_load_explicit(at, memory_order_acquire) == seq ? f : NULL;
}

static int shm_post(struct tb_ring * r, uint32_t seq) {
    struct shm_transport * t = of(r);
    uint8_t * f = shm_tx_frame(r, seq);
    atomic_store_explicit((_Atomic uint32_t *) (f + offsetof(struct tb_frame_header, seq)), seq, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);   // pairs with the sleeper's: it sees the frame or we see its flag
    if (atomic_load_explicit(&control(&t->shm)->sleeping[1 - t->shm.side], memory_order_relaxed)) {
        char bell = 'b';
        ssize_t k;
        do { k = send(t->fd, &bell, 1, MSG_DONTWAIT | MSG_NOSIGNAL); } while (k < 0 && errno == EINTR);
        // EAGAIN: the socket is full of doorbells already; any other failure shows up as end of file to the waiter
    }
    return 0;
}

static int shm_release(struct tb_ring * r, uint32_t seq) {
    (void) r; (void) seq;   // the slot is free once the peer gets the credit back
    return 0;
}

// Take the doorbells off the socket; -1 if the peer closed it. One read:
// a bell rung after it leaves poll() ready, and the next wait takes it then
// (one spurious look at the ring), which costs less than reading again on
// every wake-up to see the socket empty.
static int drain(struct shm_transport * t) {
    char buf[64];
    ssize_t k;
    do { k = recv(t->fd, buf, sizeof buf, MSG_DONTWAIT); } while (k < 0 && errno == EINTR);
    if (k > 0 || (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))) return 0;
    return tb_fail(&t->ring.base, TB_IO_CLOSED, "%s: %s", t->ring.base.peer,
                   k == 0 ? "connection closed by peer" : strerror(errno));
}

static int shm_wait(struct tb_ring * r, uint32_t seq, int timeout_ms) {
    struct shm_transport * t = of(r);
    int broken;
    const int64_t started = tb_now_ns();
    int64_t avg = __atomic_load_n(&t->wait_avg_ns, __ATOMIC_RELAXED);
    const uint32_t nth = __atomic_add_fetch(&t->waits, 1, __ATOMIC_RELAXED);
    const int checks = avg < SPIN_PAYS_NS || nth % SPIN_PROBE == 0 || tb_ring_more(r) || r->base.rendezvous
                       ? SPIN_CHECKS : SPIN_FLOOR;
    const int yields = r->base.rendezvous;
    int rc = 0, got = 0;
    for (int i = 0; i < checks && !got; i++) {
        got = shm_rx_frame(r, seq, &broken) != NULL;
        if (!got && yields && i % 64 == 63) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
        if (!got) __builtin_ia32_pause();
#elif defined(__aarch64__)
        if (!got) __asm__ __volatile__("yield");
#endif
    }
    if (!got) {
        _Atomic uint32_t * mine = &control(&t->shm)->sleeping[t->shm.side];
        atomic_store_explicit(mine, 1, memory_order_relaxed);
        atomic_thread_fence(memory_order_seq_cst);
        if (!shm_rx_frame(r, seq, &broken)) {
            __atomic_add_fetch(&r->sleeps, 1, __ATOMIC_RELAXED);
            struct pollfd p = { .fd = t->fd, .events = POLLIN };
            int k;
            do { k = poll(&p, 1, timeout_ms); } while (k < 0 && errno == EINTR);
            if (k < 0) rc = tb_fail(&r->base, TB_IO_BROKEN, "%s: poll failed: %s", r->base.peer, strerror(errno));
            else if (k > 0) rc = drain(t);
        }
        atomic_store_explicit(mine, 0, memory_order_relaxed);
    }
    // The average moves a quarter of the way to this wait's length, taken
    // as at most four times the spin's worth: a few long waits in a row stop
    // the spinning, a few short ones bring it back.
    int64_t took = tb_now_ns() - started;
    if (took > 4 * SPIN_PAYS_NS) took = 4 * SPIN_PAYS_NS;
    avg += (took - avg) / 4;
    __atomic_store_n(&t->wait_avg_ns, avg, __ATOMIC_RELAXED);
    return rc;
}

static void shm_free(struct tb_ring * r) {
    struct shm_transport * t = of(r);
    tb_ring_destroy(r);
    if (t->shm.base) munmap(t->shm.base, t->shm.size);
    tb_close(t->tcp);
    free(t);
}

// A heartbeat is a counter in the control page: it takes no slot, so a node
// computing a long graph keeps a peer blocked on its full ring waiting for as
// long as it computes. The peer may scribble on it (the control page is
// shared): the worst it can do is keep its own connection waiting.
static void shm_heartbeat(struct tb_ring * r) {
    struct shm_transport * t = of(r);
    atomic_fetch_add_explicit(&control(&t->shm)->alive[t->shm.side], 1, memory_order_relaxed);
}

static int shm_peer_alive(struct tb_ring * r) {
    struct shm_transport * t = of(r);
    const uint64_t now = atomic_load_explicit(&control(&t->shm)->alive[1 - t->shm.side], memory_order_relaxed);
    const int moved = now != t->peer_alive;
    t->peer_alive = now;
    return moved;
}

static const struct tb_ring_wire shm_wire = {
    .name = "shm", .tx_frame = shm_tx_frame, .post = shm_post, .rx_frame = shm_rx_frame,
    .release = shm_release, .wait = shm_wait, .free = shm_free, .heartbeat = shm_heartbeat, .peer_alive = shm_peer_alive,
};

struct tb_transport * tb_shm_transport(struct tb_shm * s, struct tb_transport * tcp, char * err, size_t err_len) {
    struct shm_transport * t = calloc(1, sizeof *t);
    if (!t || !tb_ring_init(&t->ring, &shm_wire, s->slots, s->stride, tcp->timeout_ms, tcp->peer)) {
        snprintf(err, err_len, "out of memory for a shared-memory ring");
        free(t);
        tb_shm_discard(s);
        return NULL;
    }
    if (s->named) shm_unlink(s->name);   // attached: nobody else may open it now
    t->shm = *s;
    t->shm.named = 0;
    free(s);
    t->tcp = tcp;
    t->fd = tb_tcp_fd(tcp);
    t->ring.base.bytes_sent = tcp->bytes_sent;
    t->ring.base.bytes_received = tcp->bytes_received;
    snprintf(t->ring.base.describe, sizeof t->ring.base.describe, "shm %ux%uK", t->shm.slots, t->shm.stride / 1024);
    return &t->ring.base;
}
