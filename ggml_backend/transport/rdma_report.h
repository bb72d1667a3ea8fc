// transport/rdma_report.h - what this machine's verbs library says about its
// RDMA devices, for `tbrpc doctor` (bound with cffi; tbrpc/facts.py).
//
// A plain report, one entry per device, each with a kind and a sentence:
// doctor judges the kinds (and the GIDs against the addresses a cluster uses),
// never the words. Nothing here touches a connection: the report opens each
// device, queries its ports and GID table, and optionally creates QPs (RESET
// state, never RTR) to count how many this device still grants, then frees
// everything.
#pragma once

#include <stdint.h>

enum tb_rdma_verdict {
    TB_RDMA_USABLE      = 0,   // a device with an ACTIVE port, an IP-based GID and a QP to spare
    TB_RDMA_NO_HEADERS  = 1,   // this build has no verbs support (no <infiniband/verbs.h> when built)
    TB_RDMA_NO_LIBRARY  = 2,   // the verbs library did not load (report.library: the path tried)
    TB_RDMA_NO_DEVICE   = 3,   // the library lists no device
    TB_RDMA_OPEN_FAILED = 4,   // ibv_open_device failed (error_number: errno; Linux: /dev/infiniband access)
    TB_RDMA_PORT_DOWN   = 5,   // no port is ACTIVE (peer not enabled, cable out, a port without RDMA)
    TB_RDMA_NO_GID      = 6,   // the active port has no IPv4-mapped or global IPv6 GID
    TB_RDMA_QP_BUDGET   = 7,   // not one more QP can be created on this device now
    TB_RDMA_INFINIBAND  = 8,   // the port's link layer is InfiniBand: tbrpc's RDMA is RoCE and Apple's only
};

#define TB_RDMA_REPORT_GIDS    8
#define TB_RDMA_REPORT_DEVICES 8

struct tb_rdma_device_report {
    char     name[64];
    int      kind;                 // enum tb_rdma_verdict
    char     text[200];            // the same, for people
    int      error_number;         // errno of a failed open, else 0
    int      port;                 // the first ACTIVE port, else 1
    int      port_state;           // enum ibv_port_state: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER
    int      link_layer;           // 1 InfiniBand, 2 Ethernet, 0 unknown
    int      active_mtu;           // bytes
    int      max_qp;               // from ibv_query_device; 0 unknown
    int      qp_free;              // QPs the probe could create (at most its limit); -1 not probed
    int      n_gids;
    char     gids[8][48];          // the port's non-zero GIDs, as IPv6 text (::ffff:a.b.c.d for IPv4)
    int      gid_index[8];         // each one's index in the GID table
    int      gid_types[8];         // each one's enum tb_gid_type: 0 untyped, 1 RoCE v1, 2 RoCE v2, 3 IB
    int      gid_chosen[8];        // 1: the entry a connection from this GID's address would use (tb_rdma_find_gid)
};

struct tb_rdma_report {
    int      kind;                 // USABLE once devices are listed (then see each device), else why not
    char     text[256];
    char     library[256];         // the library loaded, or the one tried
    char     profile[16];          // apple-uc, linux-rc, linux-uc
    uint64_t host_id;              // two ends with the same id stay on TCP (shared memory instead)
    uint64_t ring_bytes;           // memory one connection registers (locked) with this profile
    int      n_devices;            // entries filled (the library may list more)
    struct tb_rdma_device_report devices[8];
};

// Fill `out`. qp_probe > 0: create up to that many QPs per device to count the
// free ones. Returns out->kind.
int tb_rdma_report(struct tb_rdma_report * out, int qp_probe);
