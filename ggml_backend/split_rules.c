// split_rules.c - tbrpc's own tensor-split rules for llama.cpp's meta device.
//
// llama.cpp cuts every layer across devices only for the architectures it
// has rules for; it refuses deepseek2 (Kimi K2, DeepSeek V3), whose MLA
// attention its rules cannot split. Its meta device is public, though, and
// takes the rules as a callback. These rules cut the feed-forward weights
// (the dense FFN of the leading layers, the routed experts and the shared
// expert) along their inner width and the output head along the
// vocabulary, and keep every other tensor (attention, norms, router) whole
// on every node:
//
//   ffn_gate*, ffn_up*   [n_embd, n_ff(, n_expert)]  axis 1: a slice of rows
//   ffn_down*            [n_ff, n_embd(, n_expert)]  axis 0: the same slice of columns
//   output.weight        [n_embd, n_vocab]           axis 1: a slice of the vocabulary
//   (token_embd.weight on the meta device is a tied output's copy: the input
//   layer stays on the head's CPU)
//
// Each node then computes a partial sum of the FFN output, and the meta
// backend all-reduces it once per layer (tbrpc's ALLREDUCE, client.c); each
// node computes its slice of the logits, which the head gathers. The output
// head is a large part of a small model's work (over half of the weights
// Gemma 3 270M reads per token), and llama.cpp's own tensor split cuts it
// the same way.
// Every expert is cut, not placed whole, so the load is even whatever the
// router picks. Passed as the only device of a layer split, the meta device
// runs every layer on all its nodes; several of them, one per group of
// nodes, make a layer split over the groups (each device named apart:
// name_meta_device).
#include "client_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ffn_rules {
    size_t  n;
    float   shares[GGML_BACKEND_META_MAX_DEVICES];   // normalised, sum 1
    int64_t granularity;                             // slices are multiples of this
};

static struct ggml_backend_meta_split_state whole(void) {
    struct ggml_backend_meta_split_state s;
    memset(&s, 0, sizeof s);
    s.axis = GGML_BACKEND_SPLIT_AXIS_MIRRORED;
    s.nr[0] = 1;
    s.n_segments = 1;
    return s;
}

// The axis `name` is cut along (the FFN's inner width, the vocabulary), or -1 when the tensor stays whole.
static int cut_axis(const char * name) {
    if (!strcmp(name, "output.weight") || !strcmp(name, "token_embd.weight")) return 1;
    if (!strcmp(name, "output.bias")) return 0;   // follows the output's vocabulary slice
    if (strstr(name, ".bias")) return -1;
    if (strstr(name, "ffn_gate_inp") || strstr(name, "ffn_norm") || strstr(name, "exp_probs")) return -1;   // router, norms
    if (strstr(name, "ffn_gate") || strstr(name, "ffn_up")) return 1;
    if (strstr(name, "ffn_down")) return 0;
    return -1;
}

static struct ggml_backend_meta_split_state ffn_split_state(const struct ggml_tensor * t, void * userdata) {
    const struct ffn_rules * r = userdata;
    const int axis = cut_axis(t->name);
    const int64_t width = axis < 0 ? 0 : t->ne[axis];
    if (axis < 0 || width % r->granularity != 0) return whole();
    struct ggml_backend_meta_split_state s = whole();
    s.axis = (enum ggml_backend_meta_split_axis) axis;
    const int64_t units = width / r->granularity;
    int64_t done = 0;
    float upto = 0.0f;
    for (size_t j = 0; j < r->n; j++) {   // cumulative rounding: the slices add up to the width exactly
        upto += r->shares[j];
        const int64_t cut = j + 1 == r->n ? units : (int64_t) (upto * (float) units + 0.5f);
        s.ne[j] = (cut - done) * r->granularity;
        done = cut;
    }
    return s;
}

// llama.cpp files a model's weights and KV cache by buffer type *name*, and
// the ggml of llama-cpp-python 0.3.36 names every meta device and its buffer
// type "Meta()" (the constructor builds the name from the device list it has
// just moved away). With two meta devices in one model (a layer split over
// groups of nodes, each group cutting its layers' FFN: the layer+tensor
// hybrid) every group's tensors are filed under one name and ggml aborts at
// load. The name is a std::string in the device's context, on the heap;
// rewriting its six characters in place, keeping its length, gives each meta
// device a name of its own ("Meta00", "Meta01", ...) whatever the C++
// library's string layout (every one keeps the characters contiguous at
// c_str()). Only that exact broken name is rewritten: a ggml that names its
// meta devices properly is left alone. Caller holds c->lock.
static void name_meta_device(struct tbrpc_client * c, ggml_backend_dev_t meta) {
    char name[8];
    snprintf(name, sizeof name, "Meta%02x", c->n_meta_devices++ & 0xffu);
    const char * names[2] = { ggml_backend_dev_name(meta), ggml_backend_buft_name(ggml_backend_dev_buffer_type(meta)) };
    for (int i = 0; i < 2; i++) {
        if (names[i] && strcmp(names[i], "Meta()") == 0) memcpy((char *) names[i], name, 6);
    }
}

void * tbrpc_client_ffn_split_device(struct tbrpc_client * c, const size_t * nodes, size_t n, const float * shares,
                                     int64_t granularity, char * err, size_t err_len) {
    if (n < 2 || n > GGML_BACKEND_META_MAX_DEVICES) {
        snprintf(err, err_len, "an FFN split needs 2 to %d nodes, not %zu", GGML_BACKEND_META_MAX_DEVICES, n);
        return NULL;
    }
    if (granularity < 1) { snprintf(err, err_len, "granularity %lld", (long long) granularity); return NULL; }
    ggml_backend_dev_t devs[GGML_BACKEND_META_MAX_DEVICES];
    float total = 0.0f;
    pthread_mutex_lock(&c->lock);
    size_t bad = n;
    for (size_t j = 0; j < n && bad == n; j++) {
        if (nodes[j] >= c->n_nodes || !(shares[j] >= 0.0f)) bad = j;
        else devs[j] = &c->nodes[nodes[j]]->dev;
        total += shares[j];
    }
    pthread_mutex_unlock(&c->lock);
    if (bad < n) {
        snprintf(err, err_len, "node %zu or its share %g is out of range", nodes[bad], (double) shares[bad]);
        return NULL;
    }
    if (!(total > 0.0f)) { snprintf(err, err_len, "the shares add up to nothing"); return NULL; }
    // Lives as long as the device, which ggml keeps for the life of the process.
    struct ffn_rules * r = calloc(1, sizeof *r);
    if (!r) { snprintf(err, err_len, "out of memory"); return NULL; }
    r->n = n;
    r->granularity = granularity;
    for (size_t j = 0; j < n; j++) r->shares[j] = shares[j] / total;
    ggml_backend_dev_t meta = ggml_backend_meta_device(devs, n, ffn_split_state, r);
    if (!meta) { free(r); snprintf(err, err_len, "ggml could not make a meta device"); return NULL; }
    pthread_mutex_lock(&c->lock);
    name_meta_device(c, meta);
    pthread_mutex_unlock(&c->lock);
    return meta;
}
