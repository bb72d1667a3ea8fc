// client_node.c - one tbrpc node seen from the head: its connection,
// requests and replies, the handshake, the messages that describe graphs
// and ops, the node's copies of model files (OPEN_FILE) and node-to-node
// links. The ggml objects that use it are in client.c.
//
// Every call that talks to a node goes through node_call (waits for the
// answer) or node_post (does not). A node that fails is marked failed; from
// then on its operations are no-ops that report failure where ggml lets them
// (graph_compute returns GGML_STATUS_FAILED, alloc returns NULL), and Python
// turns that into an exception naming the node, of the class its error kind
// says (tbrpc/client.py, _install_error_hooks).
#include "client_internal.h"
#include "transport/rdma.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

// ---- talking to a node -------------------------------------------------------

// The failure is kept, not printed: a call that returns -kind hands it to
// its caller (connect, probe, status), and tbrpc's wrappers around
// llama.cpp's entry points raise it as the node's NodeError
// (tbrpc/client.py). A line on stderr would only repeat it, ahead of what
// the user is shown (doctor's table, launch's explanation).
void node_fail_kind(struct client_node * n, int kind, const char * step, const char * why) {
    if (n->failed) return;
    n->failed = true;
    n->error_kind = kind;
    snprintf(n->error, sizeof n->error, "tbrpc node %s (%s) failed during %s: %s", n->endpoint, n->name, step, why);
}

void node_fail(struct client_node * n, const char * step, const char * why) {
    node_fail_kind(n, n->handshaking ? TBRPC_ERR_HANDSHAKE : TBRPC_ERR_FAILED, step, why);
}

// The kind of a node's error reply: a refused HELLO is a version mismatch
// unless the node says otherwise (nodes of protocol <= 3 refuse a HELLO only
// for that, with status 1).
static int reply_kind(const struct client_node * n, uint16_t cmd, int32_t status) {
    switch (status) {
        case TB_STATUS_VERSION: return TBRPC_ERR_VERSION;
        case TB_STATUS_AUTH:    return TBRPC_ERR_AUTH;
        case TB_STATUS_FULL:    return TBRPC_ERR_FULL;
    }
    if (cmd == TB_CMD_HELLO) return TBRPC_ERR_VERSION;
    return n->handshaking ? TBRPC_ERR_HANDSHAKE : TBRPC_ERR_FAILED;
}

// Replies come in the order of the requests, and a node writing a reply the
// head does not read may block, reading nothing more: so nothing else goes to
// a node before the head has read the reply it left in flight.
void node_settle_locked(struct client_node * n) {
    if (!n->pending.waiting) return;
    const struct pending_get p = n->pending;
    n->pending = (struct pending_get) { 0 };
    if (node_call_reply_locked(n, TB_CMD_GET_TENSOR, p.id, p.data, p.size) != 0)
        memset(p.data, 0, p.size);   // never hand back uninitialised memory
}

// Send a request that will be answered. Caller holds n->lock. The request id, or 0.
uint64_t node_call_send_locked(struct client_node * n, uint16_t cmd, const void * a, size_t a_len) {
    node_settle_locked(n);
    if (n->failed) return 0;
    const uint64_t id = ++n->next_id;
    n->messages++;
    n->round_trips++;
    if (tb_msg_send(n->tp, cmd, 0, id, a, a_len, NULL, 0) != 0) {
        node_fail(n, tb_cmd_name(cmd), n->tp->error);
        return 0;
    }
    node_flush_locked(n, cmd);
    return n->failed ? 0 : id;
}

// Wait for the reply to request `id`; `out` receives exactly out_len bytes.
// Caller holds n->lock.
int node_call_reply_locked(struct client_node * n, uint16_t cmd, uint64_t id, void * out, size_t out_len) {
    if (n->failed) return -1;
    const char * step = tb_cmd_name(cmd);
    struct tb_header h;
    char err[512];
    do {   // a busy node sends keepalives; each one restarts the timeout
        if (tb_msg_recv_header(n->tp, &h, err, sizeof err) != 0) { node_fail(n, step, err); return -1; }
    } while (h.cmd == TB_CMD_KEEPALIVE && h.len == 0);
    tb_trace_mark(n->trace, TB_TRACE_REPLY, h.cmd);
    // A full node answers HELLO at once, before reading it: with id 0.
    const bool refused_unread = cmd == TB_CMD_HELLO && h.id == 0;
    if (!(h.flags & TB_FLAG_REPLY) || (h.id != id && !refused_unread) || h.cmd != cmd || h.len < sizeof(struct tb_reply_status)) {
        snprintf(err, sizeof err, "out-of-order reply (%s #%llu to %s #%llu)", tb_cmd_name(h.cmd),
                 (unsigned long long) h.id, step, (unsigned long long) id);
        node_fail(n, step, err);
        return -1;
    }
    struct tb_reply_status st;
    if (tb_recv(n->tp, &st, sizeof st) != 0) { node_fail(n, step, n->tp->error); return -1; }
    const uint64_t body = h.len - sizeof st;
    if (st.status != 0) {
        char msg[512];
        size_t keep = body < sizeof msg - 1 ? (size_t) body : sizeof msg - 1;
        if (tb_recv(n->tp, msg, keep) != 0) { node_fail(n, step, n->tp->error); return -1; }
        msg[keep] = '\0';
        if (!n->failed) n->failed_peer = st.peer;
        node_fail_kind(n, reply_kind(n, cmd, st.status), step, msg);   // the stream is not resynchronised past an error: stop using it
        return -1;
    }
    const struct tb_command * row = tb_command(cmd);   // proto.c's table says how long each reply is
    if (body != out_len || (row->reply == TB_LEN_EXACT && body != row->reply_len)) {
        snprintf(err, sizeof err, "reply of %llu bytes, expected %zu", (unsigned long long) body, out_len);
        node_fail(n, step, err);
        return -1;
    }
    if (out_len && tb_recv(n->tp, out, out_len) != 0) { node_fail(n, step, n->tp->error); return -1; }
    n->dirty = false;
    return 0;
}

// Send a request and wait for its reply; `out` receives exactly out_len bytes.
// Caller holds n->lock.
int node_call_locked(struct client_node * n, uint16_t cmd, const void * a, size_t a_len, const void * b, size_t b_len,
                            void * out, size_t out_len) {
    node_settle_locked(n);
    if (n->failed) return -1;
    const char * step = tb_cmd_name(cmd);
    const uint64_t id = ++n->next_id;
    n->messages++;
    n->round_trips++;
    if (tb_msg_send(n->tp, cmd, 0, id, a, a_len, b, b_len) != 0) {
        node_fail(n, step, n->tp->error);
        return -1;
    }
    node_flush_locked(n, cmd);
    return node_call_reply_locked(n, cmd, id, out, out_len);   // fails at once when the flush did
}

int node_call(struct client_node * n, uint16_t cmd, const void * a, size_t a_len, void * out, size_t out_len) {
    pthread_mutex_lock(&n->lock);
    int rc = node_call_locked(n, cmd, a, a_len, NULL, 0, out, out_len);
    pthread_mutex_unlock(&n->lock);
    return rc;
}

// Queue a request that has no reply. Caller holds n->lock.
int node_post_locked(struct client_node * n, uint16_t cmd, const void * a, size_t a_len, const void * b, size_t b_len) {
    node_settle_locked(n);
    if (n->failed) return -1;
    n->messages++;
    if (tb_msg_send(n->tp, cmd, 0, ++n->next_id, a, a_len, b, b_len) != 0) {
        node_fail(n, tb_cmd_name(cmd), n->tp->error);
        return -1;
    }
    n->dirty = true;
    return 0;
}

// Hand what was posted to the transport, so the node can start on it. Caller holds n->lock.
void node_flush_locked(struct client_node * n, uint16_t cmd) {
    if (n->failed) return;
    const uint64_t flushes = n->tp->flushes;
    if (tb_flush(n->tp) != 0) node_fail(n, tb_cmd_name(cmd), n->tp->error);
    else if (n->tp->flushes != flushes) tb_trace_mark(n->trace, TB_TRACE_FLUSH, cmd);   // bytes left: the node may wake
}

int node_post(struct client_node * n, uint16_t cmd, const void * a, size_t a_len) {
    pthread_mutex_lock(&n->lock);
    int rc = node_post_locked(n, cmd, a, a_len, NULL, 0);
    pthread_mutex_unlock(&n->lock);
    return rc;
}

// ---- graph encoding -----------------------------------------------------------

// Pointer -> position in the message, for linking src/view_src.
struct tensor_index {
    const struct ggml_tensor ** keys;
    int32_t * vals;
    size_t cap;
};

static size_t ptr_hash(const void * p, size_t cap) {
    uint64_t x = (uint64_t) (uintptr_t) p;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33;
    return (size_t) x & (cap - 1);
}

static int32_t index_get(const struct tensor_index * ix, const struct ggml_tensor * t) {
    for (size_t i = ptr_hash(t, ix->cap);; i = (i + 1) & (ix->cap - 1)) {
        if (ix->keys[i] == t) return ix->vals[i];
        if (ix->keys[i] == NULL) return -1;
    }
}

static void index_put(struct tensor_index * ix, const struct ggml_tensor * t, int32_t v) {
    size_t i = ptr_hash(t, ix->cap);
    while (ix->keys[i] != NULL) i = (i + 1) & (ix->cap - 1);
    ix->keys[i] = t;
    ix->vals[i] = v;
}

struct graph_encoder {
    struct client_node * node;
    struct tb_wire_tensor * tensors;
    uint32_t n, cap;
    struct tensor_index ix;      // tensor -> its position in the message
    struct tensor_index nodes;   // the graph's nodes (value 1)
    char err[256];
};

// What t is, without where its data lies: shape, strides, type, op, op
// params, flags, view offset, name. No links (src, view_src: -1) and no
// location (buffer 0, offset 0); the caller adds what its message needs.
static void describe_tensor(const struct ggml_tensor * t, struct tb_wire_tensor * w) {
    memset(w, 0, sizeof *w);
    for (int d = 0; d < GGML_MAX_DIMS; d++) { w->ne[d] = t->ne[d]; w->nb[d] = t->nb[d]; }
    w->type = (uint32_t) t->type;
    w->op = (uint32_t) t->op;
    memcpy(w->op_params, t->op_params, sizeof w->op_params);
    w->flags = t->flags;
    w->view_offs = t->view_offs;
    for (int s = 0; s < GGML_MAX_SRC; s++) w->src[s] = -1;
    w->view_src = -1;
    memcpy(w->name, t->name, GGML_MAX_NAME);
}

// Where t's data lies on this node: buffer handle and offset. A tensor
// without data stays at buffer 0; data in any other buffer (the head's CPU,
// another node) has no name here, and a graph that uses it cannot run here.
static int locate_tensor(struct graph_encoder * e, const struct ggml_tensor * t, struct tb_wire_tensor * w) {
    if (t->data == NULL) return 0;
    if (!is_our_buffer(t->buffer) || ((struct client_buffer *) t->buffer->context)->node != e->node) {
        if (e->err[0] == '\0')
            snprintf(e->err, sizeof e->err, "tensor '%s' is not in a buffer of this node", t->name);
        return -1;
    }
    struct client_buffer * cb = t->buffer->context;
    w->buffer = cb->handle;
    w->offset = tensor_offset(cb, t);
    return 0;
}

// Append t after its sources (depth-first), once. Returns its position.
// A tensor that is not a node of this graph was made before it ran (a
// weight, an input, the result of an earlier graph on this node): it goes as
// data only, an op-less tensor at its buffer and offset, without the
// tensors it was made from. A scheduler split or a meta backend's subgraph
// would otherwise drag every earlier layer into each message.
static int32_t encode_tensor(struct graph_encoder * e, const struct ggml_tensor * t) {
    if (t == NULL) return -1;
    int32_t have = index_get(&e->ix, t);
    if (have >= 0) return have;
    const bool is_node = index_get(&e->nodes, t) >= 0;
    int32_t src[GGML_MAX_SRC];
    for (int s = 0; s < GGML_MAX_SRC; s++) src[s] = is_node ? encode_tensor(e, t->src[s]) : -1;
    int32_t view_src = is_node ? encode_tensor(e, t->view_src) : -1;
    if (e->n == e->cap) {
        snprintf(e->err, sizeof e->err, "graph has more than %u tensors", e->cap);
        return -1;
    }
    struct tb_wire_tensor * w = &e->tensors[e->n];
    describe_tensor(t, w);
    if (!is_node) {
        if (t->data == NULL) {
            snprintf(e->err, sizeof e->err, "tensor '%s' is an input of the graph but has no data", t->name);
            return -1;
        }
        w->op = GGML_OP_NONE;
        w->view_offs = 0;
    }
    if (locate_tensor(e, t, w) != 0) return -1;
    memcpy(w->src, src, sizeof src);
    w->view_src = view_src;
    index_put(&e->ix, t, (int32_t) e->n);
    return (int32_t) e->n++;
}

// Build the GRAPH_COMPUTE payload in n->encode. Returns its length or 0.
size_t encode_graph(struct client_node * n, struct ggml_cgraph * g, char * err, size_t err_len) {
    const int n_nodes = ggml_graph_n_nodes(g);
    // every node has at most GGML_MAX_SRC + 1 distinct inputs: a safe bound
    const size_t max_tensors = (size_t) n_nodes * (GGML_MAX_SRC + 2);
    size_t cap = 16;
    while (cap < 2 * max_tensors) cap <<= 1;
    const size_t bytes = sizeof(struct tb_graph_header) + max_tensors * sizeof(struct tb_wire_tensor) + (size_t) n_nodes * sizeof(uint32_t);
    struct graph_encoder e = { .node = n, .cap = (uint32_t) max_tensors };
    e.ix.cap = e.nodes.cap = cap;
    e.ix.keys = calloc(cap, sizeof *e.ix.keys);
    e.ix.vals = calloc(cap, sizeof *e.ix.vals);
    e.nodes.keys = calloc(cap, sizeof *e.nodes.keys);
    e.nodes.vals = calloc(cap, sizeof *e.nodes.vals);
    size_t len = 0;
    if (!e.ix.keys || !e.ix.vals || !e.nodes.keys || !e.nodes.vals ||
        tb_reserve(&n->encode, &n->encode_cap, bytes) != 0) {
        snprintf(err, err_len, "out of memory encoding a graph of %d nodes", n_nodes);
        goto done;
    }
    for (int i = 0; i < n_nodes; i++) {
        if (index_get(&e.nodes, ggml_graph_node(g, i)) < 0) index_put(&e.nodes, ggml_graph_node(g, i), 1);
    }
    e.tensors = (struct tb_wire_tensor *) (n->encode + sizeof(struct tb_graph_header));
    uint32_t * node_idx = malloc((size_t) n_nodes * sizeof *node_idx);
    if (!node_idx) { snprintf(err, err_len, "out of memory"); goto done; }
    for (int i = 0; i < n_nodes; i++) {
        const struct ggml_tensor * node = ggml_graph_node(g, i);
        int32_t at = encode_tensor(&e, node);
        if (at < 0) { snprintf(err, err_len, "%s", e.err); free(node_idx); goto done; }
        node_idx[i] = (uint32_t) at;
        const size_t slot = g->use_counts ? tbrpc_ggml_hash_slot(&g->visited_hash_set, node, false) : (size_t) -1;
        e.tensors[at].use_count = slot != (size_t) -1 ? g->use_counts[slot] : 0;
    }
    struct tb_graph_header gh = { .n_tensors = e.n, .n_nodes = (uint32_t) n_nodes };
    memcpy(n->encode, &gh, sizeof gh);
    len = sizeof gh + (size_t) e.n * sizeof(struct tb_wire_tensor);
    memcpy(n->encode + len, node_idx, (size_t) n_nodes * sizeof *node_idx);
    len += (size_t) n_nodes * sizeof *node_idx;
    free(node_idx);
done:
    free(e.ix.keys);
    free(e.ix.vals);
    free(e.nodes.keys);
    free(e.nodes.vals);
    return len;
}

// ---- questions about ops ------------------------------------------------------

// The op keys below mix values into one FNV-1a (proto.h).
static inline uint64_t mix(uint64_t h, uint64_t v) { return tb_fnv1a_u64(h, v); }

// How t lies in memory, as ggml's layout predicates see it. Devices test
// different ones: Metal wants contiguous rows for unary and binary ops, rows
// contiguous from dimension 1 on for GLU, full contiguity for SUM or
// IM2COL. One "contiguous" bit gave a row-strided view and a transposed
// tensor the same class, and one device answer for both.
static uint64_t layout_bits(const struct ggml_tensor * t) {
    return (uint64_t) ggml_is_contiguous(t) | (uint64_t) ggml_is_contiguous_1(t) << 1 |
           (uint64_t) ggml_is_contiguous_2(t) << 2 | (uint64_t) ggml_is_contiguous_rows(t) << 3 |
           (uint64_t) ggml_is_contiguous_channels(t) << 4 | (uint64_t) ggml_is_transposed(t) << 5 |
           (uint64_t) ggml_is_permuted(t) << 6;
}

// What a device's supports_op may depend on: op, types, op params, row
// length, memory layout of the op and its sources. Not the other
// dimensions, which change with every batch size and would make every new
// prompt length cost round trips.
uint64_t supports_key(const struct ggml_tensor * op) {
    uint64_t h = mix(TB_FNV_OFFSET, 1);
    h = mix(mix(mix(mix(h, op->op), op->type), (uint64_t) op->ne[0]), layout_bits(op));
    for (size_t i = 0; i < GGML_MAX_OP_PARAMS / sizeof(int32_t); i++) h = mix(h, (uint32_t) op->op_params[i]);
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        const struct ggml_tensor * t = op->src[s];
        h = t ? mix(mix(mix(h, t->type), (uint64_t) t->ne[0]), layout_bits(t)) : mix(h, UINT64_MAX);
    }
    return h;
}

// An allocation size may depend on every dimension of the op and its sources.
uint64_t alloc_size_key(const struct ggml_tensor * op) {
    uint64_t h = mix(TB_FNV_OFFSET, 2);
    h = mix(mix(h, op->op), op->type);
    for (int d = 0; d < GGML_MAX_DIMS; d++) h = mix(h, (uint64_t) op->ne[d]);
    for (size_t i = 0; i < GGML_MAX_OP_PARAMS / sizeof(int32_t); i++) h = mix(h, (uint32_t) op->op_params[i]);
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        const struct ggml_tensor * t = op->src[s];
        if (!t) { h = mix(h, UINT64_MAX); continue; }
        h = mix(h, t->type);
        for (int d = 0; d < GGML_MAX_DIMS; d++) h = mix(mix(h, (uint64_t) t->ne[d]), t->nb[d]);
    }
    return h;
}

// The op and its direct sources as a tensor table (sources first, op last),
// each described in full and located nowhere (buffer 0): the node answers
// for its device and these shapes, and the answer is cached per op class
// whatever buffers the data of the next op of that class lies in.
size_t encode_op_query(const struct ggml_tensor * op, struct op_query * q) {
    memset(q, 0, sizeof *q);
    int32_t src_at[GGML_MAX_SRC];
    uint32_t count = 0;
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        src_at[s] = -1;
        if (!op->src[s]) continue;
        describe_tensor(op->src[s], &q->t[count]);
        src_at[s] = (int32_t) count++;
    }
    describe_tensor(op, &q->t[count]);
    memcpy(q->t[count].src, src_at, sizeof src_at);
    q->h.n_tensors = ++count;
    return sizeof q->h + count * sizeof(struct tb_wire_tensor);
}

// Ask the node about `op` (cmd SUPPORTS_OP or GET_ALLOC_SIZE), once per key.
// Returns false when the node could not answer.
bool ask_node_about_op(struct client_node * n, uint16_t cmd, uint64_t key, const struct ggml_tensor * op,
                              uint64_t * answer, size_t answer_len) {
    pthread_mutex_lock(&n->lock);
    // 4-way: two op classes that land on one slot must not keep evicting each other
    struct op_cache_entry * slot = NULL;
    for (size_t way = 0; way < 4 && !slot; way++) {
        struct op_cache_entry * e = &n->op_cache[(key + way) & (OP_CACHE_SIZE - 1)];
        if (!e->used || e->key == key) slot = e;
    }
    if (!slot) slot = &n->op_cache[key & (OP_CACHE_SIZE - 1)];
    bool ok = slot->used && slot->key == key;
    if (ok) {
        *answer = slot->value;
    } else {
        struct op_query q;
        size_t len = encode_op_query(op, &q);
        *answer = 0;
        ok = node_call_locked(n, cmd, &q, len, NULL, 0, answer, answer_len) == 0;
        if (ok) *slot = (struct op_cache_entry) { .key = key, .value = *answer, .used = true };
    }
    pthread_mutex_unlock(&n->lock);
    return ok;
}

// ---- model files the node holds too ----------------------------------------

#define FILE_MIN (256u << 10)          // smaller writes cost less to send than to look up (a /proc/self/maps parse)

// Size and content hash of a file the head has mapped: once per path in this
// process, and once per file on this machine (model_file.h caches it on disk).
static int head_file_hash(struct tbrpc_client * c, const char * path, struct head_file * out) {
    pthread_mutex_lock(&c->lock);
    for (size_t i = 0; i < c->n_head_files; i++) {
        if (strcmp(c->head_files[i].path, path) == 0) {
            *out = c->head_files[i];
            pthread_mutex_unlock(&c->lock);
            return out->ok ? 0 : -1;
        }
    }
    pthread_mutex_unlock(&c->lock);
    struct head_file hf = { .ok = 0 };
    char why[256], cache[4096];
    snprintf(hf.path, sizeof hf.path, "%s", path);
    tb_hash_cache_dir(cache, sizeof cache);
    struct stat st;
    hf.ok = stat(path, &st) == 0 && tb_file_hash_path(path, cache, hf.hash, NULL, why, sizeof why) == 0;
    hf.size = hf.ok ? (uint64_t) st.st_size : 0;
    pthread_mutex_lock(&c->lock);
    struct head_file * grown = realloc(c->head_files, (c->n_head_files + 1) * sizeof *grown);
    if (grown) { c->head_files = grown; c->head_files[c->n_head_files++] = hf; }
    pthread_mutex_unlock(&c->lock);
    *out = hf;
    return hf.ok ? 0 : -1;
}

// When [data, data+size) lies in a model file the head has mapped (llama.cpp
// loads with mmap) and the node holds the same file, the node's id for it;
// otherwise 0 and the bytes are sent. Only a node with model directories is
// asked, so a head whose nodes have none never hashes its files. Caller
// holds n->lock.
uint64_t node_file_for(struct client_node * n, const void * data, size_t size, uint64_t * file_offset) {
    char path[4096];
    if (!n->client || !(n->info.caps & TB_CAP_MODEL_FILES) || size < FILE_MIN ||
        tb_find_file_mapping(data, size, path, sizeof path, file_offset) != 0) return 0;
    for (size_t i = 0; i < n->n_files; i++) {
        if (strcmp(n->files[i].path, path) == 0) return n->files[i].id;
    }
    struct tb_open_file req;
    memset(&req, 0, sizeof req);
    uint64_t id = 0;
    struct head_file mine;
    const char * base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    char why[256];
    if (head_file_hash(n->client, path, &mine) == 0 && strlen(base) < sizeof req.name &&
        tb_file_proof_path(path, mine.size, n->info.file_nonce, req.proof, why, sizeof why) == 0) {
        req.size = mine.size;
        memcpy(req.content_hash, mine.hash, sizeof req.content_hash);
        snprintf(req.name, sizeof req.name, "%s", base);
        if (node_call_locked(n, TB_CMD_OPEN_FILE, &req, sizeof req, NULL, 0, &id, sizeof id) != 0) id = 0;
    }
    struct node_file * grown = realloc(n->files, (n->n_files + 1) * sizeof *grown);
    if (grown) {
        n->files = grown;
        snprintf(n->files[n->n_files].path, sizeof n->files[n->n_files].path, "%s", path);
        n->files[n->n_files++].id = id;
    }
    return id;
}

// ---- node-to-node links --------------------------------------------------------

// The host part of an endpoint, as the other nodes should dial it.
static void endpoint_host(const struct client_node * n, char * host, size_t len) {
    int port = 0;
    char err[64];
    if (tb_parse_endpoint(n->endpoint, host, len, &port, err, sizeof err) != 0) host[0] = '\0';
}

// A link a -> b: b listens, then b accepts while a dials (the dialer sends
// nothing until the listener has proven itself, so both must be at it at
// once: b's PEER_ACCEPT is sent before a's PEER_CONNECT and answered after).
// Three round trips, once per pair. Returns the link, or NULL when the pair
// cannot talk directly (the head then relays, as before). ggml's scheduler
// sets links up from one thread; b's lock is held across a's call, and no
// caller holds a's while waiting for b's.
struct peer_link * peer_link(struct client_node * a, struct client_node * b) {
    for (size_t i = 0; i < a->n_links; i++) {
        if (a->links[i].to == b) return a->links[i].usable ? &a->links[i] : NULL;
    }
    if (a == b || a->n_links == sizeof a->links / sizeof a->links[0] || getenv("TBRPC_NO_PEER_LINKS")) return NULL;
    struct peer_link * link = &a->links[a->n_links++];
    *link = (struct peer_link) { .to = b, .why = TB_WHY_NO_LINK };
    struct tb_peer_listen_reply listen = { 0, 0 };
    struct tb_peer_connect conn;
    memset(&conn, 0, sizeof conn);
    if (node_call(b, TB_CMD_PEER_LISTEN, NULL, 0, &listen, sizeof listen) != 0 || listen.port == 0) {
        snprintf(link->transport, sizeof link->transport, "none: %s could not listen for it", b->endpoint);
        return NULL;
    }
    endpoint_host(b, conn.host, sizeof conn.host);
    for (size_t i = 0; i < b->n_addresses; i++) {
        if (b->addresses[i].from == a) snprintf(conn.host, sizeof conn.host, "%s", b->addresses[i].host);
    }
    conn.port = listen.port;
    conn.token = listen.token;
    conn.caps = b->info.caps;                                  // what b offers for the link's upgrade
    conn.flags = a->forced_tcp || b->forced_tcp ? TB_LINK_TCP : 0;
    struct tb_peer_connect_reply connected_rep;
    memset(&connected_rep, 0, sizeof connected_rep);
    pthread_mutex_lock(&b->lock);
    const uint64_t accept_id = node_call_send_locked(b, TB_CMD_PEER_ACCEPT, &listen.token, sizeof listen.token);
    const int connected = accept_id ? node_call(a, TB_CMD_PEER_CONNECT, &conn, sizeof conn, &connected_rep, sizeof connected_rep) : -1;
    link->out_id = connected_rep.peer_id;
    connected_rep.transport[sizeof connected_rep.transport - 1] = '\0';
    snprintf(link->transport, sizeof link->transport, "%s", connected_rep.transport);
    link->why = connected_rep.why_kind == TB_WHY_NONE ? TB_WHY_NONE : tb_why_from_peer(connected_rep.why_kind, TB_WHY_NO_LINK);
    // a could not dial (or prove itself): b would wait out its timeout for
    // nobody. Any next request ends b's wait; SYNC costs nothing.
    const uint64_t nudge_id = accept_id && (connected != 0 || !link->out_id) ? node_call_send_locked(b, TB_CMD_SYNC, NULL, 0) : 0;
    const int accepted = accept_id ? node_call_reply_locked(b, TB_CMD_PEER_ACCEPT, accept_id, &link->in_id, sizeof link->in_id) : -1;
    if (nudge_id) node_call_reply_locked(b, TB_CMD_SYNC, nudge_id, NULL, 0);
    pthread_mutex_unlock(&b->lock);
    if (connected != 0 || accepted != 0 || !link->out_id || !link->in_id) {
        if (link->why != TB_WHY_NO_LINK || !link->transport[0])
            snprintf(link->transport, sizeof link->transport, "none: %s", a->failed ? a->error : b->failed ? b->error
                     : "the nodes could not complete the link");
        link->why = TB_WHY_NO_LINK;
        return NULL;
    }
    link->usable = true;
    return link;
}

// ---- connecting ---------------------------------------------------------------

// A CPU node running the same ggml build as the head answers supports_op
// exactly as the head's own CPU device would (ggml's CPU supports_op looks at
// op, types and params only), so the head asks that device instead of the
// network: no round trip for any new op shape.
static ggml_backend_dev_t cpu_twin_of(const struct tb_hello * head, const struct tb_hello * node) {
    if (!(node->caps & TB_CAP_SUPPORTS_OP_IS_CPU) || strcmp(head->ggml_build, node->ggml_build) != 0) return NULL;
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

// AUTH after HELLO: the head proves it knows the secret over both nonces,
// the node proves it back and sends its real HELLO. 0, or -1 with err and *kind.
static int authenticate(struct client_node * n, const struct tb_hello * req, int * kind, char * err, size_t err_len) {
    *kind = TBRPC_ERR_AUTH;
    const bool node_wants = (n->info.caps & TB_CAP_AUTH) != 0;
    if (node_wants && !n->secret_len) {
        snprintf(err, err_len, "tbrpc node %s: authentication failed: the node requires a cluster secret and this head "
                 "has none (--secret-file, TBRPC_SECRET_FILE or `secret_file` in the cluster file)", n->endpoint);
        return -1;
    }
    if (!node_wants && n->secret_len) {
        snprintf(err, err_len, "tbrpc node %s: authentication failed: this head has a cluster secret but the node "
                 "asks for none (start it with the same --secret-file)", n->endpoint);
        return -1;
    }
    if (!node_wants) return 0;
    struct tb_auth_req auth;
    struct tb_auth_reply rep;
    uint8_t want[TB_MAC_LEN];
    uint8_t node_nonce[TB_NONCE_LEN];
    memcpy(node_nonce, n->info.nonce, TB_NONCE_LEN);
    tb_auth_mac(n->secret, n->secret_len, TB_AUTH_ROLE_HEAD, req->nonce, node_nonce, NULL, 0, auth.mac);
    if (node_call(n, TB_CMD_AUTH, &auth, sizeof auth, &rep, sizeof rep) != 0) {
        snprintf(err, err_len, "%s", n->error);
        *kind = n->error_kind;
        return -1;
    }
    tb_auth_mac(n->secret, n->secret_len, TB_AUTH_ROLE_NODE, req->nonce, node_nonce, NULL, 0, want);
    if (!tb_equal_ct(want, rep.mac, TB_MAC_LEN)) {
        snprintf(err, err_len, "tbrpc node %s: authentication failed: the node does not know this head's secret", n->endpoint);
        return -1;
    }
    n->info = rep.hello;
    return 0;
}

// Connect + HELLO (+ AUTH). Both sides compare ABI; the node's refusal
// arrives as an error reply that names both versions. 0, or -1 with err and *kind.
static int handshake(struct client_node * n, int * kind, char * err, size_t err_len) {
    struct tb_hello req;
    memset(&req, 0, sizeof req);
    tb_abi_fill(&req.abi);
    tb_ggml_build(req.ggml_build, sizeof req.ggml_build);
    req.keepalive_ms = n->timeout_ms > 0 ? (uint32_t) n->timeout_ms / 3 : 1000;
    if (tb_random(req.nonce, sizeof req.nonce) != 0) {
        snprintf(err, err_len, "tbrpc node %s: no random bytes for a nonce", n->endpoint);
        *kind = TBRPC_ERR_OTHER;
        return -1;
    }
    if (node_call(n, TB_CMD_HELLO, &req, sizeof req, &n->info, sizeof n->info) != 0) {
        snprintf(err, err_len, "%s", n->error);
        *kind = n->error_kind;
        return -1;
    }
    char why[512];
    if (tb_abi_compare(&req.abi, &n->info.abi, "node", why, sizeof why) != 0) {
        snprintf(err, err_len, "tbrpc node %s: handshake refused: %s", n->endpoint, why);
        *kind = TBRPC_ERR_VERSION;
        return -1;
    }
    if (authenticate(n, &req, kind, err, err_len) != 0) return -1;
    n->info.device_name[sizeof n->info.device_name - 1] = '\0';
    n->info.device_description[sizeof n->info.device_description - 1] = '\0';
    n->info.node_name[sizeof n->info.node_name - 1] = '\0';
    n->info.ggml_build[sizeof n->info.ggml_build - 1] = '\0';
    if (n->info.alignment == 0 || (n->info.alignment & (n->info.alignment - 1)) != 0) {
        snprintf(err, err_len, "tbrpc node %s: handshake: invalid alignment %llu", n->endpoint, (unsigned long long) n->info.alignment);
        *kind = TBRPC_ERR_HANDSHAKE;
        return -1;
    }
    n->cpu_twin = cpu_twin_of(&req, &n->info);
    return 0;
}

// Move the connection into shared memory; 0, or -1 with why not and its
// kind (the connection then stays on TCP and works as before).
static int upgrade_to_shm(struct client_node * n, int * why_kind, char * why, size_t why_len) {
    struct tb_transport_req req = { TB_TRANSPORT_SHM, TB_SHM_SLOTS, TB_SHM_STRIDE, 0 };
    struct tb_transport_reply rep;
    if (node_call(n, TB_CMD_TRANSPORT_OFFER, &req, sizeof req, &rep, sizeof rep) != 0) {
        snprintf(why, why_len, "%s", n->error);
        return -1;
    }
    struct tb_shm * seg = tb_upgrade_attach(&rep, why_kind, why, why_len);
    if (rep.declined[0]) return -1;
    uint32_t attached = seg != NULL;
    if (node_post(n, TB_CMD_TRANSPORT_SWITCH, &attached, sizeof attached) != 0 || tb_flush(n->tp) != 0) {
        tb_shm_discard(seg);
        snprintf(why, why_len, "%s", n->failed ? n->error : n->tp->error);
        return -1;
    }
    if (!seg) return -1;
    n->dirty = false;   // the switch is posted, but the node has nothing to report about it
    struct tb_transport * shm = tb_shm_transport(seg, n->tp, why, why_len);
    if (!shm) { node_fail(n, "TRANSPORT_SWITCH", why); return -1; }   // the node has switched: we cannot stay
    n->tp = shm;
    return 0;
}

// Move the connection onto RDMA (transport/rdma.h); 0, or -1 with why not
// and its kind (both sides then stay on TCP).
static int upgrade_to_rdma(struct client_node * n, int * why_kind, char * why, size_t why_len) {
    struct tb_transport_req req = { TB_TRANSPORT_RDMA, 0, 0, 0 };
    struct tb_transport_reply rep;
    if (node_call(n, TB_CMD_TRANSPORT_OFFER, &req, sizeof req, &rep, sizeof rep) != 0) {
        snprintf(why, why_len, "%s", n->error);
        return -1;
    }
    rep.declined[sizeof rep.declined - 1] = '\0';
    if (rep.declined[0]) {
        snprintf(why, why_len, "peer: %s", rep.declined);
        *why_kind = tb_upgrade_rdma_declined(&rep);
        return -1;
    }
    struct tb_transport * rdma = tb_rdma_upgrade(n->tp, NULL, why_kind, why, why_len);
    if (!rdma) {
        if (n->tp->error_kind != TB_IO_OK) node_fail(n, "TRANSPORT_OFFER", why);   // TCP itself failed
        return -1;
    }
    n->tp = rdma;
    return 0;
}

// What to ask the node for is tb_upgrade_choose's to say (transport/upgrade.c:
// the same rules as a node-to-node link); the transport's description says
// what carries the connection, and why.
static void choose_transport(struct client_node * n, const char * wanted) {
    char why[256] = "";
    const struct tb_upgrade_want want = {
        .forced_tcp = wanted && strcmp(wanted, "tcp") == 0,
        .peer_shm = (n->info.caps & TB_CAP_SHM) != 0,
        .peer_rdma = (n->info.caps & TB_CAP_RDMA) != 0,
    };
    n->forced_tcp = want.forced_tcp;
    int kind = TB_WHY_NONE;
    switch (tb_upgrade_choose(n->tp, &want, &kind, why, sizeof why)) {
        case TB_TRANSPORT_SHM:  if (upgrade_to_shm(n, &kind, why, sizeof why) == 0) return; break;
        case TB_TRANSPORT_RDMA: if (upgrade_to_rdma(n, &kind, why, sizeof why) == 0) return; break;
        default: break;
    }
    if (n->failed) return;
    snprintf(n->tp->describe, sizeof n->tp->describe, "tcp: %s", why);
    n->tp->why = kind;
}

void node_destroy(struct client_node * n) {
    if (!n) return;
    memset(n->secret, 0, sizeof n->secret);
    tb_trace_close(n->trace);
    tb_close(n->tp);
    pthread_mutex_destroy(&n->lock);
    free(n->encode);
    for (size_t i = 0; i < TB_KEPT_GRAPHS; i++) free(n->kept[i].bytes);
    free(n->files);
    free(n);
}

// Connect to endpoint and handshake. Returns a node not yet in any
// registry, or NULL with err and *kind.
struct client_node * node_open(const char * endpoint, const char * name, int timeout_ms, const char * transport,
                               const uint8_t * secret, size_t secret_len, int * kind, char * err, size_t err_len) {
    char host[256];
    int port = 0;
    *kind = TBRPC_ERR_OTHER;
    if (tb_parse_endpoint(endpoint, host, sizeof host, &port, err, err_len) != 0) return NULL;
    if (secret && (secret_len == 0 || secret_len > TB_SECRET_MAX)) {
        snprintf(err, err_len, "a secret of %zu bytes: it must have 1 to %d", secret_len, TB_SECRET_MAX);
        return NULL;
    }
    struct client_node * n = calloc(1, sizeof *n);
    if (!n) { snprintf(err, err_len, "out of memory"); return NULL; }
    if (secret) { memcpy(n->secret, secret, secret_len); n->secret_len = secret_len; }
    pthread_mutex_init(&n->lock, NULL);
    n->timeout_ms = timeout_ms;
    snprintf(n->endpoint, sizeof n->endpoint, "%s", endpoint);
    snprintf(n->name, sizeof n->name, "%s", name);
    char why[256];
    int dial_kind = TB_IO_OK;
    n->tp = tb_dial(host, port, NULL, timeout_ms, &dial_kind, why, sizeof why);
    if (!n->tp) {
        // Refused and no answer in time are one kind to the head (tbrpc.h): the
        // remedy is the same, and the text says which. Out of descriptors or
        // memory here says nothing about the node.
        bool unreachable = dial_kind == TB_IO_REFUSED || dial_kind == TB_IO_TIMEOUT;
        snprintf(err, err_len, "tbrpc node %s: %s: %s", endpoint, unreachable ? "unreachable" : "cannot dial", why);
        *kind = unreachable ? TBRPC_ERR_UNREACHABLE : TBRPC_ERR_OTHER;
        node_destroy(n);
        return NULL;
    }
    n->handshaking = true;
    if (handshake(n, kind, err, err_len) != 0) { node_destroy(n); return NULL; }
    n->handshaking = false;
    choose_transport(n, transport);
    if (n->failed) { snprintf(err, err_len, "%s", n->error); *kind = n->error_kind; node_destroy(n); return NULL; }
    n->trace = tb_trace_open("head", endpoint);
    return n;
}
