// node_session.h - what the files of one client's session on a node share:
// the session (struct node_conn), its buffers, and the request handlers
// each file contributes. node_session.c holds the core (buffers, the
// handshake, transports, the request loop); node_graphs.c graphs and op
// questions; node_files.c the node's own model files; node_links.c
// node-to-node links and the all-reduce over them. Not part of the C API.
#pragma once

#include "ggml_abi.h"
#include "node_internal.h"
#include "trace.h"

#include <string.h>

#define MAX_FILES    256       // model files one client may have open (shards of a 1T model: ~13-60)
#define MAX_PEERS    16        // node-to-node links of one session (neighbours in the split)
#define FILE_CHUNK   (64u << 20)

struct node_buffer {
    uint64_t handle;
    ggml_backend_buffer_t buf;
    uint8_t * base;
    uint64_t size;
};

// A link to the same head's session on another node: messages go one way
// on it (outgoing: we send, the other side receives).
struct node_peer {
    struct tb_transport * tp;
    int anchor;                     // tp's TCP connection (every transport keeps it, and owns it): a peer gone shows there
    bool outgoing;
    char name[TB_NAME_LEN];
    pthread_mutex_t lock;           // its sends: the session, a mesh all-reduce's sender thread, the watchdog
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
    uint64_t failed_peer;           // the peer id of the link whose failure failed the current request (0: none)
    uint64_t sticky_peer;           // the same for the sticky failure
    struct { struct ggml_context * ctx; struct ggml_cgraph * graph; uint64_t cost; } kept[TB_KEPT_GRAPHS];   // for GRAPH_RECOMPUTE
    struct ggml_cgraph *  graph;    // the one to run

    // While a graph computes, the watchdog thread sends KEEPALIVE so the
    // client can tell a long computation from a dead node.
    pthread_mutex_t send_lock;      // replies and keepalives share the transport to the head; the peer list grows under it
    pthread_mutex_t busy_lock;      // guards closing; busy_changed wakes the watchdog to end it
    pthread_cond_t  busy_changed;
    int       busy;                 // IDLE, COMPUTING, WAITING_FOR_PEER or SENDING_TO_PEER: what the watchdog tells whom (atomic)
    int64_t   busy_since_ms;        // tb_now_ms() when it last left IDLE (atomic)
    bool      closing;
    uint32_t  keepalive_ms;         // asked for by the client at HELLO
    enum { NO_HELLO, WANT_AUTH, READY } stage;   // the handshake: HELLO, then AUTH when the node has a secret
    int64_t   handshake_deadline;   // tb_now_ms() by which the handshake must be done
    uint8_t   head_nonce[TB_NONCE_LEN], node_nonce[TB_NONCE_LEN];   // the two HELLO nonces AUTH proves over

    struct { int fd; uint64_t size; char name[TB_FILE_NAME_LEN]; } files[MAX_FILES];  // id = index + 1
    size_t    n_files;

    // Links to the same head's sessions on other nodes (id = index + 1).
    struct tb_listener * peer_listener;   // NULL until the head asks for one
    uint64_t  peer_token;           // what a peer must present to connect
    struct node_peer peers[MAX_PEERS];
    size_t    n_peers;
    pthread_t watchdog;
    bool      has_watchdog;

    struct tb_shm * offered;        // a shared-memory segment offered, until TRANSPORT_SWITCH
    bool      rdma_accepted;        // TRANSPORT_OFFER kind RDMA said yes: the bring-up follows its reply
    uint8_t   file_nonce[TB_FILE_NONCE_LEN];   // OPEN_FILE proofs answer this (sent at HELLO)
    bool      has_file_nonce;

    int       client_fd;            // the client's TCP connection (kept by every transport as liveness)
    struct tb_trace * trace;        // TBRPC_TRACE: when requests came and graphs ran (NULL: off)
    int64_t   gone_checked_ms;      // when client_left() last looked
    bool      gone;
};

// Request handlers// Each returns 0 or -1 with err filled; `reply`/`reply_len` point at the body
// for requests that have one.
struct reply {
    const void * data;
    size_t   len;
    int32_t  refusal;                       // enum tb_reply_code of a failure (0: TB_STATUS_ERROR)
    uint8_t  small[sizeof(struct tb_auth_reply)];
};

// The request scratch: grown on demand, shrunk by serve_one after a run of
// requests that needed much less (a rejected 255 MiB SET_TENSOR must not pin
// 255 MiB for the rest of the session; a prompt's all-reduces must not
// reallocate it every time either).
static inline int scratch_reserve(struct node_conn * c, size_t need) {
    if (need > c->scratch_need) c->scratch_need = need;
    return tb_reserve(&c->payload, &c->payload_cap, need);
}

static inline void count(uint64_t * counter, int64_t delta) {
    __atomic_add_fetch(counter, (uint64_t) delta, __ATOMIC_RELAXED);
}

// Why this node may not share memory with a peer (NULL: it may): only a
// worker with a process of its own maps a segment another process shares.
static inline const char * no_shm_reason(const struct tb_node * n) {
    return n->serve_mode == SERVE_THREAD ? "the node serves clients in threads (--isolation thread)" : NULL;
}

// A 1-D byte view of a buffer range: lets us use ggml's generic tensor
// set/get/memset, which work on any device (not only host memory).
static inline struct ggml_tensor byte_view(struct node_buffer * b, uint64_t offset, uint64_t size) {
    struct ggml_tensor t;
    memset(&t, 0, sizeof t);
    t.type = GGML_TYPE_I8;
    t.buffer = b->buf;
    t.ne[0] = (int64_t) size; t.ne[1] = t.ne[2] = t.ne[3] = 1;
    t.nb[0] = 1; t.nb[1] = t.nb[2] = t.nb[3] = size;
    t.data = b->base + offset;
    return t;
}

static inline int reply_u64(struct reply * r, uint64_t v) {
    memcpy(r->small, &v, sizeof v);
    r->data = r->small;
    r->len = sizeof v;
    return 0;
}

// SENDING_TO_PEER: blocked, perhaps, on a next node that computes (a
// pipelined prompt): we show life to whoever waits on us, as while computing.
enum { IDLE, COMPUTING, WAITING_FOR_PEER, SENDING_TO_PEER };

// What the watchdog tells whom (see watchdog_thread in node_session.c).
// Plain stores: the watchdog looks at its own pace, so a state change (six
// or more per decoded token) wakes no thread.
static inline void set_busy(struct node_conn * c, int busy) {
    if (busy != IDLE && __atomic_load_n(&c->busy, __ATOMIC_RELAXED) == IDLE)
        __atomic_store_n(&c->busy_since_ms, tb_now_ms(), __ATOMIC_RELAXED);
    __atomic_store_n(&c->busy, busy, __ATOMIC_RELEASE);
}

// ---- buffers (node_session.c) ---------------------------------------------------
bool lookup_buffer(void * ctx, uint64_t handle, struct tb_buffer_view * out);
struct node_buffer * find_buffer(struct node_conn * c, uint64_t handle);
// A byte range [offset, offset+size) of a buffer, checked without overflow.
struct node_buffer * checked_range(struct node_conn * c, uint64_t handle, uint64_t offset, uint64_t size,
                                   char * err, size_t err_len);
// The rows [offset + i*stride, +size) for i < n of a buffer, checked without overflow.
struct node_buffer * checked_rows(struct node_conn * c, uint64_t handle, uint64_t offset, uint64_t size, uint64_t n,
                                  uint64_t stride, const char * what, char * err, size_t err_len);
void write_rows(struct node_buffer * b, uint64_t offset, uint64_t stride, const uint8_t * rows, uint64_t size,
                uint64_t n, uint64_t src_stride);

// ---- graphs and op questions (node_graphs.c) ---------------------------------
void forget_kept_graphs(struct node_conn * c);   // they may point into a buffer being freed
bool client_left(void * data);                  // the device's abort callback (node_session.c)
int  handle_graph_compute(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);
int  handle_graph_recompute(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);
int  handle_supports_op(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len);
int  handle_alloc_size(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len);

// ---- the node's own model files (node_files.c) --------------------------------
int  handle_open_file(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len);
int  handle_load_from_file(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);
int  handle_load_from_file_2d(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);

// ---- node-to-node links and the all-reduce (node_links.c) ---------------------
int  handle_peer_listen(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len);
int  handle_peer_connect(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len);
int  handle_peer_accept(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len);
int  handle_peer_send(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);
int  handle_peer_recv(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);
int  handle_allreduce(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len);
