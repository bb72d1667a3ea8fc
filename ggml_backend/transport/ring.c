// transport/ring.c - the byte stream over frames, credits and sequence
// numbers that shared memory and RDMA share (rules in ring.h).
//
// One mutex guards all ring state; nothing waits while holding it. Frames
// are checked once, when first seen (scan), and what was checked is kept in
// rx_len/rx_flags: a hostile peer that rewrites a header afterwards changes
// nothing we rely on.
#include "ring.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WAIT_SLICE_MS 100   // how long one wait may sleep before deadlines are checked

struct rx_check { uint32_t len; uint16_t flags; };

static uint32_t payload_max(const struct tb_ring * r) { return r->stride - TB_FRAME_HEADER; }

static struct rx_check * rx_checks(struct tb_ring * r) { return (struct rx_check *) r->rx_checked; }

static int consume(struct tb_ring * r);

// Count the credits of frames that arrived since the last scan, checking each
// header once, and free the slots of frames without payload at the head of
// the queue: a sender that never reads must still hand back the slots of the
// credit returns it receives. Returns the number of new frames, or -1 (the
// ring is broken).
static int scan(struct tb_ring * r) {
    int found = 0;
    while (r->rx_seen - r->rx_seq < r->slots) {
        int broken = 0;
        const uint8_t * f = r->wire->rx_frame(r, r->rx_seen, &broken);
        if (broken) return -1;
        if (!f) break;
        struct tb_frame_header h;
        memcpy(&h, f, sizeof h);
        if (h.magic != TB_FRAME_MAGIC || h.len > payload_max(r) || (h.flags & ~3u) ||
            h.credits > r->slots - r->tx_credits) {
            return tb_fail(&r->base, TB_IO_BROKEN, "%s: %s frame %u is not a frame of this connection "
                           "(magic %08x, %u bytes, %u credits, flags %x)", r->base.peer, r->wire->name,
                           r->rx_seen, h.magic, h.len, h.credits, h.flags);
        }
        r->tx_credits += h.credits;
        rx_checks(r)[r->rx_seen % r->slots] = (struct rx_check) { h.len, h.flags };
        r->rx_seen++;
        found++;
    }
    while (!r->rx_cur && !r->peer_closed && r->rx_seq != r->rx_seen && rx_checks(r)[r->rx_seq % r->slots].len == 0) {
        if (consume(r) != 0) return -1;
    }
    return found;
}

// Post the frame being filled, with the credits we owe and `flags`.
static int post_current(struct tb_ring * r, uint16_t flags) {
    struct tb_frame_header h = { TB_FRAME_MAGIC, r->tx_fill, 0, (uint16_t) r->to_return, flags };
    memcpy(r->tx_cur, &h, sizeof h);
    if (r->wire->post(r, r->tx_seq) != 0) return -1;
    r->base.bytes_sent += r->tx_fill;
    r->to_return = 0;
    r->tx_seq++;
    r->tx_credits--;
    r->tx_cur = NULL;
    r->tx_fill = 0;
    r->frames_sent++;
    return 0;
}

// A frame may go when it leaves a credit for a later credit return, or is one.
static int may_post(const struct tb_ring * r, int returns_credits) {
    return r->tx_credits >= 2 || (r->tx_credits == 1 && returns_credits);
}

// Wait, without the lock, until a frame arrives or the deadline passes.
// Returns 0 on progress, -1 on failure (timeout, peer gone, broken).
static int wait_progress(struct tb_ring * r, int64_t * deadline) {
    int64_t left = r->base.timeout_ms > 0 ? *deadline - tb_now_ms() : WAIT_SLICE_MS;
    if (left <= 0) {
        return tb_fail(&r->base, TB_IO_TIMEOUT, "%s: no answer within %d ms (%s)", r->base.peer,
                       r->base.timeout_ms, r->base.describe);
    }
    if (r->base.deadline_ms > 0) {
        const int64_t until = r->base.deadline_ms - tb_now_ms();
        if (until <= 0) {
            return tb_fail(&r->base, TB_IO_TIMEOUT, "%s: message not complete in time (too slow a sender; %s)",
                           r->base.peer, r->base.describe);
        }
        if (until < left) left = until;
    }
    uint32_t watch = r->rx_seen;
    pthread_mutex_unlock(&r->lock);
    int rc = r->wire->wait(r, watch, left < WAIT_SLICE_MS ? (int) left : WAIT_SLICE_MS);
    pthread_mutex_lock(&r->lock);
    int found = scan(r);
    // A peer may write its last frames and exit at once: frames that arrived
    // before it went are still read; only with none left is it gone.
    if (rc != 0) return found > 0 ? 0 : -1;   // the wire said why
    if (found < 0) return -1;
    // Only silence times out: a frame, or the peer's heartbeat (a reader
    // that computes and does not read, whose frames no longer fit), is life.
    const int alive = found > 0 || (r->wire->peer_alive && r->wire->peer_alive(r));
    if (alive && r->base.timeout_ms > 0) *deadline = tb_now_ms() + r->base.timeout_ms;
    return 0;
}

static int acquire(struct tb_ring * r) {
    int64_t deadline = tb_now_ms() + r->base.timeout_ms;
    if (scan(r) < 0) return -1;
    if (!may_post(r, r->to_return > 0)) r->credit_stalls++;
    while (!may_post(r, r->to_return > 0)) {
        if (wait_progress(r, &deadline) != 0) return -1;
    }
    r->tx_cur = r->wire->tx_frame(r, r->tx_seq);
    r->tx_fill = 0;
    return 0;
}

static int ring_send(struct tb_transport * t, const void * data, size_t len) {
    struct tb_ring * r = (struct tb_ring *) t;
    const uint8_t * p = data;
    int rc = 0;
    pthread_mutex_lock(&r->lock);
    while (len > 0 && rc == 0) {
        if (!r->tx_cur && (rc = acquire(r)) != 0) break;
        size_t n = payload_max(r) - r->tx_fill;
        if (n > len) n = len;
        memcpy(r->tx_cur + TB_FRAME_HEADER + r->tx_fill, p, n);
        r->tx_fill += (uint32_t) n;
        p += n;
        len -= n;
        if (r->tx_fill == payload_max(r)) rc = post_current(r, 0);
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static int ring_flush(struct tb_transport * t) {
    struct tb_ring * r = (struct tb_ring *) t;
    int rc = 0;
    pthread_mutex_lock(&r->lock);
    if (r->tx_cur && r->tx_fill > 0) {
        rc = post_current(r, 0);
        if (rc == 0) t->flushes++;
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

// Hand freed slots back once half of them wait: on the frame being filled
// (sending it early changes nothing in the stream), else in a frame of their own.
static int return_credits(struct tb_ring * r) {
    if (r->to_return < r->slots / 2 || !may_post(r, 1)) return 0;
    if (r->tx_cur) return post_current(r, 0);
    r->tx_cur = r->wire->tx_frame(r, r->tx_seq);
    r->tx_fill = 0;
    return post_current(r, TB_FRAME_CREDIT_ONLY);
}

// Done with frame rx_seq: free its slot and owe the peer a credit.
static int consume(struct tb_ring * r) {
    uint16_t flags = rx_checks(r)[r->rx_seq % r->slots].flags;
    if (r->wire->release(r, r->rx_seq) != 0) return -1;
    r->rx_seq++;
    r->rx_cur = NULL;
    r->to_return++;
    if (flags & TB_FRAME_CLOSE) r->peer_closed = 1;
    return return_credits(r);
}

// Make rx_cur the next frame with payload, if one has arrived. 1, 0 (none yet) or -1.
static int next_frame(struct tb_ring * r) {
    while (!r->rx_cur && !r->peer_closed) {
        if (r->rx_seq == r->rx_seen && scan(r) < 0) return -1;
        if (r->rx_seq == r->rx_seen) return 0;
        struct rx_check c = rx_checks(r)[r->rx_seq % r->slots];
        if (c.len == 0) {   // credits only, or a close
            if (consume(r) != 0) return -1;
            continue;
        }
        int broken = 0;
        r->rx_cur = r->wire->rx_frame(r, r->rx_seq, &broken);
        if (!r->rx_cur) return tb_fail(&r->base, TB_IO_BROKEN, "%s: %s frame %u vanished", r->base.peer,
                                       r->wire->name, r->rx_seq);
        r->rx_len = c.len;
        r->rx_off = 0;
        // A full frame was posted because it filled, not at a flush: the
        // message goes on, and its next frame is a copy away (tb_ring_more).
        __atomic_store_n(&r->rx_more, c.len == payload_max(r), __ATOMIC_RELAXED);
    }
    return r->rx_cur != NULL;
}

static int ring_recv(struct tb_transport * t, void * data, size_t len) {
    struct tb_ring * r = (struct tb_ring *) t;
    uint8_t * p = data;
    int64_t deadline = tb_now_ms() + t->timeout_ms;
    pthread_mutex_lock(&r->lock);
    int rc = 0;
    while (len > 0) {
        int got = next_frame(r);
        if (got < 0) { rc = -1; break; }
        if (got == 0) {
            if (r->peer_closed) { rc = tb_fail(t, TB_IO_CLOSED, "%s: connection closed by peer", t->peer); break; }
            if ((rc = wait_progress(r, &deadline)) != 0) break;
            continue;
        }
        size_t n = r->rx_len - r->rx_off;
        if (n > len) n = len;
        memcpy(p, r->rx_cur + TB_FRAME_HEADER + r->rx_off, n);
        r->rx_off += (uint32_t) n;
        p += n;
        len -= n;
        t->bytes_received += n;
        if (t->timeout_ms > 0) deadline = tb_now_ms() + t->timeout_ms;
        if (r->rx_off == r->rx_len && (rc = consume(r)) != 0) break;
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static int ring_poll(struct tb_transport * t, int timeout_ms) {
    struct tb_ring * r = (struct tb_ring *) t;
    int64_t until = tb_now_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    pthread_mutex_lock(&r->lock);
    int rc;
    for (;;) {
        rc = next_frame(r);
        if (rc != 0) break;
        if (r->peer_closed) { rc = 1; break; }   // the next recv says so
        int64_t left = until - tb_now_ms();
        if (left <= 0) break;
        uint32_t watch = r->rx_seen;
        pthread_mutex_unlock(&r->lock);
        int w = r->wire->wait(r, watch, left < WAIT_SLICE_MS ? (int) left : WAIT_SLICE_MS);
        pthread_mutex_lock(&r->lock);
        if (w != 0) { rc = -1; break; }
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static void ring_close(struct tb_transport * t) {
    struct tb_ring * r = (struct tb_ring *) t;
    pthread_mutex_lock(&r->lock);
    if (!r->peer_closed && r->tx_credits >= 1) {   // best effort: the peer then reads "closed by peer"
        if (!r->tx_cur) r->tx_cur = r->wire->tx_frame(r, r->tx_seq), r->tx_fill = 0;
        post_current(r, TB_FRAME_CLOSE);
    }
    pthread_mutex_unlock(&r->lock);
    r->wire->free(r);
}

// The frame being filled has room for len, or a new one may be posted now (credits seen so far).
static int ring_room(struct tb_transport * t, size_t len) {
    struct tb_ring * r = (struct tb_ring *) t;
    pthread_mutex_lock(&r->lock);
    int ok = scan(r) >= 0 && len <= payload_max(r) &&
             (r->tx_cur ? r->tx_fill + len <= payload_max(r) : may_post(r, r->to_return > 0));
    pthread_mutex_unlock(&r->lock);
    return ok;
}

static int ring_alive(struct tb_transport * t) {
    struct tb_ring * r = (struct tb_ring *) t;
    if (!r->wire->heartbeat) return 0;
    r->wire->heartbeat(r);
    return 1;
}

static const struct tb_transport_ops ring_ops = {
    .name = "ring", .send = ring_send, .flush = ring_flush, .recv = ring_recv, .poll = ring_poll, .room = ring_room,
    .close = ring_close, .alive = ring_alive,
};

// At least 4 slots: credits go back once half the slots are free, and with
// 2 that is every frame, so each credit-only frame would be answered by
// another, forever.
int tb_ring_geometry_ok(uint32_t slots, uint32_t stride) {
    return slots >= 4 && slots <= 1024 && (slots & (slots - 1)) == 0 &&
           stride >= 4096 && stride <= (1u << 20) && stride % 64 == 0;
}

struct tb_transport * tb_ring_init(struct tb_ring * r, const struct tb_ring_wire * wire,
                                   uint32_t slots, uint32_t stride, int timeout_ms, const char * peer) {
    r->base.ops = &ring_ops;
    r->base.timeout_ms = timeout_ms;
    snprintf(r->base.peer, sizeof r->base.peer, "%s", peer);
    r->wire = wire;
    r->slots = slots;
    r->stride = stride;
    r->tx_seq = r->rx_seq = r->rx_seen = TB_RING_FIRST_SEQ;   // 1: slot 0 starts zeroed, seq 0 never matches first
    r->tx_credits = slots;
    r->rx_checked = calloc(slots, sizeof(struct rx_check));
    if (!r->rx_checked) return NULL;
    if (pthread_mutex_init(&r->lock, NULL) != 0) { free(r->rx_checked); r->rx_checked = NULL; return NULL; }
    return &r->base;
}

void tb_ring_destroy(struct tb_ring * r) {
    if (!r->rx_checked) return;
    pthread_mutex_destroy(&r->lock);
    free(r->rx_checked);
    r->rx_checked = NULL;
}
