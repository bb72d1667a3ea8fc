// ring_tests.c - the frame ring (transport/ring.c) over shared memory
// (transport/shm.c), between two real processes. One case per run:
//   ring_tests CASE    prints "PASS CASE" and exits 0, or says what failed.
// The doorbell/liveness socket is a socketpair standing in for the TCP
// connection the ring is negotiated over.
#include "transport.h"
#include "transport/ring.h"

#include "check.h"

#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>


struct pair { struct tb_transport * mine; pid_t child; };

// Fork; each side gets its end of a ring of `slots` x `stride`. The child runs
// `child_fn` on its end and exits with its return value.
static struct pair make_pair(uint32_t slots, uint32_t stride, int timeout_ms, int (*child_fn)(struct tb_transport *)) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair: %s", strerror(errno));
    char err[256];
    struct tb_shm_offer offer;
    struct tb_shm * seg = tb_shm_create(slots, stride, &offer, err, sizeof err);
    CHECK(seg, "create: %s", err);
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        close(sv[0]);
        struct tb_shm * mine = tb_shm_attach(&offer, err, sizeof err);
        CHECK(mine, "attach: %s", err);
        CHECK(write(sv[1], "a", 1) == 1, "confirm");   // as the head confirms over TCP
        struct tb_transport * t = tb_shm_transport(mine, tb_adopt(sv[1], timeout_ms), err, sizeof err);
        CHECK(t, "child transport: %s", err);
        snprintf(t->peer, sizeof t->peer, "parent");
        int rc = child_fn(t);
        tb_close(t);
        _exit(rc);
    }
    close(sv[1]);
    char confirm;   // the creator keeps the name until the attacher confirms
    CHECK(read(sv[0], &confirm, 1) == 1, "no confirmation");
    struct tb_transport * t = tb_shm_transport(seg, tb_adopt(sv[0], timeout_ms), err, sizeof err);
    CHECK(t, "parent transport: %s", err);
    snprintf(t->peer, sizeof t->peer, "child");
    return (struct pair) { t, pid };
}

// --- cases ------------------------------------------------------------------------

#define STREAM_BYTES (6u << 20)   // many times the ring, both ways at once

struct stream { struct tb_transport * t; uint32_t salt; int rc; };

// The size of a stream's next chunk: odd sizes up to `cap` from a prime's
// multiples, never past STREAM_BYTES (0 once `done` reaches it).
static uint32_t chunk(uint32_t step, uint32_t prime, uint64_t done, size_t cap) {
    const uint64_t n = (uint64_t) step * prime % cap + 1;
    return (uint32_t) (n < STREAM_BYTES - done ? n : STREAM_BYTES - done);
}

// Send STREAM_BYTES in odd chunk sizes, flushing after each.
static void * stream_out(void * arg) {
    struct stream * s = arg;
    static _Thread_local uint8_t buf[70000];
    uint64_t sent = 0;
    for (uint32_t step = 1, n; (n = chunk(step, 7919u, sent, sizeof buf)) > 0; step++) {
        for (uint32_t i = 0; i < n; i++) buf[i] = pattern(sent + i, s->salt);
        if (tb_send(s->t, buf, n) != 0 || tb_flush(s->t) != 0) { fprintf(stderr, "send: %s\n", s->t->error); s->rc = 2; return NULL; }
        sent += n;
    }
    return NULL;
}

// Receive STREAM_BYTES in other odd chunk sizes, checking every byte.
static void * stream_in(void * arg) {
    struct stream * s = arg;
    static _Thread_local uint8_t buf[70000];
    uint64_t got = 0;
    for (uint32_t step = 1, n; (n = chunk(step, 104729u, got, sizeof buf)) > 0; step++) {
        if (tb_recv(s->t, buf, n) != 0) { fprintf(stderr, "recv: %s\n", s->t->error); s->rc = 3; return NULL; }
        for (uint32_t i = 0; i < n; i++) {
            if (buf[i] != pattern(got + i, s->salt)) { fprintf(stderr, "byte %llu differs\n", (unsigned long long) (got + i)); s->rc = 4; return NULL; }
        }
        got += n;
    }
    return NULL;
}

// Both directions at once, a sending and a receiving thread on each side.
static int stream_both_ways(struct tb_transport * t, uint32_t send_salt, uint32_t recv_salt) {
    struct stream out = { t, send_salt, 0 }, in = { t, recv_salt, 0 };
    pthread_t a, b;
    if (pthread_create(&a, NULL, stream_out, &out) != 0 || pthread_create(&b, NULL, stream_in, &in) != 0) return 5;
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    return out.rc ? out.rc : in.rc;
}

static int child_stream(struct tb_transport * t) { return stream_both_ways(t, 2, 1); }

static void case_stream(void) {
    struct pair p = make_pair(8, 4096, 10000, child_stream);
    int rc = stream_both_ways(p.mine, 1, 2);
    CHECK(rc == 0, "parent stream failed (%d): %s", rc, p.mine->error);
    CHECK(child_status(p.child) == 0, "child stream failed");
    CHECK(p.mine->bytes_sent == STREAM_BYTES && p.mine->bytes_received == STREAM_BYTES,
          "counted %llu sent, %llu received", (unsigned long long) p.mine->bytes_sent, (unsigned long long) p.mine->bytes_received);
    struct tb_ring * r = (struct tb_ring *) p.mine;
    CHECK(r->frames_sent >= STREAM_BYTES / (4096 - TB_FRAME_HEADER), "only %llu frames", (unsigned long long) r->frames_sent);
    tb_close(p.mine);
}

// One-way traffic: the receiver never sends data, so credits must come back on their own.
static int child_sink(struct tb_transport * t) {
    static uint8_t buf[1 << 16];
    for (uint64_t got = 0; got < STREAM_BYTES; got += sizeof buf) {
        if (tb_recv(t, buf, sizeof buf) != 0) { fprintf(stderr, "sink: %s\n", t->error); return 2; }
    }
    uint8_t ok = 1;
    return tb_send(t, &ok, 1) == 0 && tb_flush(t) == 0 ? 0 : 3;
}

static void case_one_way(void) {
    struct pair p = make_pair(4, 4096, 10000, child_sink);
    static uint8_t buf[1 << 16];
    for (uint64_t sent = 0; sent < STREAM_BYTES; sent += sizeof buf) CHECK(tb_send(p.mine, buf, sizeof buf) == 0, "send: %s", p.mine->error);
    CHECK(tb_flush(p.mine) == 0, "flush: %s", p.mine->error);
    uint8_t ok = 0;
    CHECK(tb_recv(p.mine, &ok, 1) == 0 && ok == 1, "no answer: %s", p.mine->error);
    CHECK(child_status(p.child) == 0, "sink failed");
    tb_close(p.mine);
}

// A reader that reads late: three one-byte messages, then "done" back.
static int child_late_reader(struct tb_transport * t) {
    usleep(300 * 1000);
    uint8_t b[3], done = 1;
    if (tb_recv(t, b, 3) != 0 || tb_send(t, &done, 1) != 0 || tb_flush(t) != 0) return 2;
    return tb_recv(t, &done, 1) == 0 ? 0 : 3;   // until the parent lets go
}

// room() says no before a send would wait for a reader that is not reading
// (the node's watchdog relies on it), and yes once the reader caught up;
// an idle ring then carries nothing (credit-only frames are not answered
// with credit-only frames).
static void case_room(void) {
    struct pair p = make_pair(4, 4096, 10000, child_late_reader);
    struct tb_ring * r = (struct tb_ring *) p.mine;
    CHECK(tb_room(p.mine, sizeof(struct tb_frame_header)), "no room on a fresh ring");
    for (uint8_t i = 0; i < 3; i++) {
        CHECK(tb_room(p.mine, 1), "no room for message %u of 3 with the credits left", i);
        CHECK(tb_send(p.mine, &i, 1) == 0 && tb_flush(p.mine) == 0, "send: %s", p.mine->error);
    }
    CHECK(!tb_room(p.mine, 1), "room said yes where a send would wait for credits");
    uint8_t done = 0;
    CHECK(tb_recv(p.mine, &done, 1) == 0 && done == 1, "no answer: %s", p.mine->error);
    CHECK(tb_room(p.mine, 1), "no room after the reader caught up");
    const uint64_t frames = r->frames_sent;
    usleep(200 * 1000);
    CHECK(tb_poll(p.mine, 0) == 0 && r->frames_sent == frames, "an idle ring moved frames: %llu then %llu",
          (unsigned long long) frames, (unsigned long long) r->frames_sent);
    CHECK(tb_send(p.mine, &done, 1) == 0 && tb_flush(p.mine) == 0, "release: %s", p.mine->error);
    CHECK(child_status(p.child) == 0, "late reader failed");
    tb_close(p.mine);
}

static int child_die(struct tb_transport * t) {
    uint8_t b;
    if (tb_recv(t, &b, 1) != 0) return 2;
    kill(getpid(), SIGKILL);
    return 0;
}

static void case_peer_killed(void) {
    struct pair p = make_pair(16, 65536, 60000, child_die);
    uint8_t b = 7;
    CHECK(tb_send(p.mine, &b, 1) == 0 && tb_flush(p.mine) == 0, "send");
    int64_t t0 = tb_now_ms();
    CHECK(tb_recv(p.mine, &b, 1) != 0, "recv from a killed peer succeeded");
    CHECK(p.mine->error_kind == TB_IO_CLOSED, "kind %s: %s", tb_io_error_name(p.mine->error_kind), p.mine->error);
    CHECK(tb_now_ms() - t0 < 2000, "took %lld ms to notice", (long long) (tb_now_ms() - t0));
    CHECK(child_status(p.child) == 128 + SIGKILL, "child was not killed");
    tb_close(p.mine);
}

// A peer killed while it sleeps leaves its "wake me" flag raised: the next
// frame rings a doorbell on a socket nobody holds. That must fail the send's
// bell quietly, not kill this process with SIGPIPE (a C program embedding the
// client need not ignore it, as Python does).
static int child_sleeps(struct tb_transport * t) {
    uint8_t b;
    return tb_recv(t, &b, 1) == 0 ? 0 : 2;
}

static void case_bell_to_a_dead_peer(void) {
    struct pair p = make_pair(16, 65536, 60000, child_sleeps);
    usleep(200 * 1000);   // the child spins for microseconds, then sleeps with its flag raised
    CHECK(kill(p.child, SIGKILL) == 0, "kill: %s", strerror(errno));
    CHECK(child_status(p.child) == 128 + SIGKILL, "child was not killed");
    signal(SIGPIPE, SIG_DFL);
    uint8_t b = 7;
    for (int i = 0; i < 3; i++) (void) (tb_send(p.mine, &b, 1) == 0 && tb_flush(p.mine) == 0);
    CHECK(tb_recv(p.mine, &b, 1) != 0 && p.mine->error_kind == TB_IO_CLOSED, "recv from a dead peer: %s", p.mine->error);
    tb_close(p.mine);
}

static int child_close(struct tb_transport * t) { (void) t; return 0; }

static void case_peer_closes(void) {
    struct pair p = make_pair(16, 65536, 60000, child_close);
    uint8_t b;
    CHECK(tb_recv(p.mine, &b, 1) != 0, "recv after the peer closed succeeded");
    CHECK(p.mine->error_kind == TB_IO_CLOSED && strstr(p.mine->error, "closed by peer"), "%s", p.mine->error);
    CHECK(child_status(p.child) == 0, "child failed");
    tb_close(p.mine);
}

static int child_silent(struct tb_transport * t) { sleep(3); return 0; }

// A silent peer times out after timeout_ms, and waiting for it costs no CPU.
static void case_silence_times_out_idle(void) {
    struct pair p = make_pair(16, 65536, 1500, child_silent);
    struct rusage before, after;
    getrusage(RUSAGE_SELF, &before);
    int64_t t0 = tb_now_ms();
    uint8_t b;
    CHECK(tb_recv(p.mine, &b, 1) != 0, "recv from a silent peer succeeded");
    int64_t waited = tb_now_ms() - t0;
    getrusage(RUSAGE_SELF, &after);
    double cpu = (double) (after.ru_utime.tv_sec - before.ru_utime.tv_sec + after.ru_stime.tv_sec - before.ru_stime.tv_sec)
               + (after.ru_utime.tv_usec - before.ru_utime.tv_usec + after.ru_stime.tv_usec - before.ru_stime.tv_usec) / 1e6;
    CHECK(p.mine->error_kind == TB_IO_TIMEOUT && strstr(p.mine->error, "no answer within 1500 ms"), "%s", p.mine->error);
    CHECK(waited >= 1500 && waited < 3000, "timed out after %lld ms", (long long) waited);
    CHECK(cpu < 0.15, "waiting %lld ms cost %.3f s of CPU", (long long) waited, cpu);
    printf("idle wait: %lld ms, %.4f s CPU\n", (long long) waited, cpu);
    child_status(p.child);
    tb_close(p.mine);
}

// A peer that writes a frame that is not one breaks the connection with a clear error.
static int forge(struct tb_transport * t, struct tb_frame_header h) {
    struct tb_ring * r = (struct tb_ring *) t;
    uint8_t * f = r->wire->tx_frame(r, r->tx_seq);
    memcpy(f, &h, sizeof h);
    int rc = r->wire->post(r, r->tx_seq);
    r->tx_seq++;   // as post_current would: the close that follows is a frame of its own
    r->tx_credits--;
    return rc;
}
static int child_bad_magic(struct tb_transport * t) { return forge(t, (struct tb_frame_header) { 0xdeadbeef, 4, 0, 0, 0 }); }
static int child_bad_len(struct tb_transport * t) { return forge(t, (struct tb_frame_header) { TB_FRAME_MAGIC, 1u << 30, 0, 0, 0 }); }
static int child_bad_credits(struct tb_transport * t) { return forge(t, (struct tb_frame_header) { TB_FRAME_MAGIC, 4, 0, 5, 0 }); }
static int child_bad_flags(struct tb_transport * t) { return forge(t, (struct tb_frame_header) { TB_FRAME_MAGIC, 4, 0, 0, 0x100 }); }

static void expect_broken(int (*child_fn)(struct tb_transport *), const char * what) {
    struct pair p = make_pair(16, 65536, 5000, child_fn);
    uint8_t b[4];
    CHECK(tb_recv(p.mine, b, sizeof b) != 0, "%s was accepted", what);
    CHECK(p.mine->error_kind == TB_IO_BROKEN && strstr(p.mine->error, "is not a frame of this connection"),
          "%s: %s (%s)", what, p.mine->error, tb_io_error_name(p.mine->error_kind));
    child_status(p.child);
    tb_close(p.mine);
}

static void case_forged_frames(void) {
    expect_broken(child_bad_magic, "a bad magic");
    expect_broken(child_bad_len, "a length beyond the stride");
    expect_broken(child_bad_credits, "credits for slots never used");
    expect_broken(child_bad_flags, "flags this side does not know");
}

// A frame the peer takes back after it was counted (its seq rewritten in the
// slot, which the peer can write) breaks the connection; it is not read.
static int child_forge_then_wait(struct tb_transport * t) {
    int rc = forge(t, (struct tb_frame_header) { TB_FRAME_MAGIC, 4, 0, 0, 0 });
    sleep(1);
    return rc;
}

static void case_frame_taken_back(void) {
    struct pair p = make_pair(16, 65536, 5000, child_forge_then_wait);
    struct tb_ring * r = (struct tb_ring *) p.mine;
    usleep(300000);   // the child's frame is in its slot
    uint8_t b[4] = { 0 };
    CHECK(tb_send(p.mine, b, 1) == 0 && tb_flush(p.mine) == 0, "send: %s", p.mine->error);   // its scan counts the frame
    CHECK(r->rx_seen == r->rx_seq + 1, "the frame was not counted (seen %u, at %u)", r->rx_seen, r->rx_seq);
    int broken = 0;
    uint8_t * f = (uint8_t *) r->wire->rx_frame(r, r->rx_seq, &broken);
    CHECK(f, "no frame in the slot");
    const uint32_t other = r->rx_seq + 7;
    memcpy(f + offsetof(struct tb_frame_header, seq), &other, sizeof other);   // as the peer could, after our scan
    char want[64];
    snprintf(want, sizeof want, "child: shm frame %u vanished", r->rx_seq);
    CHECK(tb_recv(p.mine, b, sizeof b) != 0, "a frame taken back was read");
    CHECK(p.mine->error_kind == TB_IO_BROKEN && strcmp(p.mine->error, want) == 0, "%s (%s)", p.mine->error,
          tb_io_error_name(p.mine->error_kind));
    child_status(p.child);
    tb_close(p.mine);
}

static void case_attach_rules(void) {
    char err[256];
    struct tb_shm_offer offer;
    CHECK(!tb_shm_create(3, 65536, &offer, err, sizeof err), "3 slots accepted");
    CHECK(!tb_shm_create(2, 65536, &offer, err, sizeof err), "2 slots accepted (each credit-only frame would answer the last)");
    struct tb_shm * seg = tb_shm_create(16, 65536, &offer, err, sizeof err);
    CHECK(seg, "create: %s", err);
    struct tb_shm_offer wrong = offer;
    wrong.nonce[0] ^= 1;
    CHECK(!tb_shm_attach(&wrong, err, sizeof err) && strstr(err, "not the one the node offered"), "wrong nonce: %s", err);
    wrong = offer;
    wrong.stride = 32768;   // a segment smaller than the ring would be: its last slots would be past the end (SIGBUS)
    CHECK(!tb_shm_attach(&wrong, err, sizeof err) && strstr(err, "is not 1052672 bytes"), "wrong size: %s", err);
    wrong = offer;
    wrong.slots = 32;       // the same bytes in another geometry: not the ring the node made
    wrong.stride = 32768;
    CHECK(!tb_shm_attach(&wrong, err, sizeof err) && strstr(err, "not the one the node offered"), "other geometry: %s", err);
    wrong = offer;
    wrong.slots = 3;
    CHECK(!tb_shm_attach(&wrong, err, sizeof err) && strstr(err, "not ours"), "3 slots: %s", err);
    wrong = offer;
    memset(wrong.name + 7, 'x', sizeof wrong.name - 7);   // no NUL: the name would be read past its field
    CHECK(!tb_shm_attach(&wrong, err, sizeof err) && strstr(err, "not ours"), "unterminated name: %s", err);
    char path[sizeof offer.name + 16];   // a segment others may write (and truncate under our mapping)
    snprintf(path, sizeof path, "/dev/shm%s", offer.name);
    CHECK(chmod(path, 0620) == 0, "chmod %s: %s", path, strerror(errno));
    CHECK(!tb_shm_attach(&offer, err, sizeof err) && strstr(err, "is not this user's alone (owner uid") &&
          strstr(err, "mode 620)"), "group-writable: %s", err);
    CHECK(chmod(path, 0600) == 0, "chmod %s: %s", path, strerror(errno));
    wrong = offer;
    memcpy(wrong.name, "/etc-passwd", 12);
    CHECK(!tb_shm_attach(&wrong, err, sizeof err) && strstr(err, "not ours"), "foreign name: %s", err);
    struct tb_shm * ok = tb_shm_attach(&offer, err, sizeof err);
    CHECK(ok, "attach: %s", err);
    tb_shm_discard(ok);
    tb_shm_discard(seg);   // unlinks the name
    CHECK(!tb_shm_attach(&offer, err, sizeof err) && strstr(err, "another host"), "after unlink: %s", err);
}

// --- the upgrade on a link (transport/upgrade.c: tb_upgrade_dial / tb_upgrade_accept) ---
// The parent dials, the child accepts; each checks what carries its end and
// that bytes still flow both ways over it.

// dialer_why, acceptor_why: the kind (enum tb_why) each end gives the words in its describe.
struct upgrade_case { struct tb_upgrade_want want; const char * no_shm; const char * dialer, * acceptor; int garbage;
                      int dialer_why, acceptor_why; };

static int roundtrip(struct tb_transport * t, int first) {
    char out[5] = "ping", in[5] = "";
    if (first && (tb_send(t, out, 4) != 0 || tb_flush(t) != 0)) return -1;
    if (tb_recv(t, in, 4) != 0 || strcmp(in, "ping") != 0) return -1;
    if (!first && (tb_send(t, out, 4) != 0 || tb_flush(t) != 0)) return -1;
    return 0;
}

static void run_upgrade(const struct upgrade_case * u) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair: %s", strerror(errno));
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    char why[256] = "";
    if (pid == 0) {
        close(sv[0]);
        struct tb_transport * t = tb_upgrade_accept(tb_adopt(sv[1], 5000), u->no_shm, why, sizeof why);
        if (u->garbage) {
            CHECK(!t && strstr(why, "no transport upgrade where one was due"), "garbage accepted: %s", why);
            _exit(0);
        }
        CHECK(t, "accept: %s", why);
        CHECK(strcmp(t->describe, u->acceptor) == 0, "acceptor on '%s', expected '%s'", t->describe, u->acceptor);
        CHECK(t->why == u->acceptor_why, "acceptor's reason '%s' of kind %d, expected %d", t->describe, t->why, u->acceptor_why);
        CHECK(roundtrip(t, 0) == 0, "acceptor roundtrip: %s", t->error);
        tb_close(t);
        _exit(0);
    }
    close(sv[1]);
    struct tb_transport * tcp = tb_adopt(sv[0], 5000);
    if (u->garbage) {   // a peer that sends anything but an upgrade
        uint8_t junk[sizeof(struct tb_transport_req) + 168];   // the size of an upgrade ask (upgrade.c)
        memset(junk, 0x5a, sizeof junk);
        CHECK(tb_send(tcp, junk, sizeof junk) == 0 && tb_flush(tcp) == 0, "send junk");
        CHECK(child_status(pid) == 0, "acceptor");
        tb_close(tcp);
        return;
    }
    struct tb_transport * t = tb_upgrade_dial(tcp, &u->want, why, sizeof why);
    CHECK(t, "dial: %s", why);
    CHECK(strcmp(t->describe, u->dialer) == 0, "dialer on '%s', expected '%s'", t->describe, u->dialer);
    CHECK(t->why == u->dialer_why, "dialer's reason '%s' of kind %d, expected %d", t->describe, t->why, u->dialer_why);
    CHECK(roundtrip(t, 1) == 0, "dialer roundtrip: %s", t->error);
    CHECK(child_status(pid) == 0, "acceptor");
    tb_close(t);
}

static void case_upgrade(void) {
    const struct upgrade_case cases[] = {
        { { .peer_shm = 1 }, NULL, "shm 16x256K", "shm 16x256K", 0, TB_WHY_NONE, TB_WHY_NONE },
        { { .peer_shm = 1, .forced_tcp = 1 }, NULL, "tcp: asked for", "tcp: peer: asked for", 0, TB_WHY_ASKED, TB_WHY_ASKED },
        { { .peer_shm = 0 }, NULL, "tcp: the node offers no shared memory", "tcp: peer: the node offers no shared memory", 0,
          TB_WHY_NO_SHM, TB_WHY_NO_SHM },
        { { .peer_shm = 1, .no_shm = "threads here" }, NULL, "tcp: threads here", "tcp: peer: threads here", 0,
          TB_WHY_NO_SHM, TB_WHY_NO_SHM },
        { { .peer_shm = 1 }, "threads there", "tcp: threads there", "tcp: threads there", 0, TB_WHY_NO_SHM, TB_WHY_NO_SHM },
        { { .peer_shm = 1 }, NULL, "", "", 1, 0, 0 },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_upgrade(&cases[i]);
}

// A reply to an upgrade is the peer's: words that fill their field without a
// NUL are read up to the field's end, and a reason kind this side does not
// know is reported as the failure it stands for.
static void case_forged_reply(void) {
    struct tb_transport_reply rep;
    memset(&rep, 'x', sizeof rep);
    rep.why_kind = TB_WHY_NO_LINK + 1;
    char why[512];
    int kind = -1;
    CHECK(!tb_upgrade_attach(&rep, &kind, why, sizeof why), "a refusal was attached");
    CHECK(strlen(why) == sizeof rep.declined - 1 && why[0] == 'x', "the peer's words ran to %zu bytes", strlen(why));
    CHECK(kind == TB_WHY_SHM_FAILED, "unknown reason kind reported as %d", kind);
    CHECK(tb_upgrade_rdma_declined(&rep) == TB_WHY_PEER_NO_RDMA, "RDMA refusal of unknown kind reported as %d",
          tb_upgrade_rdma_declined(&rep));
    rep.why_kind = TB_WHY_NO_SHM;
    CHECK(!tb_upgrade_attach(&rep, &kind, why, sizeof why) && kind == TB_WHY_NO_SHM, "a known kind became %d", kind);
}

// A reader that computes and does not read: its ring fills, and a sender
// blocked on it waits as long as its heartbeats come (tb_alive: a counter
// outside the slots), and fails with TB_IO_TIMEOUT once they stop.
#define BUSY_BYTES (4u << 20)   // 16 slots of 64 KiB: four rings' worth
enum { BUSY_TIMEOUT_MS = 500, BEAT_US = 100000 };

static int busy_reader(struct tb_transport * t, int beats, int reads) {
    for (int i = 0; i < beats; i++) {
        usleep(BEAT_US);
        tb_alive(t);
    }
    if (!reads) { sleep(3); return 0; }
    static uint8_t buf[65536];
    for (uint32_t got = 0; got < BUSY_BYTES; got += sizeof buf) {
        if (tb_recv(t, buf, sizeof buf) != 0) { fprintf(stderr, "reader: %s\n", t->error); return 3; }
    }
    return 0;
}
static int child_busy(struct tb_transport * t) { return busy_reader(t, 25, 1); }      // 2.5 s of beats, then reads
static int child_goes_quiet(struct tb_transport * t) { return busy_reader(t, 10, 0); }  // 1 s of beats, then nothing

static int64_t send_busy(struct pair p, int * rc) {
    static uint8_t buf[BUSY_BYTES];
    const int64_t t0 = tb_now_ms();
    *rc = tb_send(p.mine, buf, sizeof buf);
    if (*rc == 0) *rc = tb_flush(p.mine);
    return tb_now_ms() - t0;
}

static void case_heartbeat_keeps_a_sender(void) {
    struct pair p = make_pair(16, 65536, BUSY_TIMEOUT_MS, child_busy);
    int rc = -1;
    const int64_t took = send_busy(p, &rc);
    CHECK(rc == 0, "a send to a reader that beat every %d ms failed after %lld ms: %s", BEAT_US / 1000, (long long) took,
          p.mine->error);
    CHECK(took >= 2000, "the send took %lld ms: the reader did not hold it up, nothing was tested", (long long) took);
    CHECK(child_status(p.child) == 0, "reader failed");
    tb_close(p.mine);
}

static void case_quiet_reader_times_out(void) {
    struct pair p = make_pair(16, 65536, BUSY_TIMEOUT_MS, child_goes_quiet);
    int rc = 0;
    const int64_t took = send_busy(p, &rc);
    CHECK(rc != 0, "a send to a reader silent for 3 s succeeded after %lld ms", (long long) took);
    CHECK(p.mine->error_kind == TB_IO_TIMEOUT, "kind %s: %s", tb_io_error_name(p.mine->error_kind), p.mine->error);
    CHECK(took >= 1000 && took < 1000 + 4 * BUSY_TIMEOUT_MS, "failed after %lld ms, want about %d (the last beat, then "
          "the timeout)", (long long) took, 1000 + BUSY_TIMEOUT_MS);
    child_status(p.child);
    tb_close(p.mine);
}

// A rendezvous (transport.h): an all-reduce's partial comes within
// microseconds, but a connection whose recent waits ran long sleeps at once,
// and pays a wake-up each time. The child answers each "go" byte after
// spinning 300 us (long) or 5 us (short), alternately, so the waits average
// long; its answer carries the time it was sent. The parent counts, among the
// short waits whose answer was sent within RV_TIMELY_US of the wait's start
// (well inside the spin), those that slept, without the hint and with it.
// Only those count: on a VM a vCPU taken away for a moment makes some
// answers late whatever the hint, and a late answer says nothing about the
// spin. The child waits with the hint throughout, so its own wake-up does
// not make the short answers long.
enum { RV_ROUNDS = 64, RV_TRIES = 12, RV_LONG_US = 300, RV_SHORT_US = 5, RV_TIMELY_US = 12, RV_SAMPLES = 32 };

static void spin_us(int64_t us) {
    const int64_t until = tb_now_ns() + us * 1000;
    while (tb_now_ns() < until) {}
}

static int child_answers(struct tb_transport * t) {
    t->rendezvous = 1;
    for (;;) {
        uint8_t go;
        if (tb_recv(t, &go, 1) != 0) return 2;
        if (go == 2) return 0;
        spin_us(go ? RV_LONG_US : RV_SHORT_US);
        const int64_t sent = tb_now_ns();
        if (tb_send(t, &sent, sizeof sent) != 0 || tb_flush(t) != 0) return 3;
    }
}

struct rv_count { int timely, slept; };

// One run of RV_ROUNDS: the timely short waits, and how many of them slept, with the parent's hint as given.
static struct rv_count short_waits_slept(struct tb_transport * t, int hint) {
    struct tb_ring * r = (struct tb_ring *) t;
    t->rendezvous = hint;
    struct rv_count n = { 0, 0 };
    for (int i = 0; i < RV_ROUNDS; i++) {
        const uint8_t go = (uint8_t) (i % 2 == 0);
        int64_t sent = 0;
        CHECK(tb_send(t, &go, 1) == 0 && tb_flush(t) == 0, "send: %s", t->error);
        const uint64_t before = __atomic_load_n(&r->sleeps, __ATOMIC_RELAXED);
        const int64_t waiting = tb_now_ns();
        CHECK(tb_recv(t, &sent, sizeof sent) == 0, "answer: %s", t->error);
        if (!go && sent - waiting <= RV_TIMELY_US * 1000) {
            n.timely++;
            n.slept += __atomic_load_n(&r->sleeps, __ATOMIC_RELAXED) != before;
        }
    }
    return n;
}

// Runs until RV_SAMPLES timely short waits were seen (at most RV_TRIES runs).
static struct rv_count sampled(struct tb_transport * t, int hint) {
    struct rv_count all = { 0, 0 };
    for (int i = 0; i < RV_TRIES && all.timely < RV_SAMPLES; i++) {
        const struct rv_count one = short_waits_slept(t, hint);
        all.timely += one.timely;
        all.slept += one.slept;
    }
    return all;
}

static void case_rendezvous_spins(void) {
    struct pair p = make_pair(16, 4096, 10000, child_answers);
    const struct rv_count without = sampled(p.mine, 0), with = sampled(p.mine, 1);
    const uint8_t stop = 2;
    CHECK(tb_send(p.mine, &stop, 1) == 0 && tb_flush(p.mine) == 0, "stop: %s", p.mine->error);
    CHECK(child_status(p.child) == 0, "the child failed");
    CHECK(without.timely >= RV_SAMPLES / 2 && with.timely >= RV_SAMPLES / 2, "only %d and %d of the short answers "
          "came within %d us: too few to judge", without.timely, with.timely, RV_TIMELY_US);
    CHECK(without.slept * 4 >= without.timely * 3, "without the hint only %d of %d timely short waits slept: the "
          "waits did not average long, the case tests nothing", without.slept, without.timely);
    CHECK(with.slept * 8 <= with.timely, "with the hint %d of %d timely short waits slept (without: %d of %d)",
          with.slept, with.timely, without.slept, without.timely);
    tb_close(p.mine);
}

int main(int argc, char ** argv) {
    static const struct { const char * name; void (*fn)(void); } cases[] = {
        { "stream", case_stream }, { "one_way", case_one_way }, { "peer_killed", case_peer_killed },
        { "bell_to_a_dead_peer", case_bell_to_a_dead_peer },
        { "peer_closes", case_peer_closes }, { "silence_times_out_idle", case_silence_times_out_idle },
        { "forged_frames", case_forged_frames }, { "attach_rules", case_attach_rules }, { "upgrade", case_upgrade },
        { "forged_reply", case_forged_reply }, { "frame_taken_back", case_frame_taken_back },
        { "room", case_room }, { "heartbeat_keeps_a_sender", case_heartbeat_keeps_a_sender },
        { "quiet_reader_times_out", case_quiet_reader_times_out }, { "rendezvous_spins", case_rendezvous_spins },
    };
    signal(SIGPIPE, SIG_IGN);
    for (size_t i = 0; argc == 2 && i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(argv[1], cases[i].name) == 0) {
            cases[i].fn();
            printf("PASS %s\n", cases[i].name);
            return 0;
        }
    }
    fprintf(stderr, "usage: ring_tests CASE\n");
    return 2;
}
