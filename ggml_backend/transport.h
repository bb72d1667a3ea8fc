// transport.h - moving bytes between a head and a node.
//
// The protocol (proto.h) speaks in whole messages; a transport only moves
// bytes. It knows nothing of ggml. Every implementation offers the same
// five operations:
//   send   queue bytes (may buffer; a message is complete only after flush)
//   flush  push everything queued so far to the peer (called at message
//          boundaries where the sender is about to wait for an answer)
//   recv   read exactly n bytes, failing after timeout_ms without progress
//   poll   wait until bytes are ready, so a server can idle and still stop
//   close  release everything; the struct is freed
// TCP is the first implementation (transport/tcp.c). RDMA (fixed-size
// registered frames, SEND/RECV only) and shared memory fit the same shape:
// send copies into the current frame, flush posts it, recv consumes frames.
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

struct tb_transport_ops {
    const char * name;
    int  (*send) (struct tb_transport * t, const void * data, size_t len);
    int  (*flush)(struct tb_transport * t);
    int  (*recv) (struct tb_transport * t, void * data, size_t len);
    // 1 when bytes are ready to read, 0 after timeout_ms without, -1 on error
    int  (*poll) (struct tb_transport * t, int timeout_ms);
    void (*close)(struct tb_transport * t);
};

struct tb_transport {
    const struct tb_transport_ops * ops;
    int      timeout_ms;      // recv/send give up after this long without progress; <= 0 waits forever
    int64_t  deadline_ms;     // recv also gives up at this tb_now_ms(), progress or not (0: no deadline):
                              // a server's bound on one whole message, against a peer that trickles bytes
    char     peer[96];        // "host:port" of the other side, for messages
    char     error[256];      // reason of the last failure
    int      error_kind;      // enum tb_io_error of the last failure
    char     describe[96];    // what carries the bytes, and why: "tcp", "shm 16x64K", "tcp: TBRPC_TRANSPORT=tcp"
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
static inline void tb_close(struct tb_transport * t)                          { if (t) t->ops->close(t); }

// --- TCP -------------------------------------------------------------------
// Connect to host:port within timeout_ms. On failure returns NULL and writes
// the reason into err.
struct tb_transport * tb_tcp_connect(const char * host, int port, int timeout_ms, char * err, size_t err_len);

// A listening socket. Returns the fd, or -1 with the reason in err.
// port 0 picks a free port; tb_tcp_bound_port() tells which.
int tb_tcp_listen(const char * host, int port, char * err, size_t err_len);
int tb_tcp_bound_port(int listen_fd);

// Wrap an accepted connection fd. Takes ownership of fd.
struct tb_transport * tb_tcp_from_fd(int fd, int timeout_ms);

// The socket under a TCP transport (a shared-memory ring keeps it as doorbell and liveness).
int tb_tcp_fd(struct tb_transport * t);
// 1 when both ends of the connection have the same address: the peer is on this host.
int tb_tcp_same_host(struct tb_transport * t);

// --- Shared memory (transport/shm.c) -----------------------------------------
// A ring of frames (transport/ring.h) in a segment the node creates and the
// head attaches to; the TCP connection they negotiated it over stays open as
// doorbell and liveness. The offer travels in the protocol's UPGRADE reply.
#define TB_SHM_NAME_LEN 32
#define TB_SHM_SLOTS    16            // what a head asks for: 16 frames of 64 KiB each way
#define TB_SHM_STRIDE   (64u * 1024)
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

// Split "host:port" (or "[v6]:port") into parts. Returns 0 or -1 with err.
int tb_parse_endpoint(const char * endpoint, char * host, size_t host_len, int * port, char * err, size_t err_len);

#ifdef __cplusplus
}
#endif
