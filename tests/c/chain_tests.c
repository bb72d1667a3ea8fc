// chain_tests.c - a chain of blocked senders waits for the node at its end,
// which computes. In a prompt pipelined through a layer split (nodes Z, A, B
// in a row, B the slowest), A sends its activations to B while B still
// computes the piece before, and Z its next ones to A meanwhile: A, blocked
// in its send, reads nothing, so Z waits on A as A waits on B. B shows life
// to A (it computes); A must show it to Z, and to the head, for as long as it
// is blocked on a node that does (node_links.c, handle_peer_send; the
// watchdog in node_session.c). With a 1 s stall timeout and B computing for
// seconds, Z's send fails without that.
//
// The three nodes serve in threads of this process (so every link is TCP),
// with 64 KiB socket buffers (TBRPC_TCP_BUFFER) so that 8 MiB of activations
// cannot wait in them. The head posts, without waiting: B a graph of
// seconds, A -> B a copy, Z -> A a copy; then reads both copies back.
// Usage: chain_tests  (prints "PASS" on success)
#include "tbrpc.h"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include "check.h"
#include "local_nodes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 3, Z = 0, A = 1, B = 2, TIMEOUT_MS = 1000 };
#define FLOATS (2u << 20)      // 8 MiB of activations per copy
#define SIDE   1536            // B's matrix: SIDE x SIDE F32
#define WIDTH  256             // times SIDE x WIDTH, over and over
#define WANT_MS 3000           // how long B computes: three stall timeouts

static double now_ms(void) { return (double) ggml_time_us() / 1000.0; }

// B's work: `k` products of a SIDE x SIDE matrix (m, set once) with the
// last SIDE x WIDTH result, the intermediates reusing memory (ggml-alloc).
struct slow { struct ggml_context * ctx; struct ggml_cgraph * gf; ggml_gallocr_t galloc; };

static struct slow slow_graph(ggml_backend_t b, struct ggml_tensor * m, int k) {
    struct ggml_init_params ip = { .mem_size = ggml_tensor_overhead() * (size_t) (2 * k + 4) + ggml_graph_overhead(),
                                   .no_alloc = true };
    struct slow s = { ggml_init(ip), NULL, ggml_gallocr_new(ggml_backend_get_default_buffer_type(b)) };
    struct ggml_tensor * cur = ggml_view_2d(s.ctx, m, SIDE, WIDTH, m->nb[1], 0);
    for (int i = 0; i < k; i++) cur = ggml_scale(s.ctx, ggml_mul_mat(s.ctx, m, cur), 1.0f / SIDE);
    s.gf = ggml_new_graph(s.ctx);
    ggml_build_forward_expand(s.gf, cur);
    CHECK(ggml_gallocr_alloc_graph(s.galloc, s.gf), "allocating B's graph");
    return s;
}

static void slow_free(struct slow s) { ggml_gallocr_free(s.galloc); ggml_free(s.ctx); }

int main(void) {
    setenv("TBRPC_TCP_BUFFER", "65536", 1);
    char err[512];
    struct local_nodes cluster;
    local_nodes_start(&cluster, N, "chain", TIMEOUT_MS, "tcp");
    struct tbrpc_client * client = cluster.client;
    ggml_backend_t * be = cluster.backends;

    // The activations: x on Z, copied to xa on A; ya on A, copied to yb on B.
    struct ggml_init_params ip = { .mem_size = ggml_tensor_overhead() * 2, .no_alloc = true };
    struct ggml_context * cz = ggml_init(ip), * ca = ggml_init(ip), * cb = ggml_init(ip);
    struct ggml_tensor * x = ggml_new_tensor_1d(cz, GGML_TYPE_F32, FLOATS);
    struct ggml_tensor * xa = ggml_new_tensor_1d(ca, GGML_TYPE_F32, FLOATS), * ya = ggml_new_tensor_1d(ca, GGML_TYPE_F32, FLOATS);
    struct ggml_tensor * yb = ggml_new_tensor_1d(cb, GGML_TYPE_F32, FLOATS);
    ggml_backend_buffer_t bz = ggml_backend_alloc_ctx_tensors(cz, be[Z]), ba = ggml_backend_alloc_ctx_tensors(ca, be[A]);
    ggml_backend_buffer_t bb = ggml_backend_alloc_ctx_tensors(cb, be[B]);
    CHECK(bz && ba && bb, "alloc");
    float * want_x = malloc(FLOATS * sizeof(float)), * want_y = malloc(FLOATS * sizeof(float)), * got = malloc(FLOATS * sizeof(float));
    for (size_t i = 0; i < FLOATS; i++) { want_x[i] = (float) (i % 9973); want_y[i] = (float) (i % 7919) - 3000.0f; }
    ggml_backend_tensor_set(x, want_x, 0, ggml_nbytes(x));
    ggml_backend_tensor_set(ya, want_y, 0, ggml_nbytes(ya));

    // How long one product takes on B, so that B computes for WANT_MS whatever the machine.
    struct ggml_context * cm = ggml_init(ip);
    struct ggml_tensor * m = ggml_new_tensor_2d(cm, GGML_TYPE_F32, SIDE, SIDE);
    ggml_backend_buffer_t bm = ggml_backend_alloc_ctx_tensors(cm, be[B]);
    CHECK(bm, "alloc on B");
    float * ones = malloc((size_t) SIDE * SIDE * sizeof(float));
    for (size_t i = 0; i < (size_t) SIDE * SIDE; i++) ones[i] = 1.0f;
    ggml_backend_tensor_set(m, ones, 0, ggml_nbytes(m));
    free(ones);
    struct slow s = slow_graph(be[B], m, 8);
    double t = now_ms();
    CHECK(ggml_backend_graph_compute(be[B], s.gf) == GGML_STATUS_SUCCESS, "eight products");
    float probe;
    ggml_backend_tensor_get(ggml_graph_node(s.gf, -1), &probe, 0, sizeof probe);
    const double one_ms = (now_ms() - t) / 8;
    CHECK(probe == 1.0f, "B's products give %g, not 1", probe);
    slow_free(s);
    int k = (int) (WANT_MS / (one_ms > 0.01 ? one_ms : 0.01)) + 1;
    if (k > 1000) k = 1000;   // within ggml's default graph size
    s = slow_graph(be[B], m, k);

    // The links, made while the nodes idle (as tbrpc.Llama makes them at load).
    ggml_backend_tensor_copy_async(be[A], be[B], ya, yb);
    ggml_backend_tensor_copy_async(be[Z], be[A], x, xa);
    ggml_backend_tensor_get(xa, got, 0, sizeof(float));
    ggml_backend_tensor_get(yb, got, 0, sizeof(float));
    CHECK(!tbrpc_client_failed(client, err, sizeof err), "linking: %s", err);
    ggml_backend_tensor_set(xa, want_y, 0, ggml_nbytes(xa));   // what the copies must overwrite
    ggml_backend_tensor_set(yb, want_x, 0, ggml_nbytes(yb));

    // Posted, in this order, none waited for: B computes; A sends to B (which
    // reads it after its graph); Z sends to A (which reads it after its send).
    t = now_ms();
    CHECK(ggml_backend_graph_compute_async(be[B], s.gf) == GGML_STATUS_SUCCESS, "post B's graph");
    ggml_backend_tensor_copy_async(be[A], be[B], ya, yb);
    ggml_backend_tensor_copy_async(be[Z], be[A], x, xa);
    ggml_backend_tensor_get(xa, got, 0, ggml_nbytes(xa));
    const double took = now_ms() - t;
    CHECK(!tbrpc_client_failed(client, err, sizeof err), "after %.0f ms (B's graph: %d products of %.1f ms): %s",
          took, k, one_ms, err);
    CHECK(memcmp(got, want_x, ggml_nbytes(xa)) == 0, "Z's activations arrived wrong on A");
    ggml_backend_tensor_get(yb, got, 0, ggml_nbytes(yb));
    CHECK(!tbrpc_client_failed(client, err, sizeof err), "%s", err);
    CHECK(memcmp(got, want_y, ggml_nbytes(yb)) == 0, "A's activations arrived wrong on B");
    CHECK(took >= 2.0 * TIMEOUT_MS, "A's copy came back after %.0f ms: B did not hold the chain up for two stall "
          "timeouts, the case tests nothing", took);

    slow_free(s);
    ggml_backend_buffer_free(bm);
    ggml_free(cm);
    ggml_backend_buffer_free(bz); ggml_backend_buffer_free(ba); ggml_backend_buffer_free(bb);
    ggml_free(cz); ggml_free(ca); ggml_free(cb);
    free(want_x); free(want_y); free(got);
    local_nodes_stop(&cluster);
    printf("PASS\n");
    return 0;
}
