// node_internal.h - what node.c (the server: listening, workers, status)
// and node_session.c (one client's session: buffers, requests, graphs)
// share. Not part of the C API.
#pragma once

#include <pthread.h>
#include <sys/types.h>
#include <stdbool.h>
#include <stdio.h>

#include "ggml-backend.h"
#include "node.h"

#define IDLE_POLL_MS 250
#define MAX_CLIENTS  64
#define MAX_REFUSING 16            // connections told "node is full" at once, each until its HELLO is drained

// Per-client counters. They live in memory shared with worker processes, so
// the node can report totals whether a client is served by a thread or by
// an isolated process. Each slot has a page of its own: a worker process
// maps only its own page writable, every other page of the table (the
// other clients' counters and the parent's in_use flags) read-only.
struct client_slot {
    uint64_t buffers, bytes_allocated, graphs_computed, bytes_received, bytes_from_files;
    uint64_t allreduces, allreduce_ns;   // tensor split: all-reduces done, and the time they took
};

// What only the parent knows and writes about a slot: in its private memory,
// never shared (a worker's copy after fork() is its own).
struct slot_control {
    int32_t in_use;
    pid_t   pid;               // worker process, or 0 when served by a thread; kill() only ever sees > 0
    char    peer[96];
};

struct tb_node {
    struct tb_node_config cfg;
    char     name[TB_NAME_LEN];
    uint8_t  id[TB_NODE_ID_LEN];  // this node process's random id (HELLO's node_id), its workers' too
    char     host[256];           // listen address; peer links listen there too
    struct tb_listener * listener;   // clients dial here
    int      port;
    int      stop_pipe[2];        // written by tb_node_stop, watched by the accept loop
    volatile int stopping;
    enum { SERVE_THREAD, SERVE_FORK, SERVE_SPAWN } serve_mode;   // see tb_node_config.isolation
    char **  worker_argv;         // SERVE_SPAWN: owned copy of tb_node_config.worker_argv
    int      status_fd;           // the shared memory behind `shared`, inherited by spawned workers (closed once mapped)
    int      parent_pipe[2];      // spawned workers hold the read end: end of file = the node is gone
    char     model_dirs[4096];    // ':'-separated; empty: clients cannot ask for files
    char     hash_cache[4096];    // where content hashes of model files are cached (tb_hash_cache_dir); empty: none
    pthread_t hasher;             // hashes the model directories' files at start (node.c start_hasher)
    bool     has_hasher;
    int      hasher_stop;         // set (atomically) to abandon it
    // The status table (MAP_SHARED over status_fd): page 0 holds in_use[MAX_CLIENTS]
    // (parent-written), page 1 + i slot i's counters. See node.c map_table.
    uint8_t * shared;
    size_t   shared_len, page;
    struct slot_control ctl[MAX_CLIENTS];   // parent only
    int      own_slot;            // in a worker process: its slot; -1 in the node
    int      max_clients;         // <= MAX_CLIENTS
    uint8_t  secret[TB_SECRET_MAX];   // the cluster secret (secret_len 0: none)
    size_t   secret_len;
    struct { int fd; int64_t until; } refusing[MAX_REFUSING];   // told "full"; closed at end of file or `until`
    ggml_backend_dev_t dev;
    FILE *   log;                 // owned when it is not stderr

    pthread_mutex_t lock;         // guards slot allocation, n_threads and log lines
    pthread_cond_t  conn_done;
    int      n_threads;           // connections served by threads, awaited at stop
};

// The content hash of every model file, in the background at start (node_files.c).
void * node_hash_model_files(void * node);

void node_log(struct tb_node * node, const char * fmt, ...) __attribute__((format(printf, 2, 3)));

// Serve the client on `fd` (owned) until it leaves or the node stops; then
// free everything it had. Counters go to `slot`.
void node_serve_client(struct tb_node * node, int fd, struct client_slot * slot);
