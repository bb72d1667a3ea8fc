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
    int          isolation;   // 1: one worker process per client (a request that crashes
                              // ggml ends only that client); 0: one thread per client;
                              // -1: the platform default (processes, threads on macOS
                              // because Metal does not survive fork)
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

#ifdef __cplusplus
}
#endif
