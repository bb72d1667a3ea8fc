// transport/ring.h - a byte stream over a ring of fixed-size frames.
//
// Shared memory and RDMA move whole frames into slots the receiver owns, not
// a byte stream. The ring turns frames back into the transport.h stream and
// holds every rule both wires share, so the same code runs at full speed on
// every machine (over shared memory) and on the Macs (over verbs):
//
//   frame    = 16-byte header + payload, at most `stride` bytes in all
//   header   = {magic, len (payload bytes), seq, credits returned, flags}
//   seq      = 1, 2, 3, ... per direction; frame seq lives in slot seq % slots;
//              a frame with another seq than the next expected is a lost or
//              forged frame and breaks the connection
//   credits  = free receive slots of the peer. Each frame costs one. A
//              receiver hands slots back in the header of its next frame, or
//              in a CREDIT_ONLY frame once half its slots wait to be returned.
//              The last credit is kept for a frame that returns credits, so
//              two senders can never both wait for each other.
//
// A wire provides five things (struct tb_ring_wire): where frame seq is
// written, how it is made visible (post), whether frame seq has arrived, how
// its slot is handed back, and how to sleep until something happens; and, if
// it can, a heartbeat outside the slots. The
// wire also owns a liveness socket (the TCP connection the ring was
// negotiated over): its end of file means the peer process is gone.
#pragma once

#include "../transport.h"

#include <pthread.h>

#define TB_FRAME_MAGIC      0x52464254u   // "TBFR"
#define TB_FRAME_HEADER     16u
#define TB_FRAME_CREDIT_ONLY 1u           // carries credits, no payload, returns no slot to the sender
#define TB_FRAME_CLOSE       2u           // the sender closes: the next recv says "closed by peer"

// The first seq of each direction. Seqs are 32 bits and wrap after 2^32
// frames (hours of small frames on a busy link); a wire must treat 0 as an
// ordinary seq. Tests build with a first seq just below the wrap
// (-DTB_RING_FIRST_SEQ=0xffffffc0u) to cross it within a short stream.
#ifndef TB_RING_FIRST_SEQ
#define TB_RING_FIRST_SEQ    1u
#endif

struct tb_frame_header {
    uint32_t magic;
    uint32_t len;       // payload bytes after the header
    uint32_t seq;       // written by the wire's post(), last
    uint16_t credits;   // receive slots of the sender freed since its last frame
    uint16_t flags;
};

struct tb_ring;

struct tb_ring_wire {
    const char * name;   // "shm", "rdma": the first word of the connection's description
    // Where frame `seq` is written before post() (stride bytes).
    uint8_t * (*tx_frame)(struct tb_ring * r, uint32_t seq);
    // Make frame `seq` (header.len + 16 bytes) visible to the peer; writes header.seq.
    int (*post)(struct tb_ring * r, uint32_t seq);
    // Frame `seq` if it has arrived (its header may still be hostile), else NULL;
    // on failure sets *broken and records why (tb_fail on &r->base).
    const uint8_t * (*rx_frame)(struct tb_ring * r, uint32_t seq, int * broken);
    // The consumer is done with frame `seq`: its slot may be filled again.
    int (*release)(struct tb_ring * r, uint32_t seq);
    // Sleep until frame `seq` may have arrived, up to timeout_ms: 0, or -1
    // (recorded with tb_fail) when the peer is gone or the wire failed.
    int (*wait)(struct tb_ring * r, uint32_t seq, int timeout_ms);
    void (*free)(struct tb_ring * r);
    // Optional (NULL: the wire has none), a sign of life outside the slots:
    // heartbeat shows ours (tb_alive), peer_alive says whether the peer's
    // has moved since it last looked, which a waiting ring counts as
    // progress like a frame. A ring whose reader does not read holds at
    // most `slots` frames, so frames alone keep a waiting sender for only
    // so many keepalives.
    void (*heartbeat)(struct tb_ring * r);
    int (*peer_alive)(struct tb_ring * r);
};

struct tb_ring {
    struct tb_transport base;          // must be first: ops receive &base
    const struct tb_ring_wire * wire;  // the wire's own state surrounds this struct
    uint32_t slots, stride;            // the same in both directions
    pthread_mutex_t lock;              // all of the state below; never held while waiting

    // tx side
    uint32_t tx_seq;                   // next frame to post
    uint32_t tx_credits;               // free receive slots of the peer
    uint8_t * tx_cur;                  // frame being filled (NULL: none)
    uint32_t tx_fill;                  // payload bytes in it
    uint32_t to_return;                // our freed receive slots not yet announced

    // rx side (one reader)
    uint32_t rx_seq;                   // next frame to consume
    uint32_t rx_seen;                  // frames before this one had their credits counted
    void *   rx_checked;               // per slot: the length and flags checked when the frame was seen
    const uint8_t * rx_cur;            // frame being consumed (NULL: none)
    uint32_t rx_len, rx_off;           // its payload length (checked) and how much was read
    int      peer_closed;
    int      rx_more;                  // the last frame taken was full: more of its message is coming (atomic)

    uint64_t frames_sent, credit_stalls;
    uint64_t sleeps;                   // waits that slept rather than spun (the wire counts them; atomic)
};

// Fill in a ring over `wire`, inside the wire's own struct. Each side starts
// with `slots` credits. Returns &r->base, or NULL if the mutex cannot be made.
struct tb_transport * tb_ring_init(struct tb_ring * r, const struct tb_ring_wire * wire,
                                   uint32_t slots, uint32_t stride, int timeout_ms, const char * peer);
// Undo tb_ring_init (the wire's free() calls it).
void tb_ring_destroy(struct tb_ring * r);

// Whether the frame awaited is, most likely, the rest of a message already
// begun (a wire may spin for it rather than sleep). Safe without the lock.
static inline int tb_ring_more(const struct tb_ring * r) { return __atomic_load_n(&r->rx_more, __ATOMIC_RELAXED); }

// Whether `stride` and `slots` make a ring: a power of two number of slots
// from 2 to 1024 and a stride from 4 KiB to 1 MiB.
int tb_ring_geometry_ok(uint32_t slots, uint32_t stride);
