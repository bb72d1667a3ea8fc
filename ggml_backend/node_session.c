// node_session.c - one client's session on a node, its core: buffers, the
// handshake, transports, the watchdog and the request loop. Graphs, model
// files and node-to-node links have files of their own (node_session.h).
//
// Requests are decoded and validated once, at the edge (proto.c and the
// handlers below); execution trusts what decoding produced. Posted requests
// that fail leave a sticky error that the next reply carries.
#include "node_session.h"
#include "transport/ring.h"
#include "transport/rdma.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SCRATCH_KEEP (4u << 20)    // request scratch always kept between requests
#define SCRATCH_IDLE 16            // more is freed after this many requests in a row that needed under a quarter of it

// ---- buffers ----------------------------------------------------------------

struct node_buffer * find_buffer(struct node_conn * c, uint64_t handle) {
    for (size_t i = 0; i < c->n_buffers; i++) {
        if (c->buffers[i].handle == handle) return &c->buffers[i];
    }
    return NULL;
}

// How graph decoding (proto.c) sees a client's buffers.
bool lookup_buffer(void * ctx, uint64_t handle, struct tb_buffer_view * out) {
    const struct node_buffer * b = find_buffer(ctx, handle);
    if (b) *out = (struct tb_buffer_view) { .base = b->base, .size = b->size, .ggml_buffer = b->buf };
    return b != NULL;
}

// A byte range [offset, offset+size) of a buffer, checked without overflow.
struct node_buffer * checked_range(struct node_conn * c, uint64_t handle, uint64_t offset, uint64_t size,
                                   char * err, size_t err_len) {
    struct node_buffer * b = find_buffer(c, handle);
    if (!b) {
        snprintf(err, err_len, "unknown buffer handle %llu", (unsigned long long) handle);
        return NULL;
    }
    if (offset > b->size || size > b->size - offset) {
        snprintf(err, err_len, "range [%llu, +%llu) lies outside buffer %llu of %llu bytes", (unsigned long long) offset,
                 (unsigned long long) size, (unsigned long long) handle, (unsigned long long) b->size);
        return NULL;
    }
    return b;
}

static void release_buffer(struct node_conn * c, size_t i) {
    count(&c->slot->buffers, -1);
    count(&c->slot->bytes_allocated, -(int64_t) c->buffers[i].size);
    ggml_backend_buffer_free(c->buffers[i].buf);
    c->buffers[i] = c->buffers[--c->n_buffers];
    // What the client read from files is that of the model its buffers hold: with the last one
    // freed it starts again, so a model loaded again on this connection counts its own load.
    if (c->n_buffers == 0) __atomic_store_n(&c->slot->bytes_from_files, 0, __ATOMIC_RELAXED);
}

struct node_buffer * checked_rows(struct node_conn * c, uint64_t handle, uint64_t offset, uint64_t size, uint64_t n,
                                  uint64_t stride, const char * what, char * err, size_t err_len) {
    uint64_t span;
    if (n == 0 || size == 0 || stride < size || __builtin_mul_overflow(n - 1, stride, &span) ||
        __builtin_add_overflow(span, size, &span)) {
        snprintf(err, err_len, "%s: %llu rows of %llu bytes, %llu apart: not a valid set of rows", what,
                 (unsigned long long) n, (unsigned long long) size, (unsigned long long) stride);
        return NULL;
    }
    return checked_range(c, handle, offset, span, err, err_len);
}

void write_rows(struct node_buffer * b, uint64_t offset, uint64_t stride, const uint8_t * rows, uint64_t size,
                uint64_t n, uint64_t src_stride) {
    for (uint64_t i = 0; i < n; i++) {
        if (ggml_backend_buffer_is_host(b->buf)) {
            memcpy(b->base + offset + i * stride, rows + i * src_stride, (size_t) size);
        } else {
            struct ggml_tensor t = byte_view(b, offset + i * stride, size);
            ggml_backend_tensor_set(&t, rows + i * src_stride, 0, (size_t) size);
        }
    }
}

static int handle_set_2d(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    struct tb_range_2d req;
    memcpy(&req, c->payload, sizeof req);
    struct node_buffer * b = checked_rows(c, req.handle, req.offset, req.size, req.n_copies, req.stride, "SET_TENSOR_2D",
                                          err, err_len);
    if (!b) return -1;
    if (h->len - sizeof req != req.n_copies * req.size) {   // no overflow: checked_rows bounded both by the buffer
        snprintf(err, err_len, "SET_TENSOR_2D: %llu rows of %llu bytes, the message carries %llu",
                 (unsigned long long) req.n_copies, (unsigned long long) req.size, (unsigned long long) (h->len - sizeof req));
        return -1;
    }
    write_rows(b, req.offset, req.stride, c->payload + sizeof req, req.size, req.n_copies, req.size);
    return 0;
}

// ---- request handlers -------------------------------------------------------

static void fill_device_info(struct tb_node * n, struct tb_hello * h) {
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(n->dev);
    size_t free_mem = 0, total_mem = 0;
    ggml_backend_dev_memory(n->dev, &free_mem, &total_mem);
    h->mem_free = free_mem;
    h->mem_total = total_mem;
    h->alignment = ggml_backend_buft_get_alignment(buft);
    h->max_size = ggml_backend_buft_get_max_size(buft);
    h->device_type = (uint32_t) ggml_backend_dev_type(n->dev);
    h->caps = buft->iface.get_alloc_size == NULL ? TB_CAP_ALLOC_SIZE_IS_NBYTES : 0;
    if (strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(n->dev)), "CPU") == 0) h->caps |= TB_CAP_SUPPORTS_OP_IS_CPU;
    if (n->serve_mode != SERVE_THREAD) h->caps |= TB_CAP_SHM;   // see handle_transport_offer
    if (n->model_dirs[0]) h->caps |= TB_CAP_MODEL_FILES;
    char no_rdma[160];
    if (tb_rdma_available(no_rdma, sizeof no_rdma)) h->caps |= TB_CAP_RDMA;
    tb_ggml_build(h->ggml_build, sizeof h->ggml_build);
    snprintf(h->device_name, sizeof h->device_name, "%s", ggml_backend_dev_name(n->dev));
    snprintf(h->device_description, sizeof h->device_description, "%s", ggml_backend_dev_description(n->dev));
    snprintf(h->node_name, sizeof h->node_name, "%s", n->name);
    memcpy(h->node_id, n->id, sizeof h->node_id);
}

static int handle_hello(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    // The ABI leads every version's HELLO: compare it before the length, so a
    // client of another protocol version (whose HELLO may differ in size)
    // hears which versions differ, not just that the size does.
    r->refusal = TB_STATUS_VERSION;   // every refusal here means the two sides speak different versions
    if (h->len < sizeof(struct tb_abi)) return tb_check_request_len(h, err, err_len);
    struct tb_hello * rep = (struct tb_hello *) r->small;
    memset(rep, 0, sizeof *rep);
    tb_abi_fill(&rep->abi);
    if (tb_abi_compare(&rep->abi, (const struct tb_abi *) c->payload, "client", err, err_len) != 0) return -1;
    if (tb_check_request_len(h, err, err_len) != 0) return -1;
    const struct tb_hello * req = (const struct tb_hello *) c->payload;
    uint32_t keepalive = req->keepalive_ms;
    if (keepalive < TB_KEEPALIVE_MIN_MS) keepalive = TB_KEEPALIVE_MIN_MS;
    if (keepalive > TB_KEEPALIVE_MAX_MS) keepalive = TB_KEEPALIVE_MAX_MS;
    pthread_mutex_lock(&c->busy_lock);
    c->keepalive_ms = keepalive;
    pthread_mutex_unlock(&c->busy_lock);
    memcpy(c->head_nonce, req->nonce, TB_NONCE_LEN);
    r->refusal = 0;
    if (tb_random(c->node_nonce, TB_NONCE_LEN) != 0) { snprintf(err, err_len, "no random bytes for a nonce"); return -1; }
    memcpy(rep->nonce, c->node_nonce, TB_NONCE_LEN);
    if (c->node->secret_len) {
        rep->caps = TB_CAP_AUTH;   // nothing about the device before AUTH
    } else {
        fill_device_info(c->node, rep);
        memcpy(rep->file_nonce, c->file_nonce, sizeof rep->file_nonce);
    }
    r->data = rep;
    r->len = sizeof *rep;
    return 0;
}

// The head proves it knows the secret over both nonces; then the node proves
// it back and tells what it serves.
static int handle_auth(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    r->refusal = TB_STATUS_AUTH;
    if (!c->node->secret_len) { snprintf(err, err_len, "AUTH: this node has no secret"); return -1; }
    const struct tb_auth_req * req = (const struct tb_auth_req *) c->payload;
    uint8_t want[TB_MAC_LEN];
    tb_auth_mac(c->node->secret, c->node->secret_len, TB_AUTH_ROLE_HEAD, c->head_nonce, c->node_nonce, NULL, 0, want);
    const int ok = tb_equal_ct(want, req->mac, TB_MAC_LEN);
    memset(want, 0, sizeof want);
    if (!ok) {
        snprintf(err, err_len, "authentication failed: the head does not know this node's secret");
        return -1;
    }
    struct tb_auth_reply * rep = (struct tb_auth_reply *) r->small;
    memset(rep, 0, sizeof *rep);
    tb_auth_mac(c->node->secret, c->node->secret_len, TB_AUTH_ROLE_NODE, c->head_nonce, c->node_nonce, NULL, 0, rep->mac);
    tb_abi_fill(&rep->hello.abi);
    fill_device_info(c->node, &rep->hello);
    memcpy(rep->hello.file_nonce, c->file_nonce, sizeof rep->hello.file_nonce);
    rep->hello.caps |= TB_CAP_AUTH;
    memcpy(rep->hello.nonce, c->node_nonce, TB_NONCE_LEN);
    r->refusal = 0;
    r->data = rep;
    r->len = sizeof *rep;
    return 0;
}

// A decode step reads every weight once. In 4 KiB pages that walk misses
// the TLB once per page; in transparent huge pages once per 2 MiB. Linux
// gives them only where asked (THP "madvise", the common default), so ask
// for every host buffer before its first byte is written. Elsewhere (Metal's
// buffers, other kernels) this is a no-op, and a refusal costs nothing.
static void prefer_huge_pages(ggml_backend_buffer_t buf, void * base, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    const uintptr_t start = ((uintptr_t) base + page - 1) & ~(page - 1);
    const uintptr_t end = ((uintptr_t) base + size) & ~(page - 1);
    if (ggml_backend_buffer_is_host(buf) && end > start) (void) madvise((void *) start, end - start, MADV_HUGEPAGE);
#else
    (void) buf; (void) base; (void) size;
#endif
}

static int handle_alloc(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    const struct tb_alloc_req * req = (const struct tb_alloc_req *) c->payload;
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(c->node->dev);
    if (req->size > ggml_backend_buft_get_max_size(buft)) {
        snprintf(err, err_len, "ALLOC_BUFFER of %llu bytes exceeds the device's maximum buffer size", (unsigned long long) req->size);
        return -1;
    }
    // One client holds at most what the device has: a request for more is
    // refused here, before the allocator (or the kernel's overcommit) sees it.
    size_t free_mem = 0, total_mem = 0;
    ggml_backend_dev_memory(c->node->dev, &free_mem, &total_mem);
    uint64_t held = 0;
    for (size_t i = 0; i < c->n_buffers; i++) held += c->buffers[i].size;
    if (total_mem > 0 && (req->size > total_mem || held > total_mem - req->size)) {
        snprintf(err, err_len, "ALLOC_BUFFER of %llu bytes refused: this client would hold %llu bytes, more than the %llu bytes of device %s",
                 (unsigned long long) req->size, (unsigned long long) (held + req->size), (unsigned long long) total_mem,
                 ggml_backend_dev_name(c->node->dev));
        return -1;
    }
    if (c->n_buffers == c->cap_buffers) {
        size_t cap = c->cap_buffers ? 2 * c->cap_buffers : 16;
        struct node_buffer * nb = realloc(c->buffers, cap * sizeof *nb);
        if (!nb) { snprintf(err, err_len, "out of memory"); return -1; }
        c->buffers = nb;
        c->cap_buffers = cap;
    }
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, (size_t) req->size);
    if (!buf) {
        snprintf(err, err_len, "device %s could not allocate %llu bytes", ggml_backend_dev_name(c->node->dev),
                 (unsigned long long) req->size);
        return -1;
    }
    struct node_buffer * b = &c->buffers[c->n_buffers++];
    b->handle = c->next_handle++;
    b->buf = buf;
    b->base = ggml_backend_buffer_get_base(buf);
    b->size = ggml_backend_buffer_get_size(buf);
    // Threads of one process share a heap: memory another client freed may
    // come back here, so it starts cleared (a worker process gets fresh pages).
    if (c->node->serve_mode == SERVE_THREAD) ggml_backend_buffer_clear(buf, 0);
    prefer_huge_pages(buf, b->base, b->size);
    count(&c->slot->buffers, 1);
    count(&c->slot->bytes_allocated, (int64_t) b->size);
    struct tb_alloc_reply * rep = (struct tb_alloc_reply *) r->small;
    rep->handle = b->handle;
    rep->base = c->next_fake_base;   // never an address of ours: see TB_FAKE_BASE in proto.h
    c->next_fake_base += (b->size + TB_FAKE_BASE_GAP - 1) / TB_FAKE_BASE_GAP * TB_FAKE_BASE_GAP + TB_FAKE_BASE_GAP;
    rep->size = b->size;
    r->data = rep;
    r->len = sizeof *rep;
    return 0;
}

static int handle_free(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_buffer_req * req = (const struct tb_buffer_req *) c->payload;
    for (size_t i = 0; i < c->n_buffers; i++) {
        if (c->buffers[i].handle == req->handle) {
            forget_kept_graphs(c);   // they may point into this buffer
            release_buffer(c, i);
            return 0;
        }
    }
    snprintf(err, err_len, "FREE_BUFFER: unknown buffer handle %llu", (unsigned long long) req->handle);
    return -1;
}

static int handle_memset(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_memset_req * req = (const struct tb_memset_req *) c->payload;
    struct node_buffer * b = checked_range(c, req->handle, req->offset, req->size, err, err_len);
    if (!b) return -1;
    if (h->cmd == TB_CMD_BUFFER_CLEAR) {
        ggml_backend_buffer_clear(b->buf, req->value);
    } else if (req->size > 0) {
        struct ggml_tensor t = byte_view(b, req->offset, req->size);
        ggml_backend_tensor_memset(&t, req->value, 0, (size_t) req->size);
    }
    return 0;
}

static int handle_get(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    const struct tb_range req = *(const struct tb_range *) c->payload;
    if (req.size > TB_MAX_PAYLOAD) {
        snprintf(err, err_len, "GET_TENSOR of %llu bytes exceeds the message limit", (unsigned long long) req.size);
        return -1;
    }
    struct node_buffer * b = checked_range(c, req.handle, req.offset, req.size, err, err_len);
    if (!b) return -1;
    if (ggml_backend_buffer_is_host(b->buf)) {
        r->data = b->base + req.offset;    // reply straight from the buffer, no copy
    } else {
        if (scratch_reserve(c, (size_t) req.size) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
        struct ggml_tensor t = byte_view(b, req.offset, req.size);
        ggml_backend_tensor_get(&t, c->payload, 0, (size_t) req.size);
        r->data = c->payload;
    }
    r->len = (size_t) req.size;
    return 0;
}

static int handle_copy(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_copy_req * req = (const struct tb_copy_req *) c->payload;
    struct node_buffer * src = checked_range(c, req->src_handle, req->src_offset, req->size, err, err_len);
    struct node_buffer * dst = src ? checked_range(c, req->dst_handle, req->dst_offset, req->size, err, err_len) : NULL;
    if (!dst) return -1;
    if (req->size == 0) return 0;
    struct ggml_tensor s = byte_view(src, req->src_offset, req->size);
    struct ggml_tensor d = byte_view(dst, req->dst_offset, req->size);
    ggml_backend_tensor_copy(&s, &d);
    return 0;
}

// ---- the watchdog ------------------------------------------------------------

// It wakes every half keepalive period, nothing else wakes it (but
// closing), and speaks when the session has been busy for a whole half
// period by then: from the moment work begins, the first KEEPALIVE comes
// within one keepalive period and the next ones every half period, so the
// client, whose timeout is three periods, never times out a node that
// works; a decode step's short busy spells send none. A tick that finds the
// session idle costs a wake-up and nothing more (a few per second), where
// waking the watchdog on every state change cost a context switch per
// change on the token's path. The sign of life is the transport's
// heartbeat where it has one (tb_alive: shared memory, RDMA, the receiving
// end of a TCP link), else a KEEPALIVE message, which goes only where it
// fits without waiting (tb_room): a watchdog blocked on a full connection
// would hold send_lock against the session's own next message.
static void * watchdog_thread(void * arg) {
    struct node_conn * c = arg;
    pthread_mutex_lock(&c->busy_lock);
    while (!c->closing) {
        const uint32_t half = c->keepalive_ms / 2;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        const uint64_t ns = (uint64_t) until.tv_nsec + (uint64_t) half * 1000000u;
        until.tv_sec += (time_t) (ns / 1000000000u);
        until.tv_nsec = (long) (ns % 1000000000u);
        pthread_cond_timedwait(&c->busy_changed, &c->busy_lock, &until);
        const int busy = __atomic_load_n(&c->busy, __ATOMIC_ACQUIRE);
        const int64_t since = __atomic_load_n(&c->busy_since_ms, __ATOMIC_RELAXED);
        if (c->closing || busy == IDLE || tb_now_ms() - since < (int64_t) half) continue;
        const size_t keepalive = sizeof(struct tb_header);
        pthread_mutex_lock(&c->send_lock);
        // A heartbeat where the transport has one (shared memory, RDMA): it takes
        // no slot, where a keepalive message left unread by a head blocked
        // sending to us would sit ahead of the credits we return, and stall
        // that send (docs/protocol.md, Keepalive and timeouts).
        if (!tb_alive(c->tp) && tb_room(c->tp, keepalive) &&
            tb_msg_send(c->tp, TB_CMD_KEEPALIVE, TB_FLAG_REPLY, 0, NULL, 0, NULL, 0) == 0)
            tb_flush(c->tp);
        const size_t n_peers = c->n_peers;   // the list only grows, under send_lock
        pthread_mutex_unlock(&c->send_lock);
        // A peer waiting on us must not give up on us either, but only while
        // we compute, or while we are blocked sending to a next node that
        // does (which itself times out the moment that node goes silent): a
        // session that merely waits for a peer must not keep alive a peer
        // that waits for it (two sessions, or one linked to itself, would
        // otherwise wait on each other forever). Every chain of waits thus
        // ends at a node that computes. The node before us (an incoming
        // link) may be blocked sending us its next piece of a pipelined
        // prompt: it gets the link's heartbeat (over TCP a byte back on the
        // link, tb_one_way; a ring's outside its slots), which touches no
        // state of a sender and takes no lock. The node after us (outgoing)
        // waits for our output only while we compute; a keepalive message
        // on a link whose own send is under way would wait behind it, so
        // that link is passed over (the send itself shows life, or fails).
        for (size_t i = 0; (busy == COMPUTING || busy == SENDING_TO_PEER) && i < n_peers; i++) {
            struct node_peer * p = &c->peers[i];
            if (tb_alive(p->tp) || !p->outgoing || busy != COMPUTING) continue;
            if (pthread_mutex_trylock(&p->lock) != 0) continue;
            if (tb_room(p->tp, keepalive) && tb_msg_send(p->tp, TB_CMD_KEEPALIVE, 0, 0, NULL, 0, NULL, 0) == 0)
                tb_flush(p->tp);
            pthread_mutex_unlock(&p->lock);
        }
    }
    pthread_mutex_unlock(&c->busy_lock);
    return NULL;
}

// The device calls this between the ops of a graph: a client that has gone
// (its connection closed) stops the computation it left behind, instead of
// the node finishing a graph nobody will read. One look every 20 ms.
bool client_left(void * data) {
    struct node_conn * c = data;
    const int64_t now = tb_now_ms();
    if (c->gone || now - c->gone_checked_ms < 20) return c->gone;
    c->gone_checked_ms = now;
    char byte;
    const ssize_t got = recv(c->client_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    c->gone = got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    return c->gone;
}

static int handle_status(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct tb_status * s = (struct tb_status *) r->small;
    tb_node_get_status(c->node, s);
    r->data = s;
    r->len = sizeof *s;
    return 0;
}

static int handle_memory(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct tb_memory * m = (struct tb_memory *) r->small;
    size_t free_mem = 0, total_mem = 0;
    ggml_backend_dev_memory(c->node->dev, &free_mem, &total_mem);
    m->free = free_mem;
    m->total = total_mem;
    r->data = m;
    r->len = sizeof *m;
    return 0;
}

// ---- the connection loop ----------------------------------------------------

static int read_payload(struct node_conn * c, size_t len) {
    if (scratch_reserve(c, len) != 0) return -1;
    return len ? tb_recv(c->tp, c->payload, len) : 0;
}

// SET_TENSOR streams weights: read the range first, then receive the bytes
// straight into host buffers instead of through the scratch payload.
static int handle_set(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len, bool * io_failed) {
    struct tb_range req;
    if (tb_check_request_len(h, err, err_len) != 0) { *io_failed = true; return -1; }
    if (tb_recv(c->tp, &req, sizeof req) != 0) { *io_failed = true; return -1; }
    const uint64_t data_len = h->len - sizeof req;
    struct node_buffer * b = NULL;
    if (data_len != req.size) {
        snprintf(err, err_len, "SET_TENSOR: header says %llu bytes, message carries %llu",
                 (unsigned long long) req.size, (unsigned long long) data_len);
    } else {
        b = checked_range(c, req.handle, req.offset, req.size, err, err_len);
    }
    if (b && ggml_backend_buffer_is_host(b->buf)) {
        if (tb_recv(c->tp, b->base + req.offset, (size_t) req.size) != 0) { *io_failed = true; return -1; }
        return 0;
    }
    // Either invalid (still consume the bytes to stay in sync) or a device buffer.
    if (read_payload(c, (size_t) data_len) != 0) { *io_failed = true; return -1; }
    if (!b) return -1;
    struct ggml_tensor t = byte_view(b, req.offset, req.size);
    if (req.size) ggml_backend_tensor_set(&t, c->payload, 0, (size_t) req.size);
    return 0;
}

// ---- transports ---------------------------------------------------------------
// What to offer, and why not, is tb_upgrade_answer's to say (transport/upgrade.c:
// the same rules as on a node-to-node link). Shared memory only from workers
// with a process of their own: the segment is shared with the peer, and a
// peer that shrank it under us could crash what maps it (it needs the node's
// own user for that, mode 0600, who could do worse).

static int handle_transport_offer(struct node_conn * c, const struct tb_header * h, struct reply * r,
                                  char * err, size_t err_len) {
    const struct tb_transport_req * req = (const struct tb_transport_req *) c->payload;
    struct tb_transport_reply * rep = (struct tb_transport_reply *) r->small;
    _Static_assert(sizeof *rep <= sizeof r->small, "the transport reply fits the small reply");
    r->data = rep;
    r->len = sizeof *rep;
    tb_shm_discard(c->offered);
    tb_upgrade_answer(req, no_shm_reason(c->node), rep, &c->offered);
    c->rdma_accepted = req->kind == TB_TRANSPORT_RDMA && !rep->declined[0];   // the bring-up runs after this reply (serve_one)
    return 0;
}

// The head switches right after sending this: if we cannot follow, the session ends (*io_failed).
static int handle_transport_switch(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len,
                                   bool * io_failed) {
    struct tb_shm * seg = c->offered;
    c->offered = NULL;
    // Outside dispatch's length rule: the u32 must be there (the scratch may
    // be NULL or stale), and a head that cannot say whether it switched
    // cannot go on, on either transport.
    if (tb_check_request_len(h, err, err_len) != 0) {
        tb_shm_discard(seg);
        *io_failed = true;
        return -1;
    }
    uint32_t attached;
    memcpy(&attached, c->payload, sizeof attached);
    if (!seg) { snprintf(err, err_len, "TRANSPORT_SWITCH without an offer"); *io_failed = attached != 0; return -1; }
    if (!attached) { tb_shm_discard(seg); return 0; }
    pthread_mutex_lock(&c->send_lock);   // the watchdog sends on c->tp
    struct tb_transport * shm = tb_shm_transport(seg, c->tp, err, err_len);
    if (shm) c->tp = shm;
    pthread_mutex_unlock(&c->send_lock);
    if (!shm) { *io_failed = true; return -1; }
    node_log(c->node, "client %s: transport %s", shm->peer, shm->describe);
    return 0;
}

// Right after accepting an RDMA offer: the symmetric bring-up over TCP
// (transport/rdma.h). It switches both sides or leaves both on TCP; either
// way the session goes on. The watchdog waits on send_lock meanwhile.
static void upgrade_to_rdma(struct node_conn * c) {
    char why[256];
    pthread_mutex_lock(&c->send_lock);
    int kind;
    struct tb_transport * rdma = tb_rdma_upgrade(c->tp, NULL, &kind, why, sizeof why);
    if (rdma) {
        c->tp = rdma;
    } else if (c->tp->error_kind == TB_IO_OK) {
        snprintf(c->tp->describe, sizeof c->tp->describe, "tcp: %s", why);
        c->tp->why = kind;
    }
    pthread_mutex_unlock(&c->send_lock);
    if (rdma) node_log(c->node, "client %s: transport %s", rdma->peer, rdma->describe);
    else node_log(c->node, "client %s: stays on tcp: %s", c->tp->peer, why);
}

static int dispatch(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    // Every length rule is in proto.c's command table; HELLO compares the
    // ABI first (handle_hello), so a client of another version hears which.
    if (h->cmd != TB_CMD_HELLO && tb_check_request_len(h, err, err_len) != 0) return -1;
    switch (h->cmd) {
        case TB_CMD_HELLO:           return handle_hello(c, h, r, err, err_len);
        case TB_CMD_AUTH:            return handle_auth(c, h, r, err, err_len);
        case TB_CMD_GET_MEMORY:      return handle_memory(c, h, r, err, err_len);
        case TB_CMD_ALLOC_BUFFER:    return handle_alloc(c, h, r, err, err_len);
        case TB_CMD_FREE_BUFFER:     return handle_free(c, h, err, err_len);
        case TB_CMD_BUFFER_CLEAR:
        case TB_CMD_MEMSET_TENSOR:   return handle_memset(c, h, err, err_len);
        case TB_CMD_GET_TENSOR:      return handle_get(c, h, r, err, err_len);
        case TB_CMD_COPY_TENSOR:     return handle_copy(c, h, err, err_len);
        case TB_CMD_GRAPH_COMPUTE:   return handle_graph_compute(c, h, err, err_len);
        case TB_CMD_GRAPH_RECOMPUTE: return handle_graph_recompute(c, h, err, err_len);
        case TB_CMD_SUPPORTS_OP:     return handle_supports_op(c, h, r, err, err_len);
        case TB_CMD_GET_ALLOC_SIZE:  return handle_alloc_size(c, h, r, err, err_len);
        case TB_CMD_OPEN_FILE:       return handle_open_file(c, h, r, err, err_len);
        case TB_CMD_LOAD_FROM_FILE:  return handle_load_from_file(c, h, err, err_len);
        case TB_CMD_PEER_LISTEN:     return handle_peer_listen(c, h, r, err, err_len);
        case TB_CMD_PEER_CONNECT:    return handle_peer_connect(c, h, r, err, err_len);
        case TB_CMD_PEER_ACCEPT:     return handle_peer_accept(c, h, r, err, err_len);
        case TB_CMD_PEER_SEND:       return handle_peer_send(c, h, err, err_len);
        case TB_CMD_PEER_RECV:       return handle_peer_recv(c, h, err, err_len);
        case TB_CMD_ALLREDUCE:       return handle_allreduce(c, h, err, err_len);
        case TB_CMD_SET_TENSOR_2D:   return handle_set_2d(c, h, err, err_len);
        case TB_CMD_LOAD_FROM_FILE_2D: return handle_load_from_file_2d(c, h, err, err_len);
        case TB_CMD_SYNC:            return 0;
        case TB_CMD_STATUS:          return handle_status(c, h, r, err, err_len);
        case TB_CMD_TRANSPORT_OFFER: return handle_transport_offer(c, h, r, err, err_len);
        default:
            snprintf(err, err_len, "unknown command %u", h->cmd);
            return -1;
    }
}

static int send_reply(struct node_conn * c, const struct tb_header * h, int rc, const struct reply * r, const char * err) {
    struct tb_reply_status st = { .status = rc == 0 ? TB_STATUS_OK : (r->refusal ? r->refusal : TB_STATUS_ERROR) };
    const void * body = r->data;
    size_t body_len = r->len;
    if (rc != 0) st.peer = (uint32_t) c->failed_peer;
    if (rc == 0 && c->sticky[0]) {       // an earlier posted request failed: report that instead
        st.status = TB_STATUS_ERROR;
        st.peer = (uint32_t) c->sticky_peer;
        err = c->sticky;
    }
    if (st.status != 0) { body = err; body_len = strlen(err); }
    pthread_mutex_lock(&c->send_lock);
    int io = tb_msg_send(c->tp, h->cmd, TB_FLAG_REPLY, h->id, &st, sizeof st, body, body_len);
    if (io == 0) io = tb_flush(c->tp);
    pthread_mutex_unlock(&c->send_lock);
    c->sticky[0] = '\0';
    c->sticky_peer = 0;
    return io;
}

// Refuse a request with an error reply of status `code` (the connection is dropped after).
static void refuse(struct node_conn * c, const struct tb_header * h, int32_t code, const char * why) {
    struct reply r = { .refusal = code };
    send_reply(c, h, -1, &r, why);
}

// Before the handshake is done only HELLO, then AUTH (when the node has a
// secret), are served, each at most TB_HANDSHAKE_MAX_LEN bytes long and
// refused before their payload is read: an unauthenticated client cannot
// make the node allocate, read or run anything. 0 when h may go on.
static int handshake_gate(struct node_conn * c, const struct tb_header * h) {
    if (c->stage == READY) return 0;
    if (c->stage == NO_HELLO && h->cmd != TB_CMD_HELLO) {
        node_log(c->node, "client %s: sent %s before HELLO; dropping it", c->tp->peer, tb_cmd_name(h->cmd));
        return -1;
    }
    if (c->stage == WANT_AUTH && h->cmd != TB_CMD_AUTH) {
        char why[160];
        snprintf(why, sizeof why, "node %s requires authentication: AUTH must follow HELLO, not %s",
                 c->node->name, tb_cmd_name(h->cmd));
        node_log(c->node, "client %s: sent %s without authenticating; refused", c->tp->peer, tb_cmd_name(h->cmd));
        refuse(c, h, TB_STATUS_AUTH, why);
        return -1;
    }
    if (h->len > TB_HANDSHAKE_MAX_LEN) {
        node_log(c->node, "client %s: a %s of %llu bytes; dropping it", c->tp->peer, tb_cmd_name(h->cmd),
                 (unsigned long long) h->len);
        return -1;
    }
    return 0;
}

// How long a whole request may take to arrive: the node's timeout, plus its
// payload at MIN_REQUEST_RATE. Without it a client sending one byte just
// inside every timeout would hold its connection (and a client slot) forever.
#define MIN_REQUEST_RATE (1u << 20)   // bytes per second

static int64_t request_deadline(const struct node_conn * c, uint64_t payload) {
    const int64_t base = c->node->cfg.timeout_ms > 0 ? c->node->cfg.timeout_ms : 10000;
    return tb_now_ms() + base + (int64_t) (payload / (MIN_REQUEST_RATE / 1000));
}

// The deadline of one message: the one above, and during the handshake no
// later than the handshake's own (HELLO and AUTH together).
static int64_t message_deadline(const struct node_conn * c, uint64_t payload) {
    const int64_t d = request_deadline(c, payload);
    return c->stage != READY && c->handshake_deadline < d ? c->handshake_deadline : d;
}

// Serve one request. Returns -1 when the connection must be dropped.
static int serve_one(struct node_conn * c) {
    struct tb_header h;
    char err[512] = "";
    c->tp->deadline_ms = message_deadline(c, 0);
    const int header_rc = tb_msg_recv_header(c->tp, &h, err, sizeof err);
    c->tp->deadline_ms = header_rc == 0 ? message_deadline(c, h.len) : 0;
    if (header_rc != 0) {
        if (c->tp->error_kind != TB_IO_CLOSED) node_log(c->node, "client %s: %s; dropping it", c->tp->peer, err);
        return -1;
    }
    if (handshake_gate(c, &h) != 0) return -1;
    tb_trace_mark(c->trace, TB_TRACE_REQUEST, h.cmd);
    count(&c->slot->bytes_received, (int64_t) h.len);

    struct reply r = { 0 };
    bool io_failed = false;
    int rc;
    c->failed_peer = 0;
    if (h.cmd == TB_CMD_SET_TENSOR) {
        rc = handle_set(c, &h, err, sizeof err, &io_failed);   // receives its payload straight into the buffer
    } else {
        io_failed = read_payload(c, (size_t) h.len) != 0;
        rc = io_failed ? -1 : 0;
    }
    c->tp->deadline_ms = 0;   // the request has arrived; carrying it out has no such bound
    if (!io_failed && h.cmd == TB_CMD_TRANSPORT_SWITCH) {
        rc = handle_transport_switch(c, &h, err, sizeof err, &io_failed);
    } else if (!io_failed && h.cmd == TB_CMD_HELLO && c->stage != NO_HELLO) {
        snprintf(err, sizeof err, "HELLO: the handshake is done already");
        rc = -1;
    } else if (!io_failed && h.cmd != TB_CMD_SET_TENSOR) {
        rc = dispatch(c, &h, &r, err, sizeof err);
    }
    tb_trace_mark(c->trace, TB_TRACE_DONE, h.cmd);
    if (io_failed) {
        node_log(c->node, "client %s: %s: %s; dropping it", c->tp->peer, tb_cmd_name(h.cmd), err[0] ? err : c->tp->error);
        return -1;
    }
    if (rc != 0) node_log(c->node, "client %s: request %llu %s rejected: %s", c->tp->peer, (unsigned long long) h.id, tb_cmd_name(h.cmd), err);
    if (c->stage != READY) {   // a refused HELLO or AUTH ends the connection
        if (rc != 0) { send_reply(c, &h, rc, &r, err); return -1; }
        c->stage = h.cmd == TB_CMD_HELLO && c->node->secret_len ? WANT_AUTH : READY;
        if (h.cmd == TB_CMD_AUTH) node_log(c->node, "client %s: authenticated", c->tp->peer);
    }
    // A large message (a rejected 255 MiB SET_TENSOR, a big graph) must not
    // pin its scratch for the rest of the session.
    if (c->payload_cap > SCRATCH_KEEP && c->scratch_need < c->payload_cap / 4) {
        if (++c->scratch_idle >= SCRATCH_IDLE) {
            free(c->payload);
            c->payload = NULL;
            c->payload_cap = 0;
            c->scratch_idle = 0;
        }
    } else {
        c->scratch_idle = 0;
    }
    c->scratch_need = 0;
    if (tb_cmd_posted(h.cmd)) {
        if (rc != 0 && !c->sticky[0]) {
            snprintf(c->sticky, sizeof c->sticky, "earlier %s (request %llu) failed: %s", tb_cmd_name(h.cmd),
                     (unsigned long long) h.id, err);
            c->sticky_peer = c->failed_peer;
        }
        return 0;
    }
    if (send_reply(c, &h, rc, &r, err) != 0) return -1;
    if (c->rdma_accepted) {
        c->rdma_accepted = false;
        upgrade_to_rdma(c);
    }
    return 0;
}

static void conn_free(struct node_conn * c) {
    if (c->has_watchdog) {
        pthread_mutex_lock(&c->busy_lock);
        c->closing = true;
        pthread_cond_signal(&c->busy_changed);
        pthread_mutex_unlock(&c->busy_lock);
        pthread_join(c->watchdog, NULL);
    }
    pthread_mutex_destroy(&c->send_lock);
    pthread_mutex_destroy(&c->busy_lock);
    pthread_cond_destroy(&c->busy_changed);
    while (c->n_buffers > 0) release_buffer(c, c->n_buffers - 1);
    for (size_t i = 0; i < c->n_files; i++) close(c->files[i].fd);
    for (size_t i = 0; i < c->n_peers; i++) {
        tb_close(c->peers[i].tp);
        pthread_mutex_destroy(&c->peers[i].lock);
    }
    tb_listener_close(c->peer_listener);
    forget_kept_graphs(c);
    if (c->backend) ggml_backend_free(c->backend);
    free(c->buffers);
    free(c->payload);
    tb_shm_discard(c->offered);
    tb_trace_close(c->trace);
    tb_close(c->tp);
    free(c);
}

// Serve one client until it leaves (or the node stops), then free all it had.
static void serve_connection(struct node_conn * c) {
    struct tb_node * n = c->node;
    char peer[sizeof c->tp->peer];
    snprintf(peer, sizeof peer, "%s", c->tp->peer);
    node_log(n, "client %s connected%s", peer, n->serve_mode != SERVE_THREAD ? " (own worker process)" : "");
    // A peer that does not complete the handshake in time (a port scanner, a
    // stuck client, one that trickles a byte at a time) must not hold one of
    // the node's client slots: HELLO and AUTH together have one deadline.
    const int handshake_ms = n->cfg.timeout_ms > 0 && n->cfg.timeout_ms < TB_HANDSHAKE_MS ? n->cfg.timeout_ms : TB_HANDSHAKE_MS;
    const int64_t deadline = tb_now_ms() + handshake_ms;
    c->handshake_deadline = deadline;
    // A client that holds nothing here and says nothing gives its slot back.
    const int idle_ms = n->cfg.idle_timeout_ms > 0 ? n->cfg.idle_timeout_ms : TB_IDLE_MS;
    int64_t last_request = tb_now_ms();
    while (!n->stopping) {
        int ready = tb_poll(c->tp, IDLE_POLL_MS);
        if (c->stage != READY && tb_now_ms() >= deadline) {
            node_log(n, "client %s: no %s within %d ms; dropping it", peer, c->stage == NO_HELLO ? "HELLO" : "AUTH", handshake_ms);
            break;
        }
        if (ready == 0 && c->n_buffers == 0 && c->n_peers == 0 && tb_now_ms() - last_request >= idle_ms) {
            node_log(n, "client %s: idle for %d ms holding nothing; dropping it", peer, idle_ms);
            break;
        }
        if (ready == 0) continue;
        if (ready < 0 || serve_one(c) != 0) break;
        last_request = tb_now_ms();
    }
    conn_free(c);
    node_log(n, "client %s disconnected; its buffers are freed", peer);
}

static struct node_conn * conn_new(struct tb_node * n, int fd, struct client_slot * slot) {
    struct node_conn * c = calloc(1, sizeof *c);
    if (c) c->tp = tb_adopt(fd, n->cfg.timeout_ms);
    if (c && c->tp) c->backend = ggml_backend_dev_init(n->dev, NULL);
    if (!c || !c->tp || !c->backend) {
        node_log(n, "cannot serve a new client: out of memory or device init failed");
        if (c && c->tp) tb_close(c->tp); else close(fd);
        free(c);
        return NULL;
    }
    c->node = n;
    c->slot = slot;
    c->client_fd = fd;
    c->next_handle = 1;
    c->next_fake_base = TB_FAKE_BASE;
    c->keepalive_ms = 1000;
    c->has_file_nonce = tb_random(c->file_nonce, sizeof c->file_nonce) == 0;
    c->trace = tb_trace_open("node", n->name);
    pthread_mutex_init(&c->send_lock, NULL);
    pthread_mutex_init(&c->busy_lock, NULL);
    pthread_cond_init(&c->busy_changed, NULL);
    c->has_watchdog = pthread_create(&c->watchdog, NULL, watchdog_thread, c) == 0;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(n->dev);
    if (n->cfg.threads > 0) {
        ggml_backend_set_n_threads_t set_threads =
            (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads");
        if (set_threads) set_threads(c->backend, n->cfg.threads);
    }
    ggml_backend_set_abort_callback_t set_abort =
        (ggml_backend_set_abort_callback_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_abort_callback");
    if (set_abort) set_abort(c->backend, client_left, c);
    return c;
}

void node_serve_client(struct tb_node * n, int fd, struct client_slot * slot) {
    struct node_conn * c = conn_new(n, fd, slot);
    if (c) serve_connection(c);
}
