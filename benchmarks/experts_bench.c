// experts_bench.c - what one node computes for a layer's routed experts,
// under the two ways of spreading them over NODES nodes:
//
//   cut    every node holds every expert, cut along the inner width
//          (FF/NODES of the FFN's rows; tbrpc's split_rules.c), and runs all
//          of a token's selected experts on its slice
//   whole  every node holds EXPERTS/NODES whole experts and runs only the
//          (token, expert) pairs whose expert it holds, ids made local
//
// Both are ggml's MUL_MAT_ID on the CPU backend with one thread, as
// llama.cpp's MoE FFN builds them: gate and up, SwiGLU, down. The router,
// the weighted sum over the selected experts and the all-reduce are the same
// for both and left out. Built and driven by benchmarks/bench_experts.py.
//
//   experts_bench N_EMBD FF EXPERTS NODES
//
// Both layouts hold the same bytes (EXPERTS x FF/NODES rows, or EXPERTS/NODES
// x FF rows, of N_EMBD Q4_K weights per matrix), so one buffer of valid Q4_K
// blocks backs both views: timings depend on the shapes and the ids, not on
// the weights' values. Then one job per stdin line:
//
//   cut K T id...       T tokens with K experts each (K x T global ids)
//   whole R id...       R (token, expert) pairs, one expert each (local ids)
//   cut-gu ..., whole-gu ...   the same, up to SwiGLU only (gate and up: the
//                       rest is the down projection's time)
//
// and one line "WALL_MS CPU_MS" per job: the time of one graph compute, and the CPU time it took.
#include <ggml.h>
#include <ggml-alloc.h>
#include <ggml-backend.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_IDS (1 << 20)

struct weights {
    int64_t n_embd, ff, experts, nodes;
    ggml_backend_buffer_t buf;
    struct ggml_context * ctx;
    struct ggml_tensor * cut[3];     // gate, up, down with width FF/NODES, all experts
    struct ggml_tensor * whole[3];   // gate, up, down with width FF, EXPERTS/NODES experts
};

static double clock_ms(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double) ts.tv_sec * 1e3 + (double) ts.tv_nsec * 1e-6;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float rnd(void) {   // xorshift64*, uniform in [-1, 1)
    rng_state ^= rng_state >> 12; rng_state ^= rng_state << 25; rng_state ^= rng_state >> 27;
    return (float) ((rng_state * 2685821657736338717ull) >> 40) / (float) (1u << 23) - 1.0f;
}

// Fill `n` bytes with Q4_K blocks quantized from random values, tiled.
static int fill_q4k(uint8_t * dst, size_t n) {
    enum { ROWS = 64, QK = 256 };
    const size_t tile = ggml_row_size(GGML_TYPE_Q4_K, QK) * ROWS;
    float * src = malloc(sizeof(float) * QK * ROWS);
    uint8_t * q = malloc(tile);
    if (!src || !q) { free(src); free(q); return -1; }
    for (size_t i = 0; i < (size_t) QK * ROWS; i++) src[i] = rnd();
    ggml_quantize_chunk(GGML_TYPE_Q4_K, src, q, 0, ROWS, QK, NULL);
    for (size_t off = 0; off < n; off += tile) memcpy(dst + off, q, n - off < tile ? n - off : tile);
    free(src);
    free(q);
    return 0;
}

static int weights_init(struct weights * w, ggml_backend_t be, char * err, size_t err_len) {
    const int64_t width = w->ff / w->nodes, held = w->experts / w->nodes;
    const size_t matrix = ggml_row_size(GGML_TYPE_Q4_K, w->n_embd) * (size_t) width * (size_t) w->experts;
    struct ggml_init_params p = { ggml_tensor_overhead() * 8, NULL, true };
    w->ctx = ggml_init(p);
    if (!w->ctx) { snprintf(err, err_len, "ggml_init failed"); return -1; }
    w->cut[0] = ggml_new_tensor_3d(w->ctx, GGML_TYPE_Q4_K, w->n_embd, width, w->experts);
    w->cut[1] = ggml_new_tensor_3d(w->ctx, GGML_TYPE_Q4_K, w->n_embd, width, w->experts);
    w->cut[2] = ggml_new_tensor_3d(w->ctx, GGML_TYPE_Q4_K, width, w->n_embd, w->experts);
    w->whole[0] = ggml_new_tensor_3d(w->ctx, GGML_TYPE_Q4_K, w->n_embd, w->ff, held);
    w->whole[1] = ggml_new_tensor_3d(w->ctx, GGML_TYPE_Q4_K, w->n_embd, w->ff, held);
    w->whole[2] = ggml_new_tensor_3d(w->ctx, GGML_TYPE_Q4_K, w->ff, w->n_embd, held);
    for (int m = 0; m < 3; m++) {
        if (ggml_nbytes(w->cut[m]) != matrix || ggml_nbytes(w->whole[m]) != matrix) {
            snprintf(err, err_len, "matrix %d: %zu and %zu bytes, not %zu", m, ggml_nbytes(w->cut[m]),
                     ggml_nbytes(w->whole[m]), matrix);
            return -1;
        }
    }
    w->buf = ggml_backend_alloc_buffer(be, 3 * matrix + 64);
    if (!w->buf) {
        snprintf(err, err_len, "cannot allocate %.2f GB of weights", 3.0 * (double) matrix / 1e9);
        return -1;
    }
    uint8_t * base = ggml_backend_buffer_get_base(w->buf);
    if (fill_q4k(base, 3 * matrix) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
    for (int m = 0; m < 3; m++) {
        if (ggml_backend_tensor_alloc(w->buf, w->cut[m], base + (size_t) m * matrix) != GGML_STATUS_SUCCESS ||
            ggml_backend_tensor_alloc(w->buf, w->whole[m], base + (size_t) m * matrix) != GGML_STATUS_SUCCESS) {
            snprintf(err, err_len, "cannot place matrix %d", m);
            return -1;
        }
    }
    return 0;
}

// One job: gate and up by MUL_MAT_ID, SwiGLU, down by MUL_MAT_ID (not with gate_up_only).
// Returns the wall ms, or < 0 on error, and the process's CPU ms in *cpu_ms (one thread
// computes: the node's own work, without the time it waited for a core on a busy machine).
// `alloc` keeps its buffer from job to job, as a node keeps its compute buffer: no job pays for fresh pages.
static double run_job(ggml_backend_t be, ggml_gallocr_t alloc, struct ggml_tensor * const mats[3], int64_t n_embd,
                      int64_t k, int64_t t, const int32_t * ids, bool gate_up_only, double * cpu_ms, char * err,
                      size_t err_len) {
    struct ggml_init_params p = { ggml_tensor_overhead() * 16 + ggml_graph_overhead(), NULL, true };
    struct ggml_context * ctx = ggml_init(p);
    if (!ctx) { snprintf(err, err_len, "ggml_init failed"); return -1; }
    struct ggml_tensor * cur = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_embd, 1, t);
    struct ggml_tensor * sel = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, t);
    struct ggml_tensor * gate = ggml_mul_mat_id(ctx, mats[0], cur, sel);
    struct ggml_tensor * up = ggml_mul_mat_id(ctx, mats[1], cur, sel);
    struct ggml_tensor * act = ggml_swiglu_split(ctx, gate, up);
    struct ggml_tensor * out = gate_up_only ? act : ggml_mul_mat_id(ctx, mats[2], act, sel);
    struct ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, out);
    double ms = -1;
    if (!ggml_gallocr_alloc_graph(alloc, g)) {
        snprintf(err, err_len, "cannot allocate the graph of %lld x %lld", (long long) k, (long long) t);
    } else {
        float * x = malloc(sizeof(float) * (size_t) (n_embd * t));
        if (!x) {
            snprintf(err, err_len, "out of memory");
        } else {
            for (int64_t i = 0; i < n_embd * t; i++) x[i] = rnd();
            ggml_backend_tensor_set(cur, x, 0, ggml_nbytes(cur));
            ggml_backend_tensor_set(sel, ids, 0, ggml_nbytes(sel));
            free(x);
            const double t0 = clock_ms(CLOCK_MONOTONIC), c0 = clock_ms(CLOCK_PROCESS_CPUTIME_ID);
            if (ggml_backend_graph_compute(be, g) != GGML_STATUS_SUCCESS) {
                snprintf(err, err_len, "graph compute failed");
            } else {
                ms = clock_ms(CLOCK_MONOTONIC) - t0;
                *cpu_ms = clock_ms(CLOCK_PROCESS_CPUTIME_ID) - c0;
            }
        }
    }
    ggml_free(ctx);
    return ms;
}

static int parse_i64(const char * s, int64_t lo, int64_t hi, int64_t * out) {
    char * end;
    const long long v = strtoll(s, &end, 10);
    if (end == s || (*end && *end != '\n') || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int main(int argc, char ** argv) {
    struct weights w = { 0 };
    if (argc != 5 || parse_i64(argv[1], 256, 1 << 16, &w.n_embd) || parse_i64(argv[2], 256, 1 << 16, &w.ff) ||
        parse_i64(argv[3], 1, 4096, &w.experts) || parse_i64(argv[4], 1, 64, &w.nodes) || w.n_embd % 256 ||
        (w.ff / w.nodes) % 256 || w.ff % w.nodes || w.experts % w.nodes) {
        fprintf(stderr, "usage: experts_bench N_EMBD FF EXPERTS NODES (N_EMBD and FF/NODES multiples of 256, "
                        "EXPERTS a multiple of NODES)\n");
        return 2;
    }
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t be = dev ? ggml_backend_dev_init(dev, NULL) : NULL;
    if (!be) { fprintf(stderr, "experts_bench: no CPU backend\n"); return 1; }
    ggml_backend_set_n_threads_t set_threads = (ggml_backend_set_n_threads_t)
        ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
    if (!set_threads) { fprintf(stderr, "experts_bench: the CPU backend cannot set its threads\n"); return 1; }
    set_threads(be, 1);
    char err[256] = "";
    if (weights_init(&w, be, err, sizeof err) != 0) { fprintf(stderr, "experts_bench: %s\n", err); return 1; }
    ggml_gallocr_t alloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
    if (!alloc) { fprintf(stderr, "experts_bench: no graph allocator\n"); return 1; }
    printf("ready\n");
    fflush(stdout);

    static char line[16 * MAX_IDS];
    static int32_t ids[MAX_IDS];
    int rc = 0;
    while (rc == 0 && fgets(line, sizeof line, stdin)) {
        char * save = NULL;
        const char * mode = strtok_r(line, " \n", &save);
        if (!mode) continue;
        const bool cut = !strcmp(mode, "cut") || !strcmp(mode, "cut-gu");
        const bool gate_up_only = !strcmp(mode, "cut-gu") || !strcmp(mode, "whole-gu");
        int64_t k = 1, t = 0;
        const char * a = strtok_r(NULL, " \n", &save);
        if (!cut && strcmp(mode, "whole") && strcmp(mode, "whole-gu")) {
            fprintf(stderr, "experts_bench: job '%s', not cut, whole, cut-gu or whole-gu\n", mode);
            rc = 1;
            break;
        }
        if (cut) {
            const char * b = strtok_r(NULL, " \n", &save);
            if (!a || !b || parse_i64(a, 1, 64, &k) || parse_i64(b, 1, MAX_IDS, &t)) { rc = 1; }
        } else if (!a || parse_i64(a, 1, MAX_IDS, &t)) {
            rc = 1;
        }
        if (rc == 0 && k * t > MAX_IDS) rc = 1;
        if (rc != 0) { fprintf(stderr, "experts_bench: a %s job with a bad count\n", mode); break; }
        const int64_t held = cut ? w.experts : w.experts / w.nodes;
        for (int64_t i = 0; i < k * t && rc == 0; i++) {
            const char * s = strtok_r(NULL, " \n", &save);
            int64_t v;
            if (!s || parse_i64(s, 0, held - 1, &v)) {
                fprintf(stderr, "experts_bench: id %lld of a %s job missing or not below %lld\n", (long long) i, mode,
                        (long long) held);
                rc = 1;
            } else {
                ids[i] = (int32_t) v;
            }
        }
        if (rc == 0 && strtok_r(NULL, " \n", &save)) {
            fprintf(stderr, "experts_bench: a %s job with more than %lld ids\n", mode, (long long) (k * t));
            rc = 1;
        }
        if (rc != 0) break;
        double cpu_ms = 0;
        const double ms = run_job(be, alloc, cut ? w.cut : w.whole, w.n_embd, k, t, ids, gate_up_only, &cpu_ms, err,
                                  sizeof err);
        if (ms < 0) { fprintf(stderr, "experts_bench: %s\n", err); rc = 1; break; }
        printf("%.4f %.4f\n", ms, cpu_ms);
        fflush(stdout);
    }
    ggml_gallocr_free(alloc);
    ggml_backend_buffer_free(w.buf);
    ggml_free(w.ctx);
    ggml_backend_free(be);
    return rc;
}
