// get_async_tests.c - a tbrpc device's get_tensor_async (client.c): the
// read leaves at once and its reply is read at synchronize, so reads from
// several nodes are in flight together (ggml's meta backend reads a tensor
// split's logits node after node); a request to the node settles the read
// first, in order; a read whose connection fails hands back zeros and the
// failure, never stale or uninitialised bytes.
//
// Nodes serve in threads of this process (every connection TCP). The test
// looks inside the head's node (client_internal.h) only to check that a
// reply is waiting unread, and to cut a connection under a read.
// Usage: get_async_tests in_flight|settles_first|failed  (prints "PASS")
#include "tbrpc.h"
#include "client_internal.h"
#include "transport.h"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include "check.h"
#include "local_nodes.h"

#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define N_FLOATS 65536   // 256 KiB: a logits slice of a large vocabulary

struct remote { struct ggml_context * ctx; ggml_backend_buffer_t buf; struct ggml_tensor * t; };

static struct remote remote_tensor(ggml_backend_t backend) {
    struct ggml_init_params ip = { .mem_size = ggml_tensor_overhead(), .no_alloc = true };
    struct remote r = { .ctx = ggml_init(ip) };
    r.t = ggml_new_tensor_1d(r.ctx, GGML_TYPE_F32, N_FLOATS);
    r.buf = ggml_backend_alloc_ctx_tensors(r.ctx, backend);
    CHECK(r.buf, "allocating on a node");
    return r;
}

static void fill(float * v, float salt) { for (size_t i = 0; i < N_FLOATS; i++) v[i] = salt + (float) i; }

static void expect(const float * got, float salt, const char * what) {
    for (size_t i = 0; i < N_FLOATS; i++)
        CHECK(got[i] == salt + (float) i, "%s: float %zu is %g, want %g", what, i, got[i], salt + (float) i);
}

static bool untouched(const float * v) {
    const uint8_t * b = (const uint8_t *) v;
    for (size_t i = 0; i < N_FLOATS * sizeof(float); i++) if (b[i] != 0xAA) return false;
    return true;
}

static struct client_node * head_side(ggml_backend_t backend) { return backend->context; }

int main(int argc, char ** argv) {
    CHECK(argc == 2, "usage: get_async_tests in_flight|settles_first|failed");
    const char * which = argv[1];
    struct local_nodes cluster;
    local_nodes_start(&cluster, 2, "get", 10000, "auto");
    static float want[N_FLOATS], got[2][N_FLOATS], later[N_FLOATS];
    struct remote r[2];
    for (int i = 0; i < 2; i++) {
        r[i] = remote_tensor(cluster.backends[i]);
        fill(want, 1000.0f * (float) (i + 1));
        ggml_backend_tensor_set(r[i].t, want, 0, sizeof want);
        memset(got[i], 0xAA, sizeof got[i]);
    }

    if (strcmp(which, "in_flight") == 0) {
        // both reads leave before either is waited for: each node answers while the head reads nothing
        for (int i = 0; i < 2; i++) ggml_backend_tensor_get_async(cluster.backends[i], r[i].t, got[i], 0, sizeof got[i]);
        for (int i = 0; i < 2; i++) {
            CHECK(untouched(got[i]), "node %d: the read was waited for inside get_tensor_async", i);
            CHECK(tb_poll(head_side(cluster.backends[i])->tp, 10000) == 1, "node %d never answered a read that left", i);
            CHECK(untouched(got[i]), "node %d: the destination changed before synchronize", i);
        }
        for (int i = 0; i < 2; i++) ggml_backend_synchronize(cluster.backends[i]);
        expect(got[0], 1000.0f, "node 0 after synchronize");
        expect(got[1], 2000.0f, "node 1 after synchronize");
    } else if (strcmp(which, "settles_first") == 0) {
        // a write and a read after a read left in flight: all three in the order asked
        ggml_backend_t b = cluster.backends[0];
        ggml_backend_tensor_get_async(b, r[0].t, got[0], 0, sizeof got[0]);
        fill(want, 5000.0f);
        ggml_backend_tensor_set(r[0].t, want, 0, sizeof want);   // posted: settles the read first
        CHECK(!head_side(b)->pending.waiting, "a write went to the node with a read's reply unread");
        expect(got[0], 1000.0f, "the read before the write");
        ggml_backend_tensor_get_async(b, r[0].t, got[1], 0, sizeof got[1]);
        ggml_backend_tensor_get(r[0].t, later, 0, sizeof later);   // a call: settles the read, then its own
        expect(got[1], 5000.0f, "the read after the write");
        expect(later, 5000.0f, "the read that waits");
        ggml_backend_synchronize(b);   // nothing left: a no-op
        expect(got[1], 5000.0f, "after a synchronize with nothing in flight");
    } else if (strcmp(which, "failed") == 0) {
        // the connection ends under a read in flight: zeros and a failure naming the read
        ggml_backend_t b = cluster.backends[0];
        ggml_backend_tensor_get_async(b, r[0].t, got[0], 0, sizeof got[0]);
        int pair[2];
        CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, pair) == 0, "socketpair");
        close(pair[1]);                                            // its reads end at once
        CHECK(dup2(pair[0], tb_tcp_fd(head_side(b)->tp)) >= 0, "dup2");   // in place of the node's socket
        close(pair[0]);
        ggml_backend_synchronize(b);
        for (size_t i = 0; i < N_FLOATS; i++) CHECK(got[0][i] == 0.0f, "float %zu is %g after a failed read", i, got[0][i]);
        char err[512] = "";
        CHECK(tbrpc_client_failed(cluster.client, err, sizeof err) != 0, "no failure after a failed read");
        CHECK(strstr(err, "GET_TENSOR") != NULL, "the failure does not name the read: %s", err);
        struct tbrpc_node_info info;
        CHECK(tbrpc_client_node_info(cluster.client, 1, &info) == 0 && !info.failed, "the other node failed too");
        ggml_backend_tensor_get(r[1].t, later, 0, sizeof later);
        expect(later, 2000.0f, "the other node, after");
    } else {
        CHECK(0, "unknown case %s", which);
    }
    for (int i = 0; i < 2; i++) { ggml_backend_buffer_free(r[i].buf); ggml_free(r[i].ctx); }
    local_nodes_stop(&cluster);
    printf("PASS\n");
    return 0;
}
