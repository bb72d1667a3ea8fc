// node_graphs.c - a session's graphs: decoding and validating them (proto.c,
// op_rules.c), keeping them by slot for GRAPH_RECOMPUTE, running them, and
// the device questions SUPPORTS_OP and GET_ALLOC_SIZE.
#include "node_session.h"
#include "op_rules.h"

#include <stdlib.h>
#include <string.h>

void forget_kept_graphs(struct node_conn * c) {
    for (size_t i = 0; i < TB_KEPT_GRAPHS; i++) {
        if (c->kept[i].ctx) ggml_free(c->kept[i].ctx);
        c->kept[i].ctx = NULL;
        c->kept[i].graph = NULL;
    }
    c->graph = NULL;
}

// Decode a tensor table (+ node list for graphs) into a fresh context.
// A graph's cost (op_rules.h) against what this client may spend now: the
// limit follows the buffers it holds, so a kept graph is checked again each
// time GRAPH_RECOMPUTE runs it (the client may have freed buffers since).
static int check_cost(struct node_conn * c, uint16_t cmd, uint64_t cost, char * err, size_t err_len) {
    uint64_t held = 0;
    for (size_t i = 0; i < c->n_buffers; i++) held += c->buffers[i].size;
    const uint64_t limit = tb_graph_cost_limit(held);
    if (cost <= limit) return 0;
    snprintf(err, err_len, "%s: the graph costs %llu element operations, over this client's limit of %llu "
             "(%llu per byte of the %llu bytes of buffers it holds, at least %llu)", tb_cmd_name(cmd),
             (unsigned long long) cost, (unsigned long long) limit, (unsigned long long) TB_COST_PER_BYTE,
             (unsigned long long) held, (unsigned long long) TB_COST_FLOOR);
    return -1;
}

static struct ggml_context * decode_graph(struct node_conn * c, const struct tb_header * h, bool with_nodes,
                                          struct ggml_tensor *** tensors_out, struct ggml_cgraph ** graph_out,
                                          uint64_t * cost_out, uint32_t * n_tensors_out, char * err, size_t err_len) {
    const struct tb_graph_header * gh = (const struct tb_graph_header *) c->payload;
    const uint32_t nt = gh->n_tensors, nn = with_nodes ? gh->n_nodes : 0;
    if (nt == 0 || nt > TB_MAX_GRAPH_TENSORS || nn > TB_MAX_GRAPH_NODES || (with_nodes && nn == 0)) {
        snprintf(err, err_len, "%s: %u tensors / %u nodes out of range", tb_cmd_name(h->cmd), nt, nn);
        return NULL;
    }
    const uint64_t want = sizeof *gh + (uint64_t) nt * sizeof(struct tb_wire_tensor) + (uint64_t) nn * sizeof(uint32_t);
    if (h->len != want) {
        snprintf(err, err_len, "%s: payload is %llu bytes, %u tensors and %u nodes need %llu", tb_cmd_name(h->cmd),
                 (unsigned long long) h->len, nt, nn, (unsigned long long) want);
        return NULL;
    }
    const struct tb_wire_tensor * wire = (const struct tb_wire_tensor *) (gh + 1);
    const uint32_t * node_idx = (const uint32_t *) (wire + nt);
    struct ggml_init_params ip = {
        .mem_size = ggml_tensor_overhead() * nt + (with_nodes ? ggml_graph_overhead_custom(nn, false) : 0) + nt * sizeof(void *) + 1024,
        .mem_buffer = NULL,
        .no_alloc = true,
    };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor ** tensors = calloc(nt, sizeof *tensors);
    uint8_t * seen = NULL;
    if (!ctx || !tensors) {
        snprintf(err, err_len, "out of memory decoding %u tensors", nt);
        goto fail;
    }
    if (tb_decode_tensors(ctx, wire, nt, lookup_buffer, c, with_nodes, tensors, err, err_len) != 0) goto fail;
    if (with_nodes) {
        struct ggml_cgraph * g = ggml_new_graph_custom(ctx, nn, false);
        uint64_t cost = 0;
        // a tensor computed twice in one graph costs twice for nothing: refused (the cost of a graph is bounded by its size)
        seen = calloc((nt + 7) / 8, 1);
        if (!seen) { snprintf(err, err_len, "out of memory decoding %u nodes", nn); goto fail; }
        for (uint32_t i = 0; i < nn; i++) {
            if (node_idx[i] >= nt) {
                snprintf(err, err_len, "GRAPH_COMPUTE: node %u refers to tensor %u of %u", i, node_idx[i], nt);
                goto fail;
            }
            if (seen[node_idx[i] / 8] & (1u << (node_idx[i] % 8))) {
                snprintf(err, err_len, "GRAPH_COMPUTE: node %u repeats tensor %u", i, node_idx[i]);
                goto fail;
            }
            seen[node_idx[i] / 8] |= (uint8_t) (1u << (node_idx[i] % 8));
            // what the node will compute must pass the op rules (op_rules.c) and the device's own supports_op
            if (tb_op_check(tensors[node_idx[i]], node_idx[i], err, err_len) != 0) goto fail;
            if (!ggml_backend_dev_supports_op(c->node->dev, tensors[node_idx[i]])) {
                snprintf(err, err_len, "tensor %u (%s): device %s does not support it", node_idx[i],
                         ggml_op_name(tensors[node_idx[i]]->op), ggml_backend_dev_name(c->node->dev));
                goto fail;
            }
            const uint64_t op_cost = tb_op_cost(tensors[node_idx[i]]);
            cost = cost > UINT64_MAX - op_cost ? UINT64_MAX : cost + op_cost;
            ggml_graph_add_node(g, tensors[node_idx[i]]);
            // the use counts let ggml fuse ops (rms_norm+mul, ...) as the head's own CPU would
            const size_t slot = tbrpc_ggml_hash_slot(&g->visited_hash_set, tensors[node_idx[i]], true);
            if (slot != (size_t) -1) g->use_counts[slot] = wire[node_idx[i]].use_count;
        }
        if (check_cost(c, h->cmd, cost, err, err_len) != 0) goto fail;
        *graph_out = g;
        *cost_out = cost;
    }
    free(seen);
    *tensors_out = tensors;
    *n_tensors_out = nt;
    return ctx;
fail:
    free(seen);
    free(tensors);
    if (ctx) ggml_free(ctx);
    return NULL;
}

static int run_graph(struct node_conn * c, char * err, size_t err_len) {
    set_busy(c, COMPUTING);
    char why[400] = "";
    tb_trace_mark(c->trace, TB_TRACE_GRAPH_START, 0);
    const int rc = tb_graph_compute_checked(c->backend, c->graph, why, sizeof why);   // row indices checked before each op
    tb_trace_mark(c->trace, TB_TRACE_GRAPH_END, 0);
    set_busy(c, IDLE);
    count(&c->slot->graphs_computed, 1);
    if (rc != 0 && c->gone) {   // the device's abort callback (client_left) stopped it
        snprintf(err, err_len, "graph compute stopped: the client has gone");
        return -1;
    }
    if (rc != 0) {
        snprintf(err, err_len, "graph compute on %s: %s", ggml_backend_dev_name(c->node->dev), why);
        return -1;
    }
    return 0;
}

int handle_graph_compute(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    struct ggml_tensor ** tensors = NULL;
    struct ggml_cgraph * g = NULL;
    uint32_t nt = 0;
    uint64_t cost = 0;
    struct ggml_context * ctx = decode_graph(c, h, true, &tensors, &g, &cost, &nt, err, err_len);
    if (!ctx) return -1;
    free(tensors);
    const uint32_t slot = ((const struct tb_graph_header *) c->payload)->slot;
    if (slot >= TB_KEPT_GRAPHS) {
        ggml_free(ctx);
        snprintf(err, err_len, "GRAPH_COMPUTE: slot %u (a node keeps %d graphs)", slot, TB_KEPT_GRAPHS);
        return -1;
    }
    if (c->kept[slot].ctx) ggml_free(c->kept[slot].ctx);
    c->kept[slot].ctx = ctx;
    c->kept[slot].graph = g;
    c->kept[slot].cost = cost;
    c->graph = g;
    return run_graph(c, err, err_len);
}

int handle_graph_recompute(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    uint32_t slot;
    memcpy(&slot, c->payload, sizeof slot);
    if (slot >= TB_KEPT_GRAPHS || !c->kept[slot].graph) {
        snprintf(err, err_len, "GRAPH_RECOMPUTE of slot %u, which holds no graph", slot);
        return -1;
    }
    if (check_cost(c, h->cmd, c->kept[slot].cost, err, err_len) != 0) return -1;
    c->graph = c->kept[slot].graph;
    return run_graph(c, err, err_len);
}

int handle_supports_op(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct ggml_tensor ** tensors = NULL;
    uint32_t nt = 0;
    struct ggml_context * ctx = decode_graph(c, h, false, &tensors, NULL, NULL, &nt, err, err_len);
    if (!ctx) return -1;
    // an op the node's rules refuse is one it does not support (and the
    // device's supports_op may dereference sources the rules require)
    char why[256];
    r->small[0] = tb_op_check(tensors[nt - 1], nt - 1, why, sizeof why) == 0 &&
                  ggml_backend_dev_supports_op(c->node->dev, tensors[nt - 1]) ? 1 : 0;
    free(tensors);
    ggml_free(ctx);
    r->data = r->small;
    r->len = 1;
    return 0;
}

int handle_alloc_size(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct ggml_tensor ** tensors = NULL;
    uint32_t nt = 0;
    struct ggml_context * ctx = decode_graph(c, h, false, &tensors, NULL, NULL, &nt, err, err_len);
    if (!ctx) return -1;
    if (tb_op_check(tensors[nt - 1], nt - 1, err, err_len) != 0) { free(tensors); ggml_free(ctx); return -1; }
    uint64_t size = ggml_backend_buft_get_alloc_size(ggml_backend_dev_buffer_type(c->node->dev), tensors[nt - 1]);
    memcpy(r->small, &size, sizeof size);
    free(tensors);
    ggml_free(ctx);
    r->data = r->small;
    r->len = sizeof size;
    return 0;
}
