// proto.c - framing, the ABI handshake data, and validated decoding of
// tensors on the node. See proto.h and docs/protocol.md.
#include "proto.h"
#include "ggml_abi.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

_Static_assert(sizeof(struct tb_header) == 24, "header is 24 bytes on the wire");
_Static_assert(sizeof(struct tb_wire_tensor) % 8 == 0, "wire tensor keeps 8-byte alignment");
_Static_assert(sizeof(struct tb_hello) % 8 == 0, "hello keeps 8-byte alignment");
_Static_assert(sizeof(struct tb_abi) == 40, "the ABI block has no padding (tb_abi_fill leaves none unset)");

#define EXACT(n)    TB_LEN_EXACT, (uint32_t) (n)
#define AT_LEAST(n) TB_LEN_AT_LEAST, (uint32_t) (n)
#define ANY         TB_LEN_ANY, 0
#define NONE        TB_LEN_EXACT, 0
static const struct tb_command commands[TB_CMD_COUNT_] = {
    //                          name                 posted request                               reply
    [TB_CMD_HELLO]           = { "HELLO",            false, EXACT(sizeof(struct tb_hello)),        EXACT(sizeof(struct tb_hello)) },
    [TB_CMD_AUTH]            = { "AUTH",             false, EXACT(sizeof(struct tb_auth_req)),     EXACT(sizeof(struct tb_auth_reply)) },
    [TB_CMD_GET_MEMORY]      = { "GET_MEMORY",       false, NONE,                                  EXACT(sizeof(struct tb_memory)) },
    [TB_CMD_ALLOC_BUFFER]    = { "ALLOC_BUFFER",     false, EXACT(sizeof(struct tb_alloc_req)),    EXACT(sizeof(struct tb_alloc_reply)) },
    [TB_CMD_FREE_BUFFER]     = { "FREE_BUFFER",      true,  EXACT(sizeof(struct tb_buffer_req)),   NONE },
    [TB_CMD_BUFFER_CLEAR]    = { "BUFFER_CLEAR",     true,  EXACT(sizeof(struct tb_memset_req)),   NONE },
    [TB_CMD_SET_TENSOR]      = { "SET_TENSOR",       true,  AT_LEAST(sizeof(struct tb_range)),     NONE },
    [TB_CMD_SET_TENSOR_2D]   = { "SET_TENSOR_2D",    true,  AT_LEAST(sizeof(struct tb_range_2d)),  NONE },
    [TB_CMD_GET_TENSOR]      = { "GET_TENSOR",       false, EXACT(sizeof(struct tb_range)),        ANY },
    [TB_CMD_MEMSET_TENSOR]   = { "MEMSET_TENSOR",    true,  EXACT(sizeof(struct tb_memset_req)),   NONE },
    [TB_CMD_COPY_TENSOR]     = { "COPY_TENSOR",      true,  EXACT(sizeof(struct tb_copy_req)),     NONE },
    [TB_CMD_GRAPH_COMPUTE]   = { "GRAPH_COMPUTE",    true,  AT_LEAST(sizeof(struct tb_graph_header)), NONE },
    [TB_CMD_GRAPH_RECOMPUTE] = { "GRAPH_RECOMPUTE",  true,  EXACT(sizeof(uint32_t)),               NONE },
    [TB_CMD_SUPPORTS_OP]     = { "SUPPORTS_OP",      false, AT_LEAST(sizeof(struct tb_graph_header)), EXACT(1) },
    [TB_CMD_GET_ALLOC_SIZE]  = { "GET_ALLOC_SIZE",   false, AT_LEAST(sizeof(struct tb_graph_header)), EXACT(sizeof(uint64_t)) },
    [TB_CMD_SYNC]            = { "SYNC",             false, NONE,                                  NONE },
    [TB_CMD_STATUS]          = { "STATUS",           false, NONE,                                  EXACT(sizeof(struct tb_status)) },
    [TB_CMD_KEEPALIVE]       = { "KEEPALIVE",        true,  NONE,                                  NONE },
    [TB_CMD_OPEN_FILE]       = { "OPEN_FILE",        false, EXACT(sizeof(struct tb_open_file)),    EXACT(sizeof(uint64_t)) },
    [TB_CMD_LOAD_FROM_FILE]  = { "LOAD_FROM_FILE",   true,  EXACT(sizeof(struct tb_file_range)),   NONE },
    [TB_CMD_LOAD_FROM_FILE_2D] = { "LOAD_FROM_FILE_2D", true, EXACT(sizeof(struct tb_file_range_2d)), NONE },
    [TB_CMD_PEER_LISTEN]     = { "PEER_LISTEN",      false, NONE,                                  EXACT(sizeof(struct tb_peer_listen_reply)) },
    [TB_CMD_PEER_CONNECT]    = { "PEER_CONNECT",     false, EXACT(sizeof(struct tb_peer_connect)), EXACT(sizeof(struct tb_peer_connect_reply)) },
    [TB_CMD_PEER_ACCEPT]     = { "PEER_ACCEPT",      false, EXACT(sizeof(uint64_t)),               EXACT(sizeof(uint64_t)) },
    [TB_CMD_PEER_SEND]       = { "PEER_SEND",        true,  EXACT(sizeof(struct tb_peer_range)),   NONE },
    [TB_CMD_PEER_RECV]       = { "PEER_RECV",        true,  EXACT(sizeof(struct tb_peer_range)),   NONE },
    [TB_CMD_ALLREDUCE]       = { "ALLREDUCE",        true,  EXACT(sizeof(struct tb_allreduce)),    NONE },
    [TB_CMD_TRANSPORT_OFFER] = { "TRANSPORT_OFFER",  false, EXACT(sizeof(struct tb_transport_req)), EXACT(sizeof(struct tb_transport_reply)) },
    [TB_CMD_TRANSPORT_SWITCH]= { "TRANSPORT_SWITCH", true,  EXACT(sizeof(uint32_t)),               NONE },
};
#undef EXACT
#undef AT_LEAST
#undef ANY
#undef NONE

const struct tb_command * tb_command(uint16_t cmd) {
    static const struct tb_command unknown = { "UNKNOWN", false, TB_LEN_ANY, 0, TB_LEN_ANY, 0 };
    return cmd > 0 && cmd < TB_CMD_COUNT_ && commands[cmd].name ? &commands[cmd] : &unknown;
}

bool tb_cmd_posted(uint16_t cmd) { return tb_command(cmd)->posted; }

const char * tb_cmd_name(uint16_t cmd) { return tb_command(cmd)->name; }

int tb_check_request_len(const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_command * c = tb_command(h->cmd);
    if (c->request == TB_LEN_ANY || (c->request == TB_LEN_EXACT ? h->len == c->request_len : h->len >= c->request_len))
        return 0;
    snprintf(err, err_len, "%s: payload is %llu bytes, expected %s%u", c->name, (unsigned long long) h->len,
             c->request == TB_LEN_EXACT ? "" : "at least ", c->request_len);
    return -1;
}

uint64_t tb_fnv1a(uint64_t h, const void * data, size_t len) {
    const uint8_t * p = data;
    for (size_t i = 0; i < len; i++) { h ^= p[i]; h *= 0x100000001b3ull; }
    return h;
}

uint64_t tb_fnv1a_u64(uint64_t h, uint64_t v) {
    for (int b = 0; b < 8; b++) { h ^= (v >> (8 * b)) & 0xff; h *= 0x100000001b3ull; }
    return h;
}

void tb_peer_key(const uint8_t * secret, size_t secret_len, uint64_t token, uint8_t out[TB_MAC_LEN]) {
    static const char label[] = "tbrpc 4 peer link";
    tb_hmac_sha256(secret, secret_len, label, sizeof label, &token, sizeof token, NULL, 0, NULL, 0, out);
}

void tb_abi_fill(struct tb_abi * abi) {
    *abi = (struct tb_abi) {
        .proto_version = TB_PROTO_VERSION, .backend_api_version = TBRPC_GGML_BACKEND_API_VERSION,
        .ggml_op_count = GGML_OP_COUNT, .ggml_type_count = GGML_TYPE_COUNT, .max_dims = GGML_MAX_DIMS,
        .max_src = GGML_MAX_SRC, .max_op_params = GGML_MAX_OP_PARAMS, .max_name = GGML_MAX_NAME,
    };
    uint64_t h = TB_FNV_OFFSET;
    for (int t = 0; t < GGML_TYPE_COUNT; t++) {
        uint64_t sizes[2] = { ggml_type_size((enum ggml_type) t), (uint64_t) ggml_blck_size((enum ggml_type) t) };
        h = tb_fnv1a(h, sizes, sizeof sizes);
    }
    abi->type_table_hash = h;
}

int tb_reserve(uint8_t ** buf, size_t * cap, size_t need) {
    if (need <= *cap) return 0;
    uint8_t * p = realloc(*buf, need);
    if (!p) return -1;
    *buf = p;
    *cap = need;
    return 0;
}

void tb_ggml_build(char * out, size_t len) {
    snprintf(out, len, "%s %s", ggml_version(), ggml_commit());
}

int tb_abi_compare(const struct tb_abi * mine, const struct tb_abi * theirs, const char * their_role,
                   char * err, size_t err_len) {
    if (mine->proto_version != theirs->proto_version) {
        snprintf(err, err_len, "protocol version mismatch: this side speaks tbrpc protocol %u, the %s speaks %u",
                 mine->proto_version, their_role, theirs->proto_version);
        return -1;
    }
    if (mine->backend_api_version != theirs->backend_api_version || mine->ggml_op_count != theirs->ggml_op_count ||
        mine->ggml_type_count != theirs->ggml_type_count || mine->type_table_hash != theirs->type_table_hash ||
        mine->max_dims != theirs->max_dims || mine->max_src != theirs->max_src ||
        mine->max_op_params != theirs->max_op_params || mine->max_name != theirs->max_name) {
        snprintf(err, err_len,
                 "ggml ABI mismatch: this side has backend API %u, %u ops, %u types (type table %016llx); "
                 "the %s has backend API %u, %u ops, %u types (type table %016llx). "
                 "Install the same tbrpc and llama-cpp-python version on both machines.",
                 mine->backend_api_version, mine->ggml_op_count, mine->ggml_type_count,
                 (unsigned long long) mine->type_table_hash, their_role, theirs->backend_api_version,
                 theirs->ggml_op_count, theirs->ggml_type_count, (unsigned long long) theirs->type_table_hash);
        return -1;
    }
    return 0;
}

int tb_msg_send(struct tb_transport * t, uint16_t cmd, uint16_t flags, uint64_t id,
                const void * a, size_t a_len, const void * b, size_t b_len) {
    struct tb_header h = { .magic = TB_MAGIC, .cmd = cmd, .flags = flags, .id = id, .len = a_len + b_len };
    if (tb_send(t, &h, sizeof h) != 0) return -1;
    if (a_len && tb_send(t, a, a_len) != 0) return -1;
    if (b_len && tb_send(t, b, b_len) != 0) return -1;
    return 0;
}

int tb_msg_recv_header(struct tb_transport * t, struct tb_header * h, char * err, size_t err_len) {
    if (tb_recv(t, h, sizeof *h) != 0) {
        snprintf(err, err_len, "%s", t->error);
        return -1;
    }
    if (h->magic != TB_MAGIC) {
        snprintf(err, err_len, "%s: not a tbrpc message (magic %08x); is this a tbrpc node/client?", t->peer, h->magic);
        return -1;
    }
    if (h->cmd == 0 || h->cmd >= TB_CMD_COUNT_) {
        snprintf(err, err_len, "%s: unknown command %u", t->peer, h->cmd);
        return -1;
    }
    if (h->len > TB_MAX_PAYLOAD) {
        snprintf(err, err_len, "%s: %s payload of %llu bytes exceeds the %llu-byte limit", t->peer,
                 tb_cmd_name(h->cmd), (unsigned long long) h->len, (unsigned long long) TB_MAX_PAYLOAD);
        return -1;
    }
    return 0;
}

// ggml_nbytes, with every multiplication and addition checked.
int tb_wire_nbytes(const struct tb_wire_tensor * w, uint64_t * out, char * err, size_t err_len) {
    if (w->type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type) w->type) <= 0 || ggml_type_size((enum ggml_type) w->type) == 0) {
        snprintf(err, err_len, "tensor '%.64s': invalid type %u", w->name, w->type);
        return -1;
    }
    const uint64_t blck = (uint64_t) ggml_blck_size((enum ggml_type) w->type);
    const uint64_t tsize = ggml_type_size((enum ggml_type) w->type);
    for (int i = 0; i < GGML_MAX_DIMS; i++) {
        if (w->ne[i] < 0 || w->ne[i] > TB_MAX_DIM_ELEMENTS) {
            snprintf(err, err_len, "tensor '%.64s': ne[%d] = %lld out of range", w->name, i, (long long) w->ne[i]);
            return -1;
        }
        if (w->nb[i] > (1ull << 52)) {
            snprintf(err, err_len, "tensor '%.64s': nb[%d] = %llu out of range", w->name, i, (unsigned long long) w->nb[i]);
            return -1;
        }
    }
    if (blck > 1 && (w->ne[0] % (int64_t) blck != 0 || w->nb[0] != tsize)) {
        snprintf(err, err_len, "tensor '%.64s': quantized rows must hold whole blocks with nb[0] = block size", w->name);
        return -1;
    }
    for (int i = 0; i < GGML_MAX_DIMS; i++) {
        if (w->ne[i] == 0) { *out = 0; return 0; }
    }
    uint64_t n, term;
    if (blck == 1) {
        n = tsize;
        for (int i = 0; i < GGML_MAX_DIMS; i++) {
            if (__builtin_mul_overflow((uint64_t) (w->ne[i] - 1), w->nb[i], &term) || __builtin_add_overflow(n, term, &n)) goto overflow;
        }
    } else {
        if (__builtin_mul_overflow((uint64_t) w->ne[0] / blck, w->nb[0], &n)) goto overflow;
        for (int i = 1; i < GGML_MAX_DIMS; i++) {
            if (__builtin_mul_overflow((uint64_t) (w->ne[i] - 1), w->nb[i], &term) || __builtin_add_overflow(n, term, &n)) goto overflow;
        }
    }
    *out = n;
    return 0;
overflow:
    snprintf(err, err_len, "tensor '%.64s': size overflows 64 bits", w->name);
    return -1;
}

// Ops whose op_params hold host function pointers: executing them for a
// remote peer would run arbitrary code, so a node never accepts them.
static bool op_is_forbidden(uint32_t op) {
    return op == GGML_OP_MAP_CUSTOM1 || op == GGML_OP_MAP_CUSTOM2 || op == GGML_OP_MAP_CUSTOM3 || op == GGML_OP_CUSTOM;
}

static int decode_one(struct ggml_context * ctx, const struct tb_wire_tensor * w, uint32_t i,
                      struct ggml_tensor ** out, tb_buffer_lookup_fn lookup, void * lookup_ctx,
                      bool require_data, char * err, size_t err_len) {
    uint64_t nbytes = 0;
    if (tb_wire_nbytes(w, &nbytes, err, err_len) != 0) return -1;
    if (w->op >= GGML_OP_COUNT || op_is_forbidden(w->op)) {
        snprintf(err, err_len, "tensor %u '%.64s': op %u is not allowed", i, w->name, w->op);
        return -1;
    }
    if (w->view_src < -1 || (w->view_src >= 0 && (uint32_t) w->view_src >= i)) {
        snprintf(err, err_len, "tensor %u '%.64s': view source %d is not an earlier tensor", i, w->name, w->view_src);
        return -1;
    }
    for (int s = 0; s < GGML_MAX_SRC; s++) {
        if (w->src[s] < -1 || (w->src[s] >= 0 && (uint32_t) w->src[s] >= i)) {
            snprintf(err, err_len, "tensor %u '%.64s': source %d = %d is not an earlier tensor", i, w->name, s, w->src[s]);
            return -1;
        }
    }
    struct tb_buffer_view view = { 0 };
    if (w->buffer != 0) {
        if (!lookup(lookup_ctx, w->buffer, &view)) {
            snprintf(err, err_len, "tensor %u '%.64s': unknown buffer handle %llu", i, w->name, (unsigned long long) w->buffer);
            return -1;
        }
        if (w->offset > view.size || nbytes > view.size - w->offset) {
            snprintf(err, err_len, "tensor %u '%.64s': data [%llu, +%llu) lies outside its %llu-byte buffer", i, w->name,
                     (unsigned long long) w->offset, (unsigned long long) nbytes, (unsigned long long) view.size);
            return -1;
        }
    } else if (require_data && nbytes > 0) {
        snprintf(err, err_len, "tensor %u '%.64s': has no buffer", i, w->name);
        return -1;
    }
    if (w->view_src >= 0 && out[w->view_src]->buffer != view.ggml_buffer) {
        snprintf(err, err_len, "tensor %u '%.64s': view lives in another buffer than its source", i, w->name);
        return -1;
    }
    if (w->view_src >= 0 && w->buffer != 0 && nbytes > 0) {   // a view's bytes lie within its source's
        const struct ggml_tensor * vs = out[w->view_src];
        const uint64_t vs_off = (uint64_t) ((const uint8_t *) vs->data - (const uint8_t *) view.base);
        if (vs->data == NULL || w->offset < vs_off || w->offset - vs_off + nbytes > ggml_nbytes(vs)) {
            snprintf(err, err_len, "tensor %u '%.64s': view [%llu, +%llu) lies outside its source (tensor %d)", i, w->name,
                     (unsigned long long) w->offset, (unsigned long long) nbytes, w->view_src);
            return -1;
        }
    }

    struct ggml_tensor * t = ggml_new_tensor(ctx, (enum ggml_type) w->type, GGML_MAX_DIMS, w->ne);
    if (!t) {
        snprintf(err, err_len, "tensor %u: out of graph context memory", i);
        return -1;
    }
    for (int d = 0; d < GGML_MAX_DIMS; d++) t->nb[d] = (size_t) w->nb[d];
    t->op = (enum ggml_op) w->op;
    memcpy(t->op_params, w->op_params, sizeof t->op_params);
    t->flags = w->flags;
    t->buffer = view.ggml_buffer;
    t->data = w->buffer ? (uint8_t *) view.base + w->offset : NULL;
    t->view_src = w->view_src >= 0 ? out[w->view_src] : NULL;
    t->view_offs = (size_t) w->view_offs;
    for (int s = 0; s < GGML_MAX_SRC; s++) t->src[s] = w->src[s] >= 0 ? out[w->src[s]] : NULL;
    memcpy(t->name, w->name, GGML_MAX_NAME);
    t->name[GGML_MAX_NAME - 1] = '\0';
    out[i] = t;
    return 0;
}

int tb_decode_tensors(struct ggml_context * ctx, const struct tb_wire_tensor * w, uint32_t n,
                      tb_buffer_lookup_fn lookup, void * lookup_ctx, bool require_data,
                      struct ggml_tensor ** out, char * err, size_t err_len) {
    for (uint32_t i = 0; i < n; i++) {
        if (decode_one(ctx, &w[i], i, out, lookup, lookup_ctx, require_data, err, err_len) != 0) return -1;
    }
    return 0;
}
