// rdma_tests.c - the RDMA wire (transport/rdma.c) over the stand-in verbs
// provider (tests/c/verbs_sim.c, loaded through TBRPC_VERBS_LIB), between two
// real processes. One case per run:
//   rdma_tests CASE    prints "PASS CASE" and exits 0, or says what failed.
// The TCP connection the bring-up runs over is a socketpair. The two sides
// are two "hosts": the parent has address 127.0.0.1 and host id A, the child
// 127.0.0.3 and host id B (TBVSIM_ADDR, TBRPC_HOST_ID), set before either
// touches verbs. TBVSIM_PROFILE / TBRPC_RDMA_PROFILE come from the caller;
// CHILD_<NAME>=value in the environment sets <NAME> in the child only (faults).
// RDMA_TEST_LOCAL overrides the address a side looks its device up by.
// Case qp_places needs no verbs: the QP budget's places (transport/qp_budget.h)
// in TBRPC_QP_DIR, within one process and across processes.
#include "transport.h"
#include "transport/qp_budget.h"
#include "transport/rdma.h"

#include "check.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char ** environ;


struct pair { struct tb_transport * mine; pid_t child; };

static void become(int child) {
    setenv("TBVSIM_ADDR", child ? "127.0.0.3" : "127.0.0.1", 1);
    setenv("TBRPC_HOST_ID", child ? "host-b" : "host-a", 1);
    if (!child) return;
    char * moves[64];
    int n = 0;
    for (char ** e = environ; *e && n < 64; e++) {
        if (strncmp(*e, "CHILD_", 6) == 0) moves[n++] = strdup(*e + 6);
    }
    for (int i = 0; i < n; i++) {
        char * eq = strchr(moves[i], '=');
        *eq = 0;
        setenv(moves[i], eq + 1, 1);
    }
}

// Fork; both sides run the bring-up over a socketpair. With expect_rdma the
// upgrade must succeed on both; else both must stay on TCP (the reasons are
// printed). The child runs child_fn on its end and exits with its value.
static struct pair make_pair(int timeout_ms, int expect_rdma, int (*child_fn)(struct tb_transport *)) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair: %s", strerror(errno));
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    int child = pid == 0;
    close(sv[child ? 0 : 1]);
    become(child);
    struct tb_transport * tcp = tb_adopt(sv[child ? 1 : 0], timeout_ms);
    snprintf(tcp->peer, sizeof tcp->peer, "%s", child ? "parent" : "child");
    char reason[256] = "";
    const char * local = getenv("RDMA_TEST_LOCAL") ? getenv("RDMA_TEST_LOCAL") : getenv("TBVSIM_ADDR");
    int why;
    struct tb_transport * t = tb_rdma_upgrade(tcp, local, &why, reason, sizeof reason);
    if (expect_rdma) {
        CHECK(t, "%s: upgrade failed: %s", child ? "child" : "parent", reason);
    } else {
        CHECK(!t, "%s: upgraded though it should not have", child ? "child" : "parent");
        CHECK(why == TB_WHY_RDMA_FAILED, "%s: a failed bring-up of kind %d", child ? "child" : "parent", why);
        printf("%s stays on tcp: %s\n", child ? "child" : "parent", reason);
        fflush(stdout);
        t = tcp;
    }
    if (child) {
        int rc = child_fn(t);
        tb_close(t);
        _exit(rc);
    }
    printf("parent: %s\n", t->describe);
    fflush(stdout);
    return (struct pair) { t, pid };
}

// --- streams ----------------------------------------------------------------------

#define STREAM_BYTES (3u << 20)

struct stream { struct tb_transport * t; uint32_t salt; int rc; int slow_ms; };

// Mixed message sizes: 1 byte to ~300 KB (several frames), flushing after each.
static uint32_t size_of_step(uint32_t step) {
    switch (step % 5) {
    case 0:  return 1 + step % 23;                  // tiny (a header)
    case 1:  return 24;                             // a request
    case 2:  return (step * 7919u) % 70000 + 1;     // odd, under a frame or a few
    case 3:  return 4096;
    default: return (step * 104729u) % 300000 + 1;  // many frames
    }
}

static void * stream_out(void * arg) {
    struct stream * s = arg;
    uint8_t * buf = malloc(300001);
    uint32_t step = 1;
    for (uint64_t sent = 0; sent < STREAM_BYTES; step++) {
        uint32_t n = size_of_step(step);
        if (n > STREAM_BYTES - sent) n = (uint32_t) (STREAM_BYTES - sent);
        for (uint32_t i = 0; i < n; i++) buf[i] = pattern(sent + i, s->salt);
        if (tb_send(s->t, buf, n) != 0 || tb_flush(s->t) != 0) {
            fprintf(stderr, "send: %s\n", s->t->error);
            s->rc = 2;
            free(buf);
            return NULL;
        }
        sent += n;
    }
    free(buf);
    return NULL;
}

// Reads the whole stream; any wrong byte is a failure (3), an error 2.
static void * stream_in(void * arg) {
    struct stream * s = arg;
    if (s->slow_ms) usleep((useconds_t) s->slow_ms * 1000);   // the sender runs far ahead meanwhile
    uint8_t * buf = malloc(65536);
    for (uint64_t got = 0; got < STREAM_BYTES;) {
        uint32_t n = (uint32_t) ((got * 31 + 17) % 65536) + 1;
        if (n > STREAM_BYTES - got) n = (uint32_t) (STREAM_BYTES - got);
        if (tb_recv(s->t, buf, n) != 0) {
            fprintf(stderr, "recv after %llu good bytes: [%s] %s\n", (unsigned long long) got,
                    tb_io_error_name(s->t->error_kind), s->t->error);
            s->rc = 2;
            free(buf);
            return NULL;
        }
        for (uint32_t i = 0; i < n; i++) {
            if (buf[i] != pattern(got + i, s->salt)) {
                fprintf(stderr, "WRONG BYTES at %llu\n", (unsigned long long) (got + i));
                s->rc = 3;
                free(buf);
                return NULL;
            }
        }
        got += n;
    }
    free(buf);
    return NULL;
}

static int both_ways(struct tb_transport * t, uint32_t out_salt, uint32_t in_salt, int slow_ms) {
    struct stream out = { t, out_salt, 0, 0 }, in = { t, in_salt, 0, slow_ms };
    pthread_t a, b;
    pthread_create(&a, NULL, stream_out, &out);
    pthread_create(&b, NULL, stream_in, &in);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    if (out.rc || in.rc) return out.rc ? out.rc : in.rc;
    char done = 'd';   // keep the connection until both sides read everything
    if (tb_send(t, &done, 1) != 0 || tb_flush(t) != 0 || tb_recv(t, &done, 1) != 0) return 4;
    return 0;
}

static int child_stream(struct tb_transport * t) { return both_ways(t, 2, 1, 0); }

static void case_stream(void) {
    struct pair p = make_pair(20000, 1, child_stream);
    CHECK(strncmp(p.mine->describe, "rdma ", 5) == 0, "describe: %s", p.mine->describe);
    int rc = both_ways(p.mine, 1, 2, 0);
    CHECK(rc == 0, "parent stream failed (%d)", rc);
    tb_close(p.mine);
    CHECK(child_status(p.child) == 0, "child stream failed");
}

// The receiver starts late: without credits a linux-uc sender would lose frames.
static int child_slow(struct tb_transport * t) {
    struct stream in = { t, 1, 0, 300 };
    stream_in(&in);
    if (in.rc) return in.rc;
    char done = 'd';
    if (tb_recv(t, &done, 1) != 0 || done != 't') {   // the tail: a frame after any that were lost
        fprintf(stderr, "tail: [%s] %s\n", tb_io_error_name(t->error_kind), t->error);
        return 2;
    }
    return tb_send(t, &done, 1) == 0 && tb_flush(t) == 0 ? 0 : 4;
}

static void case_slow_reader(void) {
    struct pair p = make_pair(5000, 1, child_slow);
    struct stream out = { p.mine, 1, 0, 0 };
    stream_out(&out);
    usleep(700 * 1000);   // after the reader has drained what it got
    char done = 't';
    CHECK(tb_send(p.mine, &done, 1) == 0 && tb_flush(p.mine) == 0, "tail: %s", p.mine->error);
    CHECK(out.rc == 0 && tb_recv(p.mine, &done, 1) == 0, "parent: %s", p.mine->error);
    tb_close(p.mine);
    int st = child_status(p.child);
    CHECK(st == 0, "the slow reader failed (%d)", st);
}

// The child's stand-in loses or corrupts a frame (CHILD_TBVSIM_FAULT): the
// child must report it by name, after only right bytes.
static int child_faulty(struct tb_transport * t) {
    struct stream in = { t, 1, 0, 0 };
    stream_in(&in);
    if (in.rc == 3) return 3;                      // wrong bytes: the worst outcome
    if (in.rc == 0) return 5;                      // the fault went unnoticed
    if (t->error_kind != TB_IO_BROKEN) return 6;
    printf("child: %s\n", t->error);
    fflush(stdout);
    return 0;
}

static void case_fault(void) {
    struct pair p = make_pair(5000, 1, child_faulty);
    struct stream out = { p.mine, 1, 0, 0 };
    stream_out(&out);   // may fail once the child has gone
    tb_close(p.mine);
    int st = child_status(p.child);
    CHECK(st == 0, "the fault was not reported as a broken connection (child exit %d)", st);
}

static int child_sleeps(struct tb_transport * t) { for (;;) pause(); return 0; }

// A peer killed with SIGKILL is reported as closed, long before the timeout.
static void case_peer_killed(void) {
    struct pair p = make_pair(8000, 1, child_sleeps);
    usleep(100 * 1000);
    kill(p.child, SIGKILL);
    int64_t t0 = tb_now_ms();
    char b;
    int rc = tb_recv(p.mine, &b, 1);
    int64_t took = tb_now_ms() - t0;
    CHECK(rc != 0 && p.mine->error_kind == TB_IO_CLOSED, "recv: rc %d [%s] %s", rc,
          tb_io_error_name(p.mine->error_kind), p.mine->error);
    CHECK(took < 2000, "closed only after %lld ms", (long long) took);
    printf("parent: %s after %lld ms\n", p.mine->error, (long long) took);
    tb_close(p.mine);
    child_status(p.child);
}

// An idle wait sleeps: a second of waiting costs well under a tenth of a core.
static int child_late(struct tb_transport * t) {
    usleep(1200 * 1000);
    char b = 'x';
    return tb_send(t, &b, 1) == 0 && tb_flush(t) == 0 && tb_recv(t, &b, 1) == 0 ? 0 : 2;
}

static double cpu_seconds(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static void case_idle(void) {
    struct pair p = make_pair(8000, 1, child_late);
    double c0 = cpu_seconds();
    int64_t t0 = tb_now_ms();
    char b;
    CHECK(tb_recv(p.mine, &b, 1) == 0, "recv: %s", p.mine->error);
    double cpu = cpu_seconds() - c0;
    int64_t wall = tb_now_ms() - t0;
    printf("parent: idle wait of %lld ms cost %.3f s of CPU\n", (long long) wall, cpu);
    CHECK(wall > 900, "woke too early (%lld ms)", (long long) wall);
    CHECK(cpu < 0.1 * wall / 1000.0 + 0.02, "an idle wait burned %.3f s of CPU in %lld ms", cpu, (long long) wall);
    CHECK(tb_send(p.mine, &b, 1) == 0 && tb_flush(p.mine) == 0, "send");
    tb_close(p.mine);
    CHECK(child_status(p.child) == 0, "child");
}

// Any reason to stay on TCP leaves BOTH sides on a working TCP connection.
static int child_tcp_echo(struct tb_transport * t) {
    char b[5];
    if (tb_recv(t, b, 5) != 0 || memcmp(b, "hello", 5) != 0) return 2;
    return tb_send(t, "world", 5) == 0 && tb_flush(t) == 0 ? 0 : 3;
}

static void case_stays_on_tcp(void) {
    struct pair p = make_pair(5000, 0, child_tcp_echo);
    CHECK(strcmp(p.mine->describe, "tcp") == 0, "describe: %s", p.mine->describe);
    char b[5];
    CHECK(tb_send(p.mine, "hello", 5) == 0 && tb_flush(p.mine) == 0 && tb_recv(p.mine, b, 5) == 0 &&
          memcmp(b, "world", 5) == 0, "tcp after a declined upgrade: %s", p.mine->error);
    tb_close(p.mine);
    CHECK(child_status(p.child) == 0, "child");
}

// The QP budget's places: each is held once, whether the other taker is this
// process (a session on a thread of a node) or another; a dead process's
// places are free again; other hosts and devices have places of their own.
static void case_qp_places(void) {
    char why[200] = "";
    int place[4], extra = -1;
    for (int i = 0; i < 3; i++) {
        CHECK(tb_qp_take(0xa, "dev0", 3, &place[i], why, sizeof why) == TB_QP_TAKEN, "place %d: %s", i, why);
        CHECK(place[i] >= 0, "place %d: no descriptor", i);
    }
    CHECK(tb_qp_take(0xa, "dev0", 3, &place[3], why, sizeof why) == TB_QP_SPENT,
          "a 4th place of 3 in one process (threads of one node would share places)");
    CHECK(strcmp(why, "QP budget: 3 of 3 in use on dev0") == 0, "why: %s", why);
    CHECK(tb_qp_take(0xb, "dev0", 3, &extra, why, sizeof why) == TB_QP_TAKEN, "another host: %s", why);
    tb_qp_give(extra);
    CHECK(tb_qp_take(0xa, "dev/1", 3, &extra, why, sizeof why) == TB_QP_TAKEN, "another device: %s", why);
    tb_qp_give(extra);
    CHECK(tb_qp_take(0xa, "dev0", 0, &extra, why, sizeof why) == TB_QP_TAKEN && extra == -1, "no limit holds nothing");

    tb_qp_give(place[1]);   // one free: a child process takes it, and holds it until it dies
    int ready[2];
    CHECK(pipe(ready) == 0, "pipe");
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        int mine = -1;
        char b = tb_qp_take(0xa, "dev0", 3, &mine, why, sizeof why) == TB_QP_TAKEN ? 'y' : 'n';
        if (write(ready[1], &b, 1) != 1) _exit(2);
        pause();
        _exit(0);
    }
    char b = 0;
    CHECK(read(ready[0], &b, 1) == 1 && b == 'y', "the child got no place");
    CHECK(tb_qp_take(0xa, "dev0", 3, &extra, why, sizeof why) == TB_QP_SPENT, "a place another process holds");
    kill(pid, SIGKILL);
    CHECK(child_status(pid) == 128 + SIGKILL, "child");
    CHECK(tb_qp_take(0xa, "dev0", 3, &extra, why, sizeof why) == TB_QP_TAKEN, "a dead process's place: %s", why);
    printf("parent: places held once per place, across threads and processes\n");

    char dir[512];
    CHECK(tb_qp_dir(dir, sizeof dir, why, sizeof why) == 0, "dir: %s", why);
    CHECK(chmod(dir, 0777) == 0, "chmod");   // a directory others may write in: no places there
    CHECK(tb_qp_take(0xc, "dev0", 3, &extra, why, sizeof why) == TB_QP_NO_PLACES, "a directory others may write");
    CHECK(strstr(why, "is not a directory of this user's that only it may write") != NULL, "why: %s", why);
    CHECK(chmod(dir, 0700) == 0, "chmod");
}

// A reader that computes and does not read: its receive slots fill, and a
// sender blocked on it waits as long as its heartbeats come (tb_alive: a byte
// on the TCP anchor, which takes no slot), and fails with TB_IO_TIMEOUT once
// they stop.
#define BUSY_BYTES (4u << 20)
enum { BUSY_TIMEOUT_MS = 500, BEAT_US = 100000 };

static int busy_reader(struct tb_transport * t, int beats, int reads) {
    for (int i = 0; i < beats; i++) {
        usleep(BEAT_US);
        if (!tb_alive(t)) return 7;   // the RDMA wire has a heartbeat
    }
    if (!reads) { sleep(3); return 0; }
    static uint8_t buf[65536];
    for (uint32_t got = 0; got < BUSY_BYTES; got += sizeof buf) {
        if (tb_recv(t, buf, sizeof buf) != 0) { fprintf(stderr, "reader: %s\n", t->error); return 3; }
    }
    return 0;
}
static int child_busy(struct tb_transport * t) { return busy_reader(t, 25, 1); }
static int child_goes_quiet(struct tb_transport * t) { return busy_reader(t, 10, 0); }

static int64_t send_busy(struct tb_transport * t, int * rc) {
    static uint8_t buf[BUSY_BYTES];
    const int64_t t0 = tb_now_ms();
    *rc = tb_send(t, buf, sizeof buf);
    if (*rc == 0) *rc = tb_flush(t);
    return tb_now_ms() - t0;
}

static void case_heartbeat(void) {
    struct pair p = make_pair(BUSY_TIMEOUT_MS, 1, child_busy);
    int rc = -1;
    int64_t took = send_busy(p.mine, &rc);
    CHECK(rc == 0, "a send to a reader that beat every %d ms failed after %lld ms: %s", BEAT_US / 1000, (long long) took,
          p.mine->error);
    CHECK(took >= 2000, "the send took %lld ms: the reader did not hold it up, nothing was tested", (long long) took);
    CHECK(child_status(p.child) == 0, "reader failed");
    tb_close(p.mine);
    p = make_pair(BUSY_TIMEOUT_MS, 1, child_goes_quiet);
    took = send_busy(p.mine, &rc);
    CHECK(rc != 0, "a send to a reader silent for 3 s succeeded after %lld ms", (long long) took);
    CHECK(p.mine->error_kind == TB_IO_TIMEOUT, "kind %s: %s", tb_io_error_name(p.mine->error_kind), p.mine->error);
    CHECK(took >= 1000 && took < 1000 + 4 * BUSY_TIMEOUT_MS, "failed after %lld ms, want about %d", (long long) took,
          1000 + BUSY_TIMEOUT_MS);
    child_status(p.child);
    tb_close(p.mine);
}

// A peer's info is hostile bytes: a GID type no side sends (9) is refused by
// name, and the side that read it stays on a working TCP connection.
static void case_hostile_gid_type(void) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair: %s", strerror(errno));
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        close(sv[0]);
        become(1);
        struct tb_rdma_info forged, theirs;
        struct tb_rdma * d = tb_rdma_prepare(getenv("TBVSIM_ADDR"), &forged);
        forged.gid_type = 9;
        int ok = write(sv[1], &forged, sizeof forged) == (ssize_t) sizeof forged;
        ok = ok && recv(sv[1], &theirs, sizeof theirs, MSG_WAITALL) == (ssize_t) sizeof theirs;
        tb_rdma_discard(d);
        _exit(ok && d ? 0 : 4);
    }
    close(sv[1]);
    become(0);
    struct tb_transport * tcp = tb_adopt(sv[0], 5000);
    char reason[256] = "";
    int why;
    struct tb_transport * t = tb_rdma_upgrade(tcp, getenv("TBVSIM_ADDR"), &why, reason, sizeof reason);
    CHECK(!t, "upgraded with a forged GID type");
    printf("parent stays on tcp: %s\n", reason);
    CHECK(strstr(reason, "peer sent an unknown GID type (9)"), "reason: %s", reason);
    CHECK(child_status(pid) == 0, "child");
    tb_close(tcp);
}

int main(int argc, char ** argv) {
    signal(SIGPIPE, SIG_IGN);
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char * c = argc > 1 ? argv[1] : "";
    if (!strcmp(c, "stream")) case_stream();
    else if (!strcmp(c, "slow_reader")) case_slow_reader();
    else if (!strcmp(c, "fault")) case_fault();
    else if (!strcmp(c, "peer_killed")) case_peer_killed();
    else if (!strcmp(c, "idle")) case_idle();
    else if (!strcmp(c, "stays_on_tcp")) case_stays_on_tcp();
    else if (!strcmp(c, "qp_places")) case_qp_places();
    else if (!strcmp(c, "heartbeat")) case_heartbeat();
    else if (!strcmp(c, "hostile_gid_type")) case_hostile_gid_type();
    else { fprintf(stderr, "unknown case %s\n", c); return 2; }
    printf("PASS %s\n", c);
    return 0;
}
