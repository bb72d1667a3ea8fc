// proto.h - tbrpc's wire format: the one place where it is defined.
//
// Client (head) and node both include this file, so they cannot drift.
// docs/protocol.md is the prose version of this header.
//
// Every message is a 24-byte header followed by `len` payload bytes.
// All integers are little-endian; all sizes, offsets, shapes and strides are
// 64-bit. Requests carry an id chosen by the client; a reply echoes it.
// Requests marked "posted" get no reply: the node executes them in order and
// remembers the first failure, which it returns with the next reply (the
// "sticky error"), so streaming weights and per-token inputs costs no round
// trip.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "ggml.h"
#include "model_file.h"
#include "transport.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "tbrpc's wire format is little-endian and this build copies structs as-is; port proto.c before using a big-endian host"
#endif

#define TB_MAGIC            0x43504254u   // "TBPC" on the wire
#define TB_PROTO_VERSION    8u
#define TB_MAX_PAYLOAD      (256ull << 20) // one message; larger tensor writes are split by the client
#define TB_MAX_GRAPH_TENSORS (1u << 20)
#define TB_MAX_GRAPH_NODES   (1u << 20)
#define TB_MAX_DIM_ELEMENTS  (1ll << 48)   // per dimension; keeps size arithmetic far from overflow
#define TB_NAME_LEN          64
#define TB_NODE_ID_LEN       16
#define TB_KEEPALIVE_MIN_MS  20            // floor for the keepalive period a client may ask for
#define TB_KEEPALIVE_MAX_MS  60000         // and its ceiling (a silent peer times out after three periods)
#define TB_HANDSHAKE_MS      5000          // HELLO and AUTH, together, must be done within this
#define TB_HANDSHAKE_MAX_LEN 4096          // no handshake message is longer; a longer one is refused unread
#define TB_IDLE_MS           (600 * 1000)  // a connection that holds nothing (no buffer, no link) and says
                                           // nothing for this long is dropped (tbrpc node --idle-timeout)

enum tb_cmd {
    TB_CMD_HELLO = 1,        // reply: tb_hello
    TB_CMD_GET_MEMORY,       // reply: tb_memory
    TB_CMD_ALLOC_BUFFER,     // tb_alloc_req        reply: tb_alloc_reply
    TB_CMD_FREE_BUFFER,      // tb_buffer_req       posted
    TB_CMD_BUFFER_CLEAR,     // tb_memset_req (offset 0, size = buffer size) posted
    TB_CMD_SET_TENSOR,       // tb_range + bytes    posted
    TB_CMD_GET_TENSOR,       // tb_range            reply: bytes
    TB_CMD_MEMSET_TENSOR,    // tb_memset_req       posted
    TB_CMD_COPY_TENSOR,      // tb_copy_req         posted
    TB_CMD_GRAPH_COMPUTE,    // tb_graph_header + tensors + node indices  posted
    TB_CMD_GRAPH_RECOMPUTE,  // u32 slot: run a kept graph again           posted
    TB_CMD_SUPPORTS_OP,      // tb_graph_header + tensors (last one is the op)  reply: u8
    TB_CMD_SYNC,             // empty               reply: empty (carries the sticky error)
    TB_CMD_STATUS,           // empty               reply: tb_status
    TB_CMD_KEEPALIVE,        // node -> client, empty, flagged REPLY with id 0: "still computing, keep waiting"
    TB_CMD_GET_ALLOC_SIZE,   // tb_graph_header + tensors (last one is the op)  reply: u64 bytes
    TB_CMD_OPEN_FILE,        // tb_open_file        reply: u64 file id, 0 when the node has no such file
    TB_CMD_LOAD_FROM_FILE,   // tb_file_range       posted: fill a buffer range from the node's own copy
    TB_CMD_PEER_LISTEN,      // empty               reply: tb_peer_listen_reply (0 port: cannot)
    TB_CMD_PEER_CONNECT,     // tb_peer_connect     reply: tb_peer_connect_reply (peer id 0: could not reach the peer)
    TB_CMD_PEER_ACCEPT,      // u64 token           reply: u64 peer id (0: nobody came in time)
    TB_CMD_PEER_SEND,        // tb_peer_range       posted: send a buffer range to a peer (also the data frame on a peer link)
    TB_CMD_PEER_RECV,        // tb_peer_range       posted: receive the peer's next range into a buffer range
    TB_CMD_TRANSPORT_OFFER,  // tb_transport_req    reply: tb_transport_reply (a segment for this connection, or why not)
    TB_CMD_TRANSPORT_SWITCH, // u32 1: attached, switch now; 0: could not, stay  posted, always over TCP
    TB_CMD_ALLREDUCE,        // tb_allreduce        posted: sum a range across nodes over their peer links
    TB_CMD_SET_TENSOR_2D,    // tb_range_2d + n_copies * size bytes (rows packed)  posted
    TB_CMD_LOAD_FROM_FILE_2D,// tb_file_range_2d    posted: rows from the node's own copy of a model file
    TB_CMD_AUTH,             // tb_auth_req         reply: tb_auth_reply (right after HELLO when the node has a secret)
    TB_CMD_COUNT_,
};

enum tb_flags {
    TB_FLAG_REPLY = 1,       // this message answers request `id`
    TB_FLAG_GAVE_UP = 2,     // a PEER_SEND frame on a peer link: its sender gave up the exchange (a ring
                             // ALLREDUCE); the payload (up to TB_GAVE_UP_MAX bytes) says why, as text
};

struct tb_header {
    uint32_t magic;
    uint16_t cmd;
    uint16_t flags;
    uint64_t id;
    uint64_t len;            // payload bytes after the header
};

// A reply payload starts with this. status 0: the command's reply body
// follows. Otherwise the rest of the payload is an error message (text), and
// the status says what kind of refusal it is (a head acts on the kind, a
// person reads the text).
enum tb_reply_code {
    TB_STATUS_OK = 0,
    TB_STATUS_ERROR = 1,     // the request failed (protocol <= 3 also refused a HELLO of another version with it)
    TB_STATUS_VERSION = 2,   // HELLO: protocol or ggml ABI differ
    TB_STATUS_AUTH = 3,      // HELLO/AUTH: authentication failed or is required
    TB_STATUS_FULL = 4,      // HELLO: the node serves as many clients as it may
};
struct tb_reply_status {
    int32_t  status;
    uint32_t peer;           // a failure: the peer id (PEER_SEND's, PEER_RECV's) of the node-to-node link that
                             // failed the request, when one did (the head names the node at its other end); else 0
};

// What both sides must agree on before anything else crosses the wire.
struct tb_abi {
    uint32_t proto_version;
    uint32_t backend_api_version;
    uint32_t ggml_op_count;
    uint32_t ggml_type_count;
    uint64_t type_table_hash;   // FNV-1a over (type size, block size) of every type
    uint32_t max_dims, max_src, max_op_params, max_name;
};

struct tb_hello {            // request and reply share it; the node fills the device part
    struct tb_abi abi;
    uint64_t mem_free;
    uint64_t mem_total;
    uint64_t alignment;
    uint64_t max_size;
    uint32_t device_type;      // enum ggml_backend_dev_type of the node's device
    uint32_t keepalive_ms;     // request: how often a computing node must say so (the client's timeout / 3)
    uint64_t caps;             // reply: TB_CAP_* facts about the node's device
    uint8_t  file_nonce[TB_FILE_NONCE_LEN];  // reply: this session's challenge for OPEN_FILE proofs (model_file.h)
    char     device_name[TB_NAME_LEN];
    char     device_description[128];
    char     node_name[TB_NAME_LEN];
    char     ggml_build[TB_NAME_LEN];  // ggml_version() and ggml_commit() of the side that sent it
    uint8_t  nonce[TB_NONCE_LEN];      // fresh random bytes of the side that sent it (the AUTH challenge)
    uint8_t  node_id[TB_NODE_ID_LEN];  // reply: drawn at random when the node process starts, the same to all its
                                       // clients: two addresses that answer with the same one reach one node
};

// The device sizes every tensor as ggml_nbytes (the CPU does; Metal does not):
// the head need not ask GET_ALLOC_SIZE.
#define TB_CAP_ALLOC_SIZE_IS_NBYTES 1u
// The device is ggml's CPU backend: a head with the same ggml_build answers
// supports_op with its own CPU device (the same code) instead of asking.
#define TB_CAP_SUPPORTS_OP_IS_CPU   2u
// The node offers shared memory (TRANSPORT_OFFER) to a head on its own host.
#define TB_CAP_SHM                  4u
// The node has an RDMA device: a head on another host may offer RDMA
// (TRANSPORT_OFFER kind 2, docs/protocol.md).
#define TB_CAP_RDMA                 8u
// The node has a cluster secret: it serves nothing before AUTH. Its HELLO
// reply then carries only abi, caps and nonce; the device facts come in the
// AUTH reply.
#define TB_CAP_AUTH                 16u
// The node has model directories: OPEN_FILE may find a file there (a head
// hashes its own copy only for a node that says so).
#define TB_CAP_MODEL_FILES          32u

// AUTH: each side proves it knows the cluster secret K with an HMAC-SHA256
// over both HELLO nonces (auth.h), the head first. The secret never crosses
// the wire; fresh nonces make a recorded AUTH useless on another connection.
#define TB_AUTH_ROLE_HEAD "tbrpc 4 head"   // HMAC(K, role || head nonce || node nonce)
#define TB_AUTH_ROLE_NODE "tbrpc 4 node"
struct tb_auth_req   { uint8_t mac[TB_MAC_LEN]; };
struct tb_auth_reply { uint8_t mac[TB_MAC_LEN]; struct tb_hello hello; };

// Node-to-node links: the dialing node sends nothing until the listening
// session has proven it knows the link key, derived from the cluster secret
// (none: empty) and the token the listener drew; then both prove it over
// both nonces. So a node dials only a tbrpc node of its own cluster that the
// head set up, and its first bytes go nowhere else.
#define TB_PEER_MAGIC "TBPEER4"
#define TB_PEER_ROLE_GREET    "tbrpc 4 peer greets"      // listener: HMAC(Kp, role || listener nonce || zeros)
#define TB_PEER_ROLE_DIALER   "tbrpc 4 peer dialer"      // dialer:   HMAC(Kp, role || listener nonce || dialer nonce || name)
#define TB_PEER_ROLE_LISTENER "tbrpc 4 peer listener"    // listener: HMAC(Kp, role || listener nonce || dialer nonce)
struct tb_peer_greeting { char magic[8]; uint8_t nonce[TB_NONCE_LEN]; uint8_t mac[TB_MAC_LEN]; };
struct tb_peer_answer   { uint8_t nonce[TB_NONCE_LEN]; uint8_t mac[TB_MAC_LEN]; char name[TB_NAME_LEN]; };
struct tb_peer_confirm  { uint8_t mac[TB_MAC_LEN]; };
// The link key: HMAC(K, "tbrpc 4 peer link" || token).
void tb_peer_key(const uint8_t * secret, size_t secret_len, uint64_t token, uint8_t out[TB_MAC_LEN]);

// TRANSPORT_OFFER carries a tb_transport_req and answers a tb_transport_reply
// (transport.h): kind 1 shared memory (then TRANSPORT_SWITCH), kind 2 RDMA
// (declined[] empty accepts; right after that reply both sides run
// tb_rdma_upgrade over the raw TCP stream, transport/rdma.h).

// What the wire says about each command, in one table (proto.c) that head
// and node both read: its name, whether it is posted (no reply; a failure is
// sticky and carried by the next reply), and how long its request and reply
// bodies are. A length rule of TB_LEN_EXACT means exactly `*_len` bytes,
// TB_LEN_AT_LEAST at least that many (a fixed part, then data), TB_LEN_ANY
// any length (bounded by TB_MAX_PAYLOAD).
enum tb_len_rule { TB_LEN_EXACT, TB_LEN_AT_LEAST, TB_LEN_ANY };
struct tb_command {
    const char * name;
    bool     posted;
    uint8_t  request;        // enum tb_len_rule
    uint32_t request_len;
    uint8_t  reply;          // enum tb_len_rule; posted commands have none
    uint32_t reply_len;
};
// The row of `cmd`; an unknown command gets a row named "UNKNOWN".
const struct tb_command * tb_command(uint16_t cmd);
// Whether a request is posted (no reply; failures are sticky).
bool tb_cmd_posted(uint16_t cmd);
// 0 when h->len obeys cmd's request rule; otherwise -1 with an error naming
// the command, the length and what was expected.
int  tb_check_request_len(const struct tb_header * h, char * err, size_t err_len);

// FNV-1a, the one non-cryptographic hash of the code base: over `len` bytes
// from `h` (start with TB_FNV_OFFSET), or over a u64's 8 bytes, least
// significant first (the same on every host).
#define TB_FNV_OFFSET 0xcbf29ce484222325ull
uint64_t tb_fnv1a(uint64_t h, const void * data, size_t len);
uint64_t tb_fnv1a_u64(uint64_t h, uint64_t v);

// Grow *buf (capacity *cap) to hold at least `need` bytes; contents are kept.
// 0, or -1 (out of memory) with *buf and *cap unchanged.
int  tb_reserve(uint8_t ** buf, size_t * cap, size_t need);

// tb_random (n unpredictable bytes) is in auth.h.

// "version commit" of the ggml this process runs, for tb_hello.ggml_build.
void tb_ggml_build(char * out, size_t len);

struct tb_memory      { uint64_t free, total; };
struct tb_alloc_req   { uint64_t size; };
// `base` is not an address on the node: it is a synthetic one (TB_FAKE_BASE,
// then each buffer TB_FAKE_BASE_GAP-aligned with a gap after the previous
// one) so the head's ggml has a distinct, aligned data pointer per buffer.
// The node only ever interprets (handle, offset).
struct tb_alloc_reply { uint64_t handle, base, size; };
#define TB_FAKE_BASE      (1ull << 44)
#define TB_FAKE_BASE_GAP  (1ull << 30)
struct tb_buffer_req  { uint64_t handle; };
struct tb_range       { uint64_t handle, offset, size; };
struct tb_memset_req  { uint64_t handle, offset, size; uint8_t value; uint8_t pad[7]; };
struct tb_copy_req    { uint64_t src_handle, src_offset, dst_handle, dst_offset, size; };

// A model file the head has mapped; the node looks for `name` in its model
// directories and accepts it only with the same size, a proof that answers
// the session's file_nonce (the head holds the whole file) and the same
// content hash (every byte is the same: model_file.h).
struct tb_open_file   { uint64_t size; uint8_t content_hash[TB_FILE_HASH_LEN]; uint8_t proof[TB_FILE_PROOF_LEN];
                        char name[TB_FILE_NAME_LEN]; };
struct tb_file_range  { uint64_t handle, offset, size, file_id, file_offset; };
// Strided writes (llama.cpp's meta device uploads a slice of every row of a
// weight): n_copies rows of `size` bytes, `stride` apart in the buffer (and
// `file_stride` apart in the file); stride >= size.
struct tb_range_2d      { uint64_t handle, offset, size, n_copies, stride; };
struct tb_file_range_2d { uint64_t handle, offset, size, n_copies, stride, file_id, file_offset, file_stride; };

// Node-to-node links: activations go from the node that computed them
// straight to the next node, instead of through the head.
struct tb_peer_listen_reply { uint64_t token, port; };
// PEER_CONNECT: where the listener is, its token, and what the head knows of
// it for the link's upgrade: its HELLO caps (TB_CAP_SHM, TB_CAP_RDMA) and
// TB_LINK_TCP when the head's transport is forced to TCP.
#define TB_LINK_TCP 1u
struct tb_peer_connect       { char host[256]; uint64_t port, token, caps, flags; };
// The link's id (0: no link) and what carries it, and why ("shm 16x256K", "tcp: asked for"; with no
// link, why not); why_kind: the kind of that reason (enum tb_why, transport.h; TB_WHY_NO_LINK with no link).
struct tb_peer_connect_reply { uint64_t peer_id; char transport[96]; uint32_t why_kind; uint32_t reserved; };
struct tb_peer_range        { uint64_t peer_id, handle, offset, size; };

// llama.cpp's tensor split: each of `n` nodes holds a partial F32 sum in a
// buffer range, and every node ends with the same bits of the sum. Mesh
// (the default): every node sends its partial to every other one, receives
// theirs, and adds all n in node order. TB_ALLREDUCE_RING: a ring
// all-reduce (reduce-scatter, then all-gather) over the links to node
// self+1 and from node self-1 (mod n) only. peer_out[k]/peer_in[k]: this
// session's peer ids of the links to and from node k (unused at k == self;
// in a ring, all but peer_out[self+1] and peer_in[self-1] are unused).
// Without TB_ALLREDUCE_COMPUTED the range holds nothing computed and counts
// as zeros. Other flag bits are refused.
#define TB_MAX_ALLREDUCE_NODES 16
#define TB_ALLREDUCE_COMPUTED  1u
#define TB_ALLREDUCE_RING      2u
#define TB_GAVE_UP_MAX         1024u
struct tb_allreduce {
    uint64_t handle, offset, size;
    uint32_t type;            // GGML_TYPE_F32, the only one yet
    uint32_t flags;
    uint32_t n, self;
    uint64_t peer_out[TB_MAX_ALLREDUCE_NODES];
    uint64_t peer_in[TB_MAX_ALLREDUCE_NODES];
};

struct tb_status {
    uint64_t buffers;            // live buffers, all clients
    uint64_t bytes_allocated;    // sum of their sizes
    uint64_t clients;            // connected clients
    uint64_t graphs_computed;
    uint64_t bytes_received;     // payload bytes received from all clients
    uint64_t bytes_from_files;   // bytes loaded from the node's own model files into the buffers clients hold now
    uint64_t allreduces;         // ALLREDUCE requests done (tensor split)
    uint64_t allreduce_ns;       // time spent in them: sending, waiting for the peers, adding
    uint64_t mem_free, mem_total;
    char     device_name[TB_NAME_LEN];
};

// One tensor of a graph. Tensors are numbered by their position in the
// message; src/view_src refer to earlier positions (or -1), which makes the
// graph acyclic by construction.
struct tb_wire_tensor {
    uint64_t buffer;          // node buffer handle; 0 means "no data": shapes only (every tensor of
                              // SUPPORTS_OP/GET_ALLOC_SIZE, only 0-byte ones in GRAPH_COMPUTE)
    uint64_t offset;          // data offset inside that buffer
    int64_t  ne[GGML_MAX_DIMS];
    uint64_t nb[GGML_MAX_DIMS];
    uint32_t type;
    uint32_t op;
    int32_t  op_params[GGML_MAX_OP_PARAMS / sizeof(int32_t)];
    int32_t  flags;
    int32_t  view_src;
    uint64_t view_offs;
    int32_t  src[GGML_MAX_SRC];
    char     name[GGML_MAX_NAME];
    int32_t  use_count;       // graph nodes: how many nodes use it (ggml fuses ops only when it knows)
    int32_t  reserved;
};

// A node keeps the last TB_KEPT_GRAPHS graphs a client sent, each in the slot
// GRAPH_COMPUTE named; GRAPH_RECOMPUTE (payload: u32 slot) runs one again.
// llama.cpp's tensor split runs a dozen subgraphs per token on every node:
// each is sent once, then only named.
#define TB_KEPT_GRAPHS 32
struct tb_graph_header {
    uint32_t n_tensors;
    uint32_t n_nodes;         // for SUPPORTS_OP: 0
    uint32_t slot;            // GRAPH_COMPUTE: where the node keeps it (< TB_KEPT_GRAPHS); otherwise 0
    uint32_t reserved;
};

// ---- helpers shared by both sides -----------------------------------------

void tb_abi_fill(struct tb_abi * abi);
// 0 if equal; otherwise -1 with a message naming both versions.
int  tb_abi_compare(const struct tb_abi * mine, const struct tb_abi * theirs, const char * their_role,
                    char * err, size_t err_len);

const char * tb_cmd_name(uint16_t cmd);

// Send one message (header + up to two payload parts). Does not flush.
int tb_msg_send(struct tb_transport * t, uint16_t cmd, uint16_t flags, uint64_t id,
                const void * a, size_t a_len, const void * b, size_t b_len);
// Read and check a header (magic, command range, payload limit).
int tb_msg_recv_header(struct tb_transport * t, struct tb_header * h, char * err, size_t err_len);

// Overflow-checked ggml_nbytes of a wire tensor. Returns 0 and sets *out on
// success; -1 with a reason when the shape is invalid.
int tb_wire_nbytes(const struct tb_wire_tensor * w, uint64_t * out, char * err, size_t err_len);

// ---- node side: decoding with validation -----------------------------------

// How the decoder reaches the node's buffers without knowing their owner.
struct tb_buffer_view {
    void *   base;
    uint64_t size;
    void *   ggml_buffer;     // ggml_backend_buffer_t
};
typedef bool (*tb_buffer_lookup_fn)(void * ctx, uint64_t handle, struct tb_buffer_view * out);

// Validate `n` wire tensors and build ggml tensors for them in ctx (created
// with no_alloc). out[i] receives tensor i. Returns 0, or -1 with a reason.
int tb_decode_tensors(struct ggml_context * ctx, const struct tb_wire_tensor * w, uint32_t n,
                      tb_buffer_lookup_fn lookup, void * lookup_ctx, bool require_data,
                      struct ggml_tensor ** out, char * err, size_t err_len);

#ifdef __cplusplus
}
#endif
