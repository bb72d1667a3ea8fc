// dial_tests.c - what tb_dial (transport/tcp.c) says when it cannot connect:
// the kind a caller acts on (enum tb_io_error) as well as the text. One case
// per run:
//   dial_tests CASE    prints "PASS CASE" and exits 0, or says what failed.
//
//   answered       a listening port: a transport, kind TB_IO_OK
//   refused        a closed port on 127.0.0.1: TB_IO_REFUSED
//   unknown_host   a name that cannot resolve (.invalid, RFC 6761): TB_IO_REFUSED
//   not_from_here  dialing from an address this host does not have: TB_IO_REFUSED
//   no_answer      a listener whose accept queue is full and never accepted
//                  drops further connection requests unanswered (Linux, BSD):
//                  TB_IO_TIMEOUT within the dial's timeout
#include "transport.h"

#include "check.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { DIAL_MS = 400 };

// A listening socket on 127.0.0.1 with the given backlog; *port says where.
static int listen_loopback(int backlog, int * port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0, "socket: %s", strerror(errno));
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t sl = sizeof sa;
    CHECK(bind(fd, (struct sockaddr *) &sa, sl) == 0 && listen(fd, backlog) == 0, "listen: %s", strerror(errno));
    CHECK(getsockname(fd, (struct sockaddr *) &sa, &sl) == 0, "getsockname: %s", strerror(errno));
    *port = ntohs(sa.sin_port);
    return fd;
}

// A port on 127.0.0.1 nothing listens on (bound, then closed).
static int closed_port(void) {
    int port = 0;
    close(listen_loopback(1, &port));
    return port;
}

static void expect_failure(const char * host, int port, const char * from, int want_kind, const char * want_text) {
    char err[256] = "";
    int kind = -1;
    struct tb_transport * t = tb_dial(host, port, from, DIAL_MS, &kind, err, sizeof err);
    CHECK(t == NULL, "dialing %s:%d connected", host, port);
    CHECK(kind == want_kind, "dialing %s:%d: kind %s, want %s (%s)", host, port, tb_io_error_name(kind),
          tb_io_error_name(want_kind), err);
    CHECK(strstr(err, want_text) != NULL, "dialing %s:%d: \"%s\" does not say \"%s\"", host, port, err, want_text);
}

static void case_answered(void) {
    int port = 0, fd = listen_loopback(4, &port);
    char err[256] = "";
    int kind = -1;
    struct tb_transport * t = tb_dial("127.0.0.1", port, NULL, DIAL_MS, &kind, err, sizeof err);
    CHECK(t != NULL && kind == TB_IO_OK, "dial: kind %s: %s", tb_io_error_name(kind), err);
    tb_close(t);
    close(fd);
}

static void case_refused(void) {
    int port = closed_port();
    char where[32];
    snprintf(where, sizeof where, "127.0.0.1:%d: cannot connect", port);
    expect_failure("127.0.0.1", port, NULL, TB_IO_REFUSED, where);
}

static void case_unknown_host(void) {
    expect_failure("no-such-host.invalid", 50052, NULL, TB_IO_REFUSED, "no-such-host.invalid:50052: cannot resolve host");
}

static void case_not_from_here(void) {
    int port = 0, fd = listen_loopback(4, &port);
    expect_failure("127.0.0.1", port, "203.0.113.77", TB_IO_REFUSED, "cannot connect");   // TEST-NET-3: not ours
    close(fd);
}

static void case_no_answer(void) {
    int port = 0, fd = listen_loopback(0, &port);
    // Fill the accept queue with connections nobody accepts; the first dial
    // that gets no answer must say so as a timeout, not as "refused".
    struct tb_transport * held[64] = { 0 };
    int n = 0;
    for (; n < 64; n++) {
        char err[256] = "";
        int kind = -1;
        held[n] = tb_dial("127.0.0.1", port, NULL, DIAL_MS, &kind, err, sizeof err);
        if (held[n]) { CHECK(kind == TB_IO_OK, "connected, kind %s", tb_io_error_name(kind)); continue; }
        CHECK(kind == TB_IO_TIMEOUT, "dial %d into a full queue: kind %s, want timeout (%s)", n, tb_io_error_name(kind), err);
        CHECK(strstr(err, "cannot connect: timed out") != NULL, "dial %d: \"%s\"", n, err);
        break;
    }
    CHECK(n < 64, "64 connections into a listener with backlog 0 all connected: this system never drops a request");
    for (int i = 0; i < n; i++) tb_close(held[i]);
    close(fd);
}

int main(int argc, char ** argv) {
    static const struct { const char * name; void (*fn)(void); } cases[] = {
        { "answered", case_answered }, { "refused", case_refused }, { "unknown_host", case_unknown_host },
        { "not_from_here", case_not_from_here }, { "no_answer", case_no_answer },
    };
    for (size_t i = 0; argc == 2 && i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(argv[1], cases[i].name) != 0) continue;
        cases[i].fn();
        printf("PASS %s\n", cases[i].name);
        return 0;
    }
    fprintf(stderr, "usage: dial_tests CASE (answered, refused, unknown_host, not_from_here, no_answer)\n");
    return 2;
}
