// transport_bench.c - what one connection to a node costs, over the transport
// the head chooses: round trips of small and large messages, bulk bandwidth
// head to node (SET_TENSOR) and node to node (PEER_SEND), the head's CPU per
// GB moved, and the CPU an idle connection burns. Built and driven by
// benchmarks/bench_transport.py, which starts the nodes and reads their CPU
// time at each phase mark.
//
//   transport_bench ENDPOINT TRANSPORT ROUNDS [PEER_ENDPOINT]
//
// Prints "MARK <phase>" (bulk, peer, idle, end) before each phase and waits
// for one line on stdin before going on, then one JSON object. PEER_ENDPOINT:
// a second node; the peer phase sends 64 MiB from the first to it.
#include "client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define BULK_BYTES  (64u << 20)
#define IDLE_S      3

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + (double) ts.tv_nsec * 1e-9;
}

static double cpu_s(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double) ru.ru_utime.tv_sec + (double) ru.ru_stime.tv_sec
         + ((double) ru.ru_utime.tv_usec + (double) ru.ru_stime.tv_usec) * 1e-6;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

static void die(struct client_node * n, const char * what) {
    fprintf(stderr, "transport_bench: %s: %s\n", what, n ? n->error : "");
    exit(1);
}

// Median and 99th percentile, in microseconds, of `rounds` calls of `cmd`.
static void round_trips(struct client_node * n, uint16_t cmd, const void * req, size_t req_len, void * out,
                        size_t out_len, int rounds, double * median_us, double * p99_us) {
    double * t = malloc(sizeof *t * (size_t) rounds);
    if (!t) die(NULL, "out of memory");
    for (int i = 0; i < rounds; i++) {
        const double t0 = now_s();
        if (node_call(n, cmd, req, req_len, out, out_len) != 0) die(n, tb_cmd_name(cmd));
        t[i] = (now_s() - t0) * 1e6;
    }
    qsort(t, (size_t) rounds, sizeof *t, cmp_double);
    *median_us = t[rounds / 2];
    *p99_us = t[(size_t) ((double) (rounds - 1) * 0.99)];
    free(t);
}

static uint64_t alloc_buffer(struct client_node * n, uint64_t size) {
    struct tb_alloc_req req = { size };
    struct tb_alloc_reply rep;
    if (node_call(n, TB_CMD_ALLOC_BUFFER, &req, sizeof req, &rep, sizeof rep) != 0) die(n, "ALLOC_BUFFER");
    return rep.handle;
}

// Bytes per second of SET_TENSOR (posted, then one SYNC) of `size` bytes; best of `rounds`.
static double set_bandwidth(struct client_node * n, uint64_t handle, const uint8_t * data, uint64_t size, int rounds) {
    double best = 1e30;
    for (int i = 0; i < rounds; i++) {
        struct tb_range r = { handle, 0, size };
        const double t0 = now_s();
        pthread_mutex_lock(&n->lock);
        int rc = node_post_locked(n, TB_CMD_SET_TENSOR, &r, sizeof r, data, size);
        pthread_mutex_unlock(&n->lock);
        if (rc != 0 || node_call(n, TB_CMD_SYNC, NULL, 0, NULL, 0) != 0) die(n, "SET_TENSOR");
        const double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    return (double) size / best;
}

// This machine's single-thread memcpy bandwidth, best of `rounds`, for scale.
static double memcpy_bandwidth(uint8_t * dst, const uint8_t * src, size_t size, int rounds) {
    double best = 1e30;
    for (int i = 0; i < rounds; i++) {
        const double t0 = now_s();
        memcpy(dst, src, size);
        const double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    return (double) size / best;
}

// Wait for the driver: it reads the nodes' CPU time at every mark.
static void mark(const char * phase) {
    printf("MARK %s\n", phase);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) die(NULL, "the driver went away");
}

// Bytes per second of PEER_SEND a -> b of `size` bytes (posted on both, then SYNC on b); best of `rounds`.
static double peer_bandwidth(struct client_node * a, uint64_t src, struct client_node * b, uint64_t dst, uint64_t size,
                             int rounds) {
    struct peer_link * link = peer_link(a, b);
    if (!link) die(a, "no peer link");
    double best = 1e30;
    for (int i = 0; i < rounds; i++) {
        struct tb_peer_range send = { .peer_id = link->out_id, .handle = src, .offset = 0, .size = size };
        struct tb_peer_range recv = { .peer_id = link->in_id, .handle = dst, .offset = 0, .size = size };
        const double t0 = now_s();
        if (node_post(a, TB_CMD_PEER_SEND, &send, sizeof send) != 0 || tb_flush(a->tp) != 0) die(a, "PEER_SEND");
        if (node_post(b, TB_CMD_PEER_RECV, &recv, sizeof recv) != 0) die(b, "PEER_RECV");
        if (node_call(b, TB_CMD_SYNC, NULL, 0, NULL, 0) != 0) die(b, "SYNC");
        const double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    if (node_call(a, TB_CMD_SYNC, NULL, 0, NULL, 0) != 0) die(a, "SYNC");
    return (double) size / best;
}

int main(int argc, char ** argv) {
    if (argc != 4 && argc != 5) { fprintf(stderr, "usage: transport_bench ENDPOINT TRANSPORT ROUNDS [PEER_ENDPOINT]\n"); return 2; }
    const int rounds = atoi(argv[3]) > 0 ? atoi(argv[3]) : 1000;
    char err[512];
    int kind = 0;   // no cluster secret: the nodes are started without one
    struct client_node * n = node_open(argv[1], "bench", 10000, argv[2], NULL, 0, &kind, err, sizeof err);
    if (!n) { fprintf(stderr, "transport_bench: %s\n", err); return 1; }
    struct client_node * peer = NULL;
    if (argc == 5 && !(peer = node_open(argv[4], "bench-peer", 10000, argv[2], NULL, 0, &kind, err, sizeof err))) {
        fprintf(stderr, "transport_bench: %s\n", err);
        return 1;
    }

    uint8_t * data = malloc(BULK_BYTES), * copy = malloc(BULK_BYTES);
    if (!data || !copy) die(NULL, "out of memory");
    for (size_t i = 0; i < BULK_BYTES; i++) data[i] = (uint8_t) (i * 131u);
    const uint64_t bulk = alloc_buffer(n, BULK_BYTES);

    double sync_med, sync_p99, k4_med, k4_p99, m1_med, m1_p99;
    round_trips(n, TB_CMD_SYNC, NULL, 0, NULL, 0, rounds, &sync_med, &sync_p99);
    struct tb_range k4 = { bulk, 0, 4096 }, m1 = { bulk, 0, 1u << 20 };
    round_trips(n, TB_CMD_GET_TENSOR, &k4, sizeof k4, copy, 4096, rounds, &k4_med, &k4_p99);
    round_trips(n, TB_CMD_GET_TENSOR, &m1, sizeof m1, copy, 1u << 20, rounds / 10 + 1, &m1_med, &m1_p99);
    const double memcpy_bw = memcpy_bandwidth(copy, data, BULK_BYTES, 5);

    mark("bulk");
    double cpu0 = cpu_s();
    const double set_bw = set_bandwidth(n, bulk, data, BULK_BYTES, 5);
    const double set_cpu_per_gb = (cpu_s() - cpu0) / (5.0 * BULK_BYTES / 1e9);
    double peer_bw = 0, peer_cpu_per_gb = 0;
    if (peer) {
        const uint64_t dst = alloc_buffer(peer, BULK_BYTES);
        mark("peer");
        cpu0 = cpu_s();
        peer_bw = peer_bandwidth(n, bulk, peer, dst, BULK_BYTES, 5);
        peer_cpu_per_gb = (cpu_s() - cpu0) / (5.0 * BULK_BYTES / 1e9);
    }

    // Idle: the connection stays open and nothing is sent; the driver reads
    // the nodes' CPU time at both marks.
    mark("idle");
    cpu0 = cpu_s();
    sleep(IDLE_S);
    const double idle_cpu = (cpu_s() - cpu0) / IDLE_S;
    mark("end");

    printf("{\"transport\": \"%s\", \"rtt_24B_us\": [%.2f, %.2f], \"rtt_get_4KiB_us\": [%.2f, %.2f], "
           "\"rtt_get_1MiB_us\": [%.2f, %.2f], \"set_64MiB_GBps\": %.3f, \"peer_64MiB_GBps\": %.3f, "
           "\"memcpy_GBps\": %.3f, \"head_cpu_s_per_GB_set\": %.4f, \"head_cpu_s_per_GB_peer\": %.4f, "
           "\"head_idle_cpu\": %.5f, \"bulk_bytes\": %u}\n",
           n->tp->describe, sync_med, sync_p99, k4_med, k4_p99, m1_med, m1_p99, set_bw / 1e9, peer_bw / 1e9,
           memcpy_bw / 1e9, set_cpu_per_gb, peer_cpu_per_gb, idle_cpu, BULK_BYTES);
    if (peer) node_destroy(peer);
    node_destroy(n);
    free(data);
    free(copy);
    return 0;
}
