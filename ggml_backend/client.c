// client.c - the head side: a ggml backend whose devices are tbrpc nodes.
//
// The ggml objects (registry "TBRPC", one device and buffer type per node,
// buffers, backends) and the C API for Python. What crosses the wire, and
// how, is client_node.c; the object model is in client_internal.h.
#include "client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SET_CHUNK (64ull << 20)        // weights cross in 64 MiB messages

// ---- buffer -----------------------------------------------------------------

// The node forgets every graph it kept (a buffer they may use was freed, or a new session).
static void forget_kept_graphs(struct client_node * n) {
    for (size_t i = 0; i < TB_KEPT_GRAPHS; i++) { n->kept[i].len = 0; n->kept[i].uid = 0; }
}

static const char * buft_get_name(ggml_backend_buffer_type_t buft);

bool is_our_buffer(ggml_backend_buffer_t b) {
    return b && b->buft && b->buft->iface.get_name == buft_get_name;
}

static void buffer_free(ggml_backend_buffer_t buffer) {
    struct client_buffer * cb = buffer->context;
    struct client_node * n = cb->node;
    struct tb_buffer_req req = { .handle = cb->handle };
    pthread_mutex_lock(&n->lock);
    forget_kept_graphs(n);                  // the node drops its kept graphs with the buffer
    node_post_locked(n, TB_CMD_FREE_BUFFER, &req, sizeof req, NULL, 0);
    node_flush_locked(n, TB_CMD_FREE_BUFFER);
    pthread_mutex_unlock(&n->lock);
    __atomic_sub_fetch(&n->live_buffers, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&n->live_bytes, cb->size, __ATOMIC_RELAXED);
    free(cb);
}

static void * buffer_get_base(ggml_backend_buffer_t buffer) {
    struct client_buffer * cb = buffer->context;
    return (void *) (uintptr_t) cb->base;
}

static void buffer_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    struct client_buffer * cb = buffer->context;
    struct client_node * n = cb->node;
    const uint8_t * p = data;
    uint64_t at = tensor_offset(cb, tensor) + offset;
    pthread_mutex_lock(&n->lock);
    uint64_t file_offset = 0;
    const uint64_t file_id = n->failed ? 0 : node_file_for(n, data, size, &file_offset);
    if (file_id) {
        struct tb_file_range req = { .handle = cb->handle, .offset = at, .size = size, .file_id = file_id, .file_offset = file_offset };
        node_post_locked(n, TB_CMD_LOAD_FROM_FILE, &req, sizeof req, NULL, 0);
        n->bytes_from_files += size;
        size = 0;
    }
    while (size > 0 && !n->failed) {
        size_t chunk = size < SET_CHUNK ? size : (size_t) SET_CHUNK;
        struct tb_range req = { .handle = cb->handle, .offset = at, .size = chunk };
        node_post_locked(n, TB_CMD_SET_TENSOR, &req, sizeof req, p, chunk);
        p += chunk; at += chunk; size -= chunk;
    }
    pthread_mutex_unlock(&n->lock);
}

// Rows of a weight's slice (llama.cpp's meta device): from the node's own
// copy of the model file in one request, or packed into messages of up to
// SET_CHUNK, instead of one request per row.
static void buffer_set_tensor_2d(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, const void * data, size_t offset,
                                 size_t size, size_t n_copies, size_t stride_tensor, size_t stride_data) {
    if (size == 0 || n_copies == 0) return;
    if (n_copies == 1 || (stride_tensor == size && stride_data == size)) {
        buffer_set_tensor(buffer, tensor, data, offset, size * n_copies);
        return;
    }
    if (stride_tensor < size || size > SET_CHUNK) {   // overlapping or huge rows: one at a time, in order (SET_CHUNK is the node's FILE_CHUNK)
        for (size_t i = 0; i < n_copies; i++)
            buffer_set_tensor(buffer, tensor, (const uint8_t *) data + i * stride_data, offset + i * stride_tensor, size);
        return;
    }
    struct client_buffer * cb = buffer->context;
    struct client_node * n = cb->node;
    const uint64_t at = tensor_offset(cb, tensor) + offset;
    pthread_mutex_lock(&n->lock);
    uint64_t file_offset = 0;
    const size_t span = (n_copies - 1) * stride_data + size;
    const uint64_t file_id = n->failed ? 0 : node_file_for(n, data, span, &file_offset);
    if (file_id) {
        struct tb_file_range_2d req = { .handle = cb->handle, .offset = at, .size = size, .n_copies = n_copies,
                                        .stride = stride_tensor, .file_id = file_id, .file_offset = file_offset,
                                        .file_stride = stride_data };
        node_post_locked(n, TB_CMD_LOAD_FROM_FILE_2D, &req, sizeof req, NULL, 0);
        n->bytes_from_files += (uint64_t) size * n_copies;
        pthread_mutex_unlock(&n->lock);
        return;
    }
    const size_t rows_per_message = SET_CHUNK / size;
    const size_t most = n_copies < rows_per_message ? n_copies : rows_per_message;
    uint8_t * packed = malloc(most * size);
    if (!packed) node_fail(n, "SET_TENSOR_2D", "out of memory on the head");
    for (size_t first = 0; packed && first < n_copies && !n->failed; first += rows_per_message) {
        const size_t rows = n_copies - first < rows_per_message ? n_copies - first : rows_per_message;
        for (size_t i = 0; i < rows; i++)
            memcpy(packed + i * size, (const uint8_t *) data + (first + i) * stride_data, size);
        struct tb_range_2d req = { .handle = cb->handle, .offset = at + first * stride_tensor, .size = size, .n_copies = rows,
                                   .stride = stride_tensor };
        node_post_locked(n, TB_CMD_SET_TENSOR_2D, &req, sizeof req, packed, rows * size);
    }
    free(packed);
    pthread_mutex_unlock(&n->lock);
}

static void buffer_get_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    struct client_buffer * cb = buffer->context;
    struct client_node * n = cb->node;
    uint8_t * p = data;
    uint64_t at = tensor_offset(cb, tensor) + offset;
    pthread_mutex_lock(&n->lock);
    while (size > 0) {
        size_t chunk = size < SET_CHUNK ? size : (size_t) SET_CHUNK;
        struct tb_range req = { .handle = cb->handle, .offset = at, .size = chunk };
        if (node_call_locked(n, TB_CMD_GET_TENSOR, &req, sizeof req, NULL, 0, p, chunk) != 0) {
            memset(p, 0, size);             // never hand back uninitialised memory
            break;
        }
        p += chunk; at += chunk; size -= chunk;
    }
    pthread_mutex_unlock(&n->lock);
}

static void buffer_memset_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size) {
    struct client_buffer * cb = buffer->context;
    struct tb_memset_req req = { .handle = cb->handle, .offset = tensor_offset(cb, tensor) + offset, .size = size, .value = value };
    node_post(cb->node, TB_CMD_MEMSET_TENSOR, &req, sizeof req);
}

static bool buffer_cpy_tensor(ggml_backend_buffer_t buffer, const struct ggml_tensor * src, struct ggml_tensor * dst) {
    struct client_buffer * dcb = buffer->context;
    if (!is_our_buffer(src->buffer)) return false;
    struct client_buffer * scb = src->buffer->context;
    if (scb->node != dcb->node) return false;   // different nodes: ggml copies through the head
    struct tb_copy_req req = {
        .src_handle = scb->handle, .src_offset = tensor_offset(scb, src),
        .dst_handle = dcb->handle, .dst_offset = tensor_offset(dcb, dst), .size = ggml_nbytes(src),
    };
    return node_post(dcb->node, TB_CMD_COPY_TENSOR, &req, sizeof req) == 0;
}

static void buffer_clear(ggml_backend_buffer_t buffer, uint8_t value) {
    struct client_buffer * cb = buffer->context;
    struct tb_memset_req req = { .handle = cb->handle, .offset = 0, .size = cb->size, .value = value };
    node_post(cb->node, TB_CMD_BUFFER_CLEAR, &req, sizeof req);
}

static const struct ggml_backend_buffer_i buffer_iface = {
    .free_buffer   = buffer_free,
    .get_base      = buffer_get_base,
    .init_tensor   = NULL,
    .memset_tensor = buffer_memset_tensor,
    .set_tensor    = buffer_set_tensor,
    .get_tensor    = buffer_get_tensor,
    .set_tensor_2d = buffer_set_tensor_2d,
    .get_tensor_2d = NULL,
    .cpy_tensor    = buffer_cpy_tensor,
    .clear         = buffer_clear,
    .reset         = NULL,
};

// ---- buffer type ------------------------------------------------------------

static const char * buft_get_name(ggml_backend_buffer_type_t buft) {
    return ((struct client_node *) buft->context)->name;
}

static ggml_backend_buffer_t buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    struct client_node * n = buft->context;
    struct tb_alloc_req req = { .size = size };
    struct tb_alloc_reply rep;
    if (node_call(n, TB_CMD_ALLOC_BUFFER, &req, sizeof req, &rep, sizeof rep) != 0) return NULL;
    // ggml takes `base` for an address: it aborts the whole process on NULL
    // (ggml_backend_buffer_get_base) and on tensors whose base + offset wraps
    // (ggml_backend_tensor_alloc). A node's word is not enough for that.
    if (rep.size < size || rep.base == 0 || rep.base % n->info.alignment != 0 || rep.size > UINTPTR_MAX - rep.base) {
        char why[256];
        snprintf(why, sizeof why, "a buffer of %zu bytes came back as %llu bytes at base 0x%llx (alignment %llu): "
                 "not a range ggml can address", size, (unsigned long long) rep.size, (unsigned long long) rep.base,
                 (unsigned long long) n->info.alignment);
        pthread_mutex_lock(&n->lock);
        node_fail(n, "ALLOC_BUFFER", why);
        pthread_mutex_unlock(&n->lock);
        return NULL;
    }
    struct client_buffer * cb = calloc(1, sizeof *cb);
    if (!cb) {
        struct tb_buffer_req free_req = { .handle = rep.handle };
        node_post(n, TB_CMD_FREE_BUFFER, &free_req, sizeof free_req);
        return NULL;
    }
    *cb = (struct client_buffer) { .node = n, .handle = rep.handle, .base = rep.base, .size = rep.size };
    __atomic_add_fetch(&n->live_buffers, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&n->live_bytes, cb->size, __ATOMIC_RELAXED);
    return ggml_backend_buffer_init(buft, buffer_iface, cb, size);
}

static size_t buft_get_alignment(ggml_backend_buffer_type_t buft) {
    return (size_t) ((struct client_node *) buft->context)->info.alignment;
}

static size_t buft_get_max_size(ggml_backend_buffer_type_t buft) {
    return (size_t) ((struct client_node *) buft->context)->info.max_size;
}

// ---- backend (stream) ---------------------------------------------------------

static struct client_node * backend_node(ggml_backend_t backend) { return backend->context; }

static const char * backend_get_name(ggml_backend_t backend) { return backend_node(backend)->name; }

static void backend_free(ggml_backend_t backend) { free(backend); }

static void backend_set_tensor_async(ggml_backend_t backend, struct ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    (void) backend;
    buffer_set_tensor(tensor->view_src ? tensor->view_src->buffer : tensor->buffer, tensor, data, offset, size);
}

// Sends the GET_TENSOR and returns; the reply is read at synchronize, or
// before the next request to the node (node_settle_locked). So a tensor
// split's logits, read from every node in turn by ggml's meta backend, come
// from all nodes at once. One read in flight per node, of one message: a
// larger one is read in pieces, at once.
static void backend_get_tensor_async(ggml_backend_t backend, const struct ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    ggml_backend_buffer_t buffer = tensor->view_src ? tensor->view_src->buffer : tensor->buffer;
    struct client_buffer * cb = buffer->context;
    struct client_node * n = cb->node;
    if (size == 0) return;
    if (size > SET_CHUNK || n != backend_node(backend)) {   // (a buffer of another node: its synchronize is not ours)
        buffer_get_tensor(buffer, tensor, data, offset, size);
        return;
    }
    pthread_mutex_lock(&n->lock);
    struct tb_range req = { .handle = cb->handle, .offset = tensor_offset(cb, tensor) + offset, .size = size };
    const uint64_t id = node_call_send_locked(n, TB_CMD_GET_TENSOR, &req, sizeof req);   // settles the one before
    if (id != 0) n->pending = (struct pending_get) { .waiting = true, .id = id, .data = data, .size = size };
    else memset(data, 0, size);
    pthread_mutex_unlock(&n->lock);
}

// synchronize only reads a reply get_tensor_async left in flight. A node
// executes one client's requests strictly in order, and nothing else the
// head can observe depends on one: every other transfer back to the head
// (get_tensor) is a call, which sends what was queued before it and waits
// for its answer; a request another node waits for (PEER_SEND, ALLREDUCE)
// and a graph leave when they are posted. So queued requests may wait in
// the head's buffer for the next of those. ggml's scheduler calls
// synchronize before every input it copies to a split (three to five times
// per node and token); sending there cost a system call each, and woke the
// node for a part of its requests at a time (docs/benchmarks.md, "A token
// hop by hop"), where now a node's inputs and graph leave together.
static void backend_synchronize(ggml_backend_t backend) {
    struct client_node * n = backend_node(backend);
    pthread_mutex_lock(&n->lock);
    node_settle_locked(n);
    pthread_mutex_unlock(&n->lock);
}

// Posts the graph; when the node already keeps an identical one (the usual
// case from one generated token to the next, for each of a tensor split's
// subgraphs too), posts only "run slot i again".
static void post_recompute(struct client_node * n, size_t slot) {
    const uint32_t s = (uint32_t) slot;
    n->graphs_reused++;
    n->kept[slot].used = ++n->kept_clock;
    node_post_locked(n, TB_CMD_GRAPH_RECOMPUTE, &s, sizeof s, NULL, 0);
}

static enum ggml_status backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * g) {
    struct client_node * n = backend_node(backend);
    char err[256] = "";
    pthread_mutex_lock(&n->lock);
    size_t slot = TB_KEPT_GRAPHS;
    for (size_t i = 0; i < TB_KEPT_GRAPHS && g->uid != 0; i++) {
        if (n->kept[i].len > 0 && n->kept[i].uid == g->uid) slot = i;   // the scheduler did not re-split
    }
    size_t len = 0;
    if (!n->failed && slot == TB_KEPT_GRAPHS) {
        len = encode_graph(n, g, err, sizeof err);
        if (len == 0) node_fail(n, "GRAPH_COMPUTE", err);
        for (size_t i = 0; i < TB_KEPT_GRAPHS && len > 0; i++) {
            if (n->kept[i].len == len && memcmp(n->kept[i].bytes, n->encode, len) == 0) slot = i;
        }
    }
    if (!n->failed && slot < TB_KEPT_GRAPHS) {
        n->kept[slot].uid = g->uid;
        post_recompute(n, slot);
    } else if (!n->failed) {
        slot = 0;                                   // the least recently used slot
        for (size_t i = 1; i < TB_KEPT_GRAPHS; i++) {
            if (n->kept[i].used < n->kept[slot].used) slot = i;
        }
        struct kept_graph * k = &n->kept[slot];
        k->len = tb_reserve(&k->bytes, &k->cap, len) == 0 ? len : 0;   // as encoded, with slot 0
        if (k->len) memcpy(k->bytes, n->encode, len);
        k->uid = g->uid;
        k->used = ++n->kept_clock;
        ((struct tb_graph_header *) n->encode)->slot = (uint32_t) slot;
        n->graphs_sent++;
        node_post_locked(n, TB_CMD_GRAPH_COMPUTE, n->encode, len, NULL, 0);
    }
    // start the node now: the head may have its own work before it reads results
    node_flush_locked(n, TB_CMD_GRAPH_COMPUTE);
    enum ggml_status st = n->failed ? GGML_STATUS_FAILED : GGML_STATUS_SUCCESS;
    pthread_mutex_unlock(&n->lock);
    return st;
}

// The scheduler's copy of a split's input from the node that computed it to
// the node that needs it: the first sends, the second receives, both posted.
// The head waits for neither; node order keeps it correct (the send runs
// after the producer's graph, the receive before the consumer's). A large
// copy (a prompt's activations) may not fit the link's buffers, so its
// sender waits until the receiver reads: then the receive leaves at once
// too, not with the receiver's next request, lest the head wait on
// something else meanwhile and the sender time out. A decoded token's few
// KiB fit any link and go with the receiver's graph, in one write.
#define PEER_COPY_FITS (64u << 10)   // below every link's buffers: TCP's, a ring's 16 slots

static bool backend_cpy_tensor_async(ggml_backend_t backend_src, ggml_backend_t backend_dst,
                                     const struct ggml_tensor * src, struct ggml_tensor * dst) {
    if (backend_src->iface.get_name != backend_get_name || !is_our_buffer(src->buffer) || !is_our_buffer(dst->buffer))
        return false;
    struct client_node * a = backend_node(backend_src), * b = backend_node(backend_dst);
    struct client_buffer * scb = src->buffer->context, * dcb = dst->buffer->context;
    if (a == b || scb->node != a || dcb->node != b || a->failed || b->failed) return false;
    struct peer_link * link = peer_link(a, b);
    if (!link) return false;
    const uint64_t size = ggml_nbytes(src);
    struct tb_peer_range send = { .peer_id = link->out_id, .handle = scb->handle, .offset = tensor_offset(scb, src), .size = size };
    struct tb_peer_range recv = { .peer_id = link->in_id, .handle = dcb->handle, .offset = tensor_offset(dcb, dst), .size = size };
    pthread_mutex_lock(&a->lock);
    node_post_locked(a, TB_CMD_PEER_SEND, &send, sizeof send, NULL, 0);
    node_flush_locked(a, TB_CMD_PEER_SEND);
    a->peer_copies++;
    pthread_mutex_unlock(&a->lock);
    pthread_mutex_lock(&b->lock);
    node_post_locked(b, TB_CMD_PEER_RECV, &recv, sizeof recv, NULL, 0);
    if (size > PEER_COPY_FITS) node_flush_locked(b, TB_CMD_PEER_RECV);
    pthread_mutex_unlock(&b->lock);
    return true;
}

// ---- all-reduce for llama.cpp's tensor split -----------------------------------
// llama.cpp's meta backend asks backend 0's registry for these. With them,
// each all-reduce is one posted ALLREDUCE per node, and the partial sums go
// node to node over the peer links; without them (NULL from comm_init, or
// false from allreduce) the meta backend falls back to its butterfly of
// cpy_tensor_async copies and one-node ADD graphs.

// Mesh or ring (node_links.c has both) is decided once per comm, from the
// per-pair addresses the cluster file's `links` give (a cable between the
// pair: Thunderbolt is point to point and does not route). A mesh needs a
// link between every pair; on a ring of cables two pairs of four have none,
// and their links would go over the ordinary network. So: a ring when every
// link a ring dials (node i to node i+1 mod n, in node order) has an
// address but not every pair's does; a mesh otherwise, including no
// addresses at all (a switch, or one host: every pair reaches every other).
// TBRPC_ALLREDUCE=ring|mesh forces one.
int tbrpc_allreduce_choose(const uint8_t * addressed, size_t n, const char * forced, char * why, size_t why_len) {
    if (forced && strcmp(forced, "ring") == 0) { snprintf(why, why_len, "TBRPC_ALLREDUCE=ring"); return TBRPC_ALLREDUCE_RING; }
    if (forced && strcmp(forced, "mesh") == 0) { snprintf(why, why_len, "TBRPC_ALLREDUCE=mesh"); return TBRPC_ALLREDUCE_MESH; }
    const char * ignored = forced && forced[0] ? " (TBRPC_ALLREDUCE is neither ring nor mesh: ignored)" : "";
    size_t pairs = 0, ring = 0;
    for (size_t a = 0; a < n; a++) {
        for (size_t b = 0; b < n; b++) pairs += a != b && addressed[a * n + b];
        ring += addressed[a * n + (a + 1) % n] != 0;
    }
    if (n > 2 && ring == n && pairs < n * (n - 1)) {
        snprintf(why, why_len, "the cluster's links give an address for each node's link to the next, not for every pair%s", ignored);
        return TBRPC_ALLREDUCE_RING;
    }
    snprintf(why, why_len, "%s%s", pairs == 0 ? "no links in the cluster: every node reaches every other"
             : pairs == n * (n - 1) ? "the cluster's links give an address for every pair"
             : "the cluster's links give addresses for some pairs but no ring in node order", ignored);
    return TBRPC_ALLREDUCE_MESH;
}

struct comm { struct client_node * nodes[TB_MAX_ALLREDUCE_NODES]; size_t n; bool ring; };

// Whether b has an address at which a dials it (tbrpc_client_set_peer_address).
static bool has_address(struct client_node * a, struct client_node * b) {
    pthread_mutex_lock(&b->lock);
    bool found = false;
    for (size_t i = 0; i < b->n_addresses && !found; i++) found = b->addresses[i].from == a;
    pthread_mutex_unlock(&b->lock);
    return found;
}

static void * comm_init(ggml_backend_t * backends, size_t n) {
    if (n < 2 || n > TB_MAX_ALLREDUCE_NODES || getenv("TBRPC_NO_ALLREDUCE")) return NULL;
    struct comm * cm = calloc(1, sizeof *cm);
    if (!cm) return NULL;
    cm->n = n;
    for (size_t i = 0; i < n; i++) {
        if (backends[i]->iface.get_name != backend_get_name) { free(cm); return NULL; }
        cm->nodes[i] = backend_node(backends[i]);
        for (size_t k = 0; k < i; k++) {
            if (cm->nodes[k] == cm->nodes[i]) { free(cm); return NULL; }
        }
    }
    uint8_t addressed[TB_MAX_ALLREDUCE_NODES * TB_MAX_ALLREDUCE_NODES] = { 0 };
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < n; k++) addressed[i * n + k] = i != k && has_address(cm->nodes[i], cm->nodes[k]);
    }
    char why[256];
    cm->ring = tbrpc_allreduce_choose(addressed, n, getenv("TBRPC_ALLREDUCE"), why, sizeof why) == TBRPC_ALLREDUCE_RING;
    ggml_log_internal(GGML_LOG_LEVEL_INFO, "tbrpc: tensor-split all-reduce over %zu nodes: %s (%s)\n", n,
                      cm->ring ? "ring" : "mesh", why);
    for (size_t i = 0; i < n; i++) {       // every link it uses now, not on the first token
        for (size_t k = 0; k < n; k++) {
            const bool used = cm->ring ? k == (i + 1) % n : i != k;   // a ring: node i to i+1 only
            if (used && !peer_link(cm->nodes[i], cm->nodes[k])) { free(cm); return NULL; }
        }
    }
    for (size_t i = 0; i < n; i++) {
        pthread_mutex_lock(&cm->nodes[i]->lock);
        snprintf(cm->nodes[i]->allreduce, sizeof cm->nodes[i]->allreduce, "%s", cm->ring ? "ring" : "mesh");
        pthread_mutex_unlock(&cm->nodes[i]->lock);
    }
    return cm;
}

static void comm_free(void * ctx) { free(ctx); }

static bool comm_allreduce_tensor(void * ctx, struct ggml_tensor ** tensors) {
    struct comm * cm = ctx;
    const size_t size = ggml_nbytes(tensors[0]);
    for (size_t j = 0; j < cm->n; j++) {
        const struct ggml_tensor * t = tensors[j];
        if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || ggml_nbytes(t) != size || !is_our_buffer(t->buffer) ||
            ((struct client_buffer *) t->buffer->context)->node != cm->nodes[j] || cm->nodes[j]->failed)
            return false;
    }
    if (size == 0) return true;
    for (size_t j = 0; j < cm->n; j++) {
        struct client_node * n = cm->nodes[j];
        struct client_buffer * cb = tensors[j]->buffer->context;
        struct tb_allreduce req;
        memset(&req, 0, sizeof req);
        req.handle = cb->handle;
        req.offset = tensor_offset(cb, tensors[j]);
        req.size = size;
        req.type = GGML_TYPE_F32;
        req.flags = (tensors[j]->flags & GGML_TENSOR_FLAG_COMPUTE) ? TB_ALLREDUCE_COMPUTED : 0;
        req.n = (uint32_t) cm->n;
        req.self = (uint32_t) j;
        // the links comm_init made, so never NULL here
        for (size_t k = 0; k < cm->n; k++) {
            if (k == j || (cm->ring && k != (j + 1) % cm->n)) continue;
            req.peer_out[k] = peer_link(n, cm->nodes[k])->out_id;
        }
        for (size_t k = 0; k < cm->n; k++) {
            if (k == j || (cm->ring && k != (j + cm->n - 1) % cm->n)) continue;
            req.peer_in[k] = peer_link(cm->nodes[k], n)->in_id;
        }
        if (cm->ring) req.flags |= TB_ALLREDUCE_RING;
        pthread_mutex_lock(&n->lock);
        node_post_locked(n, TB_CMD_ALLREDUCE, &req, sizeof req, NULL, 0);
        node_flush_locked(n, TB_CMD_ALLREDUCE);
        n->allreduces++;
        pthread_mutex_unlock(&n->lock);
    }
    return true;
}

static void * reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    (void) reg;
    if (strcmp(name, "ggml_backend_comm_init") == 0) return (void *) comm_init;
    if (strcmp(name, "ggml_backend_comm_free") == 0) return (void *) comm_free;
    if (strcmp(name, "ggml_backend_comm_allreduce_tensor") == 0) return (void *) comm_allreduce_tensor;
    return NULL;
}

static const struct ggml_backend_i backend_iface = {
    .get_name            = backend_get_name,
    .free                = backend_free,
    .set_tensor_async    = backend_set_tensor_async,
    .get_tensor_async    = backend_get_tensor_async,
    .set_tensor_2d_async = NULL,
    .get_tensor_2d_async = NULL,
    .cpy_tensor_async    = backend_cpy_tensor_async,
    .synchronize         = backend_synchronize,
    .graph_plan_create   = NULL,
    .graph_plan_free     = NULL,
    .graph_plan_update   = NULL,
    .graph_plan_compute  = NULL,
    .graph_compute       = backend_graph_compute,
    .event_record        = NULL,
    .event_wait          = NULL,
    .graph_optimize      = NULL,
};

static ggml_guid_t tbrpc_guid(void) {
    static ggml_guid guid = { 0x74, 0x62, 0x72, 0x70, 0x63, 0x2d, 0x67, 0x67, 0x6d, 0x6c, 0x2d, 0x62, 0x61, 0x63, 0x6b, 0x01 };
    return &guid;
}

// ---- device -------------------------------------------------------------------

static struct client_node * dev_node(ggml_backend_dev_t dev) { return dev->context; }

static const char * dev_get_name(ggml_backend_dev_t dev) { return dev_node(dev)->name; }
static const char * dev_get_description(ggml_backend_dev_t dev) { return dev_node(dev)->description; }

static void dev_get_memory(ggml_backend_dev_t dev, size_t * free_mem, size_t * total) {
    struct tb_memory m = { 0, 0 };
    node_call(dev_node(dev), TB_CMD_GET_MEMORY, NULL, 0, &m, sizeof m);
    *free_mem = (size_t) m.free;
    *total = (size_t) m.total;
}

static enum ggml_backend_dev_type dev_get_type(ggml_backend_dev_t dev) {
    (void) dev;
    return GGML_BACKEND_DEVICE_TYPE_GPU;   // llama.cpp offloads layers only to GPU-type devices
}

static void dev_get_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props) {
    props->name = dev_get_name(dev);
    props->description = dev_get_description(dev);
    dev_get_memory(dev, &props->memory_free, &props->memory_total);
    props->type = dev_get_type(dev);
    props->device_id = dev_node(dev)->endpoint;   // distinct per node, so llama.cpp keeps them all
    props->caps.async = true;
    props->caps.host_buffer = false;
    props->caps.buffer_from_host_ptr = false;
    props->caps.events = false;
    props->caps.mmap_support = false;
}

static ggml_backend_t dev_init_backend(ggml_backend_dev_t dev, const char * params) {
    (void) params;
    ggml_backend_t b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->guid = tbrpc_guid();
    b->iface = backend_iface;
    b->device = dev;
    b->context = dev_node(dev);
    return b;
}

static ggml_backend_buffer_type_t dev_get_buffer_type(ggml_backend_dev_t dev) { return &dev_node(dev)->buft; }

// Metal needs room beyond ggml_nbytes for some ops (MUL_MAT_ID, FLASH_ATTN_EXT,
// ARGSORT, TOP_K, ...): ask the node for exactly those, once per shape.
static size_t buft_get_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * tensor) {
    const size_t nbytes = ggml_nbytes(tensor);
    struct client_node * n = buft->context;
    if (tensor->view_src != NULL || !ggml_op_alloc_size_may_expand(tensor->op) ||
        ((n->info.caps & TB_CAP_ALLOC_SIZE_IS_NBYTES) && !n->ask_always))
        return nbytes;
    uint64_t size = 0;
    if (!ask_node_about_op(n, TB_CMD_GET_ALLOC_SIZE, alloc_size_key(tensor), tensor, &size, sizeof size)) return nbytes;
    return size > nbytes ? (size_t) size : nbytes;
}

static const struct ggml_backend_buffer_type_i buft_iface = {
    .get_name       = buft_get_name,
    .alloc_buffer   = buft_alloc_buffer,
    .get_alignment  = buft_get_alignment,
    .get_max_size   = buft_get_max_size,
    .get_alloc_size = buft_get_alloc_size,
    .is_host        = NULL,
};

// Answered by the node's real device (Metal rejects some ops the CPU runs).
static bool dev_supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) {
    if (op->op == GGML_OP_MAP_CUSTOM1 || op->op == GGML_OP_MAP_CUSTOM2 || op->op == GGML_OP_MAP_CUSTOM3 || op->op == GGML_OP_CUSTOM)
        return false;   // their op params are host function pointers
    // A node that cannot answer (it failed) says "yes": ggml then schedules
    // as before and the compute fails softly on that node, which Python
    // reports as NodeError. "No" would make ggml's scheduler abort the head
    // on weights that already live there.
    struct client_node * n = dev_node(dev);
    if (n->cpu_twin && !n->ask_always) return ggml_backend_dev_supports_op(n->cpu_twin, op);
    uint64_t supported = 0;
    return !ask_node_about_op(n, TB_CMD_SUPPORTS_OP, supports_key(op), op, &supported, 1) || supported;
}

static bool dev_supports_buft(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft) {
    return buft == &dev_node(dev)->buft;
}

static const struct ggml_backend_device_i dev_iface = {
    .get_name             = dev_get_name,
    .get_description      = dev_get_description,
    .get_memory           = dev_get_memory,
    .get_type             = dev_get_type,
    .get_props            = dev_get_props,
    .init_backend         = dev_init_backend,
    .get_buffer_type      = dev_get_buffer_type,
    .get_host_buffer_type = NULL,
    .buffer_from_host_ptr = NULL,
    .supports_op          = dev_supports_op,
    .supports_buft        = dev_supports_buft,
    .offload_op           = NULL,
    .event_new            = NULL,
    .event_free           = NULL,
    .event_synchronize    = NULL,
};

// ---- registry -----------------------------------------------------------------

static const char * reg_get_name(ggml_backend_reg_t reg) { (void) reg; return "TBRPC"; }

static size_t reg_get_device_count(ggml_backend_reg_t reg) {
    struct tbrpc_client * c = reg->context;
    pthread_mutex_lock(&c->lock);
    size_t n = c->n_nodes;
    pthread_mutex_unlock(&c->lock);
    return n;
}

static ggml_backend_dev_t reg_get_device(ggml_backend_reg_t reg, size_t i) {
    struct tbrpc_client * c = reg->context;
    pthread_mutex_lock(&c->lock);
    ggml_backend_dev_t d = i < c->n_nodes ? &c->nodes[i]->dev : NULL;
    pthread_mutex_unlock(&c->lock);
    return d;
}

static const struct ggml_backend_reg_i reg_iface = {
    .get_name = reg_get_name,
    .get_device_count = reg_get_device_count,
    .get_device = reg_get_device,
    .get_proc_address = reg_get_proc_address,
};

struct tbrpc_client * tbrpc_client_new(void) {
    struct tbrpc_client * c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->reg.api_version = TBRPC_GGML_BACKEND_API_VERSION;
    c->reg.iface = reg_iface;
    c->reg.context = c;
    pthread_mutex_init(&c->lock, NULL);
    return c;
}

static struct client_node * node_at(struct tbrpc_client * c, size_t i);

static void describe_node(struct client_node * n) {
    snprintf(n->description, sizeof n->description, "tbrpc node %s at %s: %s (%s)", n->info.node_name, n->endpoint,
             n->info.device_name, n->info.device_description);
}

// True, with err naming both endpoints, when node n (just opened) is a node
// process c is already connected to: one node at two addresses (localhost
// and 127.0.0.1, a LAN address and a cable's) would be two devices, its
// memory counted twice. A failed node's process may be gone: not compared;
// nor is `skip` (the node n connects again).
static bool same_node_as(struct tbrpc_client * c, const struct client_node * n, const struct client_node * skip,
                         char * err, size_t err_len) {
    static const uint8_t none[TB_NODE_ID_LEN];
    if (memcmp(n->info.node_id, none, sizeof none) == 0) return false;
    struct client_node * m;
    bool same = false;
    for (size_t i = 0; !same && (m = node_at(c, i)) != NULL; i++) {
        if (m == skip) continue;
        pthread_mutex_lock(&m->lock);
        same = !m->failed && memcmp(m->info.node_id, n->info.node_id, sizeof n->info.node_id) == 0;
        if (same)
            snprintf(err, err_len, "tbrpc node %s is node %s (%s), which this process is connected to already: the "
                     "same node process answers at both addresses; list each node once", n->endpoint, m->endpoint,
                     m->name);
        pthread_mutex_unlock(&m->lock);
    }
    return same;
}

int tbrpc_client_add_node(struct tbrpc_client * c, const char * endpoint, int timeout_ms, const char * transport,
                          const uint8_t * secret, size_t secret_len, char * err, size_t err_len) {
    char name[32];
    pthread_mutex_lock(&c->lock);
    const size_t index = c->n_nodes;
    pthread_mutex_unlock(&c->lock);
    snprintf(name, sizeof name, "TBRPC%zu", index);
    int kind = TBRPC_ERR_OTHER;
    struct client_node * n = node_open(endpoint, name, timeout_ms, transport, secret, secret_len, &kind, err, err_len);
    if (!n) return -kind;
    if (same_node_as(c, n, NULL, err, err_len)) {
        node_destroy(n);
        return -TBRPC_ERR_DUPLICATE;
    }
    n->client = c;
    describe_node(n);
    n->buft = (struct ggml_backend_buffer_type) { .iface = buft_iface, .device = &n->dev, .context = n };
    n->dev = (struct ggml_backend_device) { .iface = dev_iface, .reg = &c->reg, .context = n };

    pthread_mutex_lock(&c->lock);
    if (c->n_nodes == c->cap_nodes) {
        size_t cap = c->cap_nodes ? 2 * c->cap_nodes : 8;
        struct client_node ** p = realloc(c->nodes, cap * sizeof *p);
        if (!p) { pthread_mutex_unlock(&c->lock); node_destroy(n); snprintf(err, err_len, "out of memory"); return -TBRPC_ERR_OTHER; }
        c->nodes = p;
        c->cap_nodes = cap;
    }
    c->nodes[c->n_nodes++] = n;
    const bool registered = c->registered;
    pthread_mutex_unlock(&c->lock);
    if (registered) ggml_backend_device_register(&n->dev);
    return (int) index;
}

int tbrpc_client_reconnect_node(struct tbrpc_client * c, size_t i, const char * transport, char * err, size_t err_len) {
    struct client_node * n = node_at(c, i);
    if (!n) { snprintf(err, err_len, "no node %zu", i); return -TBRPC_ERR_OTHER; }
    const uint64_t live = __atomic_load_n(&n->live_buffers, __ATOMIC_RELAXED);
    if (live > 0) {
        snprintf(err, err_len, "tbrpc node %s: %llu buffer(s) of the model that used it are still open on this head; "
                 "close that model (Llama.close()) before loading again", n->endpoint, (unsigned long long) live);
        return -TBRPC_ERR_FAILED;
    }
    int kind = TBRPC_ERR_OTHER;   // the same secret as the first time
    struct client_node * fresh = node_open(n->endpoint, n->name, n->timeout_ms, transport,
                                           n->secret_len ? n->secret : NULL, n->secret_len, &kind, err, err_len);
    if (!fresh) return -kind;
    if (same_node_as(c, fresh, n, err, err_len)) {
        node_destroy(fresh);
        return -TBRPC_ERR_DUPLICATE;
    }
    pthread_mutex_lock(&n->lock);
    node_settle_locked(n);                 // (a failed node: zeroes a read left in flight)
    struct tb_transport * old = n->tp;
    n->tp = fresh->tp;
    fresh->tp = old;                       // closed with `fresh` below
    n->info = fresh->info;
    n->cpu_twin = fresh->cpu_twin;
    n->next_id = fresh->next_id;
    n->dirty = false;
    n->failed = false;
    n->error_kind = 0;
    n->failed_peer = 0;
    n->error[0] = '\0';
    forget_kept_graphs(n);                 // the new session holds no graph, file or link of the old one
    n->n_files = 0;
    n->n_links = 0;
    describe_node(n);
    pthread_mutex_unlock(&n->lock);
    node_destroy(fresh);
    // Links from other nodes to this one ended with its old session.
    for (size_t k = 0; k < tbrpc_client_node_count(c); k++) {
        struct client_node * m = node_at(c, k);
        if (m == n) continue;
        pthread_mutex_lock(&m->lock);
        size_t kept = 0;
        for (size_t j = 0; j < m->n_links; j++) {
            if (m->links[j].to != n) m->links[kept++] = m->links[j];
        }
        m->n_links = kept;
        pthread_mutex_unlock(&m->lock);
    }
    return 0;
}

int tbrpc_client_set_peer_address(struct tbrpc_client * c, size_t from, size_t to, const char * host, char * err,
                                  size_t err_len) {
    struct client_node * a = node_at(c, from), * b = node_at(c, to);
    if (!a || !b || a == b) { snprintf(err, err_len, "no pair of nodes %zu, %zu", from, to); return -1; }
    if (strlen(host) == 0 || strlen(host) >= sizeof b->addresses[0].host) { snprintf(err, err_len, "bad address '%s'", host); return -1; }
    pthread_mutex_lock(&b->lock);
    size_t i = 0;
    while (i < b->n_addresses && b->addresses[i].from != a) i++;
    const bool room = i < sizeof b->addresses / sizeof b->addresses[0];
    if (room) {
        b->addresses[i].from = a;
        snprintf(b->addresses[i].host, sizeof b->addresses[i].host, "%s", host);
        if (i == b->n_addresses) b->n_addresses++;
    }
    pthread_mutex_unlock(&b->lock);
    if (!room) { snprintf(err, err_len, "node %s has addresses for 16 peers already", b->endpoint); return -1; }
    return 0;
}

int tbrpc_client_register(struct tbrpc_client * c, char * err, size_t err_len) {
    (void) err; (void) err_len;
    if (c->registered) return 0;
    c->registered = true;
    ggml_backend_register(&c->reg);   // also registers the devices it has now
    return 0;
}

size_t tbrpc_client_node_count(struct tbrpc_client * c) { return reg_get_device_count(&c->reg); }

static struct client_node * node_at(struct tbrpc_client * c, size_t i) {
    pthread_mutex_lock(&c->lock);
    struct client_node * n = i < c->n_nodes ? c->nodes[i] : NULL;
    pthread_mutex_unlock(&c->lock);
    return n;
}

// The index of node m in c (c->n_nodes when it is not there).
static size_t reg_index_of(struct tbrpc_client * c, const struct client_node * m) {
    pthread_mutex_lock(&c->lock);
    size_t i = 0;
    while (i < c->n_nodes && c->nodes[i] != m) i++;
    pthread_mutex_unlock(&c->lock);
    return i;
}

// The index of the node at the other end of node n's link with peer id
// `peer` (n's own number for it): a node whose link to n n receives on
// (in_id), or one n sends to (out_id); -1 when none is. Takes one node's lock
// at a time, none of n's.
static int node_of_peer(struct tbrpc_client * c, const struct client_node * n, uint32_t peer) {
    int found = -1;
    struct client_node * m;
    for (size_t i = 0; found < 0 && (m = node_at(c, i)) != NULL; i++) {
        pthread_mutex_lock(&m->lock);
        for (size_t k = 0; k < m->n_links; k++) {
            const struct peer_link * l = &m->links[k];
            if ((m != n && l->to == n && l->in_id == peer) || (m == n && l->out_id == peer))
                found = (int) reg_index_of(c, m == n ? l->to : m);
        }
        pthread_mutex_unlock(&m->lock);
    }
    return found;
}

int tbrpc_client_node_info(struct tbrpc_client * c, size_t i, struct tbrpc_node_info * out) {
    struct client_node * n = node_at(c, i);
    if (!n) return -1;
    pthread_mutex_lock(&n->lock);
    *out = (struct tbrpc_node_info) {
        .hello = n->info, .failed = n->failed, .error_kind = n->failed ? n->error_kind : 0, .failed_peer = -1,
        .bytes_sent = n->tp->bytes_sent, .bytes_received = n->tp->bytes_received, .round_trips = n->round_trips,
        .messages = n->messages, .graphs_sent = n->graphs_sent, .graphs_reused = n->graphs_reused,
        .bytes_from_files = n->bytes_from_files, .peer_copies = n->peer_copies, .allreduces = n->allreduces,
        .bytes_allocated = __atomic_load_n(&n->live_bytes, __ATOMIC_RELAXED),
    };
    snprintf(out->endpoint, sizeof out->endpoint, "%s", n->endpoint);
    snprintf(out->device_name, sizeof out->device_name, "%s", n->name);
    snprintf(out->error, sizeof out->error, "%s", n->error);
    snprintf(out->transport, sizeof out->transport, "%s", n->tp->describe);
    snprintf(out->allreduce, sizeof out->allreduce, "%s", n->allreduce);
    out->transport_why = n->tp->why;
    for (size_t k = 0; k < n->n_links && k < sizeof out->link_info / sizeof out->link_info[0]; k++) {
        struct tbrpc_link_info * l = &out->link_info[out->n_link_info++];
        l->to = (uint32_t) reg_index_of(c, n->links[k].to);
        l->usable = n->links[k].usable;
        l->why = n->links[k].why;
        snprintf(l->transport, sizeof l->transport, "%s", n->links[k].transport);
    }
    size_t used = 0;
    for (size_t k = 0; k < n->n_links && used < sizeof out->links; k++) {
        if (!n->links[k].usable) continue;
        int w = snprintf(out->links + used, sizeof out->links - used, "%s%s %s", used ? "; " : "", n->links[k].to->endpoint,
                         n->links[k].transport);
        if (w > 0) used += (size_t) w;
    }
    const uint32_t peer = n->failed ? n->failed_peer : 0;
    pthread_mutex_unlock(&n->lock);
    if (peer) out->failed_peer = node_of_peer(c, n, peer);
    return 0;
}

int tbrpc_client_node_status(struct tbrpc_client * c, size_t i, struct tb_status * out, char * err, size_t err_len) {
    struct client_node * n = node_at(c, i);
    if (!n) { snprintf(err, err_len, "no node %zu", i); return -TBRPC_ERR_OTHER; }
    if (node_call(n, TB_CMD_STATUS, NULL, 0, out, sizeof *out) != 0) {
        pthread_mutex_lock(&n->lock);
        snprintf(err, err_len, "%s", n->error);
        const int kind = n->error_kind;
        pthread_mutex_unlock(&n->lock);
        return -kind;
    }
    return 0;
}

int tbrpc_client_failed(struct tbrpc_client * c, char * err, size_t err_len) {
    for (size_t i = 0; i < tbrpc_client_node_count(c); i++) {
        struct client_node * n = node_at(c, i);
        pthread_mutex_lock(&n->lock);
        const int kind = n->failed ? n->error_kind : 0;
        if (kind) snprintf(err, err_len, "%s", n->error);
        pthread_mutex_unlock(&n->lock);
        if (kind) return kind;
    }
    return 0;
}

size_t tbrpc_client_failed_nodes(struct tbrpc_client * c, uint8_t * failed, size_t cap) {
    size_t count = 0;
    for (size_t i = 0; i < cap; i++) {
        struct client_node * n = node_at(c, i);
        failed[i] = 0;
        if (!n) continue;
        pthread_mutex_lock(&n->lock);
        failed[i] = n->failed;
        pthread_mutex_unlock(&n->lock);
        count += failed[i];
    }
    return count;
}

void tbrpc_client_reset_stats(struct tbrpc_client * c) {
    for (size_t i = 0; i < tbrpc_client_node_count(c); i++) {
        struct client_node * n = node_at(c, i);
        pthread_mutex_lock(&n->lock);
        n->round_trips = n->messages = n->graphs_sent = n->graphs_reused = n->bytes_from_files = n->peer_copies = 0;
        n->allreduces = 0;
        n->tp->bytes_sent = n->tp->bytes_received = 0;
        pthread_mutex_unlock(&n->lock);
    }
}

void tbrpc_client_ask_node(struct tbrpc_client * c, size_t i, int always) {
    struct client_node * n = node_at(c, i);
    if (!n) return;
    pthread_mutex_lock(&n->lock);
    n->ask_always = always != 0;
    pthread_mutex_unlock(&n->lock);
}

int tbrpc_probe(const char * endpoint, int timeout_ms, const uint8_t * secret, size_t secret_len,
                struct tb_hello * hello, struct tb_status * status, char * err, size_t err_len) {
    int kind = TBRPC_ERR_OTHER;
    // one question: never upgraded (no shared-memory segment, no RDMA queue pair for it)
    struct client_node * n = node_open(endpoint, "probe", timeout_ms, "tcp", secret, secret_len, &kind, err, err_len);
    if (!n) return -kind;
    *hello = n->info;
    int rc = node_call(n, TB_CMD_STATUS, NULL, 0, status, sizeof *status);
    if (rc != 0) { snprintf(err, err_len, "%s", n->error); rc = -n->error_kind; }
    node_destroy(n);
    return rc;
}

int tbrpc_file_identity(const char * path, struct tb_file_identity * out, char * err, size_t err_len) {
    return tb_file_identity_path(path, out, err, err_len);
}

const char * tbrpc_runtime_ggml_version(void) { return ggml_version(); }
