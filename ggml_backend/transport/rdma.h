// transport/rdma.h - the frame ring (ring.h) over verbs SEND/RECV.
//
// A connection starts on TCP; both sides then run the bring-up over it
// (tb_rdma_upgrade): each opens the RDMA device whose GID matches its TCP
// address, creates one QP with its rings registered, and sends a
// tb_rdma_info. If both infos say yes (same profile, different hosts), both
// go RTR/RTS once, post the probe's receive, and exchange a readiness byte
// each way over TCP; then each sends one probe frame over RDMA (RTR checks no
// path), waits for the peer's, posts the ring's receives, and says so again.
// Only when both are ready at both steps do both switch; otherwise both stay
// on TCP and both know why. The TCP connection stays open under the RDMA
// transport as its liveness anchor (end of file = the peer is gone).
//
// Profiles (TBRPC_RDMA_PROFILE, default apple-uc on macOS, linux-rc elsewhere):
//   apple-uc   UC QPs, SEND/RECV only, queues counted in 4 KiB frames; every
//              SEND carries a whole stride because sender and receiver must
//              post the same number of frames (TN3205). 128 KiB x 16.
//   linux-rc   RC; a SEND carries only the bytes used. 256 KiB x 16.
//   linux-uc   UC (fabrics without RC, and tests): as linux-rc, but an
//              unmatched SEND is lost, which the ring's credits rule out.
// TBRPC_RDMA_STRIDE / TBRPC_RDMA_SLOTS override the geometry (tests),
// TBRPC_RDMA_DEVICE names the device, TBRPC_HOST_ID overrides the host id.
// Every QP first takes a place of its device's budget, counted per host over
// every tbrpc process (qp_budget.h: TBRPC_RDMA_MAX_QPS, TBRPC_QP_DIR).
#pragma once

#include "../transport.h"

#include <stdint.h>

enum tb_rdma_profile { TB_RDMA_APPLE_UC = 1, TB_RDMA_LINUX_RC = 2, TB_RDMA_LINUX_UC = 3 };

#define TB_RDMA_INFO_MAGIC   0x41445254u   // "TRDA"
#define TB_RDMA_INFO_VERSION 4   // 3: a probe frame each way before the switch; 4: gid_type
#define TB_RDMA_PREFIX       64u           // wire bytes before each ring frame: seq, length, checksum

// What each side tells the other over TCP (fixed layout, 240 bytes).
struct tb_rdma_info {
    uint32_t magic;
    uint16_t version;
    uint16_t profile;
    uint32_t ok;            // 0: this side declines; reason says why
    uint32_t qpn, psn;
    uint32_t stride;        // wire bytes per slot (ring frame + TB_RDMA_PREFIX)
    uint32_t slots;
    uint32_t mtu;           // enum ibv_mtu
    uint16_t lid;
    uint8_t  port, gid_index;
    uint8_t  gid[16];
    uint64_t host_id;
    char     device[32];
    char     reason[136];
    uint32_t why;           // ok=0: enum tb_why of the reason (TB_WHY_QP_BUDGET, else TB_WHY_RDMA_FAILED)
    uint8_t  gid_type;      // enum tb_gid_type (verbs_load.h) of gid; both sides must send the same
    uint8_t  reserved[3];
};
_Static_assert(sizeof(struct tb_rdma_info) == 240, "tb_rdma_info is a wire layout");

const char * tb_rdma_profile_name(int profile);
int tb_rdma_profile_default(void);   // from TBRPC_RDMA_PROFILE, else the platform's

// A prepared endpoint: device open, rings registered, QP in INIT.
struct tb_rdma;
// local_host: this side's address on the link (the TCP connection's own
// address); its GID picks the device. NULL on failure, with the reason in
// mine->reason (mine is always filled, ok=0 on failure, so it can be sent).
// The QP takes one of its device's places (qp_budget.h) first, and gives it
// back when the endpoint goes: no place, no QP ("QP budget: 10 of 10 in use on ...").
struct tb_rdma * tb_rdma_prepare(const char * local_host, struct tb_rdma_info * mine);
// RTR, RTS (once), post the probe's receive. 0, or -1 with err.
int tb_rdma_connect(struct tb_rdma * d, const struct tb_rdma_info * peer, char * err, size_t err_len);
// Once both sides connected: one probe frame each way (RTR checks no path),
// then post the receive ring. 0, or -1 with err.
int tb_rdma_probe(struct tb_rdma * d, char * err, size_t err_len);
void tb_rdma_discard(struct tb_rdma * d);

// The whole symmetric bring-up over `tcp` (both sides call it at the same
// point of their conversation). Returns the RDMA transport (which now owns
// tcp), or NULL with the reason in `reason` and its kind (enum tb_why) in
// *why; tcp is then still usable and the peer stayed on TCP too.
// local_host NULL: the TCP connection's own address.
struct tb_transport * tb_rdma_upgrade(struct tb_transport * tcp, const char * local_host, int * why, char * reason,
                                      size_t reason_len);

// QPs one device takes (0: no limit): apple-uc 10 (TN3205); TBRPC_RDMA_MAX_QPS overrides.
// Counted over every tbrpc process of the host (qp_budget.h).
int tb_rdma_qp_limit(int profile);

// Whether this process could offer RDMA at all: a verbs library loads and
// lists a device. 1, or 0 with why not (a node sets TB_CAP_RDMA from this).
int tb_rdma_available(char * why, size_t why_len);

// With verbs headers only (rdma_report.c uses them): this host's id (equal ids
// stay on TCP), and the ring geometry a connection registers with `profile`
// (2 x slots x stride bytes).
uint64_t tb_rdma_host_id(void);
void tb_rdma_geometry(int profile, uint32_t * slots, uint32_t * stride);

#include "verbs_load.h"
#if TB_HAVE_VERBS
// The GID index of `want` on a port of `link_layer` with `tbl_len` entries:
// the RoCE v2 entry when the address has one (RoCE NICs list each address
// twice, v1 first; v1 is an Ethernet frame no router forwards, and rdma-core's
// tools use v2), else the first entry that holds it (Apple: one untyped
// entry). -1 when none holds it; *type: enum tb_gid_type of the index.
int tb_rdma_find_gid(const struct tb_verbs * v, struct ibv_context * ctx, uint8_t port, int tbl_len, int link_layer,
                     const union ibv_gid * want, int * type);
#endif
