// op_tests.c - op-level tests through the plugin, in C.
//
// Starts a node in a thread, registers it as a ggml device through the client,
// and checks data movement (set/get/memset/copy at odd offsets, views) and
// ops (quantized matmul, MoE, norms, rope, large graphs) against the plain CPU
// backend of the same ggml: results must be bitwise identical, since both run
// the same CPU kernels. The questions the head asks a node about ops are
// checked field by field (encode_op_query, from the client's own header).
// Usage: op_tests CASE  (prints "PASS CASE" on success)
#include "tbrpc.h"
#include "client_internal.h"   // encode_op_query, supports_key: what the head puts on the wire
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include "check.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


struct env {
    struct tb_node * node;
    pthread_t thread;
    struct tbrpc_client * client;
    ggml_backend_dev_t remote_dev;
    ggml_backend_t remote, cpu;
    bool node_stopped;           // a case stopped the node on purpose
};

static void * serve(void * arg) { tb_node_serve(arg); return NULL; }

// A CPU node serving on a loopback port in a thread (named CPU: once a TBRPC
// device is registered here, it would be a node's "best" device); endpoint
// receives its address.
static struct tb_node * start_node(pthread_t * thread, char * endpoint, size_t endpoint_len) {
    char err[512];
    struct tb_node_config cfg = { .host = "127.0.0.1", .port = 0, .device = "CPU", .threads = 1, .name = "op-test", .timeout_ms = 10000 };
    struct tb_node * node = tb_node_create(&cfg, err, sizeof err);
    CHECK(node, "node: %s", err);
    pthread_create(thread, NULL, serve, node);
    snprintf(endpoint, endpoint_len, "127.0.0.1:%d", tb_node_port(node));
    return node;
}

static void env_open(struct env * e, int client_timeout_ms) {
    char err[512];
    char endpoint[64];
    e->node = start_node(&e->thread, endpoint, sizeof endpoint);
    e->client = tbrpc_client_new();
    CHECK(tbrpc_client_add_node(e->client, endpoint, client_timeout_ms, "auto", NULL, 0, err, sizeof err) == 0, "add_node: %s", err);
    CHECK(tbrpc_client_register(e->client, err, sizeof err) == 0, "register: %s", err);
    e->remote_dev = ggml_backend_dev_by_name("TBRPC0");
    CHECK(e->remote_dev, "TBRPC0 is not registered");
    e->remote = ggml_backend_dev_init(e->remote_dev, NULL);
    e->cpu = ggml_backend_dev_init(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU), NULL);
    CHECK(e->remote && e->cpu, "backend init");
}

static void env_stop_node(struct env * e) {
    tb_node_stop(e->node);
    pthread_join(e->thread, NULL);
    e->node_stopped = true;
}

static void env_close(struct env * e) {
    char err[512];
    CHECK(e->node_stopped || !tbrpc_client_failed(e->client, err, sizeof err), "node failed: %s", err);
    ggml_backend_free(e->remote);
    ggml_backend_free(e->cpu);
    if (!e->node_stopped) env_stop_node(e);
    tb_node_free(e->node);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) { rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17; return (uint32_t) rng_state; }
static float rndf(void) { return (float) (rnd() % 20001) / 10000.0f - 1.0f; }

static void fill_bytes(uint8_t * p, size_t n) { for (size_t i = 0; i < n; i++) p[i] = (uint8_t) rnd(); }

// ---- data movement -------------------------------------------------------------

static struct ggml_context * no_alloc_ctx(size_t n_tensors) {
    struct ggml_init_params ip = { .mem_size = ggml_tensor_overhead() * n_tensors + ggml_graph_overhead_custom(65536, false), .no_alloc = true };
    return ggml_init(ip);
}

static void case_set_get_odd(struct env * e) {
    struct ggml_context * ctx = no_alloc_ctx(4);
    const size_t n = 70u << 20;                      // > one 64 MiB message: exercises chunking
    struct ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) n);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, e->remote);
    CHECK(buf, "alloc");
    uint8_t * src = malloc(n), * dst = malloc(n);
    fill_bytes(src, n);
    ggml_backend_tensor_set(t, src, 0, n);
    const size_t offs[] = { 0, 1, 7, 4095, 65537, n - 3 }, sizes[] = { 1, 3, 12345, 1, 1 << 20, 3 };
    for (size_t i = 0; i < sizeof offs / sizeof *offs; i++) {
        memset(dst, 0xAB, sizes[i]);
        ggml_backend_tensor_get(t, dst, offs[i], sizes[i]);
        CHECK(memcmp(dst, src + offs[i], sizes[i]) == 0, "get at %zu+%zu differs", offs[i], sizes[i]);
    }
    // overwrite an odd range, read everything back
    uint8_t patch[333];
    fill_bytes(patch, sizeof patch);
    ggml_backend_tensor_set(t, patch, 1001, sizeof patch);
    memcpy(src + 1001, patch, sizeof patch);
    ggml_backend_tensor_get(t, dst, 0, n);
    CHECK(memcmp(dst, src, n) == 0, "full read-back differs");
    free(src); free(dst);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

static void case_memset_clear(struct env * e) {
    struct ggml_context * ctx = no_alloc_ctx(4);
    struct ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, 10007);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, e->remote);
    uint8_t want[10007], got[10007];
    fill_bytes(want, sizeof want);
    ggml_backend_tensor_set(t, want, 0, sizeof want);
    ggml_backend_tensor_memset(t, 0x5A, 333, 4444);
    memset(want + 333, 0x5A, 4444);
    ggml_backend_tensor_get(t, got, 0, sizeof got);
    CHECK(memcmp(want, got, sizeof got) == 0, "memset range differs");
    ggml_backend_buffer_clear(buf, 0x11);
    ggml_backend_tensor_get(t, got, 0, sizeof got);
    for (size_t i = 0; i < sizeof got; i++) CHECK(got[i] == 0x11, "clear left byte %zu = %u", i, got[i]);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

static void case_copy_and_views(struct env * e) {
    struct ggml_context * ctx = no_alloc_ctx(8);
    struct ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 37, 11);
    struct ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 37, 11);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, e->remote);
    float va[37 * 11], vb[37 * 11];
    for (int i = 0; i < 37 * 11; i++) va[i] = rndf();
    ggml_backend_tensor_set(a, va, 0, sizeof va);
    ggml_backend_tensor_copy(a, b);                   // same node: a COPY_TENSOR, no trip through the head
    ggml_backend_tensor_get(b, vb, 0, sizeof vb);
    CHECK(memcmp(va, vb, sizeof va) == 0, "copy differs");
    // a view of row 5 of b, written through the view
    struct ggml_context * vctx = no_alloc_ctx(2);
    struct ggml_tensor * row = ggml_view_1d(vctx, b, 37, 5 * b->nb[1]);
    CHECK(ggml_backend_view_init(row) == GGML_STATUS_SUCCESS, "view init");
    float ones[37];
    for (int i = 0; i < 37; i++) ones[i] = 1.0f + (float) i;
    ggml_backend_tensor_set(row, ones, 0, sizeof ones);
    memcpy(va + 5 * 37, ones, sizeof ones);
    ggml_backend_tensor_get(b, vb, 0, sizeof vb);
    CHECK(memcmp(va, vb, sizeof va) == 0, "write through a view differs");
    ggml_free(vctx);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// ---- ops: the same graph on the CPU backend and on the node -------------------

typedef struct ggml_tensor * (*build_fn)(struct ggml_context * ctx, struct ggml_tensor ** inputs, int * n_inputs);

// Builds the graph twice (once per backend), fills inputs with the same data,
// computes, and compares the output bytes.
static void compare_backends(struct env * e, build_fn build, const char * what) {
    uint8_t * results[2] = { NULL, NULL };
    size_t out_size = 0;
    ggml_backend_t backends[2] = { e->cpu, e->remote };
    for (int b = 0; b < 2; b++) {
        rng_state = 0x9e3779b97f4a7c15ull;                // same inputs on both
        struct ggml_context * ctx = no_alloc_ctx(8192);
        struct ggml_tensor * inputs[16];
        int n_inputs = 0;
        struct ggml_tensor * out = build(ctx, inputs, &n_inputs);
        struct ggml_cgraph * g = ggml_new_graph_custom(ctx, 65536, false);
        ggml_build_forward_expand(g, out);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backends[b]);
        CHECK(buf, "%s: alloc", what);
        for (int i = 0; i < n_inputs; i++) {
            struct ggml_tensor * t = inputs[i];
            size_t nb = ggml_nbytes(t);
            uint8_t * data = malloc(nb);
            if (t->type == GGML_TYPE_F32) {
                for (size_t k = 0; k < nb / 4; k++) ((float *) data)[k] = rndf();
            } else if (t->type == GGML_TYPE_I32) {
                int32_t range = (int32_t) t->op_params[0] > 0 ? t->op_params[0] : 1;   // set by the builder
                for (size_t k = 0; k < nb / 4; k++) ((int32_t *) data)[k] = (int32_t) (rnd() % (uint32_t) range);
            } else {                                   // quantized weights from random floats
                int64_t n = ggml_nelements(t);
                float * f = malloc(sizeof(float) * (size_t) n);
                for (int64_t k = 0; k < n; k++) f[k] = rndf();
                ggml_quantize_chunk(t->type, f, data, 0, n / t->ne[0], t->ne[0], NULL);
                free(f);
            }
            ggml_backend_tensor_set(t, data, 0, nb);
            free(data);
        }
        CHECK(ggml_backend_graph_compute(backends[b], g) == GGML_STATUS_SUCCESS, "%s: compute", what);
        out_size = ggml_nbytes(out);
        results[b] = malloc(out_size);
        ggml_backend_tensor_get(out, results[b], 0, out_size);
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    CHECK(memcmp(results[0], results[1], out_size) == 0, "%s: node result differs from the CPU backend", what);
    free(results[0]);
    free(results[1]);
}

static struct ggml_tensor * input(struct ggml_context * ctx, struct ggml_tensor ** inputs, int * n, struct ggml_tensor * t) {
    ggml_set_input(t);
    inputs[(*n)++] = t;
    return t;
}

static struct ggml_tensor * index_input(struct ggml_context * ctx, struct ggml_tensor ** inputs, int * n, int64_t ne0, int64_t ne1, int32_t range) {
    struct ggml_tensor * t = input(ctx, inputs, n, ggml_new_tensor_2d(ctx, GGML_TYPE_I32, ne0, ne1));
    t->op_params[0] = range;     // read back by compare_backends to bound the indices
    return t;
}

static enum ggml_type matmul_type;
static struct ggml_tensor * build_matmul(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * w = input(ctx, in, n, ggml_new_tensor_2d(ctx, matmul_type, 256, 96));
    struct ggml_tensor * x = input(ctx, in, n, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 256, 7));
    return ggml_mul_mat(ctx, w, x);
}

static struct ggml_tensor * build_moe(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    const int n_expert = 8, n_used = 2, n_tokens = 5;
    struct ggml_tensor * experts = input(ctx, in, n, ggml_new_tensor_3d(ctx, GGML_TYPE_Q8_0, 64, 32, n_expert));
    struct ggml_tensor * x = input(ctx, in, n, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 64, 1, n_tokens));
    struct ggml_tensor * router = input(ctx, in, n, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, n_expert));
    struct ggml_tensor * logits = ggml_mul_mat(ctx, router, ggml_reshape_2d(ctx, x, 64, n_tokens));
    struct ggml_tensor * probs = ggml_sigmoid(ctx, logits);
    struct ggml_tensor * ids = ggml_argsort_top_k(ctx, probs, n_used);
    struct ggml_tensor * weights = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, n_expert, n_tokens), ids);
    struct ggml_tensor * y = ggml_mul_mat_id(ctx, experts, x, ids);          // [32, n_used, n_tokens]
    return ggml_mul(ctx, y, weights);
}

static struct ggml_tensor * build_norm_rope_softmax(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 64, 4, 9));   // head dim, heads, tokens
    struct ggml_tensor * pos = index_input(ctx, in, n, 9, 1, 512);
    pos = ggml_reshape_1d(ctx, pos, 9);
    struct ggml_tensor * normed = ggml_rms_norm(ctx, x, 1e-6f);
    struct ggml_tensor * roped = ggml_rope_ext(ctx, normed, pos, NULL, 64, 0, 4096, 10000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
    struct ggml_tensor * kq = ggml_mul_mat(ctx, roped, roped);
    return ggml_soft_max_ext(ctx, kq, NULL, 0.125f, 0.0f);
}

static struct ggml_tensor * build_get_rows_cpy(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * table = input(ctx, in, n, ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_K, 256, 50));
    struct ggml_tensor * ids = index_input(ctx, in, n, 13, 1, 50);
    struct ggml_tensor * rows = ggml_get_rows(ctx, table, ggml_reshape_1d(ctx, ids, 13));
    return ggml_cpy(ctx, rows, ggml_new_tensor_2d(ctx, GGML_TYPE_F16, 256, 13));
}

static struct ggml_tensor * build_many_nodes(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * x = input(ctx, in, n, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1024));
    struct ggml_tensor * y = input(ctx, in, n, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1024));
    for (int i = 0; i < 3000; i++) x = (i % 3 == 0) ? ggml_add(ctx, x, y) : (i % 3 == 1 ? ggml_mul(ctx, x, y) : ggml_scale(ctx, x, 0.5f));
    return x;
}

static void case_ops(struct env * e) {
    const enum ggml_type types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K };
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        matmul_type = types[i];
        char what[64];
        snprintf(what, sizeof what, "mul_mat %s", ggml_type_name(types[i]));
        compare_backends(e, build_matmul, what);
    }
    compare_backends(e, build_moe, "MoE (sigmoid router, top-k, mul_mat_id)");
    compare_backends(e, build_norm_rope_softmax, "rms_norm + rope + soft_max");
    compare_backends(e, build_get_rows_cpy, "get_rows Q4_K + cpy to F16");
}

static void case_many_nodes(struct env * e) {
    compare_backends(e, build_many_nodes, "3000-node graph");
}

// The same graph computed twice goes out once, then as GRAPH_RECOMPUTE.
static void case_graph_reuse(struct env * e) {
    struct ggml_context * ctx = no_alloc_ctx(16);
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 8);
    struct ggml_tensor * y = ggml_scale(ctx, x, 2.0f);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, e->remote);
    float in[8], out[8];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 8; i++) in[i] = (float) (round * 10 + i);
        ggml_backend_tensor_set(x, in, 0, sizeof in);
        CHECK(ggml_backend_graph_compute(e->remote, g) == GGML_STATUS_SUCCESS, "compute");
        ggml_backend_tensor_get(y, out, 0, sizeof out);
        for (int i = 0; i < 8; i++) CHECK(out[i] == 2.0f * in[i], "round %d: y[%d] = %g", round, i, out[i]);
    }
    struct tbrpc_node_info info;
    tbrpc_client_node_info(e->client, 0, &info);
    CHECK(info.graphs_sent == 1 && info.graphs_reused == 2, "graphs sent %llu reused %llu",
          (unsigned long long) info.graphs_sent, (unsigned long long) info.graphs_reused);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// A graph whose inputs were computed by an earlier graph (a scheduler split,
// a meta backend's subgraph) sends those inputs as data, not the chain of
// ops that made them: the message stays the size of the graph, and the node
// reads the earlier results instead of computing them again.
static void case_earlier_results_as_data(struct env * e) {
    enum { CHAIN = 20 };
    struct ggml_context * ctx = no_alloc_ctx(CHAIN + 8);
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 8);
    struct ggml_tensor * a = x;
    for (int i = 0; i < CHAIN; i++) a = ggml_scale(ctx, a, 2.0f);
    struct ggml_tensor * y = ggml_scale(ctx, a, 3.0f);
    struct ggml_cgraph * whole = ggml_new_graph(ctx);
    ggml_build_forward_expand(whole, y);
    struct ggml_cgraph * last = ggml_new_graph(ctx);   // only y = 3a; a is an input here
    ggml_graph_add_node(last, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, e->remote);
    CHECK(buf, "alloc");
    float in[8], out[8];
    for (int i = 0; i < 8; i++) in[i] = (float) (i + 1);
    ggml_backend_tensor_set(x, in, 0, sizeof in);
    CHECK(ggml_backend_graph_compute(e->remote, whole) == GGML_STATUS_SUCCESS, "compute the whole chain");

    for (int i = 0; i < 8; i++) in[i] = -1.0f;   // changes nothing below: a is not recomputed
    ggml_backend_tensor_set(x, in, 0, sizeof in);
    struct tbrpc_node_info before, after;
    tbrpc_client_node_info(e->client, 0, &before);
    CHECK(ggml_backend_graph_compute(e->remote, last) == GGML_STATUS_SUCCESS, "compute the last node");
    tbrpc_client_node_info(e->client, 0, &after);
    ggml_backend_tensor_get(y, out, 0, sizeof out);
    for (int i = 0; i < 8; i++) {
        const float want = 3.0f * (float) (1u << CHAIN) * (float) (i + 1);
        CHECK(out[i] == want, "y[%d] = %g, want %g", i, out[i], want);
    }
    // y and a, and nothing of the chain behind a
    const uint64_t sent = after.bytes_sent - before.bytes_sent;
    CHECK(sent < 3 * sizeof(struct tb_wire_tensor), "the one-node graph took %llu bytes (a tensor is %zu)",
          (unsigned long long) sent, sizeof(struct tb_wire_tensor));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// A computation far longer than the client's timeout (300 ms here) is not
// mistaken for a dead node: the node sends KEEPALIVE while it computes.
static struct ggml_tensor * build_slow(struct ggml_context * ctx, struct ggml_tensor ** in, int * n) {
    struct ggml_tensor * w = input(ctx, in, n, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1024, 1024));
    struct ggml_tensor * x = input(ctx, in, n, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1024, 512));
    for (int i = 0; i < 6; i++) x = ggml_scale(ctx, ggml_mul_mat(ctx, w, x), 1.0f / 32.0f);
    return x;
}

static void case_keepalive(struct env * e) {
    compare_backends(e, build_slow, "a 6 GFLOP graph on one thread");
}

// Node-side accounting follows allocations and frees exactly.
static void case_allocation_accounting(struct env * e) {
    char err[256];
    struct tb_status st;
    CHECK(tbrpc_client_node_status(e->client, 0, &st, err, sizeof err) == 0, "%s", err);
    const uint64_t before = st.bytes_allocated;
    ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(ggml_backend_dev_buffer_type(e->remote_dev), 3u << 20);
    CHECK(buf && ggml_backend_buffer_get_size(buf) == (3u << 20), "alloc 3 MiB");
    CHECK(tbrpc_client_node_status(e->client, 0, &st, err, sizeof err) == 0, "%s", err);
    CHECK(st.bytes_allocated - before == (3u << 20), "node reports %llu new bytes", (unsigned long long) (st.bytes_allocated - before));
    ggml_backend_buffer_free(buf);
    CHECK(tbrpc_client_node_status(e->client, 0, &st, err, sizeof err) == 0, "%s", err);
    CHECK(st.bytes_allocated == before, "free left %llu bytes", (unsigned long long) (st.bytes_allocated - before));
}

// ---- questions about ops (supports_op, allocation sizes) ----------------------

static uint64_t round_trips(struct env * e) {
    struct tbrpc_node_info info;
    tbrpc_client_node_info(e->client, 0, &info);
    return info.round_trips;
}

// Three op classes: Q4_K weights times F32 rows (the CPU runs it), times Q4_0
// rows (it does not), and an ARGSORT (an op whose size a device may enlarge).
struct questions { struct ggml_context * ctx; struct ggml_tensor * mm, * bad_mm, * sorted; };

static struct questions questions_new(void) {
    struct questions q = { .ctx = no_alloc_ctx(8) };
    struct ggml_tensor * weights = ggml_new_tensor_2d(q.ctx, GGML_TYPE_Q4_K, 256, 4);
    q.mm = ggml_mul_mat(q.ctx, weights, ggml_new_tensor_2d(q.ctx, GGML_TYPE_F32, 256, 3));
    q.bad_mm = ggml_mul_mat(q.ctx, weights, ggml_new_tensor_2d(q.ctx, GGML_TYPE_Q4_0, 256, 3));
    q.sorted = ggml_argsort(q.ctx, ggml_new_tensor_2d(q.ctx, GGML_TYPE_F32, 64, 9), GGML_SORT_ORDER_DESC);
    return q;
}

// supports_op is the node device's answer. A CPU node of the head's ggml
// build says so at HELLO, and the head's own CPU device answers for it: not
// even the first question of an op class crosses the network.
static void case_supports_op(struct env * e) {
    struct questions q = questions_new();
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    struct tbrpc_node_info info;
    tbrpc_client_node_info(e->client, 0, &info);
    CHECK(info.hello.caps & TB_CAP_SUPPORTS_OP_IS_CPU, "a CPU node must say so at HELLO");
    const uint64_t before = round_trips(e);
    CHECK(ggml_backend_dev_supports_op(e->remote_dev, q.mm) && ggml_backend_dev_supports_op(cpu, q.mm), "q4_K x f32");
    CHECK(!ggml_backend_dev_supports_op(e->remote_dev, q.bad_mm) && !ggml_backend_dev_supports_op(cpu, q.bad_mm), "q4_K x q4_0");
    CHECK(round_trips(e) == before, "supports_op cost %llu round trips", (unsigned long long) (round_trips(e) - before));
    ggml_free(q.ctx);
}

// Allocation sizes are the node device's: a CPU node says at HELLO that it
// sizes every tensor as ggml_nbytes, so even ops that may need more (ARGSORT)
// cost no question. (tests/test_protocol.py checks the GET_ALLOC_SIZE answer.)
static void case_alloc_size(struct env * e) {
    struct questions q = questions_new();
    ggml_backend_buffer_type_t remote = ggml_backend_dev_buffer_type(e->remote_dev);
    ggml_backend_buffer_type_t cpu = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    struct tbrpc_node_info info;
    tbrpc_client_node_info(e->client, 0, &info);
    CHECK(info.hello.caps & TB_CAP_ALLOC_SIZE_IS_NBYTES, "a CPU node must announce nbytes sizing");
    const uint64_t before = round_trips(e);
    CHECK(ggml_backend_buft_get_alloc_size(remote, q.sorted) == ggml_backend_buft_get_alloc_size(cpu, q.sorted), "argsort size");
    CHECK(round_trips(e) == before, "%llu round trips", (unsigned long long) (round_trips(e) - before));
    ggml_free(q.ctx);
}

// The asking path (what a Metal node gets): each op class costs one round
// trip, then its answer is cached; the answers are the node device's.
static void case_asked_answers(struct env * e) {
    struct questions q = questions_new();
    ggml_backend_buffer_type_t remote = ggml_backend_dev_buffer_type(e->remote_dev);
    tbrpc_client_ask_node(e->client, 0, 1);
    const uint64_t before = round_trips(e);
    CHECK(ggml_backend_dev_supports_op(e->remote_dev, q.mm), "q4_K x f32");
    CHECK(!ggml_backend_dev_supports_op(e->remote_dev, q.bad_mm), "q4_K x q4_0");
    CHECK(ggml_backend_buft_get_alloc_size(remote, q.sorted) == ggml_nbytes(q.sorted), "argsort size");
    const uint64_t asked = round_trips(e);
    CHECK(asked - before == 3, "%llu round trips for three questions", (unsigned long long) (asked - before));
    for (int k = 0; k < 10; k++) {
        ggml_backend_dev_supports_op(e->remote_dev, q.mm);
        ggml_backend_dev_supports_op(e->remote_dev, q.bad_mm);
        ggml_backend_buft_get_alloc_size(remote, q.sorted);
    }
    CHECK(round_trips(e) == asked, "cached answers cost %llu round trips", (unsigned long long) (round_trips(e) - asked));
    ggml_free(q.ctx);
}

// A node that died cannot answer; the head then says "supported" (ggml's
// scheduler would abort on "no" for weights already there) and reports the
// failure, naming the node, instead of hanging or aborting.
static void case_dead_node_answers_yes(struct env * e) {
    struct questions q = questions_new();
    tbrpc_client_ask_node(e->client, 0, 1);
    struct tbrpc_node_info info;
    tbrpc_client_node_info(e->client, 0, &info);
    env_stop_node(e);
    CHECK(ggml_backend_dev_supports_op(e->remote_dev, q.bad_mm), "a dead node's answer must be yes");
    char err[512];
    CHECK(tbrpc_client_failed(e->client, err, sizeof err), "the failure is not reported");
    CHECK(strstr(err, info.endpoint) && strstr(err, "SUPPORTS_OP"), "error does not name the node and step: %s", err);
    ggml_free(q.ctx);
}

// ---- what a question about an op says (encode_op_query) ----------------------

// The record a question must carry for t, written out here from the ggml
// tensor (not by the encoder): every field of t but where its data lies
// (buffer 0, offset 0) and no view link; src as given.
static struct tb_wire_tensor wire_of(const struct ggml_tensor * t, const int32_t src[GGML_MAX_SRC]) {
    struct tb_wire_tensor w;
    memset(&w, 0, sizeof w);
    for (int d = 0; d < GGML_MAX_DIMS; d++) { w.ne[d] = t->ne[d]; w.nb[d] = t->nb[d]; }
    w.type = (uint32_t) t->type;
    w.op = (uint32_t) t->op;
    memcpy(w.op_params, t->op_params, sizeof w.op_params);
    w.flags = t->flags;
    w.view_src = -1;
    w.view_offs = t->view_offs;
    memcpy(w.src, src, sizeof w.src);
    memcpy(w.name, t->name, sizeof w.name);
    return w;
}

static void check_wire(const struct tb_wire_tensor * got, const struct tb_wire_tensor * want, const char * what) {
    CHECK(got->buffer == 0 && got->offset == 0, "%s: located at buffer %llu offset %llu; a question names no data", what,
          (unsigned long long) got->buffer, (unsigned long long) got->offset);
    for (int d = 0; d < GGML_MAX_DIMS; d++) {
        CHECK(got->ne[d] == want->ne[d], "%s: ne[%d] = %lld, want %lld", what, d, (long long) got->ne[d], (long long) want->ne[d]);
        CHECK(got->nb[d] == want->nb[d], "%s: nb[%d] = %llu, want %llu", what, d, (unsigned long long) got->nb[d],
              (unsigned long long) want->nb[d]);
    }
    CHECK(got->type == want->type, "%s: type %u, want %u", what, got->type, want->type);
    CHECK(got->op == want->op, "%s: op %u, want %u", what, got->op, want->op);
    for (size_t i = 0; i < sizeof got->op_params / sizeof *got->op_params; i++)
        CHECK(got->op_params[i] == want->op_params[i], "%s: op_params[%zu] = %d, want %d", what, i, got->op_params[i], want->op_params[i]);
    CHECK(got->flags == want->flags, "%s: flags %d, want %d", what, got->flags, want->flags);
    CHECK(got->view_src == -1, "%s: view_src %d, want -1", what, got->view_src);
    CHECK(got->view_offs == want->view_offs, "%s: view_offs %llu, want %llu", what, (unsigned long long) got->view_offs,
          (unsigned long long) want->view_offs);
    for (int k = 0; k < GGML_MAX_SRC; k++) CHECK(got->src[k] == want->src[k], "%s: src[%d] = %d, want %d", what, k, got->src[k], want->src[k]);
    CHECK(memcmp(got->name, want->name, sizeof got->name) == 0, "%s: name '%.64s', want '%.64s'", what, got->name, want->name);
    CHECK(got->use_count == 0 && got->reserved == 0, "%s: use_count %d reserved %d", what, got->use_count, got->reserved);
    CHECK(memcmp(got, want, sizeof *got) == 0, "%s: differs outside the fields checked above", what);
}

// An op whose sources lie in this node's buffer (at an offset), in the
// head's CPU buffer, in another node's buffer, nowhere (no buffer), and a
// strided view at an offset: each goes out with its real shape, strides,
// type, op, params, flags, view offset and name, and none with a location.
// Before, a source outside this node's buffers went out as a zero-shape F32
// tensor, and the node answered about that.
static void case_op_query_fields(struct env * e) {
    pthread_t other_thread;
    char other_endpoint[64], err[512];
    struct tb_node * other = start_node(&other_thread, other_endpoint, sizeof other_endpoint);
    CHECK(tbrpc_client_add_node(e->client, other_endpoint, 10000, "auto", NULL, 0, err, sizeof err) == 1, "add_node: %s", err);
    ggml_backend_t other_backend = ggml_backend_dev_init(ggml_backend_dev_by_name("TBRPC1"), NULL);
    CHECK(other_backend, "TBRPC1 backend");

    struct ggml_context * ctx_own = no_alloc_ctx(4), * ctx_cpu = no_alloc_ctx(2), * ctx_far = no_alloc_ctx(2), * ctx = no_alloc_ctx(8);
    ggml_new_tensor_1d(ctx_own, GGML_TYPE_I8, 4096);                  // so that `own` lies at an offset
    struct ggml_tensor * own = ggml_new_tensor_3d(ctx_own, GGML_TYPE_Q4_K, 256, 6, 2);
    struct ggml_tensor * base = ggml_new_tensor_2d(ctx_own, GGML_TYPE_F32, 64, 10);
    struct ggml_tensor * cpu = ggml_new_tensor_3d(ctx_cpu, GGML_TYPE_F16, 256, 3, 2);
    struct ggml_tensor * far = ggml_new_tensor_2d(ctx_far, GGML_TYPE_Q8_0, 64, 5);
    ggml_backend_buffer_t own_buf = ggml_backend_alloc_ctx_tensors(ctx_own, e->remote);
    ggml_backend_buffer_t cpu_buf = ggml_backend_alloc_ctx_tensors(ctx_cpu, e->cpu);
    ggml_backend_buffer_t far_buf = ggml_backend_alloc_ctx_tensors(ctx_far, other_backend);
    CHECK(own_buf && cpu_buf && far_buf, "alloc");
    CHECK((uint8_t *) own->data > (uint8_t *) ggml_backend_buffer_get_base(own_buf), "own lies at offset 0");
    struct ggml_tensor * bare = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, 3, 2);
    struct ggml_tensor * view = ggml_view_2d(ctx, base, 48, 4, 2 * base->nb[1], 3 * base->nb[1] + 8 * sizeof(float));
    CHECK(ggml_backend_view_init(view) == GGML_STATUS_SUCCESS, "view init");
    ggml_set_name(own, "blk.0.ffn_down.weight");
    ggml_set_name(cpu, "token_embd.weight");
    ggml_set_name(far, "on another node");
    ggml_set_name(bare, "ids");
    ggml_set_input(cpu);
    ggml_set_output(bare);
    cpu->op_params[3] = 77;

    struct ggml_tensor * op = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 6, 3, 2);
    op->op = GGML_OP_MUL_MAT_ID;                // only described here, never computed
    op->op_params[0] = 5;
    op->op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t) - 1] = -3;
    op->flags = GGML_TENSOR_FLAG_COMPUTE;
    ggml_set_name(op, "the op");
    op->src[0] = own; op->src[1] = cpu; op->src[3] = bare; op->src[4] = view; op->src[6] = far;

    struct op_query q;
    memset(&q, 0xEE, sizeof q);
    const size_t len = encode_op_query(op, &q);
    CHECK(len == sizeof q.h + 6 * sizeof(struct tb_wire_tensor), "message of %zu bytes for 6 tensors", len);
    CHECK(q.h.n_tensors == 6 && q.h.n_nodes == 0, "header: %u tensors, %u nodes", q.h.n_tensors, q.h.n_nodes);
    const int32_t none[GGML_MAX_SRC] = { -1, -1, -1, -1, -1, -1, -1, -1, -1, -1 };
    const int32_t links[GGML_MAX_SRC] = { 0, 1, -1, 2, 3, -1, 4, -1, -1, -1 };
    const struct { const struct ggml_tensor * t; const int32_t * src; const char * what; } want[] = {
        { own, none, "source in this node's buffer" }, { cpu, none, "source in the head's CPU buffer" },
        { bare, none, "source without a buffer" }, { view, none, "strided view at an offset" },
        { far, none, "source in another node's buffer" }, { op, links, "the op" },
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++) {
        const struct tb_wire_tensor expected = wire_of(want[i].t, want[i].src);
        check_wire(&q.t[i], &expected, want[i].what);
    }

    ggml_backend_buffer_free(own_buf);
    ggml_backend_buffer_free(cpu_buf);
    ggml_backend_buffer_free(far_buf);
    ggml_backend_free(other_backend);
    ggml_free(ctx); ggml_free(ctx_own); ggml_free(ctx_cpu); ggml_free(ctx_far);
    tb_node_stop(other);
    pthread_join(other_thread, NULL);
    tb_node_free(other);
}

// The node answers about the op as it is, wherever its sources lie: Q4_K
// weights times Q4_0 rows, both in the head's CPU buffer, are not supported.
// (Before, both went out as zero-shape F32 tensors, the node said yes, and
// that yes was cached for every Q4_K x Q4_0 product.)
static void case_asked_about_foreign_sources(struct env * e) {
    struct ggml_context * ctx_cpu = no_alloc_ctx(4), * ctx = no_alloc_ctx(8);
    struct ggml_tensor * weights = ggml_new_tensor_2d(ctx_cpu, GGML_TYPE_Q4_K, 256, 4);
    struct ggml_tensor * rows = ggml_new_tensor_2d(ctx_cpu, GGML_TYPE_Q4_0, 256, 3);
    ggml_backend_buffer_t cpu_buf = ggml_backend_alloc_ctx_tensors(ctx_cpu, e->cpu);
    CHECK(cpu_buf, "alloc");
    struct ggml_tensor * on_head = ggml_mul_mat(ctx, weights, rows);
    struct ggml_tensor * nowhere = ggml_mul_mat(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_K, 256, 4),
                                                ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_0, 256, 3));
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    CHECK(!ggml_backend_dev_supports_op(cpu, on_head), "the head's CPU runs q4_K x q4_0");
    tbrpc_client_ask_node(e->client, 0, 1);
    const uint64_t before = round_trips(e);
    CHECK(!ggml_backend_dev_supports_op(e->remote_dev, on_head), "node says it runs q4_K x q4_0 (sources in the head's CPU buffer)");
    CHECK(round_trips(e) - before == 1, "%llu round trips", (unsigned long long) (round_trips(e) - before));
    CHECK(!ggml_backend_dev_supports_op(e->remote_dev, nowhere), "the cached answer says q4_K x q4_0 runs");
    CHECK(round_trips(e) - before == 1, "the same op class was asked again");
    ggml_backend_buffer_free(cpu_buf);
    ggml_free(ctx);
    ggml_free(ctx_cpu);
}

// An answer is kept per op class (supports_key): two ops a device may
// answer differently for must fall in different classes. Metal adds F32 rows
// only when both sources have contiguous rows, and runs GLU only on a
// source whose rows are contiguous from dimension 1 on. Another batch size
// alone is the same class: a new prompt length costs no question.
static void case_supports_key_layouts(struct env * e) {
    struct ggml_context * ctx = no_alloc_ctx(32);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, 4);
    struct ggml_tensor * base = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 64, 8, 4);
    struct ggml_tensor * strided_rows = ggml_view_2d(ctx, base, 64, 4, 2 * base->nb[1], 0);           // rows contiguous
    struct ggml_tensor * transposed = ggml_transpose(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 4, 64)); // rows are columns
    CHECK(!ggml_is_contiguous(strided_rows) && !ggml_is_contiguous(transposed) && strided_rows->ne[0] == transposed->ne[0] &&
          ggml_is_contiguous_rows(strided_rows) && !ggml_is_contiguous_rows(transposed), "layouts of the ADD sources");
    struct ggml_tensor * add_rows = ggml_add(ctx, x, strided_rows), * add_columns = ggml_add(ctx, x, transposed);
    CHECK(supports_key(add_rows) != supports_key(add_columns), "ADD of strided rows and ADD of a transposed tensor share a class");

    struct ggml_tensor * split_1 = ggml_view_3d(ctx, base, 64, 4, 2, 2 * base->nb[1], base->nb[2], 0);     // dim 1 strided only
    struct ggml_tensor * split_2 = ggml_view_3d(ctx, base, 64, 4, 2, base->nb[1], base->nb[2], 0);         // dims 1 and 2 apart
    CHECK(ggml_is_contiguous_1(split_1) && !ggml_is_contiguous_1(split_2) && !ggml_is_contiguous(split_1) &&
          ggml_is_contiguous_rows(split_2), "layouts of the GLU sources");
    struct ggml_tensor * glu[2];
    for (int i = 0; i < 2; i++) {            // described only, never built by ggml_glu (which asserts the layout)
        glu[i] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 32, 4, 2);
        glu[i]->op = GGML_OP_GLU;
        glu[i]->op_params[0] = GGML_GLU_OP_SWIGLU;
        glu[i]->src[0] = i == 0 ? split_1 : split_2;
    }
    CHECK(supports_key(glu[0]) != supports_key(glu[1]), "GLU of contiguous_1 rows and of scattered rows share a class");

    struct ggml_tensor * batch_9 = ggml_add(ctx, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, 9), ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, 9));
    struct ggml_tensor * batch_4 = ggml_add(ctx, x, ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 64, 4));
    CHECK(supports_key(batch_4) == supports_key(batch_9), "another batch size made another class");
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    CHECK(argc == 2, "usage: op_tests CASE");
    static const struct { const char * name; void (*fn)(struct env *); int timeout_ms; } cases[] = {
        { "set_get_odd", case_set_get_odd }, { "memset_clear", case_memset_clear },
        { "copy_and_views", case_copy_and_views }, { "ops", case_ops }, { "many_nodes", case_many_nodes },
        { "graph_reuse", case_graph_reuse }, { "allocation_accounting", case_allocation_accounting },
        { "supports_op", case_supports_op }, { "asked_answers", case_asked_answers },
        { "dead_node_answers_yes", case_dead_node_answers_yes }, { "keepalive", case_keepalive, 300 },
        { "alloc_size", case_alloc_size }, { "op_query_fields", case_op_query_fields },
        { "asked_about_foreign_sources", case_asked_about_foreign_sources }, { "supports_key_layouts", case_supports_key_layouts },
        { "earlier_results_as_data", case_earlier_results_as_data },
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        if (strcmp(argv[1], cases[i].name) == 0) {
            struct env e = { 0 };
            env_open(&e, cases[i].timeout_ms ? cases[i].timeout_ms : 10000);
            cases[i].fn(&e);
            env_close(&e);
            printf("PASS %s\n", argv[1]);
            return 0;
        }
    }
    CHECK(0, "unknown case %s", argv[1]);
}
