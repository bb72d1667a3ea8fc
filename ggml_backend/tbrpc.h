// tbrpc.h - the C API that Python binds with cffi (tbrpc/_build.py).
//
// Head side: a tbrpc_client is a ggml backend registry ("TBRPC") whose
// devices are remote nodes. Node side: tb_node_* from node.h.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "node.h"
#include "proto.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tbrpc_client;

// What went wrong, for callers that must act on it (Python raises one
// NodeError subclass per kind); the text beside it is for people. The calls
// below that can fail return -kind (tbrpc_client_failed: +kind).
enum tbrpc_error_kind {
    TBRPC_OK = 0,
    TBRPC_ERR_UNREACHABLE = 1,   // nothing to connect to: refused, unknown host, no answer to connect (one
                                 // kind: the remedy is the same; the text says which, from tb_dial's kind)
    TBRPC_ERR_HANDSHAKE   = 2,   // connected, but the handshake did not complete (not a tbrpc node, closed, silent)
    TBRPC_ERR_VERSION     = 3,   // protocol, ggml ABI or ggml build mismatch
    TBRPC_ERR_FAILED      = 4,   // the node failed after the handshake: closed, timed out, broken, error reply
    TBRPC_ERR_AUTH        = 5,   // the shared secret did not match, or one side has none
    TBRPC_ERR_FULL        = 6,   // the node serves as many clients as it may
    TBRPC_ERR_OTHER       = 7,   // a bad argument, out of memory
    TBRPC_ERR_DUPLICATE   = 8,   // the node answers as one this client is connected to already (at another address)
};

// One node-to-node link the head made, from the node it belongs to.
struct tbrpc_link_info {
    uint32_t to;                     // the index of the node it reaches
    int      usable;                 // 0: no link (activations to `to` go through the head), transport says why
    int      why;                    // enum tb_why (transport.h) of the reason in transport; 0 when it moved off TCP
    char     transport[96];          // what carries it, and why: "shm 16x256K", "tcp: asked for", "none: cannot reach ..."
};

// What the head knows about one node (device), for Python and tests.
struct tbrpc_node_info {
    char     endpoint[96];
    char     device_name[32];        // the ggml device name on the head: TBRPC0, TBRPC1, ...
    struct tb_hello hello;           // what the node said at the handshake
    int      failed;
    int      error_kind;             // enum tbrpc_error_kind of the failure (0 while it works)
    int      failed_peer;            // the index of the node at the other end of the node-to-node link whose failure
                                     // failed this one (it waited for that node's activations, or sent it some); -1 none
    char     error[512];
    char     transport[96];          // what carries the bytes and why: "shm 16x256K", "tcp: peer has no RDMA device"
    int      transport_why;          // enum tb_why (transport.h): the kind of that reason; 0 when it moved off TCP
    char     links[512];             // its links to other nodes and what carries each: "127.0.0.1:5001 shm 16x256K; ..."
    uint32_t n_link_info;            // the links it was asked for, made or not, in the order they were made
    struct tbrpc_link_info link_info[16];
    uint64_t bytes_sent;
    uint64_t bytes_received;
    uint64_t round_trips;            // requests that waited for an answer
    uint64_t messages;               // all requests
    uint64_t graphs_sent;            // GRAPH_COMPUTE with a full graph
    uint64_t graphs_reused;          // GRAPH_RECOMPUTE (the node still had it)
    uint64_t bytes_from_files;       // weights the node read from its own copy of the model
    uint64_t peer_copies;            // activations this node sent straight to another node
    uint64_t allreduces;             // ALLREDUCE requests posted to it (tensor split)
    char     allreduce[8];           // which all-reduce those are: "mesh", "ring" ("" before a tensor split's first)
    uint64_t bytes_allocated;        // this head's buffers on it, now
};

struct tbrpc_client * tbrpc_client_new(void);
// Connect and handshake. Returns the node's index, or -kind with err;
// -TBRPC_ERR_DUPLICATE when the node process is one this client is already
// connected to (and not failed) at another endpoint (HELLO's node_id).
// transport: "tcp" forces TCP; NULL or "auto": shared memory with a node on this host, else TCP.
// secret: the cluster secret, proven in the handshake and never sent (NULL:
// none; a node that has one then refuses us, and we refuse a node without
// one when we have one).
int    tbrpc_client_add_node(struct tbrpc_client * c, const char * endpoint, int timeout_ms, const char * transport,
                             const uint8_t * secret, size_t secret_len, char * err, size_t err_len);
// Connect node i again after it failed (a node restarted on its endpoint),
// keeping its device and proving the same secret. Refused while buffers of
// the failed session are open on this head: their handles mean nothing to the
// new session. 0, or -kind with err.
int    tbrpc_client_reconnect_node(struct tbrpc_client * c, size_t i, const char * transport, char * err, size_t err_len);
// Node `from` reaches node `to` for a node-to-node link at `host` (to's
// address on the cable between them) instead of to's endpoint host. Set
// before the first link between them is made. 0, or -1 with err.
int    tbrpc_client_set_peer_address(struct tbrpc_client * c, size_t from, size_t to, const char * host, char * err,
                                     size_t err_len);
// Which all-reduce a tensor split over n nodes uses (client.c, comm_init).
// addressed[a * n + b] != 0 when node a dials node b at an address of its
// own for the pair (tbrpc_client_set_peer_address: a cable). forced: the
// value of TBRPC_ALLREDUCE ("ring", "mesh"; NULL or anything else: decide).
// Returns the kind; why says why, for the log.
enum tbrpc_allreduce_kind { TBRPC_ALLREDUCE_MESH = 0, TBRPC_ALLREDUCE_RING = 1 };
int    tbrpc_allreduce_choose(const uint8_t * addressed, size_t n, const char * forced, char * why, size_t why_len);
// One ggml "meta" device over nodes `nodes` that cuts only the feed-forward
// weights, in `shares` and in multiples of `granularity` (the largest
// quantization block of those weights), and keeps every other tensor whole
// on each node: a tensor split for architectures llama.cpp refuses one for
// (deepseek2). Used as the only device of a layer split (split_rules.c).
// Returns the device (a ggml_backend_dev_t, kept by ggml), or NULL with err.
void * tbrpc_client_ffn_split_device(struct tbrpc_client * c, const size_t * nodes, size_t n, const float * shares,
                                     int64_t granularity, char * err, size_t err_len);
// Register the registry and its devices with the ggml this library is
// linked against (once; later nodes are registered as they are added).
int    tbrpc_client_register(struct tbrpc_client * c, char * err, size_t err_len);
size_t tbrpc_client_node_count(struct tbrpc_client * c);
int    tbrpc_client_node_info(struct tbrpc_client * c, size_t i, struct tbrpc_node_info * out);
// Ask node i for its live status (one round trip). 0, or -kind with err.
int    tbrpc_client_node_status(struct tbrpc_client * c, size_t i, struct tb_status * out, char * err, size_t err_len);
// The kind (> 0) of the first node that failed, with its message in err; 0 when none did.
int    tbrpc_client_failed(struct tbrpc_client * c, char * err, size_t err_len);
// failed[i] = 1 for every node i < cap that has failed, else 0; returns how
// many have. One lock per node and no strings: cheap enough to ask around
// every decode at any node count.
size_t tbrpc_client_failed_nodes(struct tbrpc_client * c, uint8_t * failed, size_t cap);
void   tbrpc_client_reset_stats(struct tbrpc_client * c);
// Ask node i every supports_op and allocation-size question (once per op
// class) even where its HELLO lets the head answer them itself: for a device
// whose answers the head cannot know, and for tests of the asking path.
void   tbrpc_client_ask_node(struct tbrpc_client * c, size_t i, int always);

// One-shot: connect, handshake, read status, close (for doctor and launch). 0, or -kind with err.
int tbrpc_probe(const char * endpoint, int timeout_ms, const uint8_t * secret, size_t secret_len,
                struct tb_hello * hello, struct tb_status * status, char * err, size_t err_len);

// Size and fingerprint of a model file, as nodes compare them (doctor too).
int tbrpc_file_identity(const char * path, struct tb_file_identity * out, char * err, size_t err_len);

// The ggml version string of the loaded ggml, and the one we were written for.
const char * tbrpc_runtime_ggml_version(void);

#ifdef __cplusplus
}
#endif
