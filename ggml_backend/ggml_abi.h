// ggml_abi.h - tbrpc's own declarations of ggml's *internal* backend ABI.
//
// A ggml backend is a set of C structs of function pointers (buffer type,
// buffer, backend, device, registry). Their layout lives in ggml's private
// header ggml-backend-impl.h, which llama-cpp-python does not install. We
// declare the layout here, written for the ggml that llama-cpp-python 0.3.36
// ships (GGML_BACKEND_API_VERSION 2). The field order below must match that
// ggml exactly: a mismatch would make ggml call the wrong function pointer.
//
// The run-time guard is tbrpc.native.load(): it refuses to load this library
// into any llama-cpp-python but the release it was written for.
// docs/architecture.md explains how to move this file to a new release.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TBRPC_GGML_BACKEND_API_VERSION 2
// ggml_version() of the ggml inside llama-cpp-python 0.3.36.
#define TBRPC_LLAMA_CPP_PYTHON_VERSION "0.3.36"

// ggml's log (ggml-impl.h; exported by libggml-base): what the head says goes
// where llama.cpp's own messages go, so llama-cpp-python's `verbose` governs it.
GGML_API void ggml_log_internal(enum ggml_log_level level, const char * format, ...);

// --- buffer type -----------------------------------------------------------
struct ggml_backend_buffer_type_i {
    const char *          (*get_name)      (ggml_backend_buffer_type_t buft);
    ggml_backend_buffer_t (*alloc_buffer)  (ggml_backend_buffer_type_t buft, size_t size);
    size_t                (*get_alignment) (ggml_backend_buffer_type_t buft);
    size_t                (*get_max_size)  (ggml_backend_buffer_type_t buft);          // optional
    size_t                (*get_alloc_size)(ggml_backend_buffer_type_t buft, const struct ggml_tensor * tensor); // optional
    bool                  (*is_host)       (ggml_backend_buffer_type_t buft);          // optional
};

struct ggml_backend_buffer_type {
    struct ggml_backend_buffer_type_i iface;
    ggml_backend_dev_t device;
    void * context;
};

// Exported by libggml-base: ops whose buffers may need more than ggml_nbytes.
GGML_API bool ggml_op_alloc_size_may_expand(enum ggml_op op);

// --- graph -------------------------------------------------------------------
// ggml.h keeps struct ggml_cgraph opaque; we read one field of it, `uid`:
// the scheduler gives each split graph a new uid whenever it re-splits, so
// an unchanged uid means "the very same graph as last time" and the client
// can skip encoding it (client.c, backend_graph_compute).
struct tbrpc_ggml_hash_set { size_t size; uint32_t * used; struct ggml_tensor ** keys; };

struct ggml_cgraph {
    int size, n_nodes, n_leafs;
    struct ggml_tensor ** nodes;
    struct ggml_tensor ** grads;
    struct ggml_tensor ** grad_accs;
    struct ggml_tensor ** leafs;
    int32_t * use_counts;
    struct tbrpc_ggml_hash_set visited_hash_set;
    int order;                      // enum ggml_cgraph_eval_order
    uint64_t uid;                   // 0: not set
};

// ggml's own slot lookup in a graph's hash set (ggml-impl.h: ggml_hash_find):
// hash = address >> 4, linear probing. Mirrored, not shared, because it is a
// static function there; the use counts live at the same slots.
static inline size_t tbrpc_ggml_hash_slot(const struct tbrpc_ggml_hash_set * set, const struct ggml_tensor * t, bool insert) {
    if (set->size == 0) return (size_t) -1;
    const size_t start = ((size_t) (uintptr_t) t >> 4) % set->size;
    size_t i = start;
    do {
        const bool used = (set->used[i >> 5] >> (i & 31)) & 1u;
        if (!used) {
            if (!insert) return (size_t) -1;
            set->used[i >> 5] |= 1u << (i & 31);
            set->keys[i] = (struct ggml_tensor *) t;
            return i;
        }
        if (set->keys[i] == t) return i;
        i = (i + 1) % set->size;
    } while (i != start);
    return (size_t) -1;
}

// --- buffer ----------------------------------------------------------------
struct ggml_backend_buffer_i {
    void             (*free_buffer)  (ggml_backend_buffer_t buffer);
    void *           (*get_base)     (ggml_backend_buffer_t buffer);
    enum ggml_status (*init_tensor)  (ggml_backend_buffer_t buffer, struct ggml_tensor * tensor);
    void (*memset_tensor)(ggml_backend_buffer_t buffer,       struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size);
    void (*set_tensor)   (ggml_backend_buffer_t buffer,       struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
    void (*get_tensor)   (ggml_backend_buffer_t buffer, const struct ggml_tensor * tensor,       void * data, size_t offset, size_t size);
    void (*set_tensor_2d)(ggml_backend_buffer_t buffer,       struct ggml_tensor * tensor, const void * data, size_t offset, size_t size,
                          size_t n_copies, size_t stride_tensor, size_t stride_data);      // optional
    void (*get_tensor_2d)(ggml_backend_buffer_t buffer, const struct ggml_tensor * tensor,       void * data, size_t offset, size_t size,
                          size_t n_copies, size_t stride_tensor, size_t stride_data);      // optional
    bool (*cpy_tensor)   (ggml_backend_buffer_t buffer, const struct ggml_tensor * src, struct ggml_tensor * dst); // optional
    void (*clear)        (ggml_backend_buffer_t buffer, uint8_t value);
    void (*reset)        (ggml_backend_buffer_t buffer);                                  // optional
};

struct ggml_backend_buffer {
    struct ggml_backend_buffer_i iface;
    ggml_backend_buffer_type_t buft;
    void * context;
    size_t size;
    enum ggml_backend_buffer_usage usage;
};

// Exported by libggml-base: wraps an iface + context into a ggml buffer.
GGML_API ggml_backend_buffer_t ggml_backend_buffer_init(ggml_backend_buffer_type_t buft,
                                                        struct ggml_backend_buffer_i iface,
                                                        void * context, size_t size);

// --- backend (stream) ------------------------------------------------------
struct ggml_backend_graph_optimize_params;

struct ggml_backend_i {
    const char * (*get_name)(ggml_backend_t backend);
    void (*free)(ggml_backend_t backend);
    void (*set_tensor_async)   (ggml_backend_t backend,       struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
    void (*get_tensor_async)   (ggml_backend_t backend, const struct ggml_tensor * tensor,       void * data, size_t offset, size_t size);
    void (*set_tensor_2d_async)(ggml_backend_t backend,       struct ggml_tensor * tensor, const void * data, size_t offset, size_t size,
                                size_t n_copies, size_t stride_tensor, size_t stride_data);
    void (*get_tensor_2d_async)(ggml_backend_t backend, const struct ggml_tensor * tensor,       void * data, size_t offset, size_t size,
                                size_t n_copies, size_t stride_tensor, size_t stride_data);
    bool (*cpy_tensor_async)(ggml_backend_t backend_src, ggml_backend_t backend_dst, const struct ggml_tensor * src, struct ggml_tensor * dst);
    void (*synchronize)(ggml_backend_t backend);
    ggml_backend_graph_plan_t (*graph_plan_create) (ggml_backend_t backend, const struct ggml_cgraph * cgraph);
    void                      (*graph_plan_free)   (ggml_backend_t backend, ggml_backend_graph_plan_t plan);
    void                      (*graph_plan_update) (ggml_backend_t backend, ggml_backend_graph_plan_t plan, const struct ggml_cgraph * cgraph);
    enum ggml_status          (*graph_plan_compute)(ggml_backend_t backend, ggml_backend_graph_plan_t plan);
    enum ggml_status          (*graph_compute)     (ggml_backend_t backend, struct ggml_cgraph * cgraph);
    void (*event_record)(ggml_backend_t backend, ggml_backend_event_t event);
    void (*event_wait)  (ggml_backend_t backend, ggml_backend_event_t event);
    void (*graph_optimize)(ggml_backend_t backend, struct ggml_cgraph * cgraph, struct ggml_backend_graph_optimize_params * params);
};

struct ggml_backend {
    ggml_guid_t guid;
    struct ggml_backend_i iface;
    ggml_backend_dev_t device;
    void * context;
};

// --- device ----------------------------------------------------------------
struct ggml_backend_device_i {
    const char *               (*get_name)(ggml_backend_dev_t dev);
    const char *               (*get_description)(ggml_backend_dev_t dev);
    void                       (*get_memory)(ggml_backend_dev_t dev, size_t * free, size_t * total);
    enum ggml_backend_dev_type (*get_type)(ggml_backend_dev_t dev);
    void                       (*get_props)(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props);
    ggml_backend_t             (*init_backend)(ggml_backend_dev_t dev, const char * params);
    ggml_backend_buffer_type_t (*get_buffer_type)(ggml_backend_dev_t dev);
    ggml_backend_buffer_type_t (*get_host_buffer_type)(ggml_backend_dev_t dev);            // optional
    ggml_backend_buffer_t      (*buffer_from_host_ptr)(ggml_backend_dev_t dev, void * ptr, size_t size, size_t max_tensor_size); // optional
    bool                       (*supports_op)(ggml_backend_dev_t dev, const struct ggml_tensor * op);
    bool                       (*supports_buft)(ggml_backend_dev_t dev, ggml_backend_buffer_type_t buft);
    bool                       (*offload_op)(ggml_backend_dev_t dev, const struct ggml_tensor * op); // optional
    ggml_backend_event_t       (*event_new)(ggml_backend_dev_t dev);                         // optional
    void                       (*event_free)(ggml_backend_dev_t dev, ggml_backend_event_t event);
    void                       (*event_synchronize)(ggml_backend_dev_t dev, ggml_backend_event_t event);
};

struct ggml_backend_device {
    struct ggml_backend_device_i iface;
    ggml_backend_reg_t reg;
    void * context;
};

// --- registry --------------------------------------------------------------
struct ggml_backend_reg_i {
    const char *       (*get_name)(ggml_backend_reg_t reg);
    size_t             (*get_device_count)(ggml_backend_reg_t reg);
    ggml_backend_dev_t (*get_device)(ggml_backend_reg_t reg, size_t index);
    void *             (*get_proc_address)(ggml_backend_reg_t reg, const char * name); // optional
};

struct ggml_backend_reg {
    int api_version; // TBRPC_GGML_BACKEND_API_VERSION
    struct ggml_backend_reg_i iface;
    void * context;
};

#ifdef __cplusplus
}
#endif
