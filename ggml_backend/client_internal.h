// client_internal.h - what the head side's two files share.
//
// client.c is the ggml side (registry, devices, buffer types, buffers,
// backends) and the C API; client_node.c is one node seen from the head (its
// connection, requests and replies, the handshake, and the messages that
// describe graphs and ops). Objects are owned top-down:
//   tbrpc_client (the ggml registry "TBRPC")
//     └─ client_node (one per remote node = one ggml device + its buffer type
//                     + its connection)
//          ├─ client_buffer (one per remote buffer: handle, base, size)
//          └─ ggml_backend (streams created by ggml on that device)
#pragma once

#include "tbrpc.h"
#include "ggml_abi.h"
#include "trace.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#define OP_CACHE_SIZE 4096             // node answers remembered per node (power of two)

// Answers the node gave about op classes (supports_op, alloc size), by key.
struct op_cache_entry { uint64_t key; uint64_t value; bool used; };

struct client_node {
    struct ggml_backend_device      dev;    // dev.context == this
    struct ggml_backend_buffer_type buft;   // buft.context == this
    struct tbrpc_client * client;
    char   endpoint[96];
    char   name[32];
    char   description[256];
    int    timeout_ms;
    uint8_t secret[TB_SECRET_MAX];           // the cluster secret (secret_len 0: none); for the handshake only
    size_t secret_len;
    struct tb_hello info;
    ggml_backend_dev_t cpu_twin;             // the head's CPU device, when it answers supports_op for this node
    bool   ask_always;                       // ignore what HELLO let the head answer itself

    pthread_mutex_t lock;                    // one request at a time on the wire
    struct tb_transport * tp;
    uint64_t next_id;
    // A GET_TENSOR that get_tensor_async sent and whose reply is not read yet
    // (waiting false: none); node_settle_locked reads it.
    struct pending_get { bool waiting; uint64_t id; void * data; size_t size; } pending;
    bool   dirty;                            // posted requests not yet confirmed by a reply
    bool   failed;
    bool   forced_tcp;                       // asked for TCP: its links are asked to stay on TCP too
    bool   handshaking;                      // failures now are TBRPC_ERR_HANDSHAKE, later TBRPC_ERR_FAILED
    int    error_kind;                       // enum tbrpc_error_kind of the failure
    uint32_t failed_peer;                    // the node's peer id of the link it blamed for it (0: none; proto.h)
    char   error[512];

    uint8_t * encode;  size_t encode_cap;    // graph message being built
    // The graphs the node keeps (slot i of TB_KEPT_GRAPHS), as encoded with slot 0, for RECOMPUTE.
    struct kept_graph { uint64_t uid; uint8_t * bytes; size_t len, cap; uint64_t used; } kept[TB_KEPT_GRAPHS];
    uint64_t kept_clock;                     // for least-recently-used replacement
    struct op_cache_entry op_cache[OP_CACHE_SIZE];

    struct node_file { char path[4096]; uint64_t id; } * files;  // head file -> node's file id (0: the node lacks it)
    size_t n_files;

    // Links from this node to others (activations go node to node); set up once per pair.
    // transport: what carries the link, and why, as the dialing node (this one) said (for a link
    // that could not be made, why not); why: the kind of that reason (enum tb_why).
    struct peer_link { struct client_node * to; uint64_t out_id, in_id; bool usable; int why; char transport[96]; } links[16];
    size_t n_links;
    // How other nodes dial this one for a link, where not at its endpoint's
    // host: Thunderbolt links are point to point, one subnet per cable.
    struct peer_address { struct client_node * from; char host[256]; } addresses[16];
    size_t n_addresses;

    char   allreduce[8];                     // the tensor split's all-reduce it takes part in: "mesh", "ring"; "" none
    uint64_t round_trips, messages, graphs_sent, graphs_reused, bytes_from_files, peer_copies, allreduces;
    uint64_t live_buffers;                   // buffers allocated and not yet freed (atomic)
    uint64_t live_bytes;                     // their sizes (atomic)
    struct tb_trace * trace;                 // TBRPC_TRACE: when requests left and replies came (NULL: off)
};

struct tbrpc_client {
    struct ggml_backend_reg reg;             // reg.context == this
    pthread_mutex_t lock;
    struct client_node ** nodes;
    size_t n_nodes, cap_nodes;
    bool   registered;
    struct head_file { char path[4096]; int ok; uint64_t size; uint8_t hash[TB_FILE_HASH_LEN]; } * head_files;  // content hashes, computed once
    size_t n_head_files;
    unsigned n_meta_devices;                 // meta devices made (split_rules.c), for their names
};

struct client_buffer {
    struct client_node * node;
    uint64_t handle;
    uint64_t base;                           // synthetic, from the node (never its address); tensor->data lives in [base, base+size)
    uint64_t size;
};

// ---- one node (client_node.c) ----------------------------------------------------

// Connect to endpoint and handshake. Returns a node not yet in any
// registry, or NULL with err and *kind (enum tbrpc_error_kind).
// transport: "tcp" keeps the connection on TCP; NULL or "auto" takes shared memory where it can.
// secret: the cluster secret (NULL: none; then a node that asks for one is refused).
struct client_node * node_open(const char * endpoint, const char * name, int timeout_ms, const char * transport,
                               const uint8_t * secret, size_t secret_len, int * kind, char * err, size_t err_len);
void node_destroy(struct client_node * n);

// Mark the node failed (once) with a message naming it, the step and why;
// the kind is TBRPC_ERR_HANDSHAKE during the handshake, else TBRPC_ERR_FAILED.
void node_fail(struct client_node * n, const char * step, const char * why);
// The same with a kind of the caller's choosing (enum tbrpc_error_kind).
void node_fail_kind(struct client_node * n, int kind, const char * step, const char * why);
// Send a request and wait for its reply; `out` receives exactly out_len
// bytes. The _locked forms expect the caller to hold n->lock.
int  node_call(struct client_node * n, uint16_t cmd, const void * a, size_t a_len, void * out, size_t out_len);
int  node_call_locked(struct client_node * n, uint16_t cmd, const void * a, size_t a_len, const void * b, size_t b_len,
                      void * out, size_t out_len);
// The two halves of node_call_locked, for a caller that must have two nodes
// busy at once (a peer link: one accepts while the other dials). Send
// returns the request id (0 on failure); caller holds n->lock across both.
uint64_t node_call_send_locked(struct client_node * n, uint16_t cmd, const void * a, size_t a_len);
int  node_call_reply_locked(struct client_node * n, uint16_t cmd, uint64_t id, void * out, size_t out_len);
// Read the reply of the GET_TENSOR left in flight by get_tensor_async, if
// any (on failure its destination is zeroed). Every request to the node
// settles it first. Caller holds n->lock.
void node_settle_locked(struct client_node * n);
// Queue a request that has no reply (a failure comes back with the next reply).
int  node_post(struct client_node * n, uint16_t cmd, const void * a, size_t a_len);
void node_flush_locked(struct client_node * n, uint16_t cmd);   // posted requests leave now (cmd: the last, for errors)
int  node_post_locked(struct client_node * n, uint16_t cmd, const void * a, size_t a_len, const void * b, size_t b_len);

// Build the GRAPH_COMPUTE payload for g in n->encode. Returns its length, or
// 0 with err.
size_t encode_graph(struct client_node * n, struct ggml_cgraph * g, char * err, size_t err_len);

// A SUPPORTS_OP / GET_ALLOC_SIZE question: the op's sources, then the op.
struct op_query { struct tb_graph_header h; struct tb_wire_tensor t[GGML_MAX_SRC + 1]; };
// Describe op and its sources in q: real shapes, types, ops, params, flags
// and view offsets, no data location (buffer 0, offset 0) and no view links,
// wherever their data lies. Returns the message length.
size_t encode_op_query(const struct ggml_tensor * op, struct op_query * q);

// Cache keys of op classes: what supports_op, and what an allocation size,
// may depend on.
uint64_t supports_key(const struct ggml_tensor * op);
uint64_t alloc_size_key(const struct ggml_tensor * op);
// Ask the node about op (SUPPORTS_OP or GET_ALLOC_SIZE), once per key.
// Returns false when the node could not answer.
bool ask_node_about_op(struct client_node * n, uint16_t cmd, uint64_t key, const struct ggml_tensor * op,
                       uint64_t * answer, size_t answer_len);

// When [data, data+size) lies in a model file the head has mapped and the
// node holds the same file (OPEN_FILE), the node's id for it; otherwise 0
// and the bytes must be sent. Caller holds n->lock.
uint64_t node_file_for(struct client_node * n, const void * data, size_t size, uint64_t * file_offset);
// The link a -> b (PEER_LISTEN on b, PEER_CONNECT on a, PEER_ACCEPT on b),
// set up once per pair; NULL when the pair cannot talk directly.
struct peer_link * peer_link(struct client_node * a, struct client_node * b);

// ---- ggml side (client.c) ------------------------------------------------------

// True for buffers of a TBRPC buffer type (of any node).
bool is_our_buffer(ggml_backend_buffer_t b);

static inline uint64_t tensor_offset(const struct client_buffer * cb, const struct ggml_tensor * t) {
    return (uint64_t) (uintptr_t) t->data - cb->base;
}
