// transport/qp_budget.h - the RDMA QPs of a device, counted over every tbrpc
// process on this host: the head, each node, and each node's worker
// processes (one per client) alike.
//
// A device grants so many QPs whoever asks (Apple: at most 10 per device,
// TN3205). rdma.c takes a place here before it creates a QP and gives it
// back after the QP is destroyed; a connection that finds no place stays on
// TCP with the reason ("QP budget: 10 of 10 in use on rdma_en3"), and the
// peer says "peer: QP budget: ..." from the bring-up's answer.
//
// A place is a file, <dir>/qp-<host id>-<device>.<k> for k < limit, held by
// an exclusive flock() for as long as the QP lives. Why this mechanism:
//   - the kernel drops the lock when its process dies (crash, SIGKILL), so a
//     place is never leaked and there is nothing to clean up;
//   - flock() works the same on Linux and macOS. Abstract Unix socket names
//     (what the stand-in verbs provider uses for its own count) are
//     Linux-only, and a socket bound to a path outlives its process;
//   - a flock belongs to the open file, not to the process (unlike fcntl's
//     record locks, which one process holds once however many times it takes
//     them, and drops all at once when it closes any descriptor of the
//     file): two sessions served by threads of one node exclude each other
//     exactly as two processes do;
//   - a head and a node have no memory in common (a node's workers share its
//     status table, a head shares nothing), but they share a file system.
// Places are opened close-on-exec; a child forked (not exec'd) while its
// parent holds one shares the lock until it exits: the place is then counted
// longer than its QP lives, never shorter.
// The places live in a per-user directory (TBRPC_QP_DIR; else
// $XDG_RUNTIME_DIR/tbrpc-qp; else tbrpc-qp-<uid> in $TMPDIR or /tmp), made
// 0700 and refused unless this user owns it and no one else may write in it,
// so no other user can take or fake places. QPs another user's tbrpc holds on the device are
// therefore not counted here; the device then refuses the QP itself, and the
// connection stays on TCP with that reason instead.
//
// The host id (tb_rdma_host_id) is in the name because one file system may
// stand for several hosts: tests give processes on one machine host ids of
// their own (TBRPC_HOST_ID), each with a device of its own in the stand-in.
// Every process of a host should use the same limit (TBRPC_RDMA_MAX_QPS):
// one with a smaller limit looks only at the first `limit` places.
#pragma once

#include <stddef.h>
#include <stdint.h>

enum tb_qp_take {
    TB_QP_TAKEN = 0,      // a place is held (or no limit applies): create the QP
    TB_QP_SPENT = 1,      // every place is held: "QP budget: 10 of 10 in use on rdma_en3"
    TB_QP_NO_PLACES = 2,  // the directory or a place cannot be used: why says which and why
};

// Take a place for one QP of `device` on host `host_id`, within `limit`
// (<= 0: no limit, nothing is held). Returns the kind; on TB_QP_TAKEN *place
// is what tb_qp_give takes back (-1 when nothing is held), otherwise why says
// why not.
int tb_qp_take(uint64_t host_id, const char * device, int limit, int * place, char * why, size_t why_len);
// The QP is gone: its place is free again (-1: nothing to give).
void tb_qp_give(int place);
// Where the places are (made if need be). 0, or -1 with why.
int tb_qp_dir(char * dir, size_t dir_len, char * why, size_t why_len);
