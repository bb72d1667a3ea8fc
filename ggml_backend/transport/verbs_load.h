// transport/verbs_load.h - the verbs library, loaded at run time.
//
// The RDMA transport never links a verbs library: one build must run where
// none exists (macOS before 26.2 aborts a binary that hard-links librdma).
// tb_verbs_load() dlopens, in order:
//   $TBRPC_VERBS_LIB            (tests: the stand-in, tests/c/verbs_sim.c)
//   /usr/lib/librdma.dylib      (macOS 26.2+, Apple's RDMA over Thunderbolt)
//   libibverbs.so.1             (Linux, rdma-core)
// and fills a table of the setup verbs. The data path (post_send, post_recv,
// poll_cq, req_notify_cq) has no symbols anywhere: the header's static
// inlines call ctx->ops, which every provider fills, so rdma.c calls
// ibv_post_send() & co. directly.
//
// TB_HAVE_VERBS is 1 when <infiniband/verbs.h> was found at build time
// (Debian: libibverbs-dev; macOS: the SDK). Without it rdma.c is a stub that
// says "built without verbs headers".
#pragma once

#if defined(__has_include) && !defined(TB_NO_VERBS)   // -DTB_NO_VERBS: build the stub on purpose
#  if __has_include(<infiniband/verbs.h>)
#    define TB_HAVE_VERBS 1
#  endif
#endif
#ifndef TB_HAVE_VERBS
#  define TB_HAVE_VERBS 0
#endif

#include <stddef.h>

#if TB_HAVE_VERBS
#include <infiniband/verbs.h>

struct tb_verbs {
    void * handle;
    char   path[256];   // what was loaded
    struct ibv_device ** (*get_device_list)(int * num);
    void          (*free_device_list)(struct ibv_device ** list);
    const char *  (*get_device_name)(struct ibv_device * dev);
    struct ibv_context * (*open_device)(struct ibv_device * dev);
    int           (*close_device)(struct ibv_context * ctx);
    int           (*query_port)(struct ibv_context * ctx, uint8_t port, struct ibv_port_attr * attr);
    int           (*query_gid)(struct ibv_context * ctx, uint8_t port, int index, union ibv_gid * gid);
    struct ibv_pd * (*alloc_pd)(struct ibv_context * ctx);
    int           (*dealloc_pd)(struct ibv_pd * pd);
    struct ibv_mr * (*reg_mr)(struct ibv_pd * pd, void * addr, size_t len, int access);
    int           (*dereg_mr)(struct ibv_mr * mr);
    struct ibv_cq * (*create_cq)(struct ibv_context * ctx, int cqe, void * cq_context,
                                 struct ibv_comp_channel * channel, int comp_vector);
    int           (*destroy_cq)(struct ibv_cq * cq);
    struct ibv_qp * (*create_qp)(struct ibv_pd * pd, struct ibv_qp_init_attr * attr);
    int           (*modify_qp)(struct ibv_qp * qp, struct ibv_qp_attr * attr, int mask);
    int           (*destroy_qp)(struct ibv_qp * qp);
    const char *  (*wc_status_str)(enum ibv_wc_status status);
    // optional (NULL when the library lacks them: Apple documents no completion channel)
    struct ibv_comp_channel * (*create_comp_channel)(struct ibv_context * ctx);
    int           (*destroy_comp_channel)(struct ibv_comp_channel * ch);
    int           (*get_cq_event)(struct ibv_comp_channel * ch, struct ibv_cq ** cq, void ** cq_context);
    void          (*ack_cq_events)(struct ibv_cq * cq, unsigned int n);
    int           (*query_device)(struct ibv_context * ctx, struct ibv_device_attr * attr);   // optional
#ifndef __APPLE__
    // optional: rdma-core v30+ (IBVERBS_1.11); older libibverbs lacks it. Apple's librdma has
    // none (and its SDK header need not declare struct ibv_gid_entry): its GIDs are untyped.
    int           (*query_gid_ex)(struct ibv_context * ctx, uint32_t port, uint32_t index, struct ibv_gid_entry * entry,
                                  uint32_t flags, size_t entry_size);
#endif
};

// What a GID table entry is, as the two sides of a bring-up tell each other
// (tb_rdma_info.gid_type; these values, not the verbs enum, are on the wire).
enum tb_gid_type {
    TB_GID_UNTYPED = 0,   // the library says nothing (Apple's librdma: one kind of GID, nothing to choose)
    TB_GID_ROCE_V1 = 1,   // RoCE v1: an Ethernet frame (ethertype 0x8915), reaches its own L2 segment only
    TB_GID_ROCE_V2 = 2,   // RoCE v2: UDP/IP (port 4791), routable; what rdma-core's tools use by default
    TB_GID_IB      = 3,   // an InfiniBand port's GID (subnet prefix + port GUID)
};
const char * tb_gid_type_name(int type);

// The type of GID `index` of `port`: _ibv_query_gid_ex where the library has
// it, else the kernel's sysfs file (<ibdev_path>/ports/<port>/gid_attrs/types/<index>,
// what rdma-core itself reads), else TB_GID_UNTYPED. link_layer (IBV_LINK_LAYER_*)
// tells an IB port's "IB/RoCE v1" from an Ethernet port's.
int tb_verbs_gid_type(const struct tb_verbs * v, struct ibv_context * ctx, uint8_t port, int index, int link_layer);

// The process's verbs table, loaded once (thread-safe). NULL with the reason
// in err when no library or a required verb is missing.
const struct tb_verbs * tb_verbs_load(char * err, size_t err_len);
#endif

// The library tb_verbs_load() opens first: $TBRPC_VERBS_LIB, else the system's.
const char * tb_verbs_wanted(void);
