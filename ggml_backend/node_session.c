// node_session.c - one client's session on a node: its buffers, its ggml
// backend (stream), its model files, and the request loop.
//
// Requests are decoded and validated once, at the edge (proto.c and the
// handlers below); execution trusts what decoding produced. Posted requests
// that fail leave a sticky error that the next reply carries.
#include "ggml_abi.h"
#include "model_file.h"
#include "node_internal.h"
#include "op_rules.h"
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

#define MAX_FILES    256       // model files one client may have open (shards of a 1T model: ~13-60)
#define MAX_PEERS    16        // node-to-node links of one session (neighbours in the split)
#define FILE_CHUNK   (64u << 20)
#define SCRATCH_KEEP (4u << 20)    // request scratch always kept between requests
#define SCRATCH_IDLE 16            // more is freed after this many requests in a row that needed under a quarter of it

struct node_buffer {
    uint64_t handle;
    ggml_backend_buffer_t buf;
    uint8_t * base;
    uint64_t size;
};

struct node_conn {
    struct tb_node *      node;
    struct client_slot *  slot;
    struct tb_transport * tp;
    ggml_backend_t        backend;
    struct node_buffer *  buffers;   // dense array; few per client (weights, KV, compute)
    size_t   n_buffers, cap_buffers;
    uint64_t next_handle;
    uint64_t next_fake_base;        // what ALLOC_BUFFER tells the client its next buffer's "base" is
    uint8_t * payload;              // scratch for request payloads
    size_t   payload_cap;
    size_t   scratch_need;          // the most of it the current request asked for (scratch_reserve)
    uint32_t scratch_idle;          // requests in a row that needed under a quarter of payload_cap
    char     sticky[512];           // first failure of a posted request, reported with the next reply
    struct { struct ggml_context * ctx; struct ggml_cgraph * graph; } kept[TB_KEPT_GRAPHS];   // for GRAPH_RECOMPUTE
    struct ggml_cgraph *  graph;    // the one to run

    // While a graph computes, the watchdog thread sends KEEPALIVE so the
    // client can tell a long computation from a dead node.
    pthread_mutex_t send_lock;      // replies and keepalives share the transport
    pthread_mutex_t busy_lock;
    pthread_cond_t  busy_changed;
    enum { IDLE, COMPUTING, WAITING_FOR_PEER } busy;   // what the watchdog tells whom (watchdog_thread)
    bool      closing;
    uint32_t  keepalive_ms;         // asked for by the client at HELLO
    enum { NO_HELLO, WANT_AUTH, READY } stage;   // the handshake: HELLO, then AUTH when the node has a secret
    int64_t   handshake_deadline;   // tb_now_ms() by which the handshake must be done
    uint8_t   head_nonce[TB_NONCE_LEN], node_nonce[TB_NONCE_LEN];   // the two HELLO nonces AUTH proves over

    struct { int fd; uint64_t size; char name[TB_FILE_NAME_LEN]; } files[MAX_FILES];  // id = index + 1
    size_t    n_files;

    // Links to the same head's sessions on other nodes (id = index + 1).
    int       peer_listen_fd;       // -1 until the head asks for one
    uint64_t  peer_token;           // what a peer must present to connect
    struct { struct tb_transport * tp; bool outgoing; char name[TB_NAME_LEN]; } peers[MAX_PEERS];
    size_t    n_peers;
    pthread_t watchdog;
    bool      has_watchdog;

    struct tb_shm * offered;        // a shared-memory segment offered, until TRANSPORT_SWITCH
    bool      rdma_accepted;        // TRANSPORT_OFFER kind RDMA said yes: the bring-up follows its reply
    uint8_t   file_nonce[TB_FILE_NONCE_LEN];   // OPEN_FILE proofs answer this (sent at HELLO)
    bool      has_file_nonce;

    int       client_fd;            // the client's TCP connection (kept by every transport as liveness)
    int64_t   gone_checked_ms;      // when client_left() last looked
    bool      gone;
};

// The request scratch: grown on demand, shrunk by serve_one after a run of
// requests that needed much less (a rejected 255 MiB SET_TENSOR must not pin
// 255 MiB for the rest of the session; a prompt's all-reduces must not
// reallocate it every time either).
static int scratch_reserve(struct node_conn * c, size_t need) {
    if (need > c->scratch_need) c->scratch_need = need;
    return tb_reserve(&c->payload, &c->payload_cap, need);
}

// ---- buffers ----------------------------------------------------------------

static bool lookup_buffer(void * ctx, uint64_t handle, struct tb_buffer_view * out) {
    struct node_conn * c = ctx;
    for (size_t i = 0; i < c->n_buffers; i++) {
        if (c->buffers[i].handle == handle) {
            out->base = c->buffers[i].base;
            out->size = c->buffers[i].size;
            out->ggml_buffer = c->buffers[i].buf;
            return true;
        }
    }
    return false;
}

static struct node_buffer * find_buffer(struct node_conn * c, uint64_t handle) {
    for (size_t i = 0; i < c->n_buffers; i++) {
        if (c->buffers[i].handle == handle) return &c->buffers[i];
    }
    return NULL;
}

// A byte range [offset, offset+size) of a buffer, checked without overflow.
static struct node_buffer * checked_range(struct node_conn * c, uint64_t handle, uint64_t offset, uint64_t size,
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

static void count(uint64_t * counter, int64_t delta) {
    __atomic_add_fetch(counter, (uint64_t) delta, __ATOMIC_RELAXED);
}

static void release_buffer(struct node_conn * c, size_t i) {
    count(&c->slot->buffers, -1);
    count(&c->slot->bytes_allocated, -(int64_t) c->buffers[i].size);
    ggml_backend_buffer_free(c->buffers[i].buf);
    c->buffers[i] = c->buffers[--c->n_buffers];
}

// A 1-D byte view of a buffer range: lets us use ggml's generic tensor
// set/get/memset, which work on any device (not only host memory).
static struct ggml_tensor byte_view(struct node_buffer * b, uint64_t offset, uint64_t size) {
    struct ggml_tensor t;
    memset(&t, 0, sizeof t);
    t.type = GGML_TYPE_I8;
    t.buffer = b->buf;
    t.ne[0] = (int64_t) size; t.ne[1] = t.ne[2] = t.ne[3] = 1;
    t.nb[0] = 1; t.nb[1] = t.nb[2] = t.nb[3] = size;
    t.data = b->base + offset;
    return t;
}

// ---- request handlers -------------------------------------------------------
// Each returns 0 or -1 with err filled; `reply`/`reply_len` point at the body
// for requests that have one.

struct reply {
    const void * data;
    size_t   len;
    int32_t  refusal;                       // enum tb_reply_code of a failure (0: TB_STATUS_ERROR)
    uint8_t  small[sizeof(struct tb_auth_reply)];
};

static int expect_len(uint64_t got, size_t want, const char * what, char * err, size_t err_len) {
    if (got == want) return 0;
    snprintf(err, err_len, "%s: payload is %llu bytes, expected %zu", what, (unsigned long long) got, want);
    return -1;
}

static int reply_u64(struct reply * r, uint64_t v) {
    memcpy(r->small, &v, sizeof v);
    r->data = r->small;
    r->len = sizeof v;
    return 0;
}

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
    char no_rdma[160];
    if (tb_rdma_available(no_rdma, sizeof no_rdma)) h->caps |= TB_CAP_RDMA;
    tb_ggml_build(h->ggml_build, sizeof h->ggml_build);
    snprintf(h->device_name, sizeof h->device_name, "%s", ggml_backend_dev_name(n->dev));
    snprintf(h->device_description, sizeof h->device_description, "%s", ggml_backend_dev_description(n->dev));
    snprintf(h->node_name, sizeof h->node_name, "%s", n->name);
}

static int handle_hello(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    // The ABI leads every version's HELLO: compare it before the length, so a
    // client of another protocol version (whose HELLO may differ in size)
    // hears which versions differ, not just that the size does.
    r->refusal = TB_STATUS_VERSION;   // every refusal here means the two sides speak different versions
    if (h->len < sizeof(struct tb_abi)) return expect_len(h->len, sizeof(struct tb_hello), "HELLO", err, err_len);
    struct tb_hello * rep = (struct tb_hello *) r->small;
    memset(rep, 0, sizeof *rep);
    tb_abi_fill(&rep->abi);
    if (tb_abi_compare(&rep->abi, (const struct tb_abi *) c->payload, "client", err, err_len) != 0) return -1;
    if (expect_len(h->len, sizeof(struct tb_hello), "HELLO", err, err_len) != 0) return -1;
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
    if (expect_len(h->len, sizeof(struct tb_auth_req), "AUTH", err, err_len) != 0) return -1;
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
    if (expect_len(h->len, sizeof(struct tb_alloc_req), "ALLOC_BUFFER", err, err_len) != 0) return -1;
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

static void forget_kept_graphs(struct node_conn * c) {
    for (size_t i = 0; i < TB_KEPT_GRAPHS; i++) {
        if (c->kept[i].ctx) ggml_free(c->kept[i].ctx);
        c->kept[i].ctx = NULL;
        c->kept[i].graph = NULL;
    }
    c->graph = NULL;
}

static int handle_free(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_buffer_req), "FREE_BUFFER", err, err_len) != 0) return -1;
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
    if (expect_len(h->len, sizeof(struct tb_memset_req), tb_cmd_name(h->cmd), err, err_len) != 0) return -1;
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
    if (expect_len(h->len, sizeof(struct tb_range), "GET_TENSOR", err, err_len) != 0) return -1;
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
    if (expect_len(h->len, sizeof(struct tb_copy_req), "COPY_TENSOR", err, err_len) != 0) return -1;
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

// Decode a tensor table (+ node list for graphs) into a fresh context.
static struct ggml_context * decode_graph(struct node_conn * c, const struct tb_header * h, bool with_nodes,
                                          struct ggml_tensor *** tensors_out, struct ggml_cgraph ** graph_out,
                                          uint32_t * n_tensors_out, char * err, size_t err_len) {
    if (h->len < sizeof(struct tb_graph_header)) {
        snprintf(err, err_len, "%s: payload too short", tb_cmd_name(h->cmd));
        return NULL;
    }
    const struct tb_graph_header * gh = (const struct tb_graph_header *) c->payload;
    const uint32_t nt = gh->n_tensors, nn = with_nodes ? gh->n_nodes : 0;
    if (nt == 0 || nt > TB_MAX_GRAPH_TENSORS || nn > TB_MAX_GRAPH_NODES || (with_nodes && nn == 0)) {
        snprintf(err, err_len, "%s: %u tensors / %u nodes out of range", tb_cmd_name(h->cmd), nt, nn);
        return NULL;
    }
    const uint64_t want = sizeof *gh + (uint64_t) nt * sizeof(struct tb_wire_tensor) + (uint64_t) nn * sizeof(uint32_t);
    if (h->len != want) {
        snprintf(err, err_len, "%s: payload is %llu bytes, %u tensors and %u nodes need %llu", tb_cmd_name(h->cmd),
                 (unsigned long long) h->len, nt, nn, (unsigned long long) want);
        return NULL;
    }
    const struct tb_wire_tensor * wire = (const struct tb_wire_tensor *) (gh + 1);
    const uint32_t * node_idx = (const uint32_t *) (wire + nt);
    struct ggml_init_params ip = {
        .mem_size = ggml_tensor_overhead() * nt + (with_nodes ? ggml_graph_overhead_custom(nn, false) : 0) + nt * sizeof(void *) + 1024,
        .mem_buffer = NULL,
        .no_alloc = true,
    };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor ** tensors = calloc(nt, sizeof *tensors);
    uint8_t * seen = NULL;
    if (!ctx || !tensors) {
        snprintf(err, err_len, "out of memory decoding %u tensors", nt);
        goto fail;
    }
    if (tb_decode_tensors(ctx, wire, nt, lookup_buffer, c, with_nodes, tensors, err, err_len) != 0) goto fail;
    if (with_nodes) {
        struct ggml_cgraph * g = ggml_new_graph_custom(ctx, nn, false);
        // a tensor computed twice in one graph costs twice for nothing: refused (the cost of a graph is bounded by its size)
        seen = calloc((nt + 7) / 8, 1);
        if (!seen) { snprintf(err, err_len, "out of memory decoding %u nodes", nn); goto fail; }
        for (uint32_t i = 0; i < nn; i++) {
            if (node_idx[i] >= nt) {
                snprintf(err, err_len, "GRAPH_COMPUTE: node %u refers to tensor %u of %u", i, node_idx[i], nt);
                goto fail;
            }
            if (seen[node_idx[i] / 8] & (1u << (node_idx[i] % 8))) {
                snprintf(err, err_len, "GRAPH_COMPUTE: node %u repeats tensor %u", i, node_idx[i]);
                goto fail;
            }
            seen[node_idx[i] / 8] |= (uint8_t) (1u << (node_idx[i] % 8));
            // what the node will compute must pass the op rules (op_rules.c) and the device's own supports_op
            if (tb_op_check(tensors[node_idx[i]], node_idx[i], err, err_len) != 0) goto fail;
            if (!ggml_backend_dev_supports_op(c->node->dev, tensors[node_idx[i]])) {
                snprintf(err, err_len, "tensor %u (%s): device %s does not support it", node_idx[i],
                         ggml_op_name(tensors[node_idx[i]]->op), ggml_backend_dev_name(c->node->dev));
                goto fail;
            }
            ggml_graph_add_node(g, tensors[node_idx[i]]);
            // the use counts let ggml fuse ops (rms_norm+mul, ...) as the head's own CPU would
            const size_t slot = tbrpc_ggml_hash_slot(&g->visited_hash_set, tensors[node_idx[i]], true);
            if (slot != (size_t) -1) g->use_counts[slot] = wire[node_idx[i]].use_count;
        }
        *graph_out = g;
    }
    free(seen);
    *tensors_out = tensors;
    *n_tensors_out = nt;
    return ctx;
fail:
    free(seen);
    free(tensors);
    if (ctx) ggml_free(ctx);
    return NULL;
}

static void set_busy(struct node_conn * c, int busy) {
    pthread_mutex_lock(&c->busy_lock);
    c->busy = busy;
    pthread_cond_signal(&c->busy_changed);
    pthread_mutex_unlock(&c->busy_lock);
}

static void * watchdog_thread(void * arg) {
    struct node_conn * c = arg;
    pthread_mutex_lock(&c->busy_lock);
    while (!c->closing) {
        if (c->busy == IDLE) { pthread_cond_wait(&c->busy_changed, &c->busy_lock); continue; }
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        const uint64_t ns = (uint64_t) until.tv_nsec + (uint64_t) c->keepalive_ms * 1000000u;
        until.tv_sec += (time_t) (ns / 1000000000u);
        until.tv_nsec = (long) (ns % 1000000000u);
        if (pthread_cond_timedwait(&c->busy_changed, &c->busy_lock, &until) == 0 || c->busy == IDLE || c->closing) continue;
        pthread_mutex_lock(&c->send_lock);
        if (tb_msg_send(c->tp, TB_CMD_KEEPALIVE, TB_FLAG_REPLY, 0, NULL, 0, NULL, 0) == 0) tb_flush(c->tp);
        // A peer waiting for our output must not give up on us either, but
        // only while we compute: a session that merely waits for a peer must
        // not keep alive a peer that waits for it (two sessions, or one
        // linked to itself, would otherwise wait on each other forever).
        for (size_t i = 0; c->busy == COMPUTING && i < c->n_peers; i++) {
            if (c->peers[i].outgoing && tb_msg_send(c->peers[i].tp, TB_CMD_KEEPALIVE, 0, 0, NULL, 0, NULL, 0) == 0)
                tb_flush(c->peers[i].tp);
        }
        pthread_mutex_unlock(&c->send_lock);
    }
    pthread_mutex_unlock(&c->busy_lock);
    return NULL;
}

// The device calls this between the ops of a graph: a client that has gone
// (its connection closed) stops the computation it left behind, instead of
// the node finishing a graph nobody will read. One look every 20 ms.
static bool client_left(void * data) {
    struct node_conn * c = data;
    const int64_t now = tb_now_ms();
    if (c->gone || now - c->gone_checked_ms < 20) return c->gone;
    c->gone_checked_ms = now;
    char byte;
    const ssize_t got = recv(c->client_fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    c->gone = got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    return c->gone;
}

static int run_graph(struct node_conn * c, char * err, size_t err_len) {
    set_busy(c, COMPUTING);
    char why[400] = "";
    const int rc = tb_graph_compute_checked(c->backend, c->graph, why, sizeof why);   // row indices checked before each op
    set_busy(c, IDLE);
    count(&c->slot->graphs_computed, 1);
    if (rc != 0 && c->gone) {   // the device's abort callback (client_left) stopped it
        snprintf(err, err_len, "graph compute stopped: the client has gone");
        return -1;
    }
    if (rc != 0) {
        snprintf(err, err_len, "graph compute on %s: %s", ggml_backend_dev_name(c->node->dev), why);
        return -1;
    }
    return 0;
}

static int handle_graph_compute(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    struct ggml_tensor ** tensors = NULL;
    struct ggml_cgraph * g = NULL;
    uint32_t nt = 0;
    struct ggml_context * ctx = decode_graph(c, h, true, &tensors, &g, &nt, err, err_len);
    if (!ctx) return -1;
    free(tensors);
    const uint32_t slot = ((const struct tb_graph_header *) c->payload)->slot;
    if (slot >= TB_KEPT_GRAPHS) {
        ggml_free(ctx);
        snprintf(err, err_len, "GRAPH_COMPUTE: slot %u (a node keeps %d graphs)", slot, TB_KEPT_GRAPHS);
        return -1;
    }
    if (c->kept[slot].ctx) ggml_free(c->kept[slot].ctx);
    c->kept[slot].ctx = ctx;
    c->kept[slot].graph = g;
    c->graph = g;
    return run_graph(c, err, err_len);
}

static int handle_graph_recompute(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(uint32_t), "GRAPH_RECOMPUTE", err, err_len) != 0) return -1;
    uint32_t slot;
    memcpy(&slot, c->payload, sizeof slot);
    if (slot >= TB_KEPT_GRAPHS || !c->kept[slot].graph) {
        snprintf(err, err_len, "GRAPH_RECOMPUTE of slot %u, which holds no graph", slot);
        return -1;
    }
    c->graph = c->kept[slot].graph;
    return run_graph(c, err, err_len);
}

static int handle_supports_op(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct ggml_tensor ** tensors = NULL;
    uint32_t nt = 0;
    struct ggml_context * ctx = decode_graph(c, h, false, &tensors, NULL, &nt, err, err_len);
    if (!ctx) return -1;
    // an op the node's rules refuse is one it does not support (and the
    // device's supports_op may dereference sources the rules require)
    char why[256];
    r->small[0] = tb_op_check(tensors[nt - 1], nt - 1, why, sizeof why) == 0 &&
                  ggml_backend_dev_supports_op(c->node->dev, tensors[nt - 1]) ? 1 : 0;
    free(tensors);
    ggml_free(ctx);
    r->data = r->small;
    r->len = 1;
    return 0;
}

static int handle_alloc_size(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct ggml_tensor ** tensors = NULL;
    uint32_t nt = 0;
    struct ggml_context * ctx = decode_graph(c, h, false, &tensors, NULL, &nt, err, err_len);
    if (!ctx) return -1;
    if (tb_op_check(tensors[nt - 1], nt - 1, err, err_len) != 0) { free(tensors); ggml_free(ctx); return -1; }
    uint64_t size = ggml_backend_buft_get_alloc_size(ggml_backend_dev_buffer_type(c->node->dev), tensors[nt - 1]);
    memcpy(r->small, &size, sizeof size);
    free(tensors);
    ggml_free(ctx);
    r->data = r->small;
    r->len = sizeof size;
    return 0;
}

// A plain "*.gguf" file name: no directories, nothing hidden.
static bool is_model_file_name(const char * name) {
    size_t len = strlen(name);
    return len > 5 && name[0] != '.' && strchr(name, '/') == NULL && strcmp(name + len - 5, ".gguf") == 0;
}

// Whether `real` (a resolved path) lies inside one of the node's model directories.
static bool inside_model_dirs(const struct tb_node * n, const char * real) {
    char dirs[sizeof n->model_dirs];
    snprintf(dirs, sizeof dirs, "%s", n->model_dirs);
    char * save = NULL;
    for (char * dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        char root[PATH_MAX];
        if (!realpath(dir, root)) continue;
        const size_t len = strlen(root);
        if (strncmp(real, root, len) == 0 && (real[len] == '/' || (len == 1 && root[0] == '/'))) return true;
    }
    return false;
}

// Open `dir/name` for reading if it is a regular file whose real path lies
// inside a model directory: a symlink may point to another model directory,
// never elsewhere. Opened without blocking, so a FIFO cannot stall the worker.
// Returns the fd, or -1 with why (empty when there is simply no such file).
static int open_served_file(const struct tb_node * n, const char * dir, const char * name, char * path, size_t path_len,
                            char * why, size_t why_len) {
    why[0] = '\0';
    char given[PATH_MAX];
    snprintf(given, sizeof given, "%s/%s", dir, name);
    if (!realpath(given, path)) return -1;
    if (!inside_model_dirs(n, path)) {
        snprintf(why, why_len, "%s leads to %s, outside the model directories", given, path);
        return -1;
    }
    (void) path_len;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
        snprintf(why, why_len, "%s is not a regular file", path);
        close(fd);
        return -1;
    }
    if (fd >= 0) (void) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

// Look for the client's file in our model directories; return its id or 0.
// The file must match the head's size and fingerprint, and the head must
// prove it holds the whole file (model_file.h): a client cannot read out a
// file it does not already have.
static uint64_t open_model_file(struct node_conn * c, const struct tb_open_file * req) {
    for (size_t i = 0; i < c->n_files; i++) {
        if (strcmp(c->files[i].name, req->name) == 0) return i + 1;
    }
    if (c->n_files == MAX_FILES || !c->has_file_nonce) return 0;
    char dirs[sizeof c->node->model_dirs];
    snprintf(dirs, sizeof dirs, "%s", c->node->model_dirs);
    char * save = NULL;
    for (char * dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        char path[PATH_MAX], why[PATH_MAX + 128];
        int fd = open_served_file(c->node, dir, req->name, path, sizeof path, why, sizeof why);
        if (fd < 0) {
            if (why[0]) node_log(c->node, "client %s: refused to serve %s: %s", c->tp->peer, req->name, why);
            continue;
        }
        struct tb_file_identity mine;
        uint8_t proof[TB_FILE_PROOF_LEN];
        char read_err[128];
        const bool same = tb_file_identity_fd(fd, &mine, read_err, sizeof read_err) == 0 && mine.size == req->size &&
                          memcmp(mine.fingerprint, req->fingerprint, TB_FINGERPRINT_LEN) == 0;
        if (same && tb_file_proof_fd(fd, mine.size, c->file_nonce, proof, read_err, sizeof read_err) == 0 &&
            memcmp(proof, req->proof, sizeof proof) == 0) {
            size_t i = c->n_files++;
            c->files[i].fd = fd;
            c->files[i].size = mine.size;
            snprintf(c->files[i].name, sizeof c->files[i].name, "%s", req->name);
            node_log(c->node, "client %s: weights of %s come from this node's %s", c->tp->peer, req->name, path);
            return i + 1;
        }
        node_log(c->node, same ? "client %s: %s matches the head's fingerprint, but the head could not prove it holds "
                                 "the whole file; its weights will stream"
                               : "client %s: %s differs from the head's copy (size or fingerprint); its weights will stream",
                 c->tp->peer, path);
        close(fd);
    }
    return 0;
}

// Whether and how fast a file is found must not tell a client which files
// a node holds: every answer takes at least this long.
#define OPEN_FILE_MIN_NS (10 * 1000000ll)

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static int handle_open_file(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_open_file), "OPEN_FILE", err, err_len) != 0) return -1;
    const int64_t started = now_ns();
    struct tb_open_file * req = (struct tb_open_file *) c->payload;
    req->name[TB_FILE_NAME_LEN - 1] = '\0';
    uint64_t id = 0;
    if (!is_model_file_name(req->name)) {
        node_log(c->node, "client %s: refused to open '%s': not a plain *.gguf name", c->tp->peer, req->name);
    } else if (c->node->model_dirs[0]) {
        id = open_model_file(c, req);
    }
    const int64_t left = OPEN_FILE_MIN_NS - (now_ns() - started);
    if (left > 0) {
        struct timespec pause = { .tv_sec = (time_t) (left / 1000000000ll), .tv_nsec = (long) (left % 1000000000ll) };
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {}
    }
    return reply_u64(r, id);
}

// Fill [offset, offset+size) of a buffer from an open model file.
static int handle_load_from_file(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_file_range), "LOAD_FROM_FILE", err, err_len) != 0) return -1;
    const struct tb_file_range req = *(const struct tb_file_range *) c->payload;
    if (req.file_id == 0 || req.file_id > c->n_files) {
        snprintf(err, err_len, "LOAD_FROM_FILE: unknown file id %llu", (unsigned long long) req.file_id);
        return -1;
    }
    const int fd = c->files[req.file_id - 1].fd;
    const uint64_t file_size = c->files[req.file_id - 1].size;
    if (req.file_offset > file_size || req.size > file_size - req.file_offset) {
        snprintf(err, err_len, "LOAD_FROM_FILE: [%llu, +%llu) lies outside %s (%llu bytes)", (unsigned long long) req.file_offset,
                 (unsigned long long) req.size, c->files[req.file_id - 1].name, (unsigned long long) file_size);
        return -1;
    }
    struct node_buffer * b = checked_range(c, req.handle, req.offset, req.size, err, err_len);
    if (!b) return -1;
    const bool host = ggml_backend_buffer_is_host(b->buf);
    if (!host && scratch_reserve(c, FILE_CHUNK) != 0) {   // device memory: read through the scratch buffer
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    for (uint64_t done = 0; done < req.size;) {
        size_t want = req.size - done < FILE_CHUNK ? (size_t) (req.size - done) : FILE_CHUNK;
        uint8_t * dst = host ? b->base + req.offset + done : c->payload;
        ssize_t got = pread(fd, dst, want, (off_t) (req.file_offset + done));
        if (got <= 0) {
            snprintf(err, err_len, "LOAD_FROM_FILE: reading %s failed: %s", c->files[req.file_id - 1].name,
                     got == 0 ? "file is shorter than it was" : strerror(errno));
            return -1;
        }
        if (!host) {
            struct ggml_tensor t = byte_view(b, req.offset + done, (uint64_t) got);
            ggml_backend_tensor_set(&t, c->payload, 0, (size_t) got);
        }
        done += (uint64_t) got;
    }
    count(&c->slot->bytes_from_files, (int64_t) req.size);
    return 0;
}

// ---- strided writes (a weight's slice of every row) ----------------------------

// The rows [offset + i*stride, +size) for i < n of a buffer, checked without
// overflow: the span from the first row to the end of the last lies inside.
static struct node_buffer * checked_rows(struct node_conn * c, uint64_t handle, uint64_t offset, uint64_t size, uint64_t n,
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

static void write_rows(struct node_buffer * b, uint64_t offset, uint64_t stride, const uint8_t * rows, uint64_t size,
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
    if (h->len < sizeof req) { snprintf(err, err_len, "SET_TENSOR_2D: payload too short"); return -1; }
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

// Rows from a model file, read in chunks that cover whole runs of rows (one
// pread of up to FILE_CHUNK, not one per row: a row of a slice may be a few
// hundred bytes).
static int handle_load_from_file_2d(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_file_range_2d), "LOAD_FROM_FILE_2D", err, err_len) != 0) return -1;
    const struct tb_file_range_2d req = *(const struct tb_file_range_2d *) c->payload;
    if (req.file_id == 0 || req.file_id > c->n_files) {
        snprintf(err, err_len, "LOAD_FROM_FILE_2D: unknown file id %llu", (unsigned long long) req.file_id);
        return -1;
    }
    struct node_buffer * b = checked_rows(c, req.handle, req.offset, req.size, req.n_copies, req.stride, "LOAD_FROM_FILE_2D",
                                          err, err_len);
    if (!b) return -1;
    if (req.size > FILE_CHUNK) {   // the head sends rows this large one by one (LOAD_FROM_FILE)
        snprintf(err, err_len, "LOAD_FROM_FILE_2D: rows of %llu bytes (at most %u)", (unsigned long long) req.size, FILE_CHUNK);
        return -1;
    }
    const int fd = c->files[req.file_id - 1].fd;
    const uint64_t file_size = c->files[req.file_id - 1].size;
    uint64_t file_span;
    if (req.file_stride < req.size || __builtin_mul_overflow(req.n_copies - 1, req.file_stride, &file_span) ||
        __builtin_add_overflow(file_span, req.size, &file_span) || req.file_offset > file_size ||
        file_span > file_size - req.file_offset) {
        snprintf(err, err_len, "LOAD_FROM_FILE_2D: those rows lie outside %s (%llu bytes)", c->files[req.file_id - 1].name,
                 (unsigned long long) file_size);
        return -1;
    }
    const uint64_t rows_per_read = req.file_stride >= FILE_CHUNK ? 1 : FILE_CHUNK / req.file_stride;
    const size_t chunk = (size_t) ((rows_per_read - 1) * req.file_stride + req.size);
    if (scratch_reserve(c, chunk) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
    for (uint64_t first = 0; first < req.n_copies; first += rows_per_read) {
        const uint64_t rows = req.n_copies - first < rows_per_read ? req.n_copies - first : rows_per_read;
        const size_t want = (size_t) ((rows - 1) * req.file_stride + req.size);
        for (size_t done = 0; done < want;) {
            ssize_t got = pread(fd, c->payload + done, want - done, (off_t) (req.file_offset + first * req.file_stride + done));
            if (got <= 0) {
                snprintf(err, err_len, "LOAD_FROM_FILE_2D: reading %s failed: %s", c->files[req.file_id - 1].name,
                         got == 0 ? "file is shorter than it was" : strerror(errno));
                return -1;
            }
            done += (size_t) got;
        }
        write_rows(b, req.offset + first * req.stride, req.stride, c->payload, req.size, rows, req.file_stride);
    }
    count(&c->slot->bytes_from_files, (int64_t) (req.size * req.n_copies));
    return 0;
}

// ---- node-to-node links ------------------------------------------------------
// The head links the session that computes layer k with the one that
// computes layer k+1; activations then go straight from node to node and
// the head waits only for the last node's logits. Setup (three called
// requests) happens once per pair; a pair that cannot connect answers 0 and
// the head keeps relaying.

static uint64_t random_token(void) {
    uint64_t t = 0;
    while (t == 0 && tb_random(&t, sizeof t) == 0) {}
    return t ? t : (uint64_t) time(NULL) * 0x9e3779b97f4a7c15ull;
}

static uint64_t add_peer(struct node_conn * c, struct tb_transport * tp, bool outgoing, const char * name) {
    if (c->n_peers == MAX_PEERS) { tb_close(tp); return 0; }
    // The head's own timeout (three keepalive periods) bounds a silent peer
    // too; HELLO keeps keepalive_ms under TB_KEEPALIVE_MAX_MS, so this cannot overflow.
    tp->timeout_ms = (int) (c->keepalive_ms * 3u);
    pthread_mutex_lock(&c->send_lock);     // the watchdog walks this list
    c->peers[c->n_peers].tp = tp;
    c->peers[c->n_peers].outgoing = outgoing;
    snprintf(c->peers[c->n_peers].name, sizeof c->peers[c->n_peers].name, "%s", name);
    uint64_t id = ++c->n_peers;
    pthread_mutex_unlock(&c->send_lock);
    return id;
}

static int handle_peer_listen(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    if (expect_len(h->len, 0, "PEER_LISTEN", err, err_len) != 0) return -1;
    struct tb_peer_listen_reply rep = { 0, 0 };
    if (c->peer_listen_fd < 0) {
        char why[256];
        c->peer_listen_fd = tb_tcp_listen(c->node->host, 0, why, sizeof why);
        if (c->peer_listen_fd < 0) node_log(c->node, "client %s: cannot listen for peers: %s", c->tp->peer, why);
        c->peer_token = random_token();
    }
    if (c->peer_listen_fd >= 0) {
        rep.token = c->peer_token;
        rep.port = (uint64_t) tb_tcp_bound_port(c->peer_listen_fd);
    }
    memcpy(r->small, &rep, sizeof rep);
    r->data = r->small;
    r->len = sizeof rep;
    return 0;
}

// Dial a peer session's listener. Nothing is sent before the listener has
// proven it knows the link key (the cluster secret and the listener's token,
// which only the head and that listener have): a port that is not a tbrpc
// listener of this cluster receives not a byte, and the reply (0) does not
// say whether anything answered. Bounded by the head's timeout.
static int handle_peer_connect(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_peer_connect), "PEER_CONNECT", err, err_len) != 0) return -1;
    struct tb_peer_connect * req = (struct tb_peer_connect *) c->payload;
    req->host[sizeof req->host - 1] = '\0';
    char why[256] = "bad port";
    const int timeout_ms = c->node->cfg.timeout_ms > 0 ? c->node->cfg.timeout_ms : 10000;
    struct tb_transport * tp = req->port > 0 && req->port < 65536
        ? tb_tcp_connect(req->host, (int) req->port, timeout_ms, why, sizeof why) : NULL;
    uint8_t key[TB_MAC_LEN], mac[TB_MAC_LEN];
    tb_peer_key(c->node->secret, c->node->secret_len, req->token, key);
    struct tb_peer_greeting greeting;
    struct tb_peer_answer answer;
    struct tb_peer_confirm confirm;
    static const uint8_t zeros[TB_NONCE_LEN];
    bool ok = false;
    if (tp) {
        tp->deadline_ms = tb_now_ms() + timeout_ms;   // the whole exchange, not each read
        snprintf(why, sizeof why, "it did not prove it is a tbrpc node of this cluster");
        if (tb_recv(tp, &greeting, sizeof greeting) == 0 && memcmp(greeting.magic, TB_PEER_MAGIC, sizeof TB_PEER_MAGIC) == 0) {
            tb_auth_mac(key, sizeof key, TB_PEER_ROLE_GREET, greeting.nonce, zeros, NULL, 0, mac);
            if (tb_equal_ct(mac, greeting.mac, TB_MAC_LEN) && tb_random(answer.nonce, TB_NONCE_LEN) == 0) {
                memset(answer.name, 0, sizeof answer.name);   // our name, so the peer can say who went silent
                snprintf(answer.name, sizeof answer.name, "%s", c->node->name);
                tb_auth_mac(key, sizeof key, TB_PEER_ROLE_DIALER, greeting.nonce, answer.nonce, answer.name,
                            sizeof answer.name, answer.mac);
                if (tb_send(tp, &answer, sizeof answer) == 0 && tb_flush(tp) == 0 &&
                    tb_recv(tp, &confirm, sizeof confirm) == 0) {
                    tb_auth_mac(key, sizeof key, TB_PEER_ROLE_LISTENER, greeting.nonce, answer.nonce, NULL, 0, mac);
                    ok = tb_equal_ct(mac, confirm.mac, TB_MAC_LEN);
                }
            }
        }
    }
    memset(key, 0, sizeof key);
    if (!ok) {
        node_log(c->node, "client %s: cannot reach peer %s:%llu (%s); activations will go through the head",
                 c->tp->peer, req->host, (unsigned long long) req->port, why);
        tb_close(tp);
        return reply_u64(r, 0);
    }
    tp->deadline_ms = 0;
    char them[TB_NAME_LEN + 32];
    snprintf(them, sizeof them, "%s:%llu", req->host, (unsigned long long) req->port);
    return reply_u64(r, add_peer(c, tp, true, them));
}

// One dialer on our listener: greet it with proof that we know the link key,
// then it proves the same over both nonces, then we confirm. 0 when it did.
static int greet_dialer(struct node_conn * c, struct tb_transport * tp, char name[TB_NAME_LEN]) {
    uint8_t key[TB_MAC_LEN], mac[TB_MAC_LEN];
    static const uint8_t zeros[TB_NONCE_LEN];
    struct tb_peer_greeting greeting;
    struct tb_peer_answer answer;
    struct tb_peer_confirm confirm;
    memset(&greeting, 0, sizeof greeting);
    memcpy(greeting.magic, TB_PEER_MAGIC, sizeof TB_PEER_MAGIC);
    if (tb_random(greeting.nonce, TB_NONCE_LEN) != 0) return -1;
    tb_peer_key(c->node->secret, c->node->secret_len, c->peer_token, key);
    tb_auth_mac(key, sizeof key, TB_PEER_ROLE_GREET, greeting.nonce, zeros, NULL, 0, greeting.mac);
    int rc = -1;
    if (tb_send(tp, &greeting, sizeof greeting) == 0 && tb_flush(tp) == 0 && tb_recv(tp, &answer, sizeof answer) == 0) {
        tb_auth_mac(key, sizeof key, TB_PEER_ROLE_DIALER, greeting.nonce, answer.nonce, answer.name, sizeof answer.name, mac);
        if (tb_equal_ct(mac, answer.mac, TB_MAC_LEN)) {
            tb_auth_mac(key, sizeof key, TB_PEER_ROLE_LISTENER, greeting.nonce, answer.nonce, NULL, 0, confirm.mac);
            if (tb_send(tp, &confirm, sizeof confirm) == 0 && tb_flush(tp) == 0) rc = 0;
            memcpy(name, answer.name, TB_NAME_LEN);
            name[TB_NAME_LEN - 1] = '\0';
        }
    }
    memset(key, 0, sizeof key);
    return rc;
}

// Wait (the head's timeout) for the dialer the head sent our way; anyone
// else who connects meanwhile is refused and the wait goes on.
static int handle_peer_accept(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(uint64_t), "PEER_ACCEPT", err, err_len) != 0) return -1;
    uint64_t token;
    memcpy(&token, c->payload, sizeof token);
    if (c->peer_listen_fd < 0 || token != c->peer_token) return reply_u64(r, 0);
    const int timeout_ms = c->node->cfg.timeout_ms > 0 ? c->node->cfg.timeout_ms : 10000;
    const int64_t deadline = tb_now_ms() + timeout_ms;
    struct pollfd p = { .fd = c->peer_listen_fd, .events = POLLIN };
    for (int64_t left = timeout_ms; left > 0; left = deadline - tb_now_ms()) {
        // The head sends its next request only once the dialer has given up
        // (peer_link in client.c): then no one is coming, and the wait ends.
        if (poll(&p, 1, left < 50 ? (int) left : 50) <= 0) {
            if (tb_poll(c->tp, 0) > 0) break;
            continue;
        }
        int fd = accept(c->peer_listen_fd, NULL, NULL);
        if (fd < 0) continue;
        struct tb_transport * tp = tb_tcp_from_fd(fd, timeout_ms);
        if (!tp) continue;
        tp->deadline_ms = deadline;
        char name[TB_NAME_LEN] = { 0 };
        if (greet_dialer(c, tp, name) == 0) {
            tp->deadline_ms = 0;
            return reply_u64(r, add_peer(c, tp, false, name));
        }
        node_log(c->node, "client %s: a peer link attempt from %s did not prove it knows the link key; refused",
                 c->tp->peer, tp->peer);
        tb_close(tp);
    }
    return reply_u64(r, 0);
}

// The peer and the buffer range a PEER_SEND/PEER_RECV names, validated.
static struct node_buffer * peer_range(struct node_conn * c, const struct tb_peer_range * req, bool outgoing,
                                       struct tb_transport ** tp, char * err, size_t err_len) {
    if (req->peer_id == 0 || req->peer_id > c->n_peers || c->peers[req->peer_id - 1].outgoing != outgoing) {
        snprintf(err, err_len, "unknown %s peer %llu", outgoing ? "outgoing" : "incoming", (unsigned long long) req->peer_id);
        return NULL;
    }
    if (req->size > TB_MAX_PAYLOAD) {
        snprintf(err, err_len, "a peer transfer of %llu bytes exceeds the message limit", (unsigned long long) req->size);
        return NULL;
    }
    *tp = c->peers[req->peer_id - 1].tp;
    return checked_range(c, req->handle, req->offset, req->size, err, err_len);
}

// One PEER_SEND frame of `size` bytes on an outgoing link.
static int send_to_peer(struct node_conn * c, struct tb_transport * tp, const void * data, uint64_t size) {
    pthread_mutex_lock(&c->send_lock);     // the watchdog sends keepalives on peer links too
    int rc = tb_msg_send(tp, TB_CMD_PEER_SEND, 0, 0, data, (size_t) size, NULL, 0);
    if (rc == 0) rc = tb_flush(tp);
    pthread_mutex_unlock(&c->send_lock);
    return rc;
}

// The next PEER_SEND frame on an incoming link, which must carry `size`
// bytes, into dst. The sending node's keepalives reset our timeout while it computes.
static int recv_from_peer(struct tb_transport * tp, void * dst, uint64_t size, char * err, size_t err_len) {
    struct tb_header ph;
    int rc;
    do {
        rc = tb_msg_recv_header(tp, &ph, err, err_len);
    } while (rc == 0 && ph.cmd == TB_CMD_KEEPALIVE && ph.len == 0);
    if (rc == 0 && (ph.cmd != TB_CMD_PEER_SEND || ph.len != size)) {
        snprintf(err, err_len, "the peer sent %s of %llu bytes, expected %llu", tb_cmd_name(ph.cmd),
                 (unsigned long long) ph.len, (unsigned long long) size);
        return -1;
    }
    if (rc == 0 && tb_recv(tp, dst, (size_t) size) != 0) { snprintf(err, err_len, "%s", tp->error); return -1; }
    return rc;
}

static int handle_peer_send(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_peer_range), "PEER_SEND", err, err_len) != 0) return -1;
    const struct tb_peer_range req = *(const struct tb_peer_range *) c->payload;
    struct tb_transport * tp = NULL;
    struct node_buffer * b = peer_range(c, &req, true, &tp, err, err_len);
    if (!b) return -1;
    const uint8_t * data = b->base + req.offset;
    if (!ggml_backend_buffer_is_host(b->buf)) {
        if (scratch_reserve(c, (size_t) req.size) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
        struct ggml_tensor t = byte_view(b, req.offset, req.size);
        ggml_backend_tensor_get(&t, c->payload, 0, (size_t) req.size);
        data = c->payload;
    }
    if (send_to_peer(c, tp, data, req.size) != 0) { snprintf(err, err_len, "PEER_SEND: %s", tp->error); return -1; }
    return 0;
}

static int handle_peer_recv(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_peer_range), "PEER_RECV", err, err_len) != 0) return -1;
    const struct tb_peer_range req = *(const struct tb_peer_range *) c->payload;
    struct tb_transport * tp = NULL;
    struct node_buffer * b = peer_range(c, &req, false, &tp, err, err_len);
    if (!b) return -1;
    set_busy(c, WAITING_FOR_PEER);   // waiting for the peer's compute: keep the head informed
    const bool host = ggml_backend_buffer_is_host(b->buf);
    char why[256] = "";
    int rc = host ? 0 : scratch_reserve(c, (size_t) req.size);
    if (rc != 0) snprintf(why, sizeof why, "out of memory");
    if (rc == 0) rc = recv_from_peer(tp, host ? b->base + req.offset : c->payload, req.size, why, sizeof why);
    if (rc == 0 && !host) {
        struct ggml_tensor t = byte_view(b, req.offset, req.size);
        ggml_backend_tensor_set(&t, c->payload, 0, (size_t) req.size);
    }
    set_busy(c, IDLE);
    if (rc != 0) snprintf(err, err_len, "waiting for activations from node %s: %s", c->peers[req.peer_id - 1].name, why);
    return rc;
}

// ALLREDUCE: a thread sends our partial to every peer, in node order, while
// this one receives theirs in node order and adds all of them, ours at our
// place, in node order: the same additions on every node, so the same bits.
// Sending and receiving in ascending node order on every node cannot
// deadlock: node 0 is every sender's first target and reads them in turn,
// and so on up.
// Partials up to this size are sent before receiving, from this thread:
// each fits the kernel's socket buffers (or a shared-memory ring) without
// the peer reading yet, and a decoded token's partials (n_embd floats: 28 KiB
// for Kimi K2) skip a thread start. Larger ones (prompts) use the thread.
#define ALLREDUCE_INLINE (32u << 10)

struct reduce_send {
    struct node_conn * c;
    const struct tb_allreduce * req;
    const void * mine;
    int rc;
    char err[256];
};

static void * reduce_send_thread(void * arg) {
    struct reduce_send * s = arg;
    for (uint32_t k = 0; k < s->req->n && s->rc == 0; k++) {
        if (k == s->req->self) continue;
        struct tb_transport * tp = s->c->peers[s->req->peer_out[k] - 1].tp;
        if (send_to_peer(s->c, tp, s->mine, s->req->size) != 0) {
            snprintf(s->err, sizeof s->err, "sending to node %s: %s", s->c->peers[s->req->peer_out[k] - 1].name, tp->error);
            s->rc = -1;
        }
    }
    return NULL;
}

static int allreduce_check(struct node_conn * c, const struct tb_allreduce * req, char * err, size_t err_len) {
    if (req->n < 2 || req->n > TB_MAX_ALLREDUCE_NODES || req->self >= req->n) {
        snprintf(err, err_len, "ALLREDUCE: node %u of %u", req->self, req->n);
        return -1;
    }
    if (req->type != GGML_TYPE_F32 || req->size % sizeof(float) != 0 || req->size > TB_MAX_PAYLOAD) {
        snprintf(err, err_len, "ALLREDUCE: %llu bytes of type %u (F32 up to the message limit only)",
                 (unsigned long long) req->size, req->type);
        return -1;
    }
    for (uint32_t k = 0; k < req->n; k++) {
        if (k == req->self) continue;
        const uint64_t out = req->peer_out[k], in = req->peer_in[k];
        if (out == 0 || out > c->n_peers || !c->peers[out - 1].outgoing || in == 0 || in > c->n_peers ||
            c->peers[in - 1].outgoing) {
            snprintf(err, err_len, "ALLREDUCE: no link to and from node %u (peer ids %llu, %llu)", k,
                     (unsigned long long) out, (unsigned long long) in);
            return -1;
        }
    }
    return 0;
}

static int handle_allreduce(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_allreduce), "ALLREDUCE", err, err_len) != 0) return -1;
    const struct tb_allreduce req = *(const struct tb_allreduce *) c->payload;
    if (allreduce_check(c, &req, err, err_len) != 0) return -1;
    struct node_buffer * b = checked_range(c, req.handle, req.offset, req.size, err, err_len);
    if (!b) return -1;
    // Scratch: ours, then a peer's, then (for device memory) the sum. In host
    // memory the sum is made in the buffer itself, ours having been copied out.
    const bool host = ggml_backend_buffer_is_host(b->buf);
    const size_t size = (size_t) req.size, n_floats = size / sizeof(float);
    if (scratch_reserve(c, (host ? 2 : 3) * size) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
    float * mine = (float *) c->payload, * part_buf = mine + n_floats;
    float * acc = host ? (float *) (b->base + req.offset) : part_buf + n_floats;
    struct ggml_tensor t = byte_view(b, req.offset, req.size);
    if (req.flags & TB_ALLREDUCE_COMPUTED) ggml_backend_tensor_get(&t, mine, 0, size);
    else memset(mine, 0, size);
    const int64_t started = now_ns();
    set_busy(c, COMPUTING);   // peers waiting for our partial hear keepalives, as during a graph
    struct reduce_send s = { .c = c, .req = &req, .mine = mine, .rc = 0 };
    pthread_t sender;
    const bool inline_send = size <= ALLREDUCE_INLINE;
    if (inline_send) {
        reduce_send_thread(&s);
    } else if (pthread_create(&sender, NULL, reduce_send_thread, &s) != 0) {
        set_busy(c, IDLE);
        snprintf(err, err_len, "ALLREDUCE: cannot start a thread");
        return -1;
    }
    int rc = 0;
    for (uint32_t k = 0; k < req.n && rc == 0; k++) {
        const float * part = mine;
        if (k != req.self) {
            char why[256] = "";
            rc = recv_from_peer(c->peers[req.peer_in[k] - 1].tp, part_buf, req.size, why, sizeof why);
            if (rc != 0) { snprintf(err, err_len, "ALLREDUCE: from node %s: %s", c->peers[req.peer_in[k] - 1].name, why); break; }
            part = part_buf;
        }
        if (k == 0) memcpy(acc, part, size);
        else for (size_t i = 0; i < n_floats; i++) acc[i] += part[i];
    }
    if (!inline_send) pthread_join(sender, NULL);
    set_busy(c, IDLE);
    if (rc == 0 && s.rc != 0) { snprintf(err, err_len, "ALLREDUCE: %s", s.err); rc = -1; }
    if (rc == 0 && !host) ggml_backend_tensor_set(&t, acc, 0, size);
    count(&c->slot->allreduces, 1);
    count(&c->slot->allreduce_ns, now_ns() - started);
    return rc;
}

static int handle_status(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    if (expect_len(h->len, 0, "STATUS", err, err_len) != 0) return -1;
    struct tb_status * s = (struct tb_status *) r->small;
    tb_node_get_status(c->node, s);
    r->data = s;
    r->len = sizeof *s;
    return 0;
}

static int handle_memory(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    if (expect_len(h->len, 0, "GET_MEMORY", err, err_len) != 0) return -1;
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
    if (h->len < sizeof req) { snprintf(err, err_len, "SET_TENSOR: payload too short"); *io_failed = true; return -1; }
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
// A head on this host may move the connection into shared memory. Only
// workers with a process of their own offer it: the segment is shared with
// the head, and a head that shrank it under us could crash what maps it
// (it needs the node's own user for that, mode 0600, who could do worse).

static int handle_transport_offer(struct node_conn * c, const struct tb_header * h, struct reply * r,
                                  char * err, size_t err_len) {
    if (expect_len(h->len, sizeof(struct tb_transport_req), "TRANSPORT_OFFER", err, err_len) != 0) return -1;
    const struct tb_transport_req * req = (const struct tb_transport_req *) c->payload;
    struct tb_transport_reply * rep = (struct tb_transport_reply *) r->small;
    _Static_assert(sizeof *rep <= sizeof r->small, "the transport reply fits the small reply");
    memset(rep, 0, sizeof *rep);
    r->data = rep;
    r->len = sizeof *rep;
    tb_shm_discard(c->offered);
    c->offered = NULL;
    c->rdma_accepted = false;
    if (req->kind == TB_TRANSPORT_RDMA) {   // the bring-up runs after this reply (serve_one)
        c->rdma_accepted = tb_rdma_available(rep->declined, sizeof rep->declined);
        if (!c->rdma_accepted && !rep->declined[0]) snprintf(rep->declined, sizeof rep->declined, "no RDMA here");
        if (c->rdma_accepted) rep->declined[0] = '\0';
    } else if (req->kind != TB_TRANSPORT_SHM) {
        snprintf(rep->declined, sizeof rep->declined, "the node knows no transport of kind %u", req->kind);
    } else if (c->node->serve_mode == SERVE_THREAD) {
        snprintf(rep->declined, sizeof rep->declined, "the node serves clients in threads (--isolation thread)");
    } else if (!tb_ring_geometry_ok(req->slots, req->stride)) {
        snprintf(rep->declined, sizeof rep->declined, "no ring of %u slots of %u bytes", req->slots, req->stride);
    } else {
        c->offered = tb_shm_create(req->slots, req->stride, &rep->offer, rep->declined, sizeof rep->declined);
    }
    return 0;
}

// The head switches right after sending this: if we cannot follow, the session ends (*io_failed).
static int handle_transport_switch(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len,
                                   bool * io_failed) {
    if (expect_len(h->len, sizeof(uint32_t), "TRANSPORT_SWITCH", err, err_len) != 0) return -1;
    uint32_t attached;
    memcpy(&attached, c->payload, sizeof attached);
    struct tb_shm * seg = c->offered;
    c->offered = NULL;
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
    struct tb_transport * rdma = tb_rdma_upgrade(c->tp, NULL, why, sizeof why);
    if (rdma) c->tp = rdma;
    else if (c->tp->error_kind == TB_IO_OK) snprintf(c->tp->describe, sizeof c->tp->describe, "tcp: %s", why);
    pthread_mutex_unlock(&c->send_lock);
    if (rdma) node_log(c->node, "client %s: transport %s", rdma->peer, rdma->describe);
    else node_log(c->node, "client %s: stays on tcp: %s", c->tp->peer, why);
}

static int dispatch(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
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
        case TB_CMD_SYNC:            return expect_len(h->len, 0, "SYNC", err, err_len);
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
    if (rc == 0 && c->sticky[0]) {       // an earlier posted request failed: report that instead
        st.status = TB_STATUS_ERROR;
        err = c->sticky;
    }
    if (st.status != 0) { body = err; body_len = strlen(err); }
    pthread_mutex_lock(&c->send_lock);
    int io = tb_msg_send(c->tp, h->cmd, TB_FLAG_REPLY, h->id, &st, sizeof st, body, body_len);
    if (io == 0) io = tb_flush(c->tp);
    pthread_mutex_unlock(&c->send_lock);
    c->sticky[0] = '\0';
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
    count(&c->slot->bytes_received, (int64_t) h.len);

    struct reply r = { 0 };
    bool io_failed = false;
    int rc;
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
        if (rc != 0 && !c->sticky[0]) snprintf(c->sticky, sizeof c->sticky, "earlier %s (request %llu) failed: %s",
                                               tb_cmd_name(h.cmd), (unsigned long long) h.id, err);
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
    for (size_t i = 0; i < c->n_peers; i++) tb_close(c->peers[i].tp);
    if (c->peer_listen_fd >= 0) close(c->peer_listen_fd);
    forget_kept_graphs(c);
    if (c->backend) ggml_backend_free(c->backend);
    free(c->buffers);
    free(c->payload);
    tb_shm_discard(c->offered);
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
    if (c) c->tp = tb_tcp_from_fd(fd, n->cfg.timeout_ms);
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
    c->peer_listen_fd = -1;
    c->has_file_nonce = tb_random(c->file_nonce, sizeof c->file_nonce) == 0;
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
