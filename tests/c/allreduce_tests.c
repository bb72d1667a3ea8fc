// allreduce_tests.c - tbrpc's ALLREDUCE through the comm functions llama.cpp's
// meta backend calls (client.c), mesh or ring, at sizes a model never makes:
// fewer floats than nodes (empty ring chunks), sizes the node count does not
// divide, and sizes whose ring steps go in several 32 KiB pieces.
//
// N nodes serve in threads of this process, so every peer link is TCP (a
// node serving in threads shares no memory): the sends of a ring step rely
// on the kernel's socket buffers, not on a shared-memory ring. Partials of
// small integers sum exactly in any order, so each node's result must be
// the exact sum; partials of arbitrary floats must give every node the same
// bits. A node whose range is not flagged computed counts as zeros.
// Usage: allreduce_tests ring|mesh N  (prints "PASS" on success)
#include "tbrpc.h"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include "check.h"
#include "local_nodes.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_N LOCAL_NODES_MAX

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) { rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17; return (uint32_t) rng_state; }

typedef void * (*comm_init_fn)(ggml_backend_t * backends, size_t n);
typedef void (*comm_free_fn)(void * comm);
typedef bool (*comm_allreduce_fn)(void * comm, struct ggml_tensor ** tensors);

int main(int argc, char ** argv) {
    CHECK(argc == 3 && (strcmp(argv[1], "ring") == 0 || strcmp(argv[1], "mesh") == 0), "usage: allreduce_tests ring|mesh N");
    const size_t n = (size_t) atoi(argv[2]);
    CHECK(n >= 2 && n <= MAX_N, "N from 2 to %d", MAX_N);
    setenv("TBRPC_ALLREDUCE", argv[1], 1);
    char err[512];
    struct local_nodes cluster;
    local_nodes_start(&cluster, n, "ar", 10000, "auto");
    struct tbrpc_client * client = cluster.client;
    ggml_backend_t * backends = cluster.backends;
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(ggml_backend_get_device(backends[0]));
    comm_init_fn comm_init = (comm_init_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_comm_init");
    comm_free_fn comm_free = (comm_free_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_comm_free");
    comm_allreduce_fn allreduce = (comm_allreduce_fn) ggml_backend_reg_get_proc_address(reg, "ggml_backend_comm_allreduce_tensor");
    CHECK(comm_init && comm_free && allreduce, "the comm functions");
    void * comm = comm_init(backends, n);
    CHECK(comm, "comm_init refused");
    struct tbrpc_node_info info;
    for (size_t i = 0; i < n; i++) {
        CHECK(tbrpc_client_node_info(client, i, &info) == 0, "node_info");
        CHECK(strcmp(info.allreduce, argv[1]) == 0, "node %zu says all-reduce '%s'", i, info.allreduce);
        const size_t want_links = strcmp(argv[1], "ring") == 0 ? 1 : n - 1;
        CHECK(info.n_link_info == want_links, "node %zu has %u links, want %zu", i, info.n_link_info, want_links);
        for (uint32_t k = 0; k < info.n_link_info; k++) {
            CHECK(info.link_info[k].usable, "node %zu link %u: %s", i, k, info.link_info[k].transport);
            if (want_links == 1) CHECK(info.link_info[k].to == (i + 1) % n, "node %zu links to %u", i, info.link_info[k].to);
        }
    }

    // 1, n-1 floats: empty chunks; 7, 1001: n does not divide; 8192 * n + 5: pieces of 32 KiB and one of 5 floats
    // more; 100003: several pieces per step, uneven; 262144: a prompt-sized all-reduce (1 MiB)
    const size_t sizes[] = { 1, n - 1, 7, 1001, 8192 * n + 5, 100003, 262144 };
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        const size_t count = sizes[si] ? sizes[si] : 1;
        struct ggml_init_params ip = { .mem_size = ggml_tensor_overhead() * 2, .no_alloc = true };
        struct ggml_context * ctxs[MAX_N];
        ggml_backend_buffer_t bufs[MAX_N];
        struct ggml_tensor * tensors[MAX_N];
        float * parts[MAX_N], * got[MAX_N];
        for (size_t i = 0; i < n; i++) {
            ctxs[i] = ggml_init(ip);
            // one float of padding in front: the range starts at an offset inside the buffer
            struct ggml_tensor * pad = ggml_new_tensor_1d(ctxs[i], GGML_TYPE_F32, 1);
            (void) pad;
            tensors[i] = ggml_new_tensor_1d(ctxs[i], GGML_TYPE_F32, (int64_t) count);
            bufs[i] = ggml_backend_alloc_ctx_tensors(ctxs[i], backends[i]);
            CHECK(bufs[i], "alloc on node %zu", i);
            parts[i] = malloc(count * sizeof(float));
            got[i] = malloc(count * sizeof(float));
        }
        for (int round = 0; round < 3; round++) {
            // round 0: small integers (exact in any order); 1: arbitrary floats (the same bits everywhere);
            // 2: integers, and the last node's range is not flagged computed (it counts as zeros)
            for (size_t i = 0; i < n; i++) {
                for (size_t x = 0; x < count; x++) {
                    parts[i][x] = round == 1 ? (float) (rnd() % 2000001) / 1000.0f - 1000.0f
                                             : (float) ((int) ((x * 7 + i * 13) % 101) - 50);
                }
                ggml_backend_tensor_set(tensors[i], parts[i], 0, count * sizeof(float));
                tensors[i]->flags = (round == 2 && i == n - 1) ? 0 : GGML_TENSOR_FLAG_COMPUTE;
            }
            CHECK(allreduce(comm, tensors), "allreduce refused %zu floats", count);
            for (size_t i = 0; i < n; i++) ggml_backend_tensor_get(tensors[i], got[i], 0, count * sizeof(float));
            CHECK(!tbrpc_client_failed(client, err, sizeof err), "%zu floats, round %d: %s", count, round, err);
            for (size_t x = 0; x < count; x++) {
                double want = 0;
                for (size_t i = 0; i < n; i++) want += (round == 2 && i == n - 1) ? 0.0 : parts[i][x];
                const double tolerance = round == 1 ? 1e-3 * (double) n : 0.0;
                CHECK(got[0][x] - want <= tolerance && want - got[0][x] <= tolerance,
                      "%zu floats, round %d: [%zu] = %g, want %g", count, round, x, got[0][x], want);
            }
            for (size_t i = 1; i < n; i++)
                CHECK(memcmp(got[0], got[i], count * sizeof(float)) == 0, "%zu floats, round %d: node %zu has other bits than node 0",
                      count, round, i);
        }
        for (size_t i = 0; i < n; i++) {
            free(parts[i]); free(got[i]);
            ggml_backend_buffer_free(bufs[i]);
            ggml_free(ctxs[i]);
        }
    }
    struct tb_status status;
    for (size_t i = 0; i < n; i++) {
        CHECK(tbrpc_client_node_status(client, i, &status, err, sizeof err) == 0, "status: %s", err);
        CHECK(status.allreduces == 3 * sizeof sizes / sizeof *sizes, "node %zu did %llu all-reduces", i,
              (unsigned long long) status.allreduces);
    }
    comm_free(comm);
    local_nodes_stop(&cluster);
    printf("PASS\n");
    return 0;
}
