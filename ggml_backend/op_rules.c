// op_rules.c - the ops a node runs for a client, and the rules that keep
// each one inside the client's buffers. See op_rules.h.
//
// The list is what llama.cpp's graphs (llama-cpp-python 0.3.36) send for the
// model families tested here: llama, deepseek2 (MoE + MLA), gemma3, with and
// without flash attention, split by layer or by tensor. Each rule states the
// contract the ggml CPU kernel relies on (ops.cpp, binary-ops.cpp,
// ggml-cpu.c) and that a hostile client could otherwise break:
//  - sources present where the op reads them;
//  - shapes as the kernel iterates them (a destination larger than a source
//    it indexes with the destination's coordinates reads past the source);
//  - types the kernel handles (others hit GGML_ABORT, or read 4 bytes per
//    2-byte element);
//  - contiguous rows where the kernel walks a row by pointer increments
//    (their `assert`s are compiled out in release builds);
//  - destinations whose strides do not overlap (nb[1] = 0 made one row be
//    written over and over: wrong and unboundedly costly);
//  - op_params that address memory (SET/ACC's view, PAD, ROLL, CONCAT's
//    dimension, ROPE's dimensions) checked without wrap-around.
#include "op_rules.h"
#include "ggml_abi.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#ifdef TB_OP_RULES_TESTING
unsigned tb_op_rules_disabled = 0;
#define RULE_ON(family) (!(tb_op_rules_disabled & (family)))
#else
#define RULE_ON(family) 1
#endif

static int fail(char * err, size_t err_len, const struct ggml_tensor * t, uint32_t index, const char * fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int fail(char * err, size_t err_len, const struct ggml_tensor * t, uint32_t index, const char * fmt, ...) {
    // ggml_op_name, not ggml_op_desc: the latter indexes a table by op_params[0] for UNARY/GLU
    const int n = t->name[0] ? snprintf(err, err_len, "tensor %u (%s '%.64s'): ", index, ggml_op_name(t->op), t->name)
                             : snprintf(err, err_len, "tensor %u (%s): ", index, ggml_op_name(t->op));
    if (n < 0 || (size_t) n >= err_len) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, err_len - (size_t) n, fmt, ap);
    va_end(ap);
    return -1;
}

#define FAIL(...) return fail(err, err_len, t, index, __VA_ARGS__)

bool tb_op_allowed(enum ggml_op op) {
    switch (op) {
        case GGML_OP_NONE: case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
        case GGML_OP_DUP: case GGML_OP_CPY: case GGML_OP_CONT:
        case GGML_OP_ADD: case GGML_OP_SUB: case GGML_OP_MUL: case GGML_OP_DIV: case GGML_OP_ADD1: case GGML_OP_ADD_ID:
        case GGML_OP_SQR: case GGML_OP_SQRT: case GGML_OP_LOG: case GGML_OP_SIN: case GGML_OP_COS:
        case GGML_OP_SCALE: case GGML_OP_CLAMP: case GGML_OP_LEAKY_RELU: case GGML_OP_UNARY: case GGML_OP_GLU:
        case GGML_OP_NORM: case GGML_OP_RMS_NORM: case GGML_OP_L2_NORM:
        case GGML_OP_SUM_ROWS: case GGML_OP_MEAN: case GGML_OP_ARGMAX: case GGML_OP_ARGSORT: case GGML_OP_TOP_K:
        case GGML_OP_MUL_MAT: case GGML_OP_MUL_MAT_ID:
        case GGML_OP_GET_ROWS: case GGML_OP_SET_ROWS:
        case GGML_OP_SET: case GGML_OP_ACC: case GGML_OP_CONCAT: case GGML_OP_REPEAT:
        case GGML_OP_PAD: case GGML_OP_ROLL: case GGML_OP_FILL:
        case GGML_OP_DIAG_MASK_INF: case GGML_OP_SOFT_MAX: case GGML_OP_ROPE: case GGML_OP_FLASH_ATTN_EXT:
            return true;
        default:
            return false;
    }
}

// ---- cost ---------------------------------------------------------------------------

static uint64_t sat_mul(uint64_t a, uint64_t b) {
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

static uint64_t elements(const struct ggml_tensor * t) {
    uint64_t n = 1;
    for (int d = 0; d < GGML_MAX_DIMS; d++) n = sat_mul(n, t->ne[d] > 0 ? (uint64_t) t->ne[d] : 0);
    return n;
}

uint64_t tb_op_cost(const struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1], * v = t->src[2];
    switch (t->op) {
        case GGML_OP_NONE: case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
            return 0;
        case GGML_OP_MUL_MAT: case GGML_OP_MUL_MAT_ID:   // every output element is a dot product over a row of src0
            return a ? sat_mul(elements(t), (uint64_t) (a->ne[0] > 0 ? a->ne[0] : 0)) : elements(t);
        case GGML_OP_FLASH_ATTN_EXT:                   // each query row against every key: K.q and then V
            if (!a || !b || !v) return elements(t);
            return sat_mul(sat_mul(sat_mul(sat_mul((uint64_t) a->ne[1], (uint64_t) a->ne[2]), (uint64_t) a->ne[3]),
                                   (uint64_t) b->ne[1]), sat_add((uint64_t) b->ne[0], (uint64_t) v->ne[0]));
        case GGML_OP_GET_ROWS:                         // reads only the rows it gathers
            return sat_add(elements(t), b ? elements(b) : 0);
        case GGML_OP_ARGSORT: case GGML_OP_TOP_K: {    // a sort of each row
            uint64_t log2 = 1;
            for (int64_t n = a ? a->ne[0] : 1; n > 1; n >>= 1) log2++;
            return sat_mul(a ? elements(a) : elements(t), log2);
        }
        default: {                                     // one pass over its largest operand
            uint64_t most = elements(t);
            for (int s = 0; s < GGML_MAX_SRC; s++) {
                if (t->src[s] && elements(t->src[s]) > most) most = elements(t->src[s]);
            }
            return most;
        }
    }
}

uint64_t tb_graph_cost_limit(uint64_t bytes_held) {
    const uint64_t limit = sat_mul(bytes_held, TB_COST_PER_BYTE);
    return limit > TB_COST_FLOOR ? limit : TB_COST_FLOOR;
}

// ---- layout helpers ---------------------------------------------------------------

static bool is_float(enum ggml_type t) { return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16; }

// The KV cache types llama.cpp offers (--cache-type-k/-v): the CPU converts to them and attends over them.
static bool kv_type(enum ggml_type t) {
    return is_float(t) || t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_0 ||
           t == GGML_TYPE_Q5_1 || t == GGML_TYPE_IQ4_NL;
}

// Element (or block) i of a row is at data + i*nb[0]: the kernels walk rows so.
static bool rows_contiguous(const struct ggml_tensor * t) {
    return t->nb[0] == ggml_type_size(t->type);
}

// Kernels that walk "row i" as data + i*nb[1] over all ne[1]*ne[2]*ne[3]
// rows need dimensions 2 and 3 packed right after dimension 1, whatever
// their extent (ggml_is_contiguous ignores strides of 1-element dimensions).
static bool rows_packed(const struct ggml_tensor * t) {
    return rows_contiguous(t) && t->nb[2] == t->nb[1] * (uint64_t) t->ne[1] && t->nb[3] == t->nb[2] * (uint64_t) t->ne[2];
}

// Every stride exactly ggml's default: the kernel may use any of them for anything.
static bool packed(const struct ggml_tensor * t) {
    return rows_packed(t) && t->nb[1] == ggml_row_size(t->type, t->ne[0]);
}

static bool shape_is(const struct ggml_tensor * t, int64_t n0, int64_t n1, int64_t n2, int64_t n3) {
    return t->ne[0] == n0 && t->ne[1] == n1 && t->ne[2] == n2 && t->ne[3] == n3;
}

static bool non_empty(const struct ggml_tensor * t) {
    return t->ne[0] > 0 && t->ne[1] > 0 && t->ne[2] > 0 && t->ne[3] > 0;
}

// No two elements of t share bytes: ordered by stride, every dimension of
// more than one element steps past everything the smaller ones span.
static bool non_overlapping(const struct ggml_tensor * t) {
    int order[GGML_MAX_DIMS] = { 0, 1, 2, 3 };
    for (int i = 1; i < GGML_MAX_DIMS; i++) {   // insertion sort by nb
        for (int j = i; j > 0 && t->nb[order[j]] < t->nb[order[j - 1]]; j--) {
            int x = order[j]; order[j] = order[j - 1]; order[j - 1] = x;
        }
    }
    uint64_t span = ggml_type_size(t->type);   // bytes covered by one element (block) and the dimensions so far
    for (int k = 0; k < GGML_MAX_DIMS; k++) {
        const int d = order[k];
        const int64_t count = d == 0 ? t->ne[0] / ggml_blck_size(t->type) : t->ne[d];
        if (count <= 1) continue;
        if ((uint64_t) t->nb[d] < span) return false;
        uint64_t step;
        if (__builtin_mul_overflow((uint64_t) t->nb[d], (uint64_t) (count - 1), &step) || __builtin_add_overflow(span, step, &span)) return false;
    }
    return true;
}

// ---- per-op rules -------------------------------------------------------------

static int n_sources(enum ggml_op op, const struct ggml_tensor * t) {
    switch (op) {
        case GGML_OP_NONE: return 0;
        case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE: return 1;
        case GGML_OP_ADD: case GGML_OP_SUB: case GGML_OP_MUL: case GGML_OP_DIV: case GGML_OP_ADD1:
        case GGML_OP_CPY: case GGML_OP_MUL_MAT: case GGML_OP_GET_ROWS: case GGML_OP_SET_ROWS:
        case GGML_OP_SET: case GGML_OP_ACC: case GGML_OP_CONCAT: return 2;
        case GGML_OP_ROPE: return 2;
        case GGML_OP_ADD_ID: case GGML_OP_MUL_MAT_ID: return 3;
        case GGML_OP_FLASH_ATTN_EXT: return 3;
        case GGML_OP_GLU: return 1;   // src[1] optional (split gate)
        default: (void) t; return 1;
    }
}

// SET and ACC write src1 into a view of dst given by op_params
// {nb1, nb2, nb3, offset, inplace} (int32, in bytes). The kernel widens them
// to size_t, so a negative one wraps around: each must be >= 0 and the
// farthest byte of the view must lie inside the destination.
static int check_set_acc(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    const int32_t * p = (const int32_t *) t->op_params;
    if (RULE_ON(TB_RULE_OP_PARAMS)) {
        for (int k = 0; k < 4; k++) {
            if (p[k] < 0) FAIL("op_params[%d] = %d is negative (strides and offset of the view it writes)", k, p[k]);
        }
        // op_params are int32, but source 1's extents go up to 2^48 (proto.c), so
        // (ne[k] - 1) * nb_k reaches 2^79: checked, or it wraps to a small far end
        // that passes while the kernel writes (or GGML_ASSERTs) far past it
        uint64_t far, term;
        bool wraps = __builtin_mul_overflow((uint64_t) b->ne[0], (uint64_t) ggml_type_size(b->type), &term) ||
                     __builtin_add_overflow((uint64_t) p[3], term, &far);
        for (int k = 1; k < 4 && !wraps; k++) {
            wraps = __builtin_mul_overflow((uint64_t) (b->ne[k] > 0 ? b->ne[k] - 1 : 0), (uint64_t) p[k - 1], &term) ||
                    __builtin_add_overflow(far, term, &far);
        }
        if (b->ne[0] > 0 && wraps)
            FAIL("the view it writes (op_params and source 1's shape) wraps 64 bits");
        if (b->ne[0] > 0 && far > ggml_nbytes(t))
            FAIL("offset + extent %llu exceeds destination %zu bytes", (unsigned long long) far, ggml_nbytes(t));
    }
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (!ggml_are_same_shape(a, t)) FAIL("destination and source 0 differ in shape");
        if (t->type != GGML_TYPE_F32 || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32)
            FAIL("only F32 is supported (got %s, %s, %s)", ggml_type_name(t->type), ggml_type_name(a->type), ggml_type_name(b->type));
    }
    if (RULE_ON(TB_RULE_LAYOUT) && (!ggml_is_contiguous(t) || !ggml_is_contiguous(a) || !rows_contiguous(b)))
        FAIL("destination and source 0 must be contiguous, source 1 must have contiguous rows");
    return 0;
}

static int check_rope(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * a = t->src[0], * pos = t->src[1], * freq = t->src[2];
    const int32_t n_dims = ((const int32_t *) t->op_params)[1];
    const int32_t mode = ((const int32_t *) t->op_params)[2];
    if (RULE_ON(TB_RULE_OP_PARAMS)) {
        if (n_dims <= 0 || n_dims > a->ne[0] || n_dims % 2 != 0)
            FAIL("n_dims %d must be even, positive and at most ne[0] = %lld", n_dims, (long long) a->ne[0]);
        if (mode != GGML_ROPE_TYPE_NORMAL && mode != GGML_ROPE_TYPE_NEOX) FAIL("rope mode %d is not supported", mode);
    }
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (!ggml_are_same_shape(a, t) || a->type != t->type || !(a->type == GGML_TYPE_F32 || a->type == GGML_TYPE_F16))
            FAIL("destination must be source 0's shape and type (F32 or F16)");
        if (pos->type != GGML_TYPE_I32 || pos->ne[0] < a->ne[2] || !rows_contiguous(pos))
            FAIL("positions must be I32 with at least ne[2] = %lld contiguous entries", (long long) a->ne[2]);
        if (freq && (freq->type != GGML_TYPE_F32 || freq->ne[0] < n_dims / 2 || !rows_contiguous(freq)))
            FAIL("frequency factors must be F32 with at least n_dims/2 entries");
    }
    if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t)))
        FAIL("source 0 and destination rows must be contiguous");
    return 0;
}

static int check_soft_max(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * a = t->src[0], * mask = t->src[1], * sinks = t->src[2];
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (!ggml_are_same_shape(a, t) || a->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32)
            FAIL("destination must be source 0's shape, both F32");
        if (mask) {
            if (!(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32) || mask->ne[0] != a->ne[0] ||
                mask->ne[1] < a->ne[1] || !non_empty(mask) || a->ne[2] % mask->ne[2] != 0 || a->ne[3] % mask->ne[3] != 0)
                FAIL("mask must be F16/F32, ne[0] = %lld, at least %lld rows, broadcastable over dimensions 2 and 3",
                     (long long) a->ne[0], (long long) a->ne[1]);
        }
        if (sinks && (sinks->type != GGML_TYPE_F32 || sinks->ne[0] < a->ne[2])) FAIL("sinks must be F32, one per head");
    }
    if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || (mask && !rows_contiguous(mask))))
        FAIL("source rows must be contiguous");
    // the kernel reads sinks[head] as packed floats, whatever nb[0] says
    if (RULE_ON(TB_RULE_LAYOUT) && sinks && !rows_contiguous(sinks)) FAIL("sinks must be packed floats (nb[0] = 4)");
    return 0;
}

static int check_flash_attn(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * q = t->src[0], * k = t->src[1], * v = t->src[2], * mask = t->src[3], * sinks = t->src[4];
    const int32_t prec = ((const int32_t *) t->op_params)[3];
    if (RULE_ON(TB_RULE_OP_PARAMS) && prec != GGML_PREC_DEFAULT && prec != GGML_PREC_F32) FAIL("precision %d does not exist", prec);
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (q->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32) FAIL("q and the result must be F32");
        if (k->ne[0] != q->ne[0] || v->ne[1] != k->ne[1] || v->ne[2] != k->ne[2] || v->ne[3] != k->ne[3] ||
            q->ne[2] % k->ne[2] != 0 || q->ne[3] % k->ne[3] != 0)
            FAIL("q, k and v shapes do not match");
        if (!shape_is(t, v->ne[0], q->ne[2], q->ne[1], q->ne[3])) FAIL("result must be [v ne0, heads, queries, batch]");
        if (mask) {
            if (mask->type != GGML_TYPE_F16 || mask->ne[0] != k->ne[1] || mask->ne[1] < q->ne[1] || !non_empty(mask) ||
                q->ne[2] % mask->ne[2] != 0 || q->ne[3] % mask->ne[3] != 0)
                FAIL("mask must be F16 [n_kv, >= n_q, broadcastable]");
        }
        if (sinks && (sinks->type != GGML_TYPE_F32 || sinks->ne[0] < q->ne[2])) FAIL("sinks must be F32, one per head");
        if (!kv_type(k->type) || !kv_type(v->type))
            FAIL("k/v types %s/%s are not supported", ggml_type_name(k->type), ggml_type_name(v->type));
    }
    if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(q) || !rows_contiguous(k) || !rows_contiguous(v) || !ggml_is_contiguous(t) ||
                                    !(t->nb[0] <= t->nb[1] && t->nb[1] <= t->nb[2] && t->nb[2] <= t->nb[3]) ||
                                    (mask && !rows_contiguous(mask))))
        FAIL("q, k, v and mask rows and the result must be contiguous");
    if (RULE_ON(TB_RULE_LAYOUT) && sinks && !rows_contiguous(sinks)) FAIL("sinks must be packed floats (nb[0] = 4)");
    return 0;
}

// What the matrix-product kernels assume: contiguous source rows, an F32
// result with contiguous rows and ascending strides.
static bool product_layout_ok(const struct ggml_tensor * a, const struct ggml_tensor * b, const struct ggml_tensor * t) {
    return rows_contiguous(a) && rows_contiguous(b) && t->nb[0] == sizeof(float) &&
           t->nb[0] <= t->nb[1] && t->nb[1] <= t->nb[2] && t->nb[2] <= t->nb[3];
}

static int check_mul_mat(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (a->ne[0] != b->ne[0] || b->ne[2] % a->ne[2] != 0 || b->ne[3] % a->ne[3] != 0)
            FAIL("sources do not match: [%lld, %lld, %lld, %lld] x [%lld, %lld, %lld, %lld]",
                 (long long) a->ne[0], (long long) a->ne[1], (long long) a->ne[2], (long long) a->ne[3],
                 (long long) b->ne[0], (long long) b->ne[1], (long long) b->ne[2], (long long) b->ne[3]);
        if (!shape_is(t, a->ne[1], b->ne[1], b->ne[2], b->ne[3])) FAIL("result shape does not follow from the sources");
        if (t->type != GGML_TYPE_F32) FAIL("result must be F32");
        if (!(is_float(b->type) || ggml_is_quantized(b->type))) FAIL("source 1 type %s is not supported", ggml_type_name(b->type));
        if (!(is_float(a->type) || ggml_is_quantized(a->type))) FAIL("source 0 type %s is not supported", ggml_type_name(a->type));
    }
    if (RULE_ON(TB_RULE_LAYOUT) && !product_layout_ok(a, b, t)) FAIL("source and result rows must be contiguous, result strides ascending");
    return 0;
}

static int check_mul_mat_id(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * as = t->src[0], * b = t->src[1], * ids = t->src[2];
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (ids->type != GGML_TYPE_I32 || ids->ne[2] != 1 || ids->ne[3] != 1) FAIL("ids must be 2-D I32");
        if (as->ne[3] != 1 || b->ne[3] != 1 || as->ne[0] != b->ne[0] || ids->ne[1] != b->ne[2] || ids->ne[0] % b->ne[1] != 0)
            FAIL("experts [%lld, %lld, %lld], input [%lld, %lld, %lld] and ids [%lld, %lld] do not match",
                 (long long) as->ne[0], (long long) as->ne[1], (long long) as->ne[2], (long long) b->ne[0],
                 (long long) b->ne[1], (long long) b->ne[2], (long long) ids->ne[0], (long long) ids->ne[1]);
        if (!shape_is(t, as->ne[1], ids->ne[0], b->ne[2], 1) || t->type != GGML_TYPE_F32) FAIL("result must be F32 [rows, ids, tokens]");
        if (b->type != GGML_TYPE_F32) FAIL("input must be F32");
        if (!(is_float(as->type) || ggml_is_quantized(as->type))) FAIL("expert type %s is not supported", ggml_type_name(as->type));
    }
    if (RULE_ON(TB_RULE_LAYOUT) && !product_layout_ok(as, b, t)) FAIL("source and result rows must be contiguous, result strides ascending");
    return 0;
}

static int check_binary(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (!ggml_are_same_shape(a, t) || !ggml_can_repeat(b, a))
            FAIL("destination must be source 0's shape and source 1 must broadcast to it");
        const bool types_ok = (a->type == t->type && is_float(a->type) && (b->type == a->type || b->type == GGML_TYPE_F32)) ||
                              ((a->type == GGML_TYPE_F16 || a->type == GGML_TYPE_BF16) && b->type == GGML_TYPE_F32 && t->type == GGML_TYPE_F32);
        if (!types_ok) FAIL("types %s %s -> %s are not supported", ggml_type_name(a->type), ggml_type_name(b->type), ggml_type_name(t->type));
    }
    if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t)))
        FAIL("source 0 and destination rows must be contiguous");
    return 0;
}

// Ops that map source 0 to a destination of the same shape, element by element or row by row.
static int check_same_shape(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len, bool f32_only) {
    const struct ggml_tensor * a = t->src[0];
    if (RULE_ON(TB_RULE_SHAPES)) {
        if (!ggml_are_same_shape(a, t)) FAIL("destination must be source 0's shape");
        if (a->type != t->type || !(f32_only ? a->type == GGML_TYPE_F32 : (a->type == GGML_TYPE_F32 || a->type == GGML_TYPE_F16)))
            FAIL("type %s -> %s is not supported", ggml_type_name(a->type), ggml_type_name(t->type));
    }
    if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t)))
        FAIL("source 0 and destination rows must be contiguous");
    return 0;
}

static int check_op(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    const struct ggml_tensor * a = t->src[0], * b = t->src[1];
    const int32_t * p = (const int32_t *) t->op_params;
    switch (t->op) {
        case GGML_OP_DUP: case GGML_OP_CONT: case GGML_OP_CPY: {
            if (RULE_ON(TB_RULE_SHAPES)) {
                if (ggml_nelements(a) != ggml_nelements(t)) FAIL("source has %lld elements, destination %lld",
                                                                 (long long) ggml_nelements(a), (long long) ggml_nelements(t));
                if (t->op == GGML_OP_CPY && !ggml_are_same_shape(b, t)) FAIL("destination must be source 1's shape");
                if (a->type != t->type) {   // what ggml's dup converts (others: GGML_ABORT "not implemented")
                    const bool ok = (is_float(a->type) && kv_type(t->type)) ||
                                    (ggml_is_quantized(a->type) && t->type == GGML_TYPE_F32);
                    if (!ok) FAIL("conversion %s -> %s is not supported", ggml_type_name(a->type), ggml_type_name(t->type));
                }
                if ((ggml_is_quantized(a->type) || ggml_is_quantized(t->type)) && a->type != t->type &&
                    (a->ne[0] != t->ne[0]))
                    FAIL("quantized copies must keep the row length");
            }
            if (RULE_ON(TB_RULE_LAYOUT) && ggml_is_quantized(t->type) && a->type != t->type && !ggml_is_contiguous(t))
                FAIL("quantizing copies need a contiguous destination");
            if (RULE_ON(TB_RULE_LAYOUT) && ggml_is_quantized(a->type) && a->type != t->type && (!rows_contiguous(t) || !rows_contiguous(a)))
                FAIL("dequantizing copies need contiguous rows");
            return 0;
        }
        case GGML_OP_ADD: case GGML_OP_SUB: case GGML_OP_MUL: case GGML_OP_DIV:
            return check_binary(t, index, err, err_len);
        case GGML_OP_ADD1:
            if (RULE_ON(TB_RULE_SHAPES) && (ggml_nelements(b) != 1 || b->type != GGML_TYPE_F32)) FAIL("source 1 must be one F32 value");
            return check_same_shape(t, index, err, err_len, true);
        case GGML_OP_ADD_ID: {
            const struct ggml_tensor * ids = t->src[2];
            if (RULE_ON(TB_RULE_SHAPES)) {
                if (!ggml_are_same_shape(a, t) || a->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32 ||
                    ids->type != GGML_TYPE_I32 || b->ne[0] != a->ne[0] || ids->ne[0] < a->ne[1] || ids->ne[1] < a->ne[2] || a->ne[3] != 1)
                    FAIL("sources do not match the kernel's [n, rows, tokens] + [n, experts] by I32 [rows, tokens]");
            }
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(b) || !rows_contiguous(t)))
                FAIL("rows must be contiguous");
            return 0;
        }
        case GGML_OP_SQR: case GGML_OP_SQRT: case GGML_OP_LOG: case GGML_OP_SIN: case GGML_OP_COS:
            return check_same_shape(t, index, err, err_len, false);
        case GGML_OP_LEAKY_RELU: case GGML_OP_CLAMP:   // row i at data + i*nb[1]: rows must be packed
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_packed(a) || !rows_packed(t)))
                FAIL("source 0 and destination rows must be packed (nb[2] = nb[1]*ne[1], nb[3] = nb[2]*ne[2])");
            return check_same_shape(t, index, err, err_len, false);
        case GGML_OP_SCALE: case GGML_OP_DIAG_MASK_INF:   // GGML_ASSERTs: both contiguous
            if (RULE_ON(TB_RULE_OP_PARAMS) && t->op == GGML_OP_DIAG_MASK_INF && p[0] < 0) FAIL("n_past %d is negative", p[0]);
            if (RULE_ON(TB_RULE_LAYOUT) && (!packed(a) || !packed(t)))   // SCALE reads source rows with the destination's nb[1]
                FAIL("source 0 and destination must be contiguous with default strides");
            return check_same_shape(t, index, err, err_len, true);
        case GGML_OP_NORM: case GGML_OP_RMS_NORM: case GGML_OP_L2_NORM: {
            float eps;
            memcpy(&eps, &p[0], sizeof eps);
            if (RULE_ON(TB_RULE_OP_PARAMS) && !(eps >= 0.0f)) FAIL("eps must be >= 0");
            return check_same_shape(t, index, err, err_len, true);
        }
        case GGML_OP_UNARY:
            if (RULE_ON(TB_RULE_OP_PARAMS) && (p[0] < 0 || p[0] >= GGML_UNARY_OP_COUNT)) FAIL("unary op %d does not exist", p[0]);
            if (RULE_ON(TB_RULE_LAYOUT) && (!ggml_is_contiguous_1(a) || !ggml_is_contiguous_1(t)))
                FAIL("source 0 and destination must be contiguous from dimension 1 on");
            return check_same_shape(t, index, err, err_len, false);
        case GGML_OP_GLU:
            if (RULE_ON(TB_RULE_OP_PARAMS) && (p[0] < 0 || p[0] >= GGML_GLU_OP_COUNT)) FAIL("glu op %d does not exist", p[0]);
            if (RULE_ON(TB_RULE_SHAPES)) {
                const int64_t n0 = b ? a->ne[0] : a->ne[0] / 2;
                if (!shape_is(t, n0, a->ne[1], a->ne[2], a->ne[3]) || (b && !ggml_are_same_shape(a, b)) ||
                    a->type != t->type || (b && b->type != a->type) || !(a->type == GGML_TYPE_F32 || a->type == GGML_TYPE_F16))
                    FAIL("shapes or types do not match a gated unit (%s)", b ? "split" : "fused");
            }
            if (RULE_ON(TB_RULE_LAYOUT) && (!ggml_is_contiguous_1(a) || (b && !ggml_is_contiguous_1(b)) || !ggml_is_contiguous_1(t)))
                FAIL("sources and destination must be contiguous from dimension 1 on");
            return 0;
        case GGML_OP_SUM_ROWS: case GGML_OP_MEAN:
            if (RULE_ON(TB_RULE_SHAPES) && (!shape_is(t, 1, a->ne[1], a->ne[2], a->ne[3]) || a->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32))
                FAIL("result must be F32 [1, %lld, %lld, %lld]", (long long) a->ne[1], (long long) a->ne[2], (long long) a->ne[3]);
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        case GGML_OP_ARGMAX:
            if (RULE_ON(TB_RULE_SHAPES) && (!shape_is(t, a->ne[1], 1, 1, 1) || a->ne[2] != 1 || a->ne[3] != 1 ||
                                            a->type != GGML_TYPE_F32 || t->type != GGML_TYPE_I32))
                FAIL("argmax takes a 2-D F32 matrix to one I32 per row");
            if (RULE_ON(TB_RULE_LAYOUT) && !rows_contiguous(a)) FAIL("source rows must be contiguous");
            return 0;
        case GGML_OP_ARGSORT: case GGML_OP_TOP_K:
            if (RULE_ON(TB_RULE_OP_PARAMS) && t->op == GGML_OP_ARGSORT && p[0] != GGML_SORT_ORDER_ASC && p[0] != GGML_SORT_ORDER_DESC)
                FAIL("sort order %d does not exist", p[0]);
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_packed(a) || !rows_packed(t)))   // row i at data + i*nb[1]
                FAIL("source 0 and destination rows must be packed (nb[2] = nb[1]*ne[1], nb[3] = nb[2]*ne[2])");
            if (RULE_ON(TB_RULE_SHAPES)) {
                const int64_t n0 = t->op == GGML_OP_ARGSORT ? a->ne[0] : t->ne[0];
                if (!shape_is(t, n0, a->ne[1], a->ne[2], a->ne[3]) || n0 > a->ne[0] || a->type != GGML_TYPE_F32 || t->type != GGML_TYPE_I32)
                    FAIL("result must be I32 with source 0's rows, at most %lld per row", (long long) a->ne[0]);
            }
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        case GGML_OP_MUL_MAT: return check_mul_mat(t, index, err, err_len);
        case GGML_OP_MUL_MAT_ID: return check_mul_mat_id(t, index, err, err_len);
        case GGML_OP_GET_ROWS:
            if (RULE_ON(TB_RULE_SHAPES)) {
                if (!(b->type == GGML_TYPE_I32) || b->ne[3] != 1 || a->ne[2] != b->ne[1] || a->ne[3] != b->ne[2])
                    FAIL("rows [%lld, %lld, %lld, %lld] and I32 indices [%lld, %lld, %lld, %lld] do not match",
                         (long long) a->ne[0], (long long) a->ne[1], (long long) a->ne[2], (long long) a->ne[3],
                         (long long) b->ne[0], (long long) b->ne[1], (long long) b->ne[2], (long long) b->ne[3]);
                if (!shape_is(t, a->ne[0], b->ne[0], b->ne[1], b->ne[2])) FAIL("result must be [row length, indices...]");
                const bool types_ok = t->type == GGML_TYPE_F32 ? (is_float(a->type) || ggml_is_quantized(a->type))
                                                               : (t->type == a->type && t->type == GGML_TYPE_I32);
                if (!types_ok) FAIL("%s rows into %s are not supported", ggml_type_name(a->type), ggml_type_name(t->type));
            }
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        case GGML_OP_SET_ROWS:
            if (RULE_ON(TB_RULE_SHAPES)) {
                if (!(b->type == GGML_TYPE_I32 || b->type == GGML_TYPE_I64) || b->ne[0] != a->ne[1] || b->ne[3] != 1 ||
                    a->ne[2] % b->ne[1] != 0 || a->ne[3] % b->ne[2] != 0)
                    FAIL("indices must be I32/I64 with one entry per source row, broadcastable");
                if (t->ne[0] != a->ne[0] || t->ne[2] != a->ne[2] || t->ne[3] != a->ne[3])
                    FAIL("destination [%lld, *, %lld, %lld] does not match source [%lld, *, %lld, %lld]",
                         (long long) t->ne[0], (long long) t->ne[2], (long long) t->ne[3],
                         (long long) a->ne[0], (long long) a->ne[2], (long long) a->ne[3]);
                if (!(a->type == GGML_TYPE_F32 || a->type == GGML_TYPE_F16) || !(is_float(t->type) || ggml_is_quantized(t->type)) ||
                    (a->type == GGML_TYPE_F16 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_F32 && !ggml_is_quantized(t->type)))
                    FAIL("%s rows into %s are not supported", ggml_type_name(a->type), ggml_type_name(t->type));
            }
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        case GGML_OP_SET: case GGML_OP_ACC:
            return check_set_acc(t, index, err, err_len);
        case GGML_OP_CONCAT: {
            const int32_t dim = p[0];
            if (RULE_ON(TB_RULE_OP_PARAMS) && (dim < 0 || dim >= GGML_MAX_DIMS)) FAIL("dimension %d does not exist", dim);
            if (RULE_ON(TB_RULE_SHAPES)) {
                for (int d = 0; d < GGML_MAX_DIMS; d++) {
                    const int64_t want = d == dim ? a->ne[d] + b->ne[d] : a->ne[d];
                    if (t->ne[d] != want || (d != dim && b->ne[d] != a->ne[d]))
                        FAIL("shapes do not concatenate along dimension %d", dim);
                }
                if (a->type != t->type || b->type != t->type || ggml_is_quantized(t->type)) FAIL("sources and result must share a plain type");
            }
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(b) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        }
        case GGML_OP_REPEAT:
            if (RULE_ON(TB_RULE_SHAPES) && (!ggml_can_repeat(a, t) || a->type != t->type || !(is_float(t->type) || t->type == GGML_TYPE_I32)))
                FAIL("source 0 does not repeat into the destination");
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        case GGML_OP_PAD: {
            if (RULE_ON(TB_RULE_OP_PARAMS)) {
                if (p[8] != 0) FAIL("circular padding is not supported");
                for (int d = 0; d < GGML_MAX_DIMS; d++) {
                    if (p[2 * d] < 0 || p[2 * d + 1] < 0 || t->ne[d] != a->ne[d] + (int64_t) p[2 * d] + (int64_t) p[2 * d + 1])
                        FAIL("padding %d + %d around %lld does not give ne[%d] = %lld", p[2 * d], p[2 * d + 1],
                             (long long) a->ne[d], d, (long long) t->ne[d]);
                }
            }
            if (RULE_ON(TB_RULE_SHAPES) && (a->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32)) FAIL("only F32 is supported");
            if (RULE_ON(TB_RULE_LAYOUT) && !ggml_is_contiguous(t)) FAIL("destination must be contiguous");
            return 0;
        }
        case GGML_OP_ROLL:
            if (RULE_ON(TB_RULE_OP_PARAMS)) {
                for (int d = 0; d < GGML_MAX_DIMS; d++) {
                    if ((int64_t) p[d] <= -a->ne[d] || (int64_t) p[d] >= a->ne[d])
                        FAIL("shift %d along dimension %d is not within (-%lld, %lld)", p[d], d, (long long) a->ne[d], (long long) a->ne[d]);
                }
            }
            if (RULE_ON(TB_RULE_SHAPES) && (!ggml_are_same_shape(a, t) || a->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32))
                FAIL("destination must be source 0's shape, both F32");
            if (RULE_ON(TB_RULE_LAYOUT) && (!rows_contiguous(a) || !rows_contiguous(t))) FAIL("rows must be contiguous");
            return 0;
        case GGML_OP_FILL:
            // the kernel picks its element type from source 0 and writes the destination with it
            if (RULE_ON(TB_RULE_SHAPES) && (a->type != t->type || (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16)))
                FAIL("source 0 and destination must both be F32 or both F16");
            if (RULE_ON(TB_RULE_LAYOUT) && !rows_contiguous(t)) FAIL("destination rows must be contiguous");
            return 0;
        case GGML_OP_SOFT_MAX: return check_soft_max(t, index, err, err_len);
        case GGML_OP_ROPE: return check_rope(t, index, err, err_len);
        case GGML_OP_FLASH_ATTN_EXT: return check_flash_attn(t, index, err, err_len);
        default:
            return 0;
    }
}

int tb_op_check(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len) {
    if (!tb_op_allowed(t->op)) {
        if ((unsigned) t->op < GGML_OP_COUNT) FAIL("op %s is not allowed on a node", ggml_op_name(t->op));
        return snprintf(err, err_len, "tensor %u: op %u is not allowed on a node", index, (unsigned) t->op), -1;
    }
    const int need = n_sources(t->op, t);
    if (RULE_ON(TB_RULE_SOURCES)) {
        for (int s = 0; s < need; s++) {
            if (!t->src[s]) FAIL("source %d is missing", s);
        }
    }
    if (t->op == GGML_OP_NONE) return 0;
    if (t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE) {
        return 0;   // no computation; its bytes were checked against its buffer (and view source) by proto.c
    }
    if (ggml_is_empty(t)) return 0;   // ggml computes nothing for an empty result
    if (RULE_ON(TB_RULE_SOURCES)) {   // the kernels (and the rules below) divide by source extents 1-3 (broadcasting)
        for (int s = 0; s < GGML_MAX_SRC; s++) {   // an empty row (ne[0] = 0) is fine: a tensor split's 0-head slice
            if (t->src[s] && (t->src[s]->ne[1] < 1 || t->src[s]->ne[2] < 1 || t->src[s]->ne[3] < 1)) FAIL("source %d is empty", s);
        }
    }
    if (RULE_ON(TB_RULE_LAYOUT) && !non_overlapping(t))
        FAIL("destination strides [%zu, %zu, %zu, %zu] make elements overlap", t->nb[0], t->nb[1], t->nb[2], t->nb[3]);
    return check_op(t, index, err, err_len);
}

// ---- run-time index checks ------------------------------------------------------

// The tensor of node `t` that holds row indices, and how many rows they index.
static const struct ggml_tensor * index_source(const struct ggml_tensor * t, int64_t * limit) {
    switch (t->op) {
        case GGML_OP_GET_ROWS:   *limit = t->src[0]->ne[1]; return t->src[1];
        case GGML_OP_SET_ROWS:   *limit = t->ne[1];         return t->src[1];
        case GGML_OP_MUL_MAT_ID: *limit = t->src[0]->ne[2]; return t->src[2];
        case GGML_OP_ADD_ID:     *limit = t->src[1]->ne[1]; return t->src[2];
        default: return NULL;
    }
}

// The bytes a tensor's elements span: [lo, hi).
static void byte_hull(const struct ggml_tensor * t, uintptr_t * lo, uintptr_t * hi) {
    *lo = (uintptr_t) t->data;
    *hi = *lo + ggml_nbytes(t);
}

// Which elements of the index tensor the op reads: GET_ROWS all of them,
// SET_ROWS the first ne[1] of src0 per row, MUL_MAT_ID/ADD_ID ids' first
// columns. Checking every element of the tensor is a superset and simple.
static int check_indices(const struct ggml_tensor * t, uint32_t node, char * err, size_t err_len) {
    int64_t limit = 0;
    const struct ggml_tensor * ix = index_source(t, &limit);
    if (!ix || ggml_is_empty(t) || ggml_is_empty(ix)) return 0;
    if (!ggml_backend_buffer_is_host(ix->buffer)) return 0;   // device memory: the device's own kernels bound-check (see docs)
    const bool i64 = ix->type == GGML_TYPE_I64;
    for (int64_t i3 = 0; i3 < ix->ne[3]; i3++)
    for (int64_t i2 = 0; i2 < ix->ne[2]; i2++)
    for (int64_t i1 = 0; i1 < ix->ne[1]; i1++) {
        const char * row = (const char *) ix->data + i1 * ix->nb[1] + i2 * ix->nb[2] + i3 * ix->nb[3];
        for (int64_t i0 = 0; i0 < ix->ne[0]; i0++) {
            int64_t v;
            if (i64) memcpy(&v, row + i0 * ix->nb[0], sizeof v);
            else { int32_t w; memcpy(&w, row + i0 * ix->nb[0], sizeof w); v = w; }
            if (v < 0 || v >= limit) {
                snprintf(err, err_len, "node %u (%s '%.64s'): index %lld at [%lld, %lld, %lld, %lld] of '%s' is outside [0, %lld)",
                         node, ggml_op_name(t->op), t->name, (long long) v, (long long) i0, (long long) i1, (long long) i2,
                         (long long) i3, ix->name, (long long) limit);
                return -1;
            }
        }
    }
    return 0;
}

static int run_segment(ggml_backend_t backend, struct ggml_cgraph * g, int i0, int i1, char * err, size_t err_len) {
    if (i1 <= i0) return 0;
    struct ggml_cgraph view = *g;
    view.size = 0;
    view.n_nodes = i1 - i0;
    view.nodes = g->nodes + i0;
    view.n_leafs = 0;
    view.leafs = NULL;
    view.uid = 0;
    enum ggml_status st = ggml_backend_graph_compute(backend, i0 == 0 && i1 == g->n_nodes ? g : &view);
    if (st != GGML_STATUS_SUCCESS) {
        snprintf(err, err_len, "graph compute failed with status %d", (int) st);
        return -1;
    }
    return 0;
}

int tb_graph_compute_checked(ggml_backend_t backend, struct ggml_cgraph * g, char * err, size_t err_len) {
    const int n = g->n_nodes;
    int start = 0;
    for (int i = 0; i < n; i++) {
        struct ggml_tensor * t = g->nodes[i];
        int64_t limit;
        const struct ggml_tensor * ix = index_source(t, &limit);
        if (!ix || !RULE_ON(TB_RULE_INDICES)) continue;
        // Written by a node between the segment start and here? Then that
        // part must run before the indices can be read.
        uintptr_t lo, hi;
        byte_hull(ix, &lo, &hi);
        bool produced = false;
        for (int j = start; j < i && !produced; j++) {
            const struct ggml_tensor * w = g->nodes[j];
            if (w->buffer != ix->buffer || w->op == GGML_OP_NONE || w->op == GGML_OP_VIEW || w->op == GGML_OP_RESHAPE ||
                w->op == GGML_OP_PERMUTE || w->op == GGML_OP_TRANSPOSE) continue;
            uintptr_t wlo, whi;
            byte_hull(w, &wlo, &whi);
            produced = wlo < hi && lo < whi;
        }
        if (produced) {
            if (run_segment(backend, g, start, i, err, err_len) != 0) return -1;
            start = i;
        }
        if (check_indices(t, (uint32_t) i, err, err_len) != 0) return -1;
    }
    return run_segment(backend, g, start, n, err, err_len);
}
