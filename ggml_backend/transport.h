// transport.h - moving bytes between a head and a node.
//
// The protocol (proto.h) speaks in whole messages; a transport only moves
// bytes. It knows nothing of ggml. Every implementation offers the same
// six operations:
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
// Errors: every call returns 0 on success and -1 on failure, with a
// human-readable reason in t->error (which names the peer).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct tb_transport;

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
    char     peer[96];        // "host:port" of the other side, for messages
    char     error[256];      // reason of the last failure
    uint64_t bytes_sent;
    uint64_t bytes_received;
    uint64_t flushes;         // number of flushes that actually sent bytes
};

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

// Split "host:port" (or "[v6]:port") into parts. Returns 0 or -1 with err.
int tb_parse_endpoint(const char * endpoint, char * host, size_t host_len, int * port, char * err, size_t err_len);

#ifdef __cplusplus
}
#endif
