// transport/tcp.c - the TCP transport: buffered writes, timed reads; and
// connecting (dial, listen, accept), since every connection starts as TCP
// (transport.h).
//
// Small messages (set-input, graph, get-output) are coalesced in a write
// buffer and leave in one segment at flush, so a token costs one round trip
// per node. Large payloads (weights) bypass the buffer.
#include "../transport.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0   // macOS: SO_NOSIGPIPE on the socket does the same (tb_adopt)
#endif

#define TCP_WBUF_SIZE (256 * 1024)
#define WAIT_SLICE_MS 100   // how long a blocked send sleeps before it looks for signs of life

enum one_way { BOTH_WAYS = 0, SENDS, RECEIVES };   // tb_one_way

struct tcp_transport {
    struct tb_transport base;   // must be first: ops receive &base
    int    fd;
    int    one_way;             // enum one_way
    int64_t drained_ms;         // SENDS: when the peer's heartbeat bytes were last read away
    size_t wlen;
    uint8_t wbuf[TCP_WBUF_SIZE];
};

// Wait until fd is readable/writable. Returns 1 ready, 0 timeout, -1 error.
static int wait_fd(int fd, short events, int timeout_ms) {
    struct pollfd p = { .fd = fd, .events = events };
    for (;;) {
        int rc = poll(&p, 1, timeout_ms > 0 ? timeout_ms : -1);
        if (rc < 0 && errno == EINTR) continue;
        return rc < 0 ? -1 : (rc == 0 ? 0 : 1);
    }
}

// Bytes the peer sent that wait to be read, or -1.
static int waiting_in(int fd) {
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 ? n : -1;
}

// The sending end of a one-way connection reads away the heartbeat bytes
// its peer writes back (tcp_alive): zero bytes, nothing else comes that
// way. At most 16 KiB a call, so a peer writing without end cannot hold us
// here. Returns 1 when some came, 0 when none, or -1 with the failure
// recorded (the peer closed, or wrote something else).
static int drain_heartbeats(struct tcp_transport * t) {
    uint8_t scratch[256];
    int got = 0;
    for (int reads = 0; reads < 64; reads++) {
        const ssize_t k = recv(t->fd, scratch, sizeof scratch, MSG_DONTWAIT);
        if (k > 0) {
            for (ssize_t i = 0; i < k; i++) {
                if (scratch[i] != 0) return tb_fail(&t->base, TB_IO_BROKEN, "%s: the receiving end of a link wrote data", t->base.peer);
            }
            got = 1;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        const int kind = k == 0 || errno == ECONNRESET ? TB_IO_CLOSED : TB_IO_BROKEN;
        return tb_fail(&t->base, kind, "%s: %s", t->base.peer, k == 0 ? "connection closed by peer" : strerror(errno));
    }
    t->drained_ms = tb_now_ms();
    return got;
}

// Wait until the socket takes more. A peer that does not read may still be
// alive and busy: a node computing a long graph sends keepalives, and the
// next node of a pipelined prompt, still on the piece before, gives a
// heartbeat on the link it receives ours on (tb_one_way). So, as in the
// frame ring (ring.c, wait_progress), only silence times out: bytes
// arriving meanwhile restart the clock (a heartbeat is read away, anything
// else left queued for whoever reads it). Returns 0, or -1 with the
// failure recorded.
static int wait_writable(struct tcp_transport * t) {
    const int timeout_ms = t->base.timeout_ms;
    int64_t deadline = timeout_ms > 0 ? tb_now_ms() + timeout_ms : 0;
    int heard = t->one_way == SENDS ? 0 : waiting_in(t->fd);
    for (;;) {
        int slice = WAIT_SLICE_MS;
        if (deadline > 0) {
            const int64_t left = deadline - tb_now_ms();
            if (left <= 0) return tb_fail(&t->base, TB_IO_TIMEOUT, "%s: send timed out after %d ms", t->base.peer, timeout_ms);
            if (left < slice) slice = (int) left;
        }
        const int w = wait_fd(t->fd, POLLOUT, slice);
        if (w > 0) return 0;
        if (w < 0) return tb_fail(&t->base, TB_IO_BROKEN, "%s: poll failed: %s", t->base.peer, strerror(errno));
        if (t->one_way == SENDS) {
            const int got = drain_heartbeats(t);
            if (got < 0) return -1;
            if (got > 0 && deadline > 0) deadline = tb_now_ms() + timeout_ms;
            continue;
        }
        const int now_heard = waiting_in(t->fd);
        if (now_heard > heard && deadline > 0) deadline = tb_now_ms() + timeout_ms;
        if (now_heard >= 0) heard = now_heard;
    }
}

static int write_all(struct tcp_transport * t, const uint8_t * p, size_t n) {
    // Heartbeats that came while we did not wait are read away too, at most
    // once a second (a system call), so they never fill the socket.
    if (t->one_way == SENDS && tb_now_ms() - t->drained_ms >= 1000 && drain_heartbeats(t) < 0) return -1;
    while (n > 0) {
        ssize_t k = send(t->fd, p, n, MSG_NOSIGNAL);
        if (k > 0) { p += k; n -= (size_t) k; t->base.bytes_sent += (uint64_t) k; continue; }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (wait_writable(t) != 0) return -1;
            continue;
        }
        int kind = k == 0 || errno == EPIPE || errno == ECONNRESET ? TB_IO_CLOSED : TB_IO_BROKEN;
        return tb_fail(&t->base, kind, "%s: send failed: %s", t->base.peer, k == 0 ? "connection closed" : strerror(errno));
    }
    return 0;
}

static int tcp_flush(struct tb_transport * base) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    if (t->wlen == 0) return 0;
    int rc = write_all(t, t->wbuf, t->wlen);
    t->wlen = 0;
    base->flushes++;
    return rc;
}

static int tcp_send(struct tb_transport * base, const void * data, size_t len) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    if (t->wlen + len <= TCP_WBUF_SIZE) {
        memcpy(t->wbuf + t->wlen, data, len);
        t->wlen += len;
        return 0;
    }
    // Too big to coalesce: drain what is queued, then write straight through.
    if (tcp_flush(base) != 0) return -1;
    if (len <= TCP_WBUF_SIZE / 4) {
        memcpy(t->wbuf, data, len);
        t->wlen = len;
        return 0;
    }
    return write_all(t, data, len);
}

static int tcp_recv(struct tb_transport * base, void * data, size_t len) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    uint8_t * p = data;
    while (len > 0) {
        // The bytes are usually here already (the rest of a message, a reply
        // that came while we sent): take them without a poll() first, and
        // poll() only when nothing is waiting. Measured: about a third less
        // kernel time per node added to a split (docs/benchmarks.md).
        ssize_t k = recv(t->fd, p, len, MSG_DONTWAIT);
        if (k > 0) { p += k; len -= (size_t) k; base->bytes_received += (uint64_t) k; continue; }
        if (k == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
            int kind = k == 0 || errno == ECONNRESET ? TB_IO_CLOSED : TB_IO_BROKEN;
            return tb_fail(base, kind, "%s: %s", base->peer, k == 0 ? "connection closed by peer" : strerror(errno));
        }
        int wait = base->timeout_ms;
        if (base->deadline_ms > 0) {
            const int64_t left = base->deadline_ms - tb_now_ms();
            if (left <= 0) return tb_fail(base, TB_IO_TIMEOUT, "%s: message not complete in time (too slow a sender)", base->peer);
            if (wait <= 0 || left < wait) wait = (int) left;
        }
        int w = wait_fd(t->fd, POLLIN, wait);
        if (w == 0 && base->deadline_ms > 0 && tb_now_ms() >= base->deadline_ms) continue;   // said above
        if (w == 0) return tb_fail(base, TB_IO_TIMEOUT, "%s: no answer within %d ms", base->peer, base->timeout_ms);
        if (w < 0) return tb_fail(base, TB_IO_BROKEN, "%s: poll failed: %s", base->peer, strerror(errno));
    }
    return 0;
}

static int tcp_poll(struct tb_transport * base, int timeout_ms) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    struct pollfd p = { .fd = t->fd, .events = POLLIN };
    int rc;
    do { rc = poll(&p, 1, timeout_ms); } while (rc < 0 && errno == EINTR);
    if (rc < 0) return tb_fail(base, TB_IO_BROKEN, "%s: poll failed: %s", base->peer, strerror(errno));
    return rc > 0 ? 1 : 0;
}

// The socket takes more (POLLOUT), and what is queued plus len still fits the buffer a flush writes.
static int tcp_room(struct tb_transport * base, size_t len) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    if (t->wlen + len > TCP_WBUF_SIZE) return 0;
    struct pollfd p = { .fd = t->fd, .events = POLLOUT };
    int rc;
    do { rc = poll(&p, 1, 0); } while (rc < 0 && errno == EINTR);
    return rc == 1 && (p.revents & POLLOUT) && !(p.revents & (POLLERR | POLLHUP));
}

// The receiving end of a one-way connection: one byte back, which its
// sender reads away as a sign of life. Never waits; 0 when it did not go.
static int tcp_alive(struct tb_transport * base) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    if (t->one_way != RECEIVES || t->wlen != 0) return 0;
    const uint8_t beat = 0;
    ssize_t k;
    do { k = send(t->fd, &beat, 1, MSG_DONTWAIT | MSG_NOSIGNAL); } while (k < 0 && errno == EINTR);
    return k == 1;
}

static void tcp_close(struct tb_transport * base) {
    struct tcp_transport * t = (struct tcp_transport *) base;
    // Unread heartbeats would make the close a reset, which may drop our
    // last frame (a GAVE_UP) before the peer reads it.
    if (t->fd >= 0 && t->one_way == SENDS) (void) drain_heartbeats(t);
    if (t->fd >= 0) close(t->fd);
    free(t);
}

static const struct tb_transport_ops tcp_ops = {
    .name = "tcp", .send = tcp_send, .flush = tcp_flush, .recv = tcp_recv, .poll = tcp_poll, .room = tcp_room,
    .close = tcp_close, .alive = tcp_alive,
};

void tb_one_way(struct tb_transport * base, int sending) {
    if (base->ops != &tcp_ops) return;
    struct tcp_transport * t = (struct tcp_transport *) base;
    t->one_way = sending ? SENDS : RECEIVES;
    t->drained_ms = tb_now_ms();
}

// Each socket's send and receive buffer: 4 MiB, or TBRPC_TCP_BUFFER bytes
// (4 KiB to 256 MiB; other values are ignored). Linux caps what is asked at
// net.core.wmem_max and rmem_max; macOS refuses more than
// kern.ipc.maxsockbuf allows, so set_buffer halves until it is taken.
// Larger suits a link with a long round trip; small ones make a sender wait
// sooner, as a pipelined prompt's activations of many MB do on any machine
// (tests use it so).
static int socket_buffer_bytes(void) {
    const char * e = getenv("TBRPC_TCP_BUFFER");
    char * end = NULL;
    const long v = e ? strtol(e, &end, 10) : 0;
    return e && *e && end && *end == '\0' && v >= 4096 && v <= 256L * 1024 * 1024 ? (int) v : 4 * 1024 * 1024;
}

static void set_buffer(int fd, int which, int bytes) {
    while (setsockopt(fd, SOL_SOCKET, which, &bytes, sizeof bytes) != 0 && bytes > 64 * 1024) bytes /= 2;
}

static void set_socket_options(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    set_buffer(fd, SO_SNDBUF, socket_buffer_bytes());
    set_buffer(fd, SO_RCVBUF, socket_buffer_bytes());
#ifdef SO_NOSIGPIPE
    setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof one);
#endif
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

static void describe_peer(int fd, char * out, size_t out_len) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
    if (getpeername(fd, (struct sockaddr *) &ss, &sl) == 0)
        getnameinfo((struct sockaddr *) &ss, sl, host, sizeof host, port, sizeof port, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(out, out_len, "%s:%s", host, port);
}

int tb_tcp_same_host(struct tb_transport * base) {
    int fd = ((struct tcp_transport *) base)->fd;
    struct sockaddr_storage mine, theirs;
    socklen_t ml = sizeof mine, tl = sizeof theirs;
    if (getsockname(fd, (struct sockaddr *) &mine, &ml) != 0 || getpeername(fd, (struct sockaddr *) &theirs, &tl) != 0) return 0;
    if (mine.ss_family != theirs.ss_family) return 0;
    if (mine.ss_family == AF_INET) {
        return ((struct sockaddr_in *) &mine)->sin_addr.s_addr == ((struct sockaddr_in *) &theirs)->sin_addr.s_addr;
    }
    if (mine.ss_family == AF_INET6) {
        return memcmp(&((struct sockaddr_in6 *) &mine)->sin6_addr, &((struct sockaddr_in6 *) &theirs)->sin6_addr,
                      sizeof(struct in6_addr)) == 0;
    }
    return mine.ss_family == AF_UNIX;
}

int tb_tcp_fd(struct tb_transport * base) {
    return ((struct tcp_transport *) base)->fd;
}

struct tb_transport * tb_adopt(int fd, int timeout_ms) {
    struct tcp_transport * t = calloc(1, sizeof *t);
    if (!t) { close(fd); return NULL; }
    t->base.ops = &tcp_ops;
    t->base.timeout_ms = timeout_ms;
    t->fd = fd;
    snprintf(t->base.describe, sizeof t->base.describe, "tcp");
    set_socket_options(fd);
    describe_peer(fd, t->base.peer, sizeof t->base.peer);
    return &t->base;
}

// Non-blocking connect bounded by timeout_ms (a dead host must not hang us).
static int connect_with_timeout(int fd, const struct sockaddr * sa, socklen_t sl, int timeout_ms) {
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    if (connect(fd, sa, sl) == 0) return 0;
    if (errno != EINPROGRESS) return -1;
    int w = wait_fd(fd, POLLOUT, timeout_ms);
    if (w <= 0) { errno = w == 0 ? ETIMEDOUT : errno; return -1; }
    int so_err = 0;
    socklen_t len = sizeof so_err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_err, &len);
    if (so_err != 0) { errno = so_err; return -1; }
    return 0;
}

// A socket that no worker process inherits (macOS has no SOCK_CLOEXEC).
static int cloexec_socket(const struct addrinfo * ai) {
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd >= 0 && fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) { close(fd); return -1; }
    return fd;
}

// Bind fd to the local address `from` (any port) before connecting.
static int bind_from(int fd, int family, const char * from) {
    struct addrinfo hints = { .ai_family = family, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICHOST }, * res = NULL;
    if (getaddrinfo(from, "0", &hints, &res) != 0) { errno = EADDRNOTAVAIL; return -1; }
    int rc = bind(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return rc;
}

// What a failed connect means to a caller (transport.h): no answer in time,
// nothing to connect to there, or a failure of this process's own resources.
static int dial_error_kind(int e) {
    switch (e) {
        case ETIMEDOUT: return TB_IO_TIMEOUT;
        case EMFILE: case ENFILE: case ENOMEM: case ENOBUFS: return TB_IO_BROKEN;
        default: return TB_IO_REFUSED;   // refused, unreachable network or host, address not here, firewall
    }
}

struct tb_transport * tb_dial(const char * host, int port, const char * from, int timeout_ms, int * kind, char * err,
                              size_t err_len) {
    char port_str[16];
    snprintf(port_str, sizeof port_str, "%d", port);
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, * res = NULL;
    int gai = getaddrinfo(host, port_str, &hints, &res);
    if (gai != 0) {
        *kind = gai == EAI_MEMORY ? TB_IO_BROKEN : TB_IO_REFUSED;
        snprintf(err, err_len, "%s:%d: cannot resolve host: %s", host, port, gai_strerror(gai));
        return NULL;
    }
    int64_t deadline = tb_now_ms() + timeout_ms;
    int last_errno = 0;
    for (struct addrinfo * ai = res; ai; ai = ai->ai_next) {
        int fd = cloexec_socket(ai);
        if (fd < 0) { last_errno = errno; continue; }
        if (from && *from && bind_from(fd, ai->ai_family, from) != 0) { last_errno = errno; close(fd); continue; }
        int left = (int) (deadline - tb_now_ms());
        if (connect_with_timeout(fd, ai->ai_addr, ai->ai_addrlen, left > 0 ? left : 1) == 0) {
            freeaddrinfo(res);
            struct tb_transport * t = tb_adopt(fd, timeout_ms);
            *kind = t ? TB_IO_OK : TB_IO_BROKEN;
            if (t) snprintf(t->peer, sizeof t->peer, "%s:%d", host, port);
            else snprintf(err, err_len, "%s:%d: out of memory", host, port);
            return t;
        }
        last_errno = errno;
        close(fd);
    }
    freeaddrinfo(res);
    *kind = dial_error_kind(last_errno);
    snprintf(err, err_len, "%s:%d: cannot connect: %s", host, port,
             last_errno == ETIMEDOUT ? "timed out" : strerror(last_errno));
    return NULL;
}

struct tb_listener {
    int fd;
    int port;
};

static int bound_port(int fd) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *) &ss, &sl) != 0) return -1;
    if (ss.ss_family == AF_INET)  return ntohs(((struct sockaddr_in *)  &ss)->sin_port);
    if (ss.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *) &ss)->sin6_port);
    return -1;
}

struct tb_listener * tb_listen(const char * host, int port, char * err, size_t err_len) {
    char port_str[16];
    snprintf(port_str, sizeof port_str, "%d", port);
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE }, * res = NULL;
    int gai = getaddrinfo(host && *host ? host : NULL, port_str, &hints, &res);
    if (gai != 0) {
        snprintf(err, err_len, "%s:%d: cannot resolve: %s", host, port, gai_strerror(gai));
        return NULL;
    }
    int fd = -1, last_errno = 0;
    for (struct addrinfo * ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = cloexec_socket(ai);
        if (fd < 0) { last_errno = errno; continue; }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
            last_errno = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) { snprintf(err, err_len, "%s:%d: cannot listen: %s", host, port, strerror(last_errno)); return NULL; }
    struct tb_listener * l = malloc(sizeof *l);
    if (!l) { close(fd); snprintf(err, err_len, "out of memory"); return NULL; }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);   // accept never blocks: poll() says when
    l->fd = fd;
    l->port = bound_port(fd);
    return l;
}

int tb_listener_port(const struct tb_listener * l) { return l->port; }
int tb_listener_fd(const struct tb_listener * l) { return l->fd; }

int tb_accept_fd(struct tb_listener * l) {
    int fd;
    do { fd = accept(l->fd, NULL, NULL); } while (fd < 0 && errno == EINTR);
    if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);   // BSDs pass the listener's on: not ours to hand on
    return fd;
}

struct tb_transport * tb_accept(struct tb_listener * l, int timeout_ms) {
    int fd = tb_accept_fd(l);
    return fd >= 0 ? tb_adopt(fd, timeout_ms) : NULL;
}

void tb_listener_close(struct tb_listener * l) {
    if (!l) return;
    close(l->fd);
    free(l);
}

int tb_parse_endpoint(const char * endpoint, char * host, size_t host_len, int * port, char * err, size_t err_len) {
    const char * colon = strrchr(endpoint, ':');
    if (!colon || colon == endpoint || colon[1] == '\0') {
        snprintf(err, err_len, "'%s' is not host:port", endpoint);
        return -1;
    }
    const char * h = endpoint;
    size_t hl = (size_t) (colon - endpoint);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') { h++; hl -= 2; }
    char * end = NULL;
    long p = strtol(colon + 1, &end, 10);
    if (*end != '\0' || p <= 0 || p > 65535) {
        snprintf(err, err_len, "'%s': port must be 1-65535", endpoint);
        return -1;
    }
    if (hl + 1 > host_len) {
        snprintf(err, err_len, "'%s': host name too long", endpoint);
        return -1;
    }
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (int) p;
    return 0;
}
