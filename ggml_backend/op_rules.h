// op_rules.h - what a node lets a client's graph do.
//
// ggml kernels trust their tensors: they take addresses from op_params and
// from the shapes and strides of the destination and of other sources. A
// node runs graphs a remote client wrote, so every op it accepts is on an
// allowlist (op_rules.c) whose rules make the kernel stay inside the
// tensors it is given, and every tensor was already checked to lie inside
// its buffer (proto.c). Together: no op reads or writes outside the
// client's buffers, and none reaches a GGML_ASSERT by a broken contract.
//
// Row indices (GET_ROWS, SET_ROWS, MUL_MAT_ID, ADD_ID) are data: they are
// checked at run time, right before the op that reads them
// (tb_graph_compute_checked).
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// Is `op` on the allowlist at all (views and NONE included)?
bool tb_op_allowed(enum ggml_op op);

// The rules for tensor `index` of a message, whose sources were decoded
// (and checked) before it. 0, or -1 with a message naming the tensor and
// its op ("tensor 12 (SET): offset + extent 4096 exceeds destination 2048 bytes").
int tb_op_check(const struct ggml_tensor * t, uint32_t index, char * err, size_t err_len);

// Compute `graph` on `backend`, checking every row index an op reads right
// before that op runs: where an index tensor is written by an earlier node
// of the same graph, the graph runs in segments split there. 0, or -1 with
// a message naming the op, the tensor and the bad index.
int tb_graph_compute_checked(ggml_backend_t backend, struct ggml_cgraph * graph, char * err, size_t err_len);

// What a graph may cost. Each node's cost is an estimate, in element
// operations, of the work its kernel does (tb_op_cost: a matrix product
// costs its output's elements times the shared dimension, attention its
// query rows times the keys times the head sizes, most ops the elements of
// their largest operand, views nothing). A graph's cost, the sum over its
// nodes, may be at most TB_COST_PER_BYTE per byte of buffers the client
// holds, and never less than TB_COST_FLOOR: a real model's graph does about
// (parameters + KV cache elements) x tokens in the batch, and a byte holds at
// most a handful of parameters, so 65536 per byte leaves room for batches of
// thousands of tokens, while a client holding little cannot make a node
// work for long (docs/protocol.md, The op rules).
#define TB_COST_PER_BYTE 65536ull
#define TB_COST_FLOOR    (1ull << 34)

// The cost of computing t (saturating at UINT64_MAX).
uint64_t tb_op_cost(const struct ggml_tensor * t);
// The most a graph may cost for a client holding `bytes_held` bytes.
uint64_t tb_graph_cost_limit(uint64_t bytes_held);

#ifdef TB_OP_RULES_TESTING
// Test builds only (tests/c/safety_tests.c): switch one rule family off to
// show that the property test notices. Never compiled into the library.
enum { TB_RULE_OP_PARAMS = 1, TB_RULE_SHAPES = 2, TB_RULE_LAYOUT = 4, TB_RULE_INDICES = 8, TB_RULE_SOURCES = 16 };
extern unsigned tb_op_rules_disabled;
#endif

#ifdef __cplusplus
}
#endif
