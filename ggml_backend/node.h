// node.h - the node server: serves this machine's best ggml device to
// tbrpc clients over a transport.
//
// One worker process (or thread) per connected client. Buffers belong to the connection that
// allocated them and are freed when it goes away, so a crashed head never
// leaks node memory. Every request is validated before it touches memory
// (proto.c); a bad request gets an error reply and a log line, and the node
// keeps serving everyone else.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "proto.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tb_node_config {
    const char * host;        // address to listen on ("127.0.0.1", "0.0.0.0", ...)
    int          port;        // 0 picks a free port
    const char * device;      // ggml device name, or NULL/"" for the best one (GPU, else CPU)
    int          threads;     // CPU threads for compute; <= 0 keeps ggml's default
    const char * name;        // node name shown to clients and in logs
    const char * log_path;    // append log lines here; NULL/"" logs to stderr
    int          timeout_ms;  // a client silent mid-message for this long is dropped
    const char * model_dirs;  // ':'-separated directories whose *.gguf files clients may
                              // ask the node to load weights from (NULL/"": none)
    int          isolation;   // how each client is served: 1: a forked worker process (a
                              // request that crashes ggml ends only that client); 2: a
                              // freshly started worker process (worker_argv; for macOS,
                              // where Metal does not survive fork); 0: a thread; -1: the
                              // platform default (fork; on macOS spawn with worker_argv,
                              // else threads)
    const char * const * worker_argv;  // NULL-terminated command that runs tb_node_worker_serve
                              // (isolation 2); the node appends --client-fd N --status-fd N
                              // --parent-fd N --slot N --name NAME
    const uint8_t * secret;   // the cluster secret: clients and peers must prove they know it
                              // (AUTH, docs/protocol.md); NULL: anyone who reaches the port is served
    size_t       secret_len;  // 1..TB_SECRET_MAX bytes
    int          max_clients; // clients served at once (<= 0 or above 64: 64); one more is told "node is full"
    int          idle_timeout_ms; // drop a client that holds no buffer or link and is silent this long
                              // (<= 0: TB_IDLE_MS, ten minutes: a head between two loads keeps its slot)
};

struct tb_node;

struct tb_node * tb_node_create(const struct tb_node_config * cfg, char * err, size_t err_len);
int  tb_node_port(const struct tb_node * node);
// Accept and serve clients until tb_node_stop(). Returns 0 after a clean stop.
int  tb_node_serve(struct tb_node * node);
// Ask tb_node_serve() to return; safe from any thread and from a signal handler.
void tb_node_stop(struct tb_node * node);
void tb_node_get_status(struct tb_node * node, struct tb_status * out);
void tb_node_free(struct tb_node * node);

// The body of a spawned worker (isolation 2): serve the client on client_fd
// with the device cfg names, count into slot `slot` of the node's status
// mapping (status_fd), and exit when the node dies (end of file on
// parent_fd). Returns when the client leaves; -1 with err if it cannot start.
int tb_node_worker_serve(const struct tb_node_config * cfg, int client_fd, int status_fd, int slot, int parent_fd,
                         char * err, size_t err_len);

#ifdef __cplusplus
}
#endif
