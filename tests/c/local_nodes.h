// local_nodes.h - what the C tests that drive tbrpc's devices share: nodes
// serving in threads of the test's own process, a client registered with
// them, and one ggml backend per node (TBRPC0, TBRPC1, ...). A node serving
// in threads shares no memory with the client, so every connection and link
// is TCP.
#pragma once

#include "tbrpc.h"
#include "ggml-backend.h"

#include "check.h"

#include <pthread.h>
#include <stdio.h>

#define LOCAL_NODES_MAX 8

struct local_nodes {
    size_t n;
    struct tb_node * nodes[LOCAL_NODES_MAX];
    pthread_t threads[LOCAL_NODES_MAX];
    struct tbrpc_client * client;
    ggml_backend_t backends[LOCAL_NODES_MAX];
};

static inline void * local_nodes_serve(void * node) { tb_node_serve(node); return NULL; }

// n nodes named prefix-0, prefix-1, ...; the client times each out after
// timeout_ms (the nodes' own timeout too) and asks for `transport`.
static inline void local_nodes_start(struct local_nodes * c, size_t n, const char * prefix, int timeout_ms,
                                     const char * transport) {
    CHECK(n <= LOCAL_NODES_MAX, "at most %d local nodes", LOCAL_NODES_MAX);
    char err[512];
    c->n = n;
    c->client = tbrpc_client_new();
    for (size_t i = 0; i < n; i++) {
        char name[32], endpoint[64];
        snprintf(name, sizeof name, "%s-%zu", prefix, i);
        struct tb_node_config cfg = { .host = "127.0.0.1", .port = 0, .device = "CPU", .threads = 1, .name = name,
                                      .timeout_ms = timeout_ms };
        c->nodes[i] = tb_node_create(&cfg, err, sizeof err);
        CHECK(c->nodes[i], "node: %s", err);
        CHECK(pthread_create(&c->threads[i], NULL, local_nodes_serve, c->nodes[i]) == 0, "pthread_create");
        snprintf(endpoint, sizeof endpoint, "127.0.0.1:%d", tb_node_port(c->nodes[i]));
        CHECK(tbrpc_client_add_node(c->client, endpoint, timeout_ms, transport, NULL, 0, err, sizeof err) == (int) i,
              "add_node: %s", err);
    }
    CHECK(tbrpc_client_register(c->client, err, sizeof err) == 0, "register: %s", err);
    for (size_t i = 0; i < n; i++) {
        char dev_name[32];
        snprintf(dev_name, sizeof dev_name, "TBRPC%zu", i);
        ggml_backend_dev_t dev = ggml_backend_dev_by_name(dev_name);
        CHECK(dev, "%s is not registered", dev_name);
        c->backends[i] = ggml_backend_dev_init(dev, NULL);
        CHECK(c->backends[i], "backend %zu", i);
    }
}

static inline void local_nodes_stop(struct local_nodes * c) {
    for (size_t i = 0; i < c->n; i++) ggml_backend_free(c->backends[i]);
    for (size_t i = 0; i < c->n; i++) {
        tb_node_stop(c->nodes[i]);
        pthread_join(c->threads[i], NULL);
        tb_node_free(c->nodes[i]);
    }
}
