// transport.h - moving bytes between a head and a node, or two nodes.
//
// The protocol (proto.h) speaks in whole messages; a transport only moves
// bytes. It knows nothing of ggml. Every implementation offers the same
// six operations, and a seventh where the wire has room for it:
//   send   queue bytes (may buffer; a message is complete only after flush)
//   flush  push everything queued so far to the peer (called at message
//          boundaries where the sender is about to wait for an answer)
//   recv   read exactly n bytes, failing after timeout_ms without progress
//   poll   wait until bytes are ready, so a server can idle and still stop
//   room   whether len bytes could be sent and flushed now without waiting
//          (a keepalive to a reader that is not reading must not block)
//   close  release everything; the struct is freed
//   alive  (optional) show the peer this side lives without taking any of
//          its room: a node that computes and does not read keeps a peer
//          waiting on it, where a keepalive message would take a slot of a
//          frame ring that peer is not reading (and, left unread ahead of
//          the credits the node returns, stall a peer blocked sending to it).
//          Over TCP only the receiving end of a one-way connection has one
//          (tb_one_way); elsewhere keepalive messages do that job
//
// The layer has three parts. Callers (client_node.c, node.c,
// node_session.c, node_links.c) use only the names below, never those of
// one transport:
//
//   connecting  tb_dial, tb_listen / tb_accept, tb_adopt. Every connection
//               starts as TCP (transport/tcp.c): finding a peer by address
//               and noticing that its process died (end of file) are what
//               TCP does, and shared memory and RDMA have no way of their
//               own to do either. So they never dial: they take over a TCP
//               connection, which stays open under them as the anchor
//               (doorbell for shm, liveness for both).
//   upgrading   transport/upgrade.c: right after the authenticated
//               handshake, the dialing side chooses what to ask for
//               (tb_upgrade_choose), the answering side offers or declines
//               (tb_upgrade_answer), both follow. The head carries these
//               steps in its commands (TRANSPORT_OFFER, TRANSPORT_SWITCH);
//               a dialing node on a fresh peer link, which has no commands
//               yet, as raw structs (tb_upgrade_dial / tb_upgrade_accept).
//               Either way "which transport, and why not the others" is
//               decided by the same two functions, so a head connection and
//               a peer link give the same reasons.
//   moving      the six operations above: tcp.c, shm.c, rdma.c; shm and
//               RDMA share the frame ring (transport/ring.h).
//
// A new transport joins as one new file: its six operations over a wire,
// and what its side of an upgrade does (a kind below, the answer it makes,
// the step each side follows), called from one case each in upgrade.c.
//
// Errors: every call returns 0 on success and -1 on failure, with a kind in
// t->error_kind (enum tb_io_error: what a caller may act on) and a reason in
// t->error that names the peer (what a person reads).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct tb_transport;

enum tb_io_error {
    TB_IO_OK = 0,
    TB_IO_CLOSED,    // the peer closed the connection, or its process is gone
    TB_IO_TIMEOUT,   // no progress within timeout_ms
    TB_IO_REFUSED,   // nothing to connect to: refused, unreachable, unknown host
    TB_IO_BROKEN,    // an I/O error, or bytes that break the wire's rules (a lost or forged frame)
};

// Why a connection or link is carried by TCP (or by nothing) when it might
// have moved: a kind callers act on (Python attaches the fix a user types),
// beside the words in describe. Seen from the dialing side (the head, or the
// node that dials a link): "peer" is the answering side, "here" the dialer.
enum tb_why {
    TB_WHY_NONE = 0,         // it moved (shm, RDMA), or nothing was decided yet
    TB_WHY_ASKED,            // TBRPC_TRANSPORT=tcp, transport = "tcp" in the cluster file
    TB_WHY_PEER_NO_RDMA,     // another host, which has no RDMA device (its HELLO caps, or its answer)
    TB_WHY_NO_RDMA_HERE,     // another host, and the dialing side's verbs library lists no device
    TB_WHY_QP_BUDGET,        // a device's queue pairs are all taken (Apple: 10 per device), either side
    TB_WHY_NO_SHM,           // this host, and a side may not share memory (no process of its own, or no offer)
    TB_WHY_SHM_FAILED,       // this host: the segment could not be made or mapped
    TB_WHY_RDMA_FAILED,      // the RDMA bring-up failed on either side (no GID for the address, port down, profiles differ...)
    TB_WHY_PEER_OLD,         // the peer knows no transport of the kind asked for
    TB_WHY_NO_LINK,          // a node-to-node link could not be made at all: activations go through the head
};

struct tb_transport_ops {
    const char * name;
    int  (*send) (struct tb_transport * t, const void * data, size_t len);
    int  (*flush)(struct tb_transport * t);
    int  (*recv) (struct tb_transport * t, void * data, size_t len);
    // 1 when bytes are ready to read, 0 after timeout_ms without, -1 on error
    int  (*poll) (struct tb_transport * t, int timeout_ms);
    // 1 when len bytes (one small message) can be sent and flushed without waiting, else 0
    int  (*room) (struct tb_transport * t, size_t len);
    void (*close)(struct tb_transport * t);
    // A sign of life outside the byte stream, which a peer waiting on this
    // connection counts as progress: 1 when given, 0 when this transport has
    // none (then a keepalive message is the sign). NULL: none
    int  (*alive)(struct tb_transport * t);
};

struct tb_transport {
    const struct tb_transport_ops * ops;
    int      timeout_ms;      // recv/send give up after this long without progress; <= 0 waits forever
    int64_t  deadline_ms;     // recv also gives up at this tb_now_ms(), progress or not (0: no deadline):
                              // a server's bound on one whole message, against a peer that trickles bytes
    int      rendezvous;      // set by a caller whose peer works on the same step and sends within
                              // microseconds (an all-reduce's partial): a shared-memory wait spins its
                              // whole budget, yielding the core now and then, before sleeping, whatever
                              // the connection's recent waits
                              // were (RDMA always spins first; TCP showed no gain from it on loopback)
    char     peer[96];        // "host:port" of the other side, for messages
    char     error[256];      // reason of the last failure
    int      error_kind;      // enum tb_io_error of the last failure
    char     describe[96];    // what carries the bytes, and why: "tcp", "shm 16x256K", "tcp: asked for"
    int      why;             // enum tb_why: the kind of the reason in describe (TB_WHY_NONE when it moved)
    uint64_t bytes_sent;
    uint64_t bytes_received;
    uint64_t flushes;         // number of flushes that actually sent bytes
};

// Record a failure of t (kind and reason); returns -1 for `return tb_fail(...)`.
int tb_fail(struct tb_transport * t, int kind, const char * fmt, ...) __attribute__((format(printf, 3, 4)));
const char * tb_io_error_name(int kind);
int64_t tb_now_ms(void);   // a monotonic clock, for deadlines
int64_t tb_now_ns(void);   // the same clock in nanoseconds, for measuring

static inline int  tb_send (struct tb_transport * t, const void * d, size_t n) { return t->ops->send(t, d, n); }
static inline int  tb_flush(struct tb_transport * t)                          { return t->ops->flush(t); }
static inline int  tb_recv (struct tb_transport * t, void * d, size_t n)       { return t->ops->recv(t, d, n); }
static inline int  tb_poll (struct tb_transport * t, int timeout_ms)        { return t->ops->poll(t, timeout_ms); }
static inline int  tb_room (struct tb_transport * t, size_t n)              { return t->ops->room(t, n); }
static inline void tb_close(struct tb_transport * t)                          { if (t) t->ops->close(t); }
static inline int  tb_alive(struct tb_transport * t)                          { return t->ops->alive ? t->ops->alive(t) : 0; }

// --- Connecting (transport/tcp.c) -----------------------------------------------
// Dial host:port within timeout_ms, from the local address `from` (NULL: the
// one the kernel's route picks). NULL on failure, with the reason in err and
// its kind (enum tb_io_error) in *kind: TB_IO_REFUSED when there is nothing to
// connect to (refused, unreachable network or host, unknown host, `from` not
// an address of this host), TB_IO_TIMEOUT when nothing answered within
// timeout_ms, TB_IO_BROKEN when this process ran out of descriptors or memory.
struct tb_transport * tb_dial(const char * host, int port, const char * from, int timeout_ms, int * kind, char * err,
                              size_t err_len);

// A listening endpoint. port 0 picks a free port; tb_listener_port() tells
// which. NULL on failure, with the reason in err.
struct tb_listener;
struct tb_listener * tb_listen(const char * host, int port, char * err, size_t err_len);
int  tb_listener_port(const struct tb_listener * l);
int  tb_listener_fd(const struct tb_listener * l);   // to poll() for a dialer together with other descriptors
// The next connection's descriptor (-1: none waiting), for a process that
// hands it on (node.c to a worker, which makes it a transport with tb_adopt).
int  tb_accept_fd(struct tb_listener * l);
struct tb_transport * tb_accept(struct tb_listener * l, int timeout_ms);   // NULL: none waiting
void tb_listener_close(struct tb_listener * l);

// A connection accepted elsewhere (a worker's client). Takes ownership of fd.
struct tb_transport * tb_adopt(int fd, int timeout_ms);

// For what rides on a TCP connection (shm, RDMA, the upgrade): its socket,
// and whether both ends have the same address (the peer is on this host).
int tb_tcp_fd(struct tb_transport * t);
int tb_tcp_same_host(struct tb_transport * t);

// A peer link carries messages one way only (node_links.c); over TCP its
// idle direction then carries the receiver's heartbeat: the receiving end's
// alive writes one byte back, and the sending end reads such bytes away,
// counting them as progress while a send waits. No effect on a connection
// that moved to shared memory or RDMA, whose alive needs no help.
void tb_one_way(struct tb_transport * t, int sending);

// --- Shared memory (transport/shm.c) -----------------------------------------
// A ring of frames (transport/ring.h) in a segment the answering side
// creates and the dialing side attaches to; the TCP connection they
// negotiated it over stays open as doorbell and liveness.
#define TB_SHM_NAME_LEN 32
#define TB_SHM_SLOTS    16            // what a dialer asks for: 16 frames of 256 KiB each way
#define TB_SHM_STRIDE   (256u * 1024)
struct tb_shm_offer {
    uint32_t slots;
    uint32_t stride;
    uint8_t  nonce[16];
    char     name[TB_SHM_NAME_LEN];
};
struct tb_shm;   // a mapped segment, not yet a transport
struct tb_shm * tb_shm_create(uint32_t slots, uint32_t stride, struct tb_shm_offer * offer, char * err, size_t err_len);
struct tb_shm * tb_shm_attach(const struct tb_shm_offer * offer, char * err, size_t err_len);
void tb_shm_discard(struct tb_shm * s);   // unmap (and unlink, on the creating side)
// One transport from an attached segment and its TCP connection: it owns
// both, or on failure (NULL) has discarded the segment and left the TCP
// connection to the caller. The creator's name is unlinked here.
struct tb_transport * tb_shm_transport(struct tb_shm * s, struct tb_transport * tcp, char * err, size_t err_len);

// --- Upgrading (transport/upgrade.c) ----------------------------------------------
// The kinds a connection may move to.
#define TB_TRANSPORT_TCP  0u          // stay on TCP (a peer link's ask then says why)
#define TB_TRANSPORT_SHM  1u          // a ring in shared memory the answering side creates
#define TB_TRANSPORT_RDMA 2u          // a ring over verbs, after the symmetric bring-up (transport/rdma.h)

// What the dialing side asks for (TRANSPORT_OFFER's request): a kind, and for
// shared memory the ring it wants (the answer may pick another geometry).
struct tb_transport_req { uint32_t kind; uint32_t slots; uint32_t stride; uint32_t reserved; };
// The answer: a segment made for this connection, yes to RDMA (all zero), or why not (declined[0] != 0).
// why_kind: enum tb_why of a refusal, as the dialing side will report it.
struct tb_transport_reply { struct tb_shm_offer offer; char declined[160]; uint32_t why_kind; uint32_t reserved; };

// What the dialing side knows when it chooses.
struct tb_upgrade_want {
    int  forced_tcp;            // TBRPC_TRANSPORT=tcp, transport = "tcp": stay, "asked for"
    int  peer_shm, peer_rdma;   // what the answering side said it offers (its HELLO caps)
    const char * no_shm;        // why this side may not map a peer's segment (NULL: it may)
};

// The dialing side: the kind to ask for, or TB_TRANSPORT_TCP with why not (*why_kind: enum tb_why).
uint32_t tb_upgrade_choose(struct tb_transport * tcp, const struct tb_upgrade_want * want, int * why_kind, char * why,
                           size_t why_len);
// The answering side: fill rep (an offer, yes, or why not). no_shm: why this
// side may not create a segment (NULL: it may); a segment goes to *offered.
void tb_upgrade_answer(const struct tb_transport_req * req, const char * no_shm, struct tb_transport_reply * rep,
                       struct tb_shm ** offered);
// The dialing side, after a shared-memory answer: the segment, or NULL with why (*why_kind).
struct tb_shm * tb_upgrade_attach(const struct tb_transport_reply * rep, int * why_kind, char * why, size_t why_len);
// A kind (enum tb_why) from the peer's bytes, as one of ours: a value we do
// not know, or NONE where a refusal was said, is `otherwise`.
int tb_why_from_peer(uint32_t kind, int otherwise);
// The kind (enum tb_why) an RDMA answer's refusal is reported as by the dialing side.
int tb_upgrade_rdma_declined(const struct tb_transport_reply * rep);

// A whole upgrade over a TCP connection that carries nothing else yet (a
// node-to-node link after its greeting), as raw structs: the dialer sends
// {req, why}; the acceptor answers with a tb_transport_reply; for shared
// memory the dialer then says whether it attached (u32); for RDMA both run
// tb_rdma_upgrade. Both return the transport to use from now on: the
// upgraded one (which owns tcp), or tcp itself, its describe "tcp: <why>"
// and its why the kind of that reason (the acceptor's: the dialer's kind).
// NULL only when tcp itself failed (it is closed then), with why.
struct tb_transport * tb_upgrade_dial(struct tb_transport * tcp, const struct tb_upgrade_want * want, char * why,
                                      size_t why_len);
struct tb_transport * tb_upgrade_accept(struct tb_transport * tcp, const char * no_shm, char * why, size_t why_len);

// Split "host:port" (or "[v6]:port") into parts. Returns 0 or -1 with err.
int tb_parse_endpoint(const char * endpoint, char * host, size_t host_len, int * port, char * err, size_t err_len);

#ifdef __cplusplus
}
#endif
