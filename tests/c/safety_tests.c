// safety_tests.c - the node's graph path against hostile graphs, in C.
//
// Built with TB_OP_RULES_TESTING (tests/test_safety.py), which adds one
// switch to op_rules.c: tb_op_rules_disabled, so a run can show that without
// a rule family the property below fails.
//
// property SEED N [DISABLED_MASK]
//   N random single-op graphs, for every op on the allowlist: a valid op made
//   with ggml's own constructors, then (mostly) mutated on the wire: shapes,
//   strides, op_params, types, sources, offsets, index values. Every tensor
//   gets its own buffer whose end touches a PROT_NONE guard page and whose
//   start follows canary bytes after another guard page. Each graph goes the
//   node's way: tb_decode_tensors (proto.c) with the buffers, then per node
//   what decode_graph in node_session.c does (tb_op_check, the device's
//   supports_op), then tb_graph_compute_checked on the CPU backend. Every run
//   must be refused with an error or touch nothing outside its buffers: a
//   fault, an abort or a changed canary byte ends the program with the case.
//   Prints per-op counts of runs and refusals; every op must have both.
//
// attacks
//   The reported attacks, each refused by name: SET/ACC wrap-around, PAD
//   with an overlapping destination, ROLL beyond its source, a bad GET_ROWS
//   index, a NULL source, nb[1] = 0 on an output.
#include "op_rules.h"
#include "proto.h"
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"   // ggml_add1: still an op a client may send
#include "ggml.h"
#include "ggml-backend.h"

#include "check.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAXT 16
#define CASE_SECONDS 10

static char current_case[512] = "(none)";
static ggml_backend_dev_t cpu_dev;
static ggml_backend_t cpu;

static void on_fault(int sig) {
    // async-signal-safe enough for a dying test: write(2) only
    char msg[700];
    int n = snprintf(msg, sizeof msg, "\nFAULT signal %d in case %s\n", sig, current_case);
    if (n > 0) { ssize_t ignored = write(2, msg, (size_t) n); (void) ignored; }
    _exit(3);
}

// ---- guarded buffers ----------------------------------------------------------------

struct gbuf {
    uint8_t * map;          // guard | canary ... | data ... | guard
    size_t map_len;
    uint8_t * data;         // size bytes, ending at the second guard page
    size_t size;
    size_t canary_len;
    ggml_backend_buffer_t buf;
    uint64_t handle;
};

static size_t page_size(void) { return (size_t) sysconf(_SC_PAGESIZE); }

static void gbuf_alloc(struct gbuf * g, size_t size, uint64_t handle) {
    const size_t page = page_size();
    size = (size + 63) & ~(size_t) 63;
    if (size == 0) size = 64;
    const size_t body = (size + page - 1) / page * page + page;   // at least one page of canary before the data
    g->map_len = body + 2 * page;
    g->map = mmap(NULL, g->map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(g->map != MAP_FAILED, "mmap");
    CHECK(mprotect(g->map + page, body, PROT_READ | PROT_WRITE) == 0, "mprotect");
    g->data = g->map + page + body - size;
    g->size = size;
    g->canary_len = body - size;
    memset(g->map + page, 0xA5, g->canary_len);
    g->buf = ggml_backend_dev_buffer_from_host_ptr(cpu_dev, g->data, size, size);
    CHECK(g->buf, "buffer_from_host_ptr");
    g->handle = handle;
}

static bool gbuf_canary_ok(const struct gbuf * g) {
    const uint8_t * c = g->map + page_size();
    for (size_t i = 0; i < g->canary_len; i++) if (c[i] != 0xA5) return false;
    return true;
}

static void gbuf_free(struct gbuf * g) {
    ggml_backend_buffer_free(g->buf);
    munmap(g->map, g->map_len);
}

struct bufs { struct gbuf b[MAXT]; int n; };

static bool lookup(void * ctx, uint64_t handle, struct tb_buffer_view * out) {
    struct bufs * bs = ctx;
    for (int i = 0; i < bs->n; i++) {
        if (bs->b[i].handle == handle) {
            out->base = bs->b[i].data;
            out->size = bs->b[i].size;
            out->ggml_buffer = bs->b[i].buf;
            return true;
        }
    }
    return false;
}

// ---- random numbers -----------------------------------------------------------------

static uint64_t rng;
static uint32_t rnd(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t) (rng >> 11); }
static int rint_in(int lo, int hi) { return lo + (int) (rnd() % (uint32_t) (hi - lo + 1)); }
static bool chance(int percent) { return (int) (rnd() % 100) < percent; }

// ---- the ops ------------------------------------------------------------------------

static const enum ggml_op OPS[] = {
    GGML_OP_DUP, GGML_OP_CPY, GGML_OP_CONT, GGML_OP_ADD, GGML_OP_SUB, GGML_OP_MUL, GGML_OP_DIV, GGML_OP_ADD1,
    GGML_OP_ADD_ID, GGML_OP_SQR, GGML_OP_SQRT, GGML_OP_LOG, GGML_OP_SIN, GGML_OP_COS, GGML_OP_SCALE, GGML_OP_CLAMP,
    GGML_OP_LEAKY_RELU, GGML_OP_UNARY, GGML_OP_GLU, GGML_OP_NORM, GGML_OP_RMS_NORM, GGML_OP_L2_NORM, GGML_OP_SUM_ROWS,
    GGML_OP_MEAN, GGML_OP_ARGMAX, GGML_OP_ARGSORT, GGML_OP_TOP_K, GGML_OP_MUL_MAT, GGML_OP_MUL_MAT_ID, GGML_OP_GET_ROWS,
    GGML_OP_SET_ROWS, GGML_OP_SET, GGML_OP_ACC, GGML_OP_CONCAT, GGML_OP_REPEAT, GGML_OP_PAD, GGML_OP_ROLL,
    GGML_OP_DIAG_MASK_INF, GGML_OP_SOFT_MAX, GGML_OP_ROPE, GGML_OP_FLASH_ATTN_EXT, GGML_OP_FILL,
    GGML_OP_VIEW, GGML_OP_RESHAPE, GGML_OP_PERMUTE, GGML_OP_TRANSPOSE,
};
#define N_OPS ((int) (sizeof OPS / sizeof *OPS))

static int d(void) { return rint_in(1, 6); }

static struct ggml_tensor * f32(struct ggml_context * c, int64_t a, int64_t b, int64_t e, int64_t f) {
    return ggml_new_tensor_4d(c, GGML_TYPE_F32, a, b, e, f);
}

// A valid use of `op` made by ggml's own constructors.
static struct ggml_tensor * make_op(struct ggml_context * c, enum ggml_op op) {
    const int64_t n0 = 2 * rint_in(1, 8), n1 = d(), n2 = rint_in(1, 3), n3 = rint_in(1, 2);
    struct ggml_tensor * a = f32(c, n0, n1, n2, n3);
    switch (op) {
        case GGML_OP_DUP:  return ggml_dup(c, a);
        case GGML_OP_CPY:  return ggml_cpy(c, a, ggml_new_tensor_4d(c, chance(50) ? GGML_TYPE_F16 : GGML_TYPE_F32, n0, n1, n2, n3));
        case GGML_OP_CONT: return ggml_cont(c, ggml_transpose(c, a));
        case GGML_OP_ADD:  return ggml_add(c, a, f32(c, n0, chance(50) ? 1 : n1, 1, 1));
        case GGML_OP_SUB:  return ggml_sub(c, a, f32(c, n0, n1, n2, n3));
        case GGML_OP_MUL:  return ggml_mul(c, a, f32(c, n0, 1, 1, 1));
        case GGML_OP_DIV:  return ggml_div(c, a, f32(c, n0, n1, 1, 1));
        case GGML_OP_ADD1: return ggml_add1(c, a, f32(c, 1, 1, 1, 1));
        case GGML_OP_ADD_ID: {
            struct ggml_tensor * x = f32(c, n0, n1, n2, 1);
            return ggml_add_id(c, x, f32(c, n0, 4, 1, 1), ggml_new_tensor_2d(c, GGML_TYPE_I32, n1, n2));
        }
        case GGML_OP_SQR:  return ggml_sqr(c, a);
        case GGML_OP_SQRT: return ggml_sqrt(c, a);
        case GGML_OP_LOG:  return ggml_log(c, a);
        case GGML_OP_SIN:  return ggml_sin(c, a);
        case GGML_OP_COS:  return ggml_cos(c, a);
        case GGML_OP_SCALE: return ggml_scale(c, a, 0.5f);
        case GGML_OP_CLAMP: return ggml_clamp(c, a, -1.0f, 1.0f);
        case GGML_OP_LEAKY_RELU: return ggml_leaky_relu(c, a, 0.1f, false);
        case GGML_OP_UNARY: return chance(50) ? ggml_silu(c, a) : ggml_gelu(c, a);
        case GGML_OP_GLU: return chance(50) ? ggml_swiglu(c, a) : ggml_geglu_split(c, a, f32(c, n0, n1, n2, n3));
        case GGML_OP_NORM: return ggml_norm(c, a, 1e-5f);
        case GGML_OP_RMS_NORM: return ggml_rms_norm(c, a, 1e-5f);
        case GGML_OP_L2_NORM: return ggml_l2_norm(c, a, 1e-5f);
        case GGML_OP_SUM_ROWS: return ggml_sum_rows(c, a);
        case GGML_OP_MEAN: return ggml_mean(c, a);
        case GGML_OP_ARGMAX: return ggml_argmax(c, f32(c, n0, n1, 1, 1));
        case GGML_OP_ARGSORT: return ggml_argsort(c, a, GGML_SORT_ORDER_DESC);
        case GGML_OP_TOP_K: return ggml_top_k(c, a, rint_in(1, (int) n0));
        case GGML_OP_MUL_MAT: {
            const enum ggml_type wt = chance(30) ? GGML_TYPE_Q8_0 : chance(50) ? GGML_TYPE_F16 : GGML_TYPE_F32;
            const int64_t k = wt == GGML_TYPE_Q8_0 ? 32 : n0;
            return ggml_mul_mat(c, ggml_new_tensor_4d(c, wt, k, n1, n2, n3), f32(c, k, rint_in(1, 3), n2, n3));
        }
        case GGML_OP_MUL_MAT_ID: {
            const int n_as = rint_in(1, 4), used = rint_in(1, n_as), tokens = rint_in(1, 3);
            return ggml_mul_mat_id(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, n0, n1, n_as), f32(c, n0, chance(50) ? 1 : used, tokens, 1),
                                   ggml_new_tensor_2d(c, GGML_TYPE_I32, used, tokens));
        }
        case GGML_OP_GET_ROWS: {
            const enum ggml_type wt = chance(30) ? GGML_TYPE_F16 : GGML_TYPE_F32;
            return ggml_get_rows(c, ggml_new_tensor_2d(c, wt, n0, n1), ggml_new_tensor_1d(c, GGML_TYPE_I32, d()));
        }
        case GGML_OP_SET_ROWS: {
            const int rows = rint_in(1, (int) n1);
            return ggml_set_rows(c, ggml_new_tensor_2d(c, chance(50) ? GGML_TYPE_F16 : GGML_TYPE_F32, n0, n1),
                                 f32(c, n0, rows, 1, 1), ggml_new_tensor_1d(c, chance(50) ? GGML_TYPE_I64 : GGML_TYPE_I32, rows));
        }
        case GGML_OP_SET: {
            struct ggml_tensor * dst = f32(c, n0, n1 + 1, 1, 1);
            return ggml_set_2d(c, dst, f32(c, n0 / 2, n1, 1, 1), dst->nb[1], rint_in(0, (int) (n0 / 2)) * sizeof(float));
        }
        case GGML_OP_ACC: {
            struct ggml_tensor * dst = f32(c, n0, n1 + 1, 1, 1);
            return ggml_acc(c, dst, f32(c, n0 / 2, n1, 1, 1), dst->nb[1], dst->nb[2], dst->nb[3], dst->nb[1]);
        }
        case GGML_OP_CONCAT: return ggml_concat(c, a, f32(c, n0, rint_in(1, 3), n2, n3), 1);
        case GGML_OP_REPEAT: return ggml_repeat(c, f32(c, n0, 1, 1, 1), a);
        case GGML_OP_PAD: return ggml_pad_ext(c, a, rint_in(0, 2), rint_in(0, 2), rint_in(0, 2), rint_in(0, 2), 0, 1, 0, 0);
        case GGML_OP_ROLL: return ggml_roll(c, a, rint_in(-(int) n0 + 1, (int) n0 - 1), rint_in(0, (int) n1 - 1), 0, 0);
        case GGML_OP_DIAG_MASK_INF: return ggml_diag_mask_inf(c, f32(c, n0, n1, n2, 1), rint_in(0, 3));
        case GGML_OP_SOFT_MAX: {
            struct ggml_tensor * x = f32(c, n0, n1, n2, 1);
            return ggml_soft_max_ext(c, x, chance(50) ? ggml_new_tensor_2d(c, GGML_TYPE_F16, n0, n1) : NULL, 0.5f, 0.0f);
        }
        case GGML_OP_ROPE: {
            struct ggml_tensor * x = f32(c, n0, n1, n2, 1);
            return ggml_rope_ext(c, x, ggml_new_tensor_1d(c, GGML_TYPE_I32, n2), NULL, (int) n0, chance(50) ? GGML_ROPE_TYPE_NEOX : 0,
                                 4096, 10000.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
        }
        case GGML_OP_FLASH_ATTN_EXT: {
            const enum ggml_type kvt[] = { GGML_TYPE_F16, GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_F32 };
            const enum ggml_type kt = kvt[rnd() % 5], vt = chance(50) ? kt : GGML_TYPE_F16;
            const bool quant = ggml_is_quantized(kt) || ggml_is_quantized(vt);
            const int64_t D = quant ? 32 : 4 * rint_in(1, 4), nq = rint_in(1, 3), nkv = rint_in(1, 5), H = rint_in(1, 2);
            struct ggml_tensor * q = f32(c, D, nq, H, 1);
            struct ggml_tensor * k = ggml_new_tensor_4d(c, kt, D, nkv, H, 1);
            struct ggml_tensor * v = ggml_new_tensor_4d(c, vt, D, nkv, H, 1);
            struct ggml_tensor * m = chance(50) ? ggml_new_tensor_2d(c, GGML_TYPE_F16, nkv, nq) : NULL;
            return ggml_flash_attn_ext(c, q, k, v, m, 0.5f, 0.0f, 0.0f);
        }
        case GGML_OP_FILL: return ggml_fill(c, a, 0.25f);
        case GGML_OP_VIEW: return ggml_view_2d(c, a, n0 / 2, n1, a->nb[1], sizeof(float) * (size_t) rint_in(0, (int) (n0 / 2)));
        case GGML_OP_RESHAPE: return ggml_reshape_2d(c, a, n0 * n1, n2 * n3);
        case GGML_OP_PERMUTE: return ggml_permute(c, a, 1, 0, 2, 3);
        case GGML_OP_TRANSPOSE: return ggml_transpose(c, a);
        default: return NULL;
    }
}

// ---- one case -----------------------------------------------------------------------

struct outcome { int ran, refused_decode, refused_rules, refused_run; };

static struct tb_wire_tensor wire[MAXT];
static int n_wire;
static struct ggml_tensor * made[MAXT];

static int wire_index(const struct ggml_tensor * t) {
    for (int i = 0; i < n_wire; i++) if (made[i] == t) return i;
    return -1;
}

// Tensors in dependency order: sources and view sources first.
static void collect(struct ggml_tensor * t) {
    if (!t || wire_index(t) >= 0) return;
    collect(t->view_src);
    for (int s = 0; s < GGML_MAX_SRC; s++) collect(t->src[s]);
    CHECK(n_wire < MAXT, "too many tensors");
    made[n_wire++] = t;
}

static void to_wire(void) {
    memset(wire, 0, sizeof wire);
    for (int i = 0; i < n_wire; i++) {
        const struct ggml_tensor * t = made[i];
        struct tb_wire_tensor * w = &wire[i];
        for (int k = 0; k < GGML_MAX_DIMS; k++) { w->ne[k] = t->ne[k]; w->nb[k] = t->nb[k]; }
        w->type = t->type;
        w->op = t->op;
        w->flags = t->flags | (i == n_wire - 1 ? GGML_TENSOR_FLAG_COMPUTE : 0);   // what the head's scheduler marks
        memcpy(w->op_params, t->op_params, sizeof w->op_params);
        w->view_src = t->view_src ? wire_index(t->view_src) : -1;
        w->view_offs = t->view_offs;
        for (int s = 0; s < GGML_MAX_SRC; s++) w->src[s] = t->src[s] ? wire_index(t->src[s]) : -1;
        snprintf(w->name, sizeof w->name, "t%d", i);
    }
}

static int64_t wild(void) {
    switch (rnd() % 6) {
        case 0: return 0;
        case 1: return -(int64_t) rint_in(1, 1 << 20);
        case 2: return (int64_t) rint_in(0, 64);
        case 3: return INT32_MIN;
        case 4: return INT32_MAX;
        default: return (int64_t) (int32_t) rnd();
    }
}

// One mutation of the wire form: what a hostile client can choose.
static void mutate(char * what, size_t len) {
    const int i = rint_in(0, n_wire - 1);
    struct tb_wire_tensor * w = &wire[i];
    const int k = rint_in(0, GGML_MAX_DIMS - 1);
    switch (rnd() % 9) {
        case 0: w->ne[k] = chance(50) ? w->ne[k] + rint_in(1, 4) : rint_in(0, 9); snprintf(what, len, "t%d.ne[%d]=%lld", i, k, (long long) w->ne[k]); break;
        case 1: {
            const uint64_t choices[] = { 0, 1, 2, 4, w->nb[k] / 2, w->nb[k] * 2, w->nb[(k + 1) % 4] };
            w->nb[k] = choices[rnd() % 7];
            snprintf(what, len, "t%d.nb[%d]=%llu", i, k, (unsigned long long) w->nb[k]);
            break;
        }
        case 2: case 3: {
            const int p = rint_in(0, 9);
            w->op_params[p] = (int32_t) wild();
            snprintf(what, len, "t%d.op_params[%d]=%d", i, p, w->op_params[p]);
            break;
        }
        case 4: {
            const enum ggml_type ts[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32, GGML_TYPE_I64, GGML_TYPE_Q8_0, GGML_TYPE_BF16, GGML_TYPE_I8 };
            w->type = ts[rnd() % 7];
            snprintf(what, len, "t%d.type=%s", i, ggml_type_name((enum ggml_type) w->type));
            break;
        }
        case 5: { const int s = rint_in(0, 3); w->src[s] = -1; snprintf(what, len, "t%d.src[%d]=NULL", i, s); break; }
        case 6: { const int s = rint_in(0, 3); w->src[s] = i > 0 ? rint_in(0, i - 1) : -1; snprintf(what, len, "t%d.src[%d]=%d", i, s, w->src[s]); break; }
        case 7: w->view_offs += 64; w->offset += 64; snprintf(what, len, "t%d view moved by 64", i); break;
        default: w->nb[1] = 0; snprintf(what, len, "t%d.nb[1]=0", i); break;
    }
}

// ---- hostile shapes and params --------------------------------------------------
//
// mutate() changes one field at random; it almost never breaks the contract
// between an op and the small tensors that steer it (positions, masks, row
// indices, ids) or its int params (n_dims, CONCAT's dimension, PAD's
// amounts): a shape bumped by 1-4 moves a read a few bytes, inside the 64
// bytes by which a buffer is rounded up. hostile() breaks exactly that
// contract, and by enough to reach the guard page: it grows what the op
// iterates (rows, heads, keys, slices) far past what the steering tensor
// holds, or sets the param out of range, and re-packs the strides of what it
// resizes, so that every other rule still holds and only the one that pairs
// the two can refuse it. Ops with no such pairing get an ordinary mutation.

// ne[k] = n, with ggml's default strides for the new shape (the tensors
// make_op builds are packed; a view keeps its view_src and is re-packed too).
static void resize(int i, int k, int64_t n) {
    struct tb_wire_tensor * w = &wire[i];
    w->ne[k] = n;
    w->nb[0] = ggml_type_size((enum ggml_type) w->type);
    w->nb[1] = ggml_row_size((enum ggml_type) w->type, w->ne[0]);
    for (int j = 2; j < GGML_MAX_DIMS; j++) w->nb[j] = w->nb[j - 1] * (uint64_t) w->ne[j - 1];
}

// Another type for an index (or position) tensor, strides re-packed to it.
static void retype(int i) {
    const enum ggml_type ts[] = { GGML_TYPE_I64, GGML_TYPE_I32, GGML_TYPE_I16, GGML_TYPE_I8, GGML_TYPE_F32, GGML_TYPE_F16 };
    wire[i].type = ts[rnd() % 6];
    resize(i, 0, wire[i].ne[0]);
}

// Far more than the op's steering tensor holds: ggml's constructors here make
// at most 16 of anything, so 17-64 entries read 4-192 bytes past the end.
static int64_t many(void) { return rint_in(17, 64); }

static void hostile(char * what, size_t len) {
    const int t = n_wire - 1;
    struct tb_wire_tensor * w = &wire[t];
    int32_t * p = w->op_params;
    const int s0 = w->src[0], s1 = w->src[1], s2 = w->src[2], s3 = w->src[3];
    switch ((enum ggml_op) w->op) {
        case GGML_OP_ROPE: {   // src0 [n, heads, tokens], positions [tokens], op_params[1] = n_dims
            const int r = rint_in(0, 2);
            if (r == 0) {
                const int32_t bad[] = { (int32_t) wire[s0].ne[0] + 2 * rint_in(1, 64), (int32_t) wire[s0].ne[0] + 1, 0, -2, 1 << 20, INT32_MIN };
                p[1] = bad[rnd() % 6];
                snprintf(what, len, "hostile ROPE n_dims=%d of ne[0]=%lld", p[1], (long long) wire[s0].ne[0]);
            } else if (r == 1) {
                const int64_t n = many();
                resize(s0, 2, n); resize(t, 2, n);
                snprintf(what, len, "hostile ROPE %lld tokens, %lld positions", (long long) n, (long long) wire[s1].ne[0]);
            } else {
                retype(s1);
                snprintf(what, len, "hostile ROPE positions %s", ggml_type_name((enum ggml_type) wire[s1].type));
            }
            return;
        }
        case GGML_OP_SOFT_MAX:   // row i reads mask row i: rows past the mask's
            if (s1 < 0) break;
            {
                const int64_t n = many();
                resize(s0, 1, n); resize(t, 1, n);
                snprintf(what, len, "hostile SOFT_MAX %lld rows, mask of %lld", (long long) n, (long long) wire[s1].ne[1]);
            }
            return;
        case GGML_OP_FLASH_ATTN_EXT:   // each query reads n_kv mask values: more keys than the mask's rows hold
            if (s3 < 0) break;
            {
                const int64_t n = many();
                resize(s1, 1, n); resize(s2, 1, n);
                snprintf(what, len, "hostile FLASH_ATTN_EXT n_kv=%lld, mask rows of %lld", (long long) n, (long long) wire[s3].ne[0]);
            }
            return;
        case GGML_OP_GET_ROWS:   // indices [n, slices, batch]: slice i11 of src0 for each
            if (chance(25)) { retype(s1); snprintf(what, len, "hostile GET_ROWS indices %s", ggml_type_name((enum ggml_type) wire[s1].type)); return; }
            {
                const int k = rint_in(1, 2);   // indices' dimension 1 or 2, the result's 2 or 3
                const int64_t n = rint_in(2, 32);
                resize(s1, k, n); resize(t, k + 1, n);
                snprintf(what, len, "hostile GET_ROWS indices ne[%d]=%lld over %lld", k, (long long) n, (long long) wire[s0].ne[k + 1]);
            }
            return;
        case GGML_OP_SET_ROWS: {   // source rows written into destination rows: longer ones
            if (chance(25)) { retype(s1); snprintf(what, len, "hostile SET_ROWS indices %s", ggml_type_name((enum ggml_type) wire[s1].type)); return; }
            const int64_t n = 64 * rint_in(2, 4);
            resize(s0, 0, n);
            snprintf(what, len, "hostile SET_ROWS rows of %lld into %lld", (long long) n, (long long) w->ne[0]);
            return;
        }
        case GGML_OP_CONCAT: {   // a dimension that does not exist, shapes that agree on the four that do
            const int32_t bad[] = { 4, 5, 7, 64, -1, INT32_MIN, INT32_MAX };
            p[0] = bad[rnd() % 7];
            resize(s1, 1, wire[s0].ne[1]); resize(t, 1, wire[s0].ne[1]);
            snprintf(what, len, "hostile CONCAT dim=%d", p[0]);
            return;
        }
        case GGML_OP_PAD: {   // amounts: negative ones, or a destination they do not account for
            const int d = rint_in(0, 3), k = rint_in(1, 8);
            if (chance(50)) { p[2 * d] -= k; p[2 * d + 1] += k; }   // same extent, shifted source
            else { p[2 * d] = -k; resize(t, d, w->ne[d] + many()); }
            snprintf(what, len, "hostile PAD dim %d: %d + %d around %lld to %lld", d, p[2 * d], p[2 * d + 1],
                     (long long) wire[s0].ne[d], (long long) w->ne[d]);
            return;
        }
        case GGML_OP_ADD_ID: {   // ids [rows, tokens]: more rows or tokens than it has
            if (chance(25)) { retype(s2); snprintf(what, len, "hostile ADD_ID ids %s", ggml_type_name((enum ggml_type) wire[s2].type)); return; }
            const int k = rint_in(1, 2);
            const int64_t n = many();
            resize(s0, k, n); resize(t, k, n);
            snprintf(what, len, "hostile ADD_ID ne[%d]=%lld, ids [%lld, %lld]", k, (long long) n, (long long) wire[s2].ne[0], (long long) wire[s2].ne[1]);
            return;
        }
        default: break;
    }
    mutate(what, len);
}

static void fill(struct gbuf * g, const struct tb_wire_tensor * w, int index_mode) {
    if (w->type == GGML_TYPE_I32 || w->type == GGML_TYPE_I64) {
        const size_t es = w->type == GGML_TYPE_I32 ? 4 : 8;
        for (size_t off = 0; off + es <= g->size; off += es) {
            int64_t v = index_mode == 2 ? wild() : index_mode == 1 ? rint_in(0, 2) : 0;
            if (es == 4) { int32_t x = (int32_t) v; memcpy(g->data + off, &x, 4); } else memcpy(g->data + off, &v, 8);
        }
    } else if (w->type == GGML_TYPE_F32) {
        for (size_t off = 0; off + 4 <= g->size; off += 4) { float x = (float) (rnd() % 200) / 100.0f - 1.0f; memcpy(g->data + off, &x, 4); }
    } else {
        for (size_t off = 0; off < g->size; off++) g->data[off] = (uint8_t) (rnd() % 64);   // small finite halves/blocks
    }
}

static int run_case(enum ggml_op op, int case_no, int n_mutations, struct outcome * out, char * err, size_t err_len) {
    struct ggml_init_params ip = { .mem_size = 64 * ggml_tensor_overhead() + ggml_graph_overhead(), .mem_buffer = NULL, .no_alloc = true };
    struct ggml_context * mk = ggml_init(ip);
    n_wire = 0;
    collect(make_op(mk, op));
    to_wire();
    int len = snprintf(current_case, sizeof current_case, "#%d %s seed-state %llu:", case_no, ggml_op_name(op), (unsigned long long) rng);
    for (int m = 0; m < n_mutations; m++) {
        char what[96];
        if (m == 0 && chance(30)) hostile(what, sizeof what);   // a third of mutated cases aim at the op's contract
        else mutate(what, sizeof what);
        if (len > 0 && (size_t) len < sizeof current_case) len += snprintf(current_case + len, sizeof current_case - (size_t) len, " %s", what);
    }
    const int index_mode = n_mutations == 0 ? 0 : chance(30) ? 2 : 1;   // 0: all 0 (valid), 1: small, 2: wild
    // Buffers: one per tensor that is no view, sized to what its views need too.
    struct bufs bs = { .n = 0 };
    int owner[MAXT];
    uint64_t need[MAXT] = { 0 };
    for (int i = 0; i < n_wire; i++) {
        int r = i;
        uint64_t off = 0;
        while (r >= 0 && r < n_wire && wire[r].view_src >= 0 && wire[r].view_src < r) { off += wire[r].view_offs; r = wire[r].view_src; }
        owner[i] = r;
        wire[i].offset = off;
        uint64_t nb = 0;
        char e2[256];
        if (tb_wire_nbytes(&wire[i], &nb, e2, sizeof e2) != 0) nb = 0;
        if (nb < (1u << 24) && off < (1u << 24) && off + nb > need[r]) need[r] = off + nb;
    }
    for (int i = 0; i < n_wire; i++) {
        if (owner[i] != i) continue;
        gbuf_alloc(&bs.b[bs.n], (size_t) need[i], (uint64_t) (i + 1));
        fill(&bs.b[bs.n], &wire[i], index_mode);
        bs.n++;
    }
    for (int i = 0; i < n_wire; i++) wire[i].buffer = (uint64_t) (owner[i] + 1);

    struct ggml_context * ctx = ggml_init((struct ggml_init_params) { .mem_size = MAXT * ggml_tensor_overhead() + ggml_graph_overhead() + 4096, .no_alloc = true });
    struct ggml_tensor * t[MAXT];
    alarm(CASE_SECONDS);   // each case takes milliseconds; a graph that never ends is a node that never answers
    int rc = tb_decode_tensors(ctx, wire, (uint32_t) n_wire, lookup, &bs, true, t, err, err_len);
    if (rc != 0) {
        out->refused_decode++;
    } else {
        struct ggml_tensor * node = t[n_wire - 1];
        if (tb_op_check(node, (uint32_t) (n_wire - 1), err, err_len) != 0 || !ggml_backend_dev_supports_op(cpu_dev, node)) {
            out->refused_rules++;
            rc = -1;
        } else {
            struct ggml_cgraph * g = ggml_new_graph(ctx);
            ggml_graph_add_node(g, node);
            if (tb_graph_compute_checked(cpu, g, err, err_len) != 0) { out->refused_run++; rc = -1; }
            else out->ran++;
        }
    }
    alarm(0);
    for (int i = 0; i < bs.n; i++) {
        if (!gbuf_canary_ok(&bs.b[i])) {
            fprintf(stderr, "\nCANARY overwritten before buffer %d in case %s\n", i, current_case);
            exit(4);
        }
        gbuf_free(&bs.b[i]);
    }
    ggml_free(ctx);
    ggml_free(mk);
    return rc;
}

static void setup(void) {
    signal(SIGSEGV, on_fault);
    signal(SIGBUS, on_fault);
    signal(SIGABRT, on_fault);
    signal(SIGFPE, on_fault);
    signal(SIGILL, on_fault);
    signal(SIGALRM, on_fault);   // a case still running after CASE_SECONDS: a hang (ROPE with n_dims 0 loops forever)
    cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    CHECK(cpu_dev, "no CPU device");
    cpu = ggml_backend_dev_init(cpu_dev, NULL);
    ggml_backend_set_n_threads_t set_threads =
        (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu_dev), "ggml_backend_set_n_threads");
    if (set_threads) set_threads(cpu, 1);
}

static int property(uint64_t seed, int n, unsigned disabled) {
    tb_op_rules_disabled = disabled;
    rng = seed * 0x9E3779B97F4A7C15ull + 1;
    struct outcome per_op[N_OPS];
    memset(per_op, 0, sizeof per_op);
    char err[512];
    for (int i = 0; i < n; i++) {
        const int k = i % N_OPS;
        // a third unmutated (the rules must let llama's uses through), the rest with 1-3 mutations
        const int mutations = (i / N_OPS) % 3 == 0 ? 0 : rint_in(1, 3);
        const int rc = run_case(OPS[k], i, mutations, &per_op[k], err, sizeof err);
        if (rc == 0 && mutations == 0) continue;
        if (rc != 0 && mutations == 0 && disabled == 0) {
            fprintf(stderr, "FAIL: a valid %s was refused: %s (case %s)\n", ggml_op_name(OPS[k]), err, current_case);
            return 1;
        }
    }
    int bad = 0;
    for (int k = 0; k < N_OPS; k++) {
        const struct outcome * o = &per_op[k];
        printf("%-16s ran %4d  refused: decode %4d rules %4d run %4d\n", ggml_op_name(OPS[k]), o->ran, o->refused_decode, o->refused_rules, o->refused_run);
        if (o->ran == 0) bad = 1;
        const bool view_like = OPS[k] == GGML_OP_VIEW || OPS[k] == GGML_OP_RESHAPE || OPS[k] == GGML_OP_PERMUTE || OPS[k] == GGML_OP_TRANSPOSE;
        if (!view_like && o->refused_rules + o->refused_run + o->refused_decode == 0) bad = 1;
    }
    if (bad && disabled == 0) { fprintf(stderr, "FAIL: some op never ran or was never refused\n"); return 1; }
    printf("PASS property\n");
    return 0;
}

// ---- the reported attacks -----------------------------------------------------------

// Run a single-op graph from wire tensors; expect a refusal whose message contains `want`.
static void expect_refused(const char * name, const char * want) {
    struct bufs bs = { .n = 0 };
    int owner[MAXT];
    for (int i = 0; i < n_wire; i++) {
        int r = i;
        while (wire[r].view_src >= 0) r = wire[r].view_src;
        owner[i] = r;
    }
    for (int i = 0; i < n_wire; i++) {
        if (owner[i] != i) continue;
        uint64_t nb = 0;
        char e2[256];
        CHECK(tb_wire_nbytes(&wire[i], &nb, e2, sizeof e2) == 0, "%s: %s", name, e2);
        gbuf_alloc(&bs.b[bs.n], (size_t) nb + 4096, (uint64_t) (i + 1));
        memset(bs.b[bs.n].data, 0, bs.b[bs.n].size);
        bs.n++;
    }
    for (int i = 0; i < n_wire; i++) wire[i].buffer = (uint64_t) (owner[i] + 1);
    snprintf(current_case, sizeof current_case, "attack %s", name);
    struct ggml_context * ctx = ggml_init((struct ggml_init_params) { .mem_size = MAXT * ggml_tensor_overhead() + ggml_graph_overhead() + 4096, .no_alloc = true });
    struct ggml_tensor * t[MAXT];
    char err[512] = "";
    int rc = tb_decode_tensors(ctx, wire, (uint32_t) n_wire, lookup, &bs, true, t, err, sizeof err);
    if (rc == 0) rc = tb_op_check(t[n_wire - 1], (uint32_t) (n_wire - 1), err, sizeof err);
    if (rc == 0) {
        struct ggml_cgraph * g = ggml_new_graph(ctx);
        ggml_graph_add_node(g, t[n_wire - 1]);
        rc = tb_graph_compute_checked(cpu, g, err, sizeof err);
    }
    CHECK(rc != 0, "%s was not refused", name);
    CHECK(strstr(err, want), "%s: refused, but with \"%s\" (wanted \"%s\")", name, err, want);
    printf("refused %-22s %s\n", name, err);
    for (int i = 0; i < bs.n; i++) { CHECK(gbuf_canary_ok(&bs.b[i]), "canary"); gbuf_free(&bs.b[i]); }
    ggml_free(ctx);
}

static struct ggml_context * fresh(void) {
    struct ggml_init_params ip = { .mem_size = 64 * ggml_tensor_overhead() + ggml_graph_overhead(), .mem_buffer = NULL, .no_alloc = true };
    return ggml_init(ip);
}

static void from(struct ggml_tensor * out) { n_wire = 0; collect(out); to_wire(); }

static int attacks(void) {
    const int32_t D = 1 << 20;
    struct ggml_context * c = fresh();
    // SET: {nb1 = -D, nb2, nb3, offset = D, inplace}: ggml's own check passes by wrap-around
    struct ggml_tensor * dst = ggml_new_tensor_1d(c, GGML_TYPE_F32, 512);
    from(ggml_set_1d(c, dst, ggml_new_tensor_2d(c, GGML_TYPE_F32, 4, 2), 0));
    wire[n_wire - 1].op_params[0] = -D; wire[n_wire - 1].op_params[3] = D; wire[n_wire - 1].op_params[4] = 1;
    expect_refused("SET wrap-around", "(SET");
    from(ggml_set_1d(c, dst, ggml_new_tensor_1d(c, GGML_TYPE_F32, 4), 0));
    wire[n_wire - 1].op_params[3] = 4096;
    expect_refused("SET past the end", "exceeds destination 2048 bytes");
    // SET of 8,590,196,741 rows of one float, nb1 = 2,147,418,113 bytes apart: (rows - 1) * nb1 is
    // 2^64 + 4, so the view's far end computed in 64 bits wrapped to 8 bytes. Source 1 repeats one
    // float (nb[1] = 0: 4 bytes on the wire) and its 2^33 elements cost less than the floor.
    {
        struct ggml_tensor * one = ggml_new_tensor_1d(c, GGML_TYPE_F32, 1);
        from(ggml_set_1d(c, dst, one, 0));
        const int i = wire_index(one);
        wire[i].ne[1] = 8590196741; wire[i].nb[1] = wire[i].nb[2] = wire[i].nb[3] = 0;
        wire[n_wire - 1].op_params[0] = 2147418113;
        expect_refused("SET rows wrapping 64 bits", "wraps 64 bits");
    }
    from(ggml_acc(c, dst, ggml_new_tensor_2d(c, GGML_TYPE_F32, 4, 2), 64, 64, 64, 0));
    wire[n_wire - 1].op_params[0] = INT32_MIN; wire[n_wire - 1].op_params[3] = INT32_MAX;
    expect_refused("ACC +-2 GiB", "(ACC");
    // PAD whose destination rows overlap
    from(ggml_pad(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 4, 4), 2, 2, 0, 0));
    wire[n_wire - 1].nb[1] = 4;
    expect_refused("PAD overlapping rows", "overlap");
    // ROLL beyond its source
    from(ggml_roll(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), 1, 1, 0, 0));
    wire[n_wire - 1].op_params[1] = -1000;
    expect_refused("ROLL out of range", "(ROLL");
    // GET_ROWS with an index past the rows
    from(ggml_get_rows(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), ggml_new_tensor_1d(c, GGML_TYPE_I32, 1)));
    {
        // the index is data: set it in the buffer the run will use (expect_refused zeroes buffers, so patch after)
    }
    // NULL source
    from(ggml_mul_mat(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 2)));
    wire[n_wire - 1].src[1] = -1;
    expect_refused("NULL source", "source 1 is missing");
    // nb[1] = 0 on an output: one row written over and over
    from(ggml_add(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 1000), ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 1000)));
    wire[n_wire - 1].nb[1] = 0;
    expect_refused("nb[1] = 0 output", "overlap");
    // Attention sinks (one F32 per head) with nb[0] = 0: 4 bytes on the wire, at
    // the end of the buffer; the kernels read sinks[head] for every head as
    // packed floats, past the end (the guard page)
    {
        const int64_t heads = 64;
        struct ggml_tensor * sinks = ggml_new_tensor_1d(c, GGML_TYPE_F32, heads);
        struct ggml_tensor * sm = ggml_soft_max_ext(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 4, 2, heads), NULL, 1.0f, 0.0f);
        ggml_soft_max_add_sinks(sm, sinks);
        from(sm);
        const int s = wire_index(sinks);
        wire[s].nb[0] = 0;
        wire[s].offset = (4 + 4096 + 63) / 64 * 64 - 4;   // the buffer expect_refused makes for it: its last 4 bytes
        expect_refused("SOFT_MAX sinks nb[0] = 0", "sinks must be");
        struct ggml_tensor * fa = ggml_flash_attn_ext(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 1, heads),
                                                      ggml_new_tensor_3d(c, GGML_TYPE_F16, 8, 4, 1),
                                                      ggml_new_tensor_3d(c, GGML_TYPE_F16, 8, 4, 1), NULL, 1.0f, 0.0f, 0.0f);
        ggml_flash_attn_ext_add_sinks(fa, sinks);
        from(fa);
        const int f = wire_index(sinks);
        wire[f].nb[0] = 0;
        wire[f].offset = (4 + 4096 + 63) / 64 * 64 - 4;
        expect_refused("FLASH_ATTN sinks nb[0] = 0", "sinks must be");
    }
    // Rules the random graphs rarely break, each a read (and for ROPE a write) past
    // what a row or a tensor holds. expect_refused gives every buffer 4096 bytes
    // of slack, so without the rule the op runs quietly and is "not refused".
    // ROPE rotates pairs up to n_dims in each row: past a row of 8 with n_dims 64
    from(ggml_rope(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 2, 3), ggml_new_tensor_1d(c, GGML_TYPE_I32, 3), 8, GGML_ROPE_TYPE_NEOX));
    wire[n_wire - 1].op_params[1] = 64;
    expect_refused("ROPE n_dims past the row", "n_dims 64 must be even, positive and at most ne[0] = 8");
    // ROPE reads one position per ne[2]: 3 rows of heads, 1 position
    {
        struct ggml_tensor * pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, 3);
        from(ggml_rope(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 2, 3), pos, 8, GGML_ROPE_TYPE_NEOX));
        wire[wire_index(pos)].ne[0] = 1;
        expect_refused("ROPE too few positions", "positions must be I32 with at least ne[2] = 3");
    }
    // SOFT_MAX reads mask row i for row i of its source: 4 rows, a mask of 1
    {
        struct ggml_tensor * mask = ggml_new_tensor_2d(c, GGML_TYPE_F16, 8, 4);
        from(ggml_soft_max_ext(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 4, 2), mask, 1.0f, 0.0f));
        wire[wire_index(mask)].ne[1] = 1;
        expect_refused("SOFT_MAX mask too few rows", "mask must be F16/F32, ne[0] = 8, at least 4 rows");
    }
    // FLASH_ATTN_EXT reads n_kv mask values per query: rows of 2 for 4 keys
    {
        struct ggml_tensor * mask = ggml_new_tensor_2d(c, GGML_TYPE_F16, 4, 64);
        from(ggml_flash_attn_ext(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 1, 2), ggml_new_tensor_3d(c, GGML_TYPE_F16, 8, 4, 1),
                                 ggml_new_tensor_3d(c, GGML_TYPE_F16, 8, 4, 1), mask, 1.0f, 0.0f, 0.0f));
        wire[wire_index(mask)].ne[0] = 2;
        wire[wire_index(mask)].nb[1] = 4;
        wire[wire_index(mask)].nb[2] = wire[wire_index(mask)].nb[3] = 4 * 64;
        expect_refused("FLASH_ATTN mask short of n_kv", "mask must be F16 [n_kv, >= n_q, broadcastable]");
    }
    // GET_ROWS takes row r of a's slice i11 for index [i10, i11]: 3 index rows, 1 slice
    {
        struct ggml_tensor * ix = ggml_new_tensor_2d(c, GGML_TYPE_I32, 2, 1);
        from(ggml_get_rows(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 4, 1), ix));
        const int i = wire_index(ix);
        wire[i].ne[1] = 3; wire[i].nb[2] = wire[i].nb[3] = 24;
        wire[n_wire - 1].ne[2] = 3; wire[n_wire - 1].nb[3] = 3 * wire[n_wire - 1].nb[2];
        expect_refused("GET_ROWS past the slices", "rows [8, 4, 1, 1] and I32 indices [2, 3, 1, 1] do not match");
    }
    // SET_ROWS writes source rows of 8 into destination rows of 4
    from(ggml_set_rows(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 2),
                       ggml_new_tensor_1d(c, GGML_TYPE_I64, 2)));
    wire[n_wire - 1].ne[0] = 4; wire[n_wire - 1].nb[1] = 16; wire[n_wire - 1].nb[2] = wire[n_wire - 1].nb[3] = 64;
    expect_refused("SET_ROWS rows too short", "destination [4, *, 1, 1] does not match source [8, *, 1, 1]");
    // CONCAT along dimension 7 of 4 (the kernel indexes its ne[4] arrays with it); equal shapes pass the shape rule
    from(ggml_concat(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 4, 2), ggml_new_tensor_2d(c, GGML_TYPE_F32, 4, 2), 1));
    wire[n_wire - 1].op_params[0] = 7; wire[n_wire - 1].ne[1] = 2; wire[n_wire - 1].nb[2] = wire[n_wire - 1].nb[3] = 32;
    expect_refused("CONCAT dimension 7", "dimension 7 does not exist");
    // PAD -2 on the left, +2 on the right: the same extent. ggml's kernel reads src[i - lp] only for
    // lp <= i < ne - rp, so this stays in bounds (a shifted output); the rule refuses padding that is
    // not what llama.cpp builds, a sanity check, not the bound (the extent check is that)
    from(ggml_pad(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), 0, 0, 0, 0));
    wire[n_wire - 1].op_params[0] = -2; wire[n_wire - 1].op_params[1] = 2;
    expect_refused("PAD negative padding", "padding -2 + 2 around 8 does not give ne[0] = 8");
    // ADD_ID reads ids[row, token] for each of a's rows: 4 rows, ids for 1
    {
        struct ggml_tensor * ids = ggml_new_tensor_2d(c, GGML_TYPE_I32, 4, 2);
        from(ggml_add_id(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 4, 2), ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 3), ids));
        const int i = wire_index(ids);
        wire[i].ne[0] = 1; wire[i].nb[1] = 4; wire[i].nb[2] = wire[i].nb[3] = 8;
        expect_refused("ADD_ID too few ids", "sources do not match the kernel's");
    }
    // an op that is not on the list
    from(ggml_ssm_conv(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 4, 1), ggml_new_tensor_2d(c, GGML_TYPE_F32, 4, 4)));
    expect_refused("op off the list", "SSM_CONV is not allowed");
    ggml_free(c);
    printf("PASS attacks\n");
    return 0;
}

// GET_ROWS / SET_ROWS / MUL_MAT_ID with a bad index in the data: refused at run time, by name.
static int bad_indices(void) {
    struct ggml_context * c = fresh();
    struct { const char * name; struct ggml_tensor * op; int ix; int64_t value; } cases[3];
    cases[0].name = "GET_ROWS index 4 of 4 rows";
    cases[0].op = ggml_get_rows(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), ggml_new_tensor_1d(c, GGML_TYPE_I32, 2));
    cases[0].value = 4;
    cases[1].name = "SET_ROWS index -1";
    cases[1].op = ggml_set_rows(c, ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 4), ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 2),
                                ggml_new_tensor_1d(c, GGML_TYPE_I64, 2));
    cases[1].value = -1;
    cases[2].name = "MUL_MAT_ID expert 9 of 3";
    cases[2].op = ggml_mul_mat_id(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 4, 3), ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 1, 2),
                                  ggml_new_tensor_2d(c, GGML_TYPE_I32, 2, 2));
    cases[2].value = 9;
    for (int k = 0; k < 3; k++) {
        from(cases[k].op);
        struct bufs bs = { .n = 0 };
        int ix = -1;
        for (int i = 0; i < n_wire; i++) {
            uint64_t nb = 0;
            char e2[256];
            if (wire[i].view_src >= 0) { wire[i].buffer = wire[wire[i].view_src].buffer; continue; }
            CHECK(tb_wire_nbytes(&wire[i], &nb, e2, sizeof e2) == 0, "%s", e2);
            gbuf_alloc(&bs.b[bs.n], (size_t) nb, (uint64_t) (i + 1));
            memset(bs.b[bs.n].data, 0, bs.b[bs.n].size);
            if (wire[i].type == GGML_TYPE_I32 || wire[i].type == GGML_TYPE_I64) ix = bs.n;
            wire[i].buffer = (uint64_t) (i + 1);
            bs.n++;
        }
        CHECK(ix >= 0, "no index tensor");
        if (k == 1) { int64_t v = cases[k].value; memcpy(bs.b[ix].data + 8, &v, 8); }
        else { int32_t v = (int32_t) cases[k].value; memcpy(bs.b[ix].data + 4, &v, 4); }
        snprintf(current_case, sizeof current_case, "index %s", cases[k].name);
        struct ggml_context * ctx = ggml_init((struct ggml_init_params) { .mem_size = MAXT * ggml_tensor_overhead() + ggml_graph_overhead() + 4096, .no_alloc = true });
        struct ggml_tensor * t[MAXT];
        char err[512] = "";
        CHECK(tb_decode_tensors(ctx, wire, (uint32_t) n_wire, lookup, &bs, true, t, err, sizeof err) == 0, "%s: %s", cases[k].name, err);
        CHECK(tb_op_check(t[n_wire - 1], (uint32_t) (n_wire - 1), err, sizeof err) == 0, "%s: %s", cases[k].name, err);
        struct ggml_cgraph * g = ggml_new_graph(ctx);
        ggml_graph_add_node(g, t[n_wire - 1]);
        CHECK(tb_graph_compute_checked(cpu, g, err, sizeof err) != 0, "%s ran", cases[k].name);
        CHECK(strstr(err, "outside [0, ") && strstr(err, ggml_op_name(t[n_wire - 1]->op)), "%s: %s", cases[k].name, err);
        printf("refused %-28s %s\n", cases[k].name, err);
        for (int i = 0; i < bs.n; i++) gbuf_free(&bs.b[i]);
        ggml_free(ctx);
    }
    ggml_free(c);
    printf("PASS bad_indices\n");
    return 0;
}

// MoE expert ids are computed in the graph (TOP_K of the router's logits):
// the check must run between that node and MUL_MAT_ID, on the values the
// graph made. Router logits over 8 "experts", but only 3 expert matrices.
static int produced_indices(void) {
    struct ggml_context * c = fresh();
    struct ggml_tensor * logits = ggml_new_tensor_2d(c, GGML_TYPE_F32, 8, 2);
    struct ggml_tensor * top = ggml_top_k(c, logits, 2);
    struct ggml_tensor * out = ggml_mul_mat_id(c, ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 4, 3),
                                               ggml_new_tensor_3d(c, GGML_TYPE_F32, 8, 1, 2), top);
    n_wire = 0;
    collect(out);
    to_wire();
    struct bufs bs = { .n = 0 };
    int i_logits = wire_index(logits), i_top = wire_index(top);
    for (int i = 0; i < n_wire; i++) {
        uint64_t nb = 0;
        char e2[256];
        CHECK(tb_wire_nbytes(&wire[i], &nb, e2, sizeof e2) == 0, "%s", e2);
        gbuf_alloc(&bs.b[bs.n], (size_t) nb, (uint64_t) (i + 1));
        memset(bs.b[bs.n].data, 0, bs.b[bs.n].size);
        wire[i].buffer = (uint64_t) (i + 1);
        bs.n++;
    }
    wire[i_top].flags |= GGML_TENSOR_FLAG_COMPUTE;
    for (int pass = 0; pass < 2; pass++) {
        // pass 0: the largest logits are experts 0 and 2 (valid); pass 1: experts 7 and 6
        float * l = (float *) bs.b[i_logits].data;
        for (int r = 0; r < 2; r++) for (int e = 0; e < 8; e++) l[r * 8 + e] = pass == 0 ? (e == 0 || e == 2 ? 1.0f : 0.0f) : (float) e;
        snprintf(current_case, sizeof current_case, "produced indices, pass %d", pass);
        struct ggml_context * ctx = ggml_init((struct ggml_init_params) { .mem_size = MAXT * ggml_tensor_overhead() + ggml_graph_overhead() + 4096, .no_alloc = true });
        struct ggml_tensor * t[MAXT];
        char err[512] = "";
        CHECK(tb_decode_tensors(ctx, wire, (uint32_t) n_wire, lookup, &bs, true, t, err, sizeof err) == 0, "%s", err);
        struct ggml_cgraph * g = ggml_new_graph(ctx);
        ggml_graph_add_node(g, t[i_top]);
        ggml_graph_add_node(g, t[n_wire - 1]);
        for (int k = 0; k < ggml_graph_n_nodes(g); k++) CHECK(tb_op_check(ggml_graph_node(g, k), (uint32_t) k, err, sizeof err) == 0, "%s", err);
        const int rc = tb_graph_compute_checked(cpu, g, err, sizeof err);
        if (pass == 0) CHECK(rc == 0, "valid expert ids refused: %s", err);
        else {
            CHECK(rc != 0 && strstr(err, "MUL_MAT_ID") && strstr(err, "outside [0, 3)"), "bad expert ids: rc %d, %s", rc, err);
            printf("refused %s\n", err);
        }
        ggml_free(ctx);
    }
    for (int i = 0; i < bs.n; i++) gbuf_free(&bs.b[i]);
    ggml_free(c);
    printf("PASS produced_indices\n");
    return 0;
}

int main(int argc, char ** argv) {
    CHECK(argc >= 2, "usage: safety_tests property SEED N [DISABLED] | attacks | bad_indices");
    setup();
    if (strcmp(argv[1], "property") == 0) {
        CHECK(argc >= 4, "property SEED N [DISABLED]");
        return property(strtoull(argv[2], NULL, 10), atoi(argv[3]), argc > 4 ? (unsigned) strtoul(argv[4], NULL, 0) : 0);
    }
    if (strcmp(argv[1], "attacks") == 0) return attacks();
    if (argc > 2 && strcmp(argv[1], "property") != 0) tb_op_rules_disabled = (unsigned) strtoul(argv[2], NULL, 0);
    if (strcmp(argv[1], "bad_indices") == 0) return bad_indices();
    if (strcmp(argv[1], "produced_indices") == 0) return produced_indices();
    CHECK(0, "unknown case %s", argv[1]);
    return 1;
}
