// tcp_send_tests.c - a TCP send (transport/tcp.c) that the peer does not read:
// only silence times out. A node computing a long graph does not read its
// connection, but sends keepalives; a send blocked meanwhile must wait as
// long as they come, and fail with TB_IO_TIMEOUT once they stop. One case
// per run:
//   tcp_send_tests CASE    prints "PASS CASE" and exits 0, or says what failed.
//
//   busy_peer    the peer writes a byte every 100 ms for 1.5 s without reading,
//                then reads: the send (timeout 300 ms) completes
//   silent_peer  the peer writes a byte every 100 ms for 1 s, then neither
//                writes nor reads: the send fails with TB_IO_TIMEOUT about
//                300 ms after the last byte
//   one_way      a peer link (tb_one_way): the receiving end's tb_alive is the
//                heartbeat byte that keeps the sender waiting, and the
//                sending end reads those bytes away, so none stay queued
//   one_way_data the receiving end of a link writes a byte that is not a
//                heartbeat: the sender's next write fails, TB_IO_BROKEN
#include "transport.h"

#include "check.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { TIMEOUT_MS = 300, BEAT_MS = 100, PAYLOAD = 64 << 20 };

struct peer {
    int fd;
    int beats;    // bytes written, one every BEAT_MS, before ...
    int reads;    // ... reading everything (1), or going silent (0)
};

static void sleep_ms(int ms) {
    struct timespec ts = { ms / 1000, (long) (ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
}

static void * run_peer(void * arg) {
    struct peer * p = arg;
    for (int i = 0; i < p->beats; i++) {
        sleep_ms(BEAT_MS);
        const char b = 'k';
        if (send(p->fd, &b, 1, MSG_NOSIGNAL) != 1) return NULL;
    }
    if (!p->reads) return NULL;
    static char sink[1 << 16];
    while (recv(p->fd, sink, sizeof sink, 0) > 0) {}
    return NULL;
}

// A transport dialed to a loopback listener, and the accepted end (*peer_fd),
// whose receive buffer is kept small so the payload cannot all fit.
static struct tb_transport * connected_pair(int * peer_fd) {
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t sl = sizeof sa;
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *) &sa, sl) == 0 && listen(lfd, 1) == 0, "listen: %s", strerror(errno));
    CHECK(getsockname(lfd, (struct sockaddr *) &sa, &sl) == 0, "getsockname: %s", strerror(errno));
    char err[256] = "";
    int kind = -1;
    struct tb_transport * t = tb_dial("127.0.0.1", ntohs(sa.sin_port), NULL, 1000, &kind, err, sizeof err);
    CHECK(t != NULL, "dial: %s", err);
    *peer_fd = accept(lfd, NULL, NULL);
    CHECK(*peer_fd >= 0, "accept: %s", strerror(errno));
    const int small = 64 << 10;
    setsockopt(*peer_fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    close(lfd);
    t->timeout_ms = TIMEOUT_MS;
    return t;
}

// Send PAYLOAD bytes while the peer behaves as `p` says; the result of the
// flush, the transport's kind, and how long it took (ms) in *took.
static int send_against(struct peer p, int * kind, int64_t * took, char * error, size_t error_len) {
    struct tb_transport * t = connected_pair(&p.fd);
    uint8_t * payload = calloc(1, PAYLOAD);
    CHECK(payload != NULL, "out of memory");
    pthread_t th;
    CHECK(pthread_create(&th, NULL, run_peer, &p) == 0, "pthread_create");
    const int64_t started = tb_now_ms();
    int rc = tb_send(t, payload, PAYLOAD);
    if (rc == 0) rc = tb_flush(t);
    *took = tb_now_ms() - started;
    *kind = t->error_kind;
    snprintf(error, error_len, "%s", t->error);
    tb_close(t);                  // the peer's recv then ends (a silent peer has returned already)
    pthread_join(th, NULL);
    close(p.fd);
    free(payload);
    return rc;
}

static void case_busy_peer(void) {
    int kind = -1;
    int64_t took = 0;
    char error[256] = "";
    const int rc = send_against((struct peer) { .beats = 15, .reads = 1 }, &kind, &took, error, sizeof error);
    CHECK(rc == 0, "a send to a peer that wrote every %d ms failed after %lld ms: %s", BEAT_MS, (long long) took, error);
    CHECK(took >= 15 * BEAT_MS, "the send took %lld ms: the peer did not hold it up, nothing was tested", (long long) took);
}

static void case_silent_peer(void) {
    int kind = -1;
    int64_t took = 0;
    char error[256] = "";
    const int rc = send_against((struct peer) { .beats = 10, .reads = 0 }, &kind, &took, error, sizeof error);
    CHECK(rc != 0, "a send to a peer that neither read nor wrote for %lld ms succeeded", (long long) took);
    CHECK(kind == TB_IO_TIMEOUT, "kind %s, want timeout (%s)", tb_io_error_name(kind), error);
    CHECK(strstr(error, "send timed out") != NULL, "\"%s\"", error);
    CHECK(took >= 10 * BEAT_MS + TIMEOUT_MS - 50 && took <= 10 * BEAT_MS + 6 * TIMEOUT_MS,
          "failed after %lld ms, want about %d (the last byte, then the timeout)", (long long) took, 10 * BEAT_MS + TIMEOUT_MS);
}

struct link_end {
    struct tb_transport * r;   // the receiving end of a one-way connection
    _Atomic int beats_given;   // read by the sender while this end's thread runs
};

static void * run_link_receiver(void * arg) {
    struct link_end * e = arg;
    for (int i = 0; i < 15; i++) {
        sleep_ms(BEAT_MS);
        e->beats_given += tb_alive(e->r);
    }
    static char sink[1 << 16];
    const int fd = tb_tcp_fd(e->r);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);   // tb_adopt made it non-blocking
    for (size_t got = 0; got < PAYLOAD; ) {
        const ssize_t k = recv(fd, sink, sizeof sink, 0);
        if (k <= 0) return NULL;
        got += (size_t) k;
    }
    for (int i = 0; i < 3; i++) {   // while the sender, done, does not wait
        sleep_ms(BEAT_MS);
        e->beats_given += tb_alive(e->r);
    }
    while (recv(fd, sink, sizeof sink, 0) > 0) {}
    return NULL;
}

static int queued_bytes(int fd) {
    int n = -1;
    CHECK(ioctl(fd, FIONREAD, &n) == 0, "FIONREAD: %s", strerror(errno));
    return n;
}

static void case_one_way(void) {
    int peer_fd = -1;
    struct tb_transport * t = connected_pair(&peer_fd);
    struct tb_transport * r = tb_adopt(peer_fd, 1000);
    CHECK(r != NULL, "adopt failed");
    const int small = 64 << 10;
    setsockopt(tb_tcp_fd(r), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);   // tb_adopt set 4 MiB
    CHECK(tb_alive(r) == 0 && tb_alive(t) == 0, "a TCP connection carrying messages both ways has a heartbeat");
    tb_one_way(r, 0);
    tb_one_way(t, 1);
    CHECK(tb_alive(t) == 0, "the sending end of a one-way connection has a heartbeat");

    uint8_t * payload = calloc(1, PAYLOAD);
    CHECK(payload != NULL, "out of memory");
    struct link_end e = { .r = r };
    pthread_t th;
    CHECK(pthread_create(&th, NULL, run_link_receiver, &e) == 0, "pthread_create");
    const int64_t started = tb_now_ms();
    int rc = tb_send(t, payload, PAYLOAD);
    if (rc == 0) rc = tb_flush(t);
    const int64_t took = tb_now_ms() - started;
    CHECK(rc == 0, "a send to a receiver that gave a heartbeat every %d ms failed after %lld ms: %s", BEAT_MS,
          (long long) took, t->error);
    CHECK(took >= 15 * BEAT_MS, "the send took %lld ms: the receiver did not hold it up, nothing was tested", (long long) took);
    // Heartbeats that come while the sender does not wait are read away by
    // its next write a second or more after the last time it read them.
    sleep_ms(1100);
    CHECK(e.beats_given == 18, "the receiving end gave %d of 18 heartbeats", e.beats_given);
    CHECK(queued_bytes(tb_tcp_fd(t)) >= 3, "%d bytes queued on the sending end: the case tests nothing",
          queued_bytes(tb_tcp_fd(t)));
    const uint8_t small_msg[16] = { 0 };
    CHECK(tb_send(t, small_msg, sizeof small_msg) == 0 && tb_flush(t) == 0, "%s", t->error);
    CHECK(queued_bytes(tb_tcp_fd(t)) == 0, "%d heartbeat bytes left queued on the sending end",
          queued_bytes(tb_tcp_fd(t)));
    tb_close(t);
    pthread_join(th, NULL);
    tb_close(r);
    free(payload);
}

static void case_one_way_data(void) {
    int peer_fd = -1;
    struct tb_transport * t = connected_pair(&peer_fd);
    tb_one_way(t, 1);
    CHECK(send(peer_fd, "x", 1, MSG_NOSIGNAL) == 1, "peer send: %s", strerror(errno));
    sleep_ms(1100);   // the sender reads what came back at most once a second
    const uint8_t msg[16] = { 0 };
    const int rc = tb_send(t, msg, sizeof msg) == 0 ? tb_flush(t) : -1;
    CHECK(rc != 0, "a link whose receiving end wrote data went on");
    CHECK(t->error_kind == TB_IO_BROKEN && strstr(t->error, "wrote data"), "kind %s: %s", tb_io_error_name(t->error_kind),
          t->error);
    tb_close(t);
    close(peer_fd);
}

int main(int argc, char ** argv) {
    static const struct { const char * name; void (*fn)(void); } cases[] = {
        { "busy_peer", case_busy_peer }, { "silent_peer", case_silent_peer }, { "one_way", case_one_way },
        { "one_way_data", case_one_way_data },
    };
    signal(SIGPIPE, SIG_IGN);   // a send to a closed peer fails; MSG_NOSIGNAL is not everywhere
    for (size_t i = 0; argc == 2 && i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(argv[1], cases[i].name) != 0) continue;
        cases[i].fn();
        printf("PASS %s\n", cases[i].name);
        return 0;
    }
    fprintf(stderr, "usage: tcp_send_tests CASE (busy_peer, silent_peer, one_way, one_way_data)\n");
    return 2;
}
