// node_links.c - node-to-node links of a session (PEER_LISTEN, PEER_CONNECT,
// PEER_ACCEPT, then PEER_SEND / PEER_RECV) and the all-reduce that runs over
// them (ALLREDUCE).
#define _GNU_SOURCE   // POLLRDHUP: a peer that hung up, whatever bytes it sent before (peer_gone)
#include "node_session.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

// ---- node-to-node links ------------------------------------------------------
// The head links the session that computes layer k with the one that
// computes layer k+1; activations then go straight from node to node and
// the head waits only for the last node's logits. Setup (three called
// requests) happens once per pair; a pair that cannot connect answers 0 and
// the head keeps relaying. After the authenticated greeting the dialer
// upgrades the link as a head upgrades its connection (transport/upgrade.c:
// shared memory on one host, RDMA between hosts that both have it, else
// TCP with the reason); the TCP connection stays open under it as anchor.

static uint64_t random_token(void) {
    uint64_t t = 0;
    while (t == 0 && tb_random(&t, sizeof t) == 0) {}
    return t ? t : (uint64_t) time(NULL) * 0x9e3779b97f4a7c15ull;
}

// Whether a link's peer has gone: its end of the anchor connection closed
// (the peer process ended, or its session did). Never waits.
static bool peer_gone(const struct node_peer * p) {
#ifdef POLLRDHUP
    struct pollfd q = { .fd = p->anchor, .events = POLLRDHUP };
#else
    struct pollfd q = { .fd = p->anchor, .events = POLLIN };
#endif
    int rc;
    do { rc = poll(&q, 1, 0); } while (rc < 0 && errno == EINTR);
    if (rc <= 0) return false;
    if (q.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
#ifdef POLLRDHUP
    return (q.revents & POLLRDHUP) != 0;
#else
    uint8_t b;   // readable: the end of the stream, unless bytes (heartbeats, bells) come first
    ssize_t k;
    do { k = recv(p->anchor, &b, 1, MSG_PEEK | MSG_DONTWAIT); } while (k < 0 && errno == EINTR);
    return k == 0;
#endif
}

// A new link takes the slot of one whose peer has gone, else the next one. A
// node whose neighbour fails and restarts again and again keeps its own
// session (the head reconnects only to the failed node); without the reuse
// every dead link (a socket and, over shared memory, a mapped segment) stayed
// until the client left, and after MAX_PEERS no link could be made
// (tests/test_outage.py, test_a_surviving_node_drops_the_links_of_a_peer_that_died).
// The watchdog walks the list only while a graph computes, under busy_lock;
// a link is made while the session waits for the peer, never then.
static uint64_t add_peer(struct node_conn * c, struct tb_transport * tp, int anchor, bool outgoing, const char * name) {
    size_t slot = c->n_peers;
    for (size_t i = 0; i < c->n_peers; i++) {
        if (peer_gone(&c->peers[i])) { slot = i; break; }
    }
    if (slot == MAX_PEERS) { tb_close(tp); return 0; }
    struct node_peer * p = &c->peers[slot];
    const bool reused = slot < c->n_peers;
    if (!reused && pthread_mutex_init(&p->lock, NULL) != 0) { tb_close(tp); return 0; }
    // The head's own timeout (three keepalive periods) bounds a silent peer
    // too; HELLO keeps keepalive_ms under TB_KEEPALIVE_MAX_MS, so this cannot overflow.
    tp->timeout_ms = (int) (c->keepalive_ms * 3u);
    tb_one_way(tp, outgoing);   // over TCP, a receiver that computes heartbeats a sender blocked on it
    pthread_mutex_lock(&c->send_lock);     // the watchdog walks this list
    if (reused) pthread_mutex_lock(&p->lock);
    struct tb_transport * old = reused ? p->tp : NULL;
    if (reused) node_log(c->node, "client %s: link %zu to peer %s is gone (it hung up); its slot is reused", c->tp->peer,
                         slot + 1, p->name);
    p->tp = tp;
    p->anchor = anchor;
    p->outgoing = outgoing;
    snprintf(p->name, sizeof p->name, "%s", name);
    if (reused) pthread_mutex_unlock(&p->lock);
    else c->n_peers++;
    pthread_mutex_unlock(&c->send_lock);
    tb_close(old);
    return slot + 1;
}

int handle_peer_listen(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct tb_peer_listen_reply rep = { 0, 0 };
    if (!c->peer_listener) {
        char why[256];
        c->peer_listener = tb_listen(c->node->host, 0, why, sizeof why);
        if (!c->peer_listener) node_log(c->node, "client %s: cannot listen for peers: %s", c->tp->peer, why);
        c->peer_token = random_token();
    }
    if (c->peer_listener) {
        rep.token = c->peer_token;
        rep.port = (uint64_t) tb_listener_port(c->peer_listener);
    }
    memcpy(r->small, &rep, sizeof rep);
    r->data = r->small;
    r->len = sizeof rep;
    return 0;
}

// Where a node dials a peer from. A node given a loopback address of its own
// (127.0.0.x: one that stands for a host in tests) dials loopback peers from
// it, as a host with that address would; any other takes the kernel's route,
// which on a Thunderbolt ring is the address on the cable to that peer, the
// one whose GID finds the right RDMA device.
static const char * dial_from(const struct tb_node * n, const char * peer_host) {
    return strncmp(n->host, "127.", 4) == 0 && strncmp(peer_host, "127.", 4) == 0 ? n->host : NULL;
}

// The link's upgrade, decided as a head decides for its connection.
static struct tb_transport * upgrade_link(struct node_conn * c, struct tb_transport * tp, const struct tb_peer_connect * req,
                                          char * why, size_t why_len) {
    const struct tb_upgrade_want want = {
        .forced_tcp = (req->flags & TB_LINK_TCP) != 0,
        .peer_shm = (req->caps & TB_CAP_SHM) != 0,
        .peer_rdma = (req->caps & TB_CAP_RDMA) != 0,
        .no_shm = no_shm_reason(c->node),
    };
    return tb_upgrade_dial(tp, &want, why, why_len);
}

// Dial a peer session's listener. Nothing is sent before the listener has
// proven it knows the link key (the cluster secret and the listener's token,
// which only the head and that listener have): a port that is not a tbrpc
// listener of this cluster receives not a byte. Then the link's upgrade.
// Bounded by the head's timeout. The reply says what carries the link, or
// why there is none (refused, timed out, not a node of this cluster): words
// the head needs to say what to fix, which tell a client where something
// listens -- a client that has passed the handshake, on a node whose
// secret it holds (or one that chose to run without: loopback, --insecure).
int handle_peer_connect(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    struct tb_peer_connect * req = (struct tb_peer_connect *) c->payload;
    req->host[sizeof req->host - 1] = '\0';
    char why[256] = "bad port";
    const int timeout_ms = c->node->cfg.timeout_ms > 0 ? c->node->cfg.timeout_ms : 10000;
    struct tb_peer_connect_reply * rep = (struct tb_peer_connect_reply *) r->small;
    _Static_assert(sizeof *rep <= sizeof r->small, "the link reply fits the small reply");
    memset(rep, 0, sizeof *rep);
    r->data = rep;
    r->len = sizeof *rep;
    // Reaching the peer, proving the link key and upgrading may take longer
    // than the head's timeout (an RDMA bring-up, a loaded host): the head
    // hears keepalives meanwhile, as while a graph computes.
    set_busy(c, WAITING_FOR_PEER);
    int dial_kind = TB_IO_OK;   // the link falls back to the head whatever the kind: why says which
    struct tb_transport * tp = req->port > 0 && req->port < 65536
        ? tb_dial(req->host, (int) req->port, dial_from(c->node, req->host), timeout_ms, &dial_kind, why, sizeof why)
        : NULL;
    uint8_t key[TB_MAC_LEN], mac[TB_MAC_LEN];
    tb_peer_key(c->node->secret, c->node->secret_len, req->token, key);
    struct tb_peer_greeting greeting;
    struct tb_peer_answer answer;
    struct tb_peer_confirm confirm;
    static const uint8_t zeros[TB_NONCE_LEN];
    bool ok = false;
    if (tp) {
        tp->deadline_ms = tb_now_ms() + timeout_ms;   // the whole exchange, not each read
        snprintf(why, sizeof why, "it did not prove it is a tbrpc node of this cluster");
        if (tb_recv(tp, &greeting, sizeof greeting) == 0 && memcmp(greeting.magic, TB_PEER_MAGIC, sizeof TB_PEER_MAGIC) == 0) {
            tb_auth_mac(key, sizeof key, TB_PEER_ROLE_GREET, greeting.nonce, zeros, NULL, 0, mac);
            if (tb_equal_ct(mac, greeting.mac, TB_MAC_LEN) && tb_random(answer.nonce, TB_NONCE_LEN) == 0) {
                memset(answer.name, 0, sizeof answer.name);   // our name, so the peer can say who went silent
                snprintf(answer.name, sizeof answer.name, "%s", c->node->name);
                tb_auth_mac(key, sizeof key, TB_PEER_ROLE_DIALER, greeting.nonce, answer.nonce, answer.name,
                            sizeof answer.name, answer.mac);
                if (tb_send(tp, &answer, sizeof answer) == 0 && tb_flush(tp) == 0 &&
                    tb_recv(tp, &confirm, sizeof confirm) == 0) {
                    tb_auth_mac(key, sizeof key, TB_PEER_ROLE_LISTENER, greeting.nonce, answer.nonce, NULL, 0, mac);
                    ok = tb_equal_ct(mac, confirm.mac, TB_MAC_LEN);
                }
            }
        }
    }
    memset(key, 0, sizeof key);
    const int anchor = tp ? tb_tcp_fd(tp) : -1;   // the upgraded transport keeps (and owns) it
    if (ok && !(tp = upgrade_link(c, tp, req, why, sizeof why))) ok = false;   // the TCP connection failed (and is closed)
    set_busy(c, IDLE);
    if (!ok) {
        node_log(c->node, "client %s: cannot reach peer %s:%llu (%s); activations will go through the head",
                 c->tp->peer, req->host, (unsigned long long) req->port, why);
        snprintf(rep->transport, sizeof rep->transport, "none: cannot reach %s:%llu (%s)", req->host,
                 (unsigned long long) req->port, why);
        rep->why_kind = TB_WHY_NO_LINK;
        tb_close(tp);
        return 0;
    }
    tp->deadline_ms = 0;
    char them[TB_NAME_LEN + 32];
    snprintf(them, sizeof them, "%s:%llu", req->host, (unsigned long long) req->port);
    snprintf(rep->transport, sizeof rep->transport, "%s", tp->describe);
    rep->why_kind = (uint32_t) tp->why;
    node_log(c->node, "client %s: link to peer %s: transport %s", c->tp->peer, them, tp->describe);
    rep->peer_id = add_peer(c, tp, anchor, true, them);
    return 0;
}

// One dialer on our listener: greet it with proof that we know the link key,
// then it proves the same over both nonces, then we confirm. 0 when it did.
static int greet_dialer(struct node_conn * c, struct tb_transport * tp, char name[TB_NAME_LEN]) {
    uint8_t key[TB_MAC_LEN], mac[TB_MAC_LEN];
    static const uint8_t zeros[TB_NONCE_LEN];
    struct tb_peer_greeting greeting;
    struct tb_peer_answer answer;
    struct tb_peer_confirm confirm;
    memset(&greeting, 0, sizeof greeting);
    memcpy(greeting.magic, TB_PEER_MAGIC, sizeof TB_PEER_MAGIC);
    if (tb_random(greeting.nonce, TB_NONCE_LEN) != 0) return -1;
    tb_peer_key(c->node->secret, c->node->secret_len, c->peer_token, key);
    tb_auth_mac(key, sizeof key, TB_PEER_ROLE_GREET, greeting.nonce, zeros, NULL, 0, greeting.mac);
    int rc = -1;
    if (tb_send(tp, &greeting, sizeof greeting) == 0 && tb_flush(tp) == 0 && tb_recv(tp, &answer, sizeof answer) == 0) {
        tb_auth_mac(key, sizeof key, TB_PEER_ROLE_DIALER, greeting.nonce, answer.nonce, answer.name, sizeof answer.name, mac);
        if (tb_equal_ct(mac, answer.mac, TB_MAC_LEN)) {
            tb_auth_mac(key, sizeof key, TB_PEER_ROLE_LISTENER, greeting.nonce, answer.nonce, NULL, 0, confirm.mac);
            if (tb_send(tp, &confirm, sizeof confirm) == 0 && tb_flush(tp) == 0) rc = 0;
            memcpy(name, answer.name, TB_NAME_LEN);
            name[TB_NAME_LEN - 1] = '\0';
        }
    }
    memset(key, 0, sizeof key);
    return rc;
}

// Wait (the head's timeout) for the dialer the head sent our way; anyone
// else who connects meanwhile is refused and the wait goes on.
static int await_dialer(struct node_conn * c, struct reply * r);

int handle_peer_accept(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    uint64_t token;
    memcpy(&token, c->payload, sizeof token);
    if (!c->peer_listener || token != c->peer_token) return reply_u64(r, 0);
    set_busy(c, WAITING_FOR_PEER);   // the head hears keepalives while the dialer takes its time
    const int rc = await_dialer(c, r);
    set_busy(c, IDLE);
    return rc;
}

static int await_dialer(struct node_conn * c, struct reply * r) {
    const int timeout_ms = c->node->cfg.timeout_ms > 0 ? c->node->cfg.timeout_ms : 10000;
    const int64_t deadline = tb_now_ms() + timeout_ms;
    struct pollfd p = { .fd = tb_listener_fd(c->peer_listener), .events = POLLIN };
    for (int64_t left = timeout_ms; left > 0; left = deadline - tb_now_ms()) {
        // The head sends its next request only once the dialer has given up
        // (peer_link in client.c): then no one is coming, and the wait ends.
        if (poll(&p, 1, left < 50 ? (int) left : 50) <= 0) {
            if (tb_poll(c->tp, 0) > 0) break;
            continue;
        }
        struct tb_transport * tp = tb_accept(c->peer_listener, timeout_ms);
        if (!tp) continue;
        tp->deadline_ms = deadline;
        char name[TB_NAME_LEN] = { 0 };
        if (greet_dialer(c, tp, name) == 0) {
            char why[256];
            const int anchor = tb_tcp_fd(tp);   // the upgraded transport keeps (and owns) it
            tp = tb_upgrade_accept(tp, no_shm_reason(c->node), why, sizeof why);
            if (!tp) {
                node_log(c->node, "client %s: link from peer %s failed in its upgrade: %s", c->tp->peer, name, why);
                return reply_u64(r, 0);
            }
            tp->deadline_ms = 0;
            node_log(c->node, "client %s: link from peer %s: transport %s", c->tp->peer, name, tp->describe);
            return reply_u64(r, add_peer(c, tp, anchor, false, name));
        }
        node_log(c->node, "client %s: a peer link attempt from %s did not prove it knows the link key; refused",
                 c->tp->peer, tp->peer);
        tb_close(tp);
    }
    return reply_u64(r, 0);
}

// The peer and the buffer range a PEER_SEND/PEER_RECV names, validated.
static struct node_buffer * peer_range(struct node_conn * c, const struct tb_peer_range * req, bool outgoing,
                                       struct node_peer ** peer, char * err, size_t err_len) {
    if (req->peer_id == 0 || req->peer_id > c->n_peers || c->peers[req->peer_id - 1].outgoing != outgoing) {
        snprintf(err, err_len, "unknown %s peer %llu", outgoing ? "outgoing" : "incoming", (unsigned long long) req->peer_id);
        return NULL;
    }
    if (req->size > TB_MAX_PAYLOAD) {
        snprintf(err, err_len, "a peer transfer of %llu bytes exceeds the message limit", (unsigned long long) req->size);
        return NULL;
    }
    *peer = &c->peers[req->peer_id - 1];
    return checked_range(c, req->handle, req->offset, req->size, err, err_len);
}

// One PEER_SEND frame of `size` bytes on an outgoing link. Under the link's
// own lock: a send blocked on a busy next node holds no other, so the
// watchdog still speaks to the head and to the node before us.
static int send_to_peer(struct node_peer * p, const void * data, uint64_t size) {
    pthread_mutex_lock(&p->lock);
    int rc = tb_msg_send(p->tp, TB_CMD_PEER_SEND, 0, 0, data, (size_t) size, NULL, 0);
    if (rc == 0) rc = tb_flush(p->tp);
    pthread_mutex_unlock(&p->lock);
    return rc;
}

// The next PEER_SEND frame on an incoming link, which must carry `size`
// bytes, into dst. The sending node's keepalives reset our timeout while it
// computes. A frame flagged TB_FLAG_GAVE_UP fails the receive with the
// sender's reason (give_up below).
static int recv_from_peer(struct tb_transport * tp, void * dst, uint64_t size, char * err, size_t err_len) {
    struct tb_header ph;
    int rc;
    do {
        rc = tb_msg_recv_header(tp, &ph, err, err_len);
    } while (rc == 0 && ph.cmd == TB_CMD_KEEPALIVE && ph.len == 0);
    if (rc == 0 && ph.cmd == TB_CMD_PEER_SEND && (ph.flags & TB_FLAG_GAVE_UP) && ph.len <= TB_GAVE_UP_MAX) {
        char why[TB_GAVE_UP_MAX + 1];
        if (tb_recv(tp, why, (size_t) ph.len) != 0) { snprintf(err, err_len, "%s", tp->error); return -1; }
        why[ph.len] = '\0';
        for (size_t i = 0; i < ph.len; i++) why[i] = why[i] >= 32 && why[i] < 127 ? why[i] : '?';   // text for a log
        snprintf(err, err_len, "it gave up: %s", why);
        return -1;
    }
    if (rc == 0 && (ph.cmd != TB_CMD_PEER_SEND || ph.len != size)) {
        snprintf(err, err_len, "the peer sent %s of %llu bytes, expected %llu", tb_cmd_name(ph.cmd),
                 (unsigned long long) ph.len, (unsigned long long) size);
        return -1;
    }
    if (rc == 0 && tb_recv(tp, dst, (size_t) size) != 0) { snprintf(err, err_len, "%s", tp->error); return -1; }
    return rc;
}

int handle_peer_send(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_peer_range req = *(const struct tb_peer_range *) c->payload;
    struct node_peer * peer = NULL;
    struct node_buffer * b = peer_range(c, &req, true, &peer, err, err_len);
    if (!b) return -1;
    const uint8_t * data = b->base + req.offset;
    if (!ggml_backend_buffer_is_host(b->buf)) {
        if (scratch_reserve(c, (size_t) req.size) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
        struct ggml_tensor t = byte_view(b, req.offset, req.size);
        ggml_backend_tensor_get(&t, c->payload, 0, (size_t) req.size);
        data = c->payload;
    }
    // A pipelined prompt may block this send on a next node still computing
    // the piece before: while it does, we show life to the head and to the
    // node before us, which may be blocked sending to us (the watchdog).
    set_busy(c, SENDING_TO_PEER);
    const int rc = send_to_peer(peer, data, req.size);
    set_busy(c, IDLE);
    if (rc != 0) {
        c->failed_peer = req.peer_id;
        snprintf(err, err_len, "PEER_SEND: %s", peer->tp->error);
        return -1;
    }
    return 0;
}

int handle_peer_recv(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_peer_range req = *(const struct tb_peer_range *) c->payload;
    struct node_peer * peer = NULL;
    struct node_buffer * b = peer_range(c, &req, false, &peer, err, err_len);
    if (!b) return -1;
    set_busy(c, WAITING_FOR_PEER);   // waiting for the peer's compute: keep the head informed
    const bool host = ggml_backend_buffer_is_host(b->buf);
    char why[256] = "";
    int rc = host ? 0 : scratch_reserve(c, (size_t) req.size);
    if (rc != 0) snprintf(why, sizeof why, "out of memory");
    if (rc == 0) rc = recv_from_peer(peer->tp, host ? b->base + req.offset : c->payload, req.size, why, sizeof why);
    tb_trace_mark(c->trace, TB_TRACE_PEER_DATA, TB_CMD_PEER_RECV);
    if (rc == 0 && !host) {
        struct ggml_tensor t = byte_view(b, req.offset, req.size);
        ggml_backend_tensor_set(&t, c->payload, 0, (size_t) req.size);
    }
    set_busy(c, IDLE);
    if (rc != 0) {
        c->failed_peer = req.peer_id;
        snprintf(err, err_len, "waiting for activations from node %s: %s", c->peers[req.peer_id - 1].name, why);
    }
    return rc;
}

// ---- ALLREDUCE -------------------------------------------------------------------
// Two ways to sum n nodes' F32 partials so that every node ends with the
// same bits; the head picks one per comm (client.c, comm_init) and says so
// with TB_ALLREDUCE_RING. What both share (the checks, the partial read
// from the range, the busy state, the sum written back, the counters) is in
// handle_allreduce; only the exchange differs.

// Sends of up to this size go before the matching receive, from this
// thread: each fits the kernel's socket buffers (or one frame of a
// shared-memory or RDMA ring) without the peer reading yet. A decoded
// token's partials (n_embd floats: 28 KiB for Kimi K2) thus skip a thread
// start in the mesh, and a ring step never waits for its neighbour's read.
#define ALLREDUCE_INLINE (32u << 10)

// Mesh: a thread sends our partial to every peer, in node order, while this
// one receives theirs in node order and adds all of them, ours at our
// place, in node order: the same additions on every node, so the same bits.
// Sending and receiving in ascending node order on every node cannot
// deadlock: node 0 is every sender's first target and reads them in turn,
// and so on up. Partials up to ALLREDUCE_INLINE are sent before receiving,
// from this thread; larger ones (prompts) use the thread.
struct reduce_send {
    struct node_conn * c;
    const struct tb_allreduce * req;
    const void * mine;
    int rc;
    char err[256];
};

static void * reduce_send_thread(void * arg) {
    struct reduce_send * s = arg;
    for (uint32_t k = 0; k < s->req->n && s->rc == 0; k++) {
        if (k == s->req->self) continue;
        struct node_peer * p = &s->c->peers[s->req->peer_out[k] - 1];
        if (send_to_peer(p, s->mine, s->req->size) != 0) {
            snprintf(s->err, sizeof s->err, "sending to node %s: %s", p->name, p->tp->error);
            s->rc = -1;
        }
    }
    return NULL;
}

// mine: our partial (a copy); part_buf: room for one peer's; acc: where the sum goes.
static int mesh_allreduce(struct node_conn * c, const struct tb_allreduce * req, const float * mine, float * part_buf,
                          float * acc, char * err, size_t err_len) {
    const size_t size = (size_t) req->size, n_floats = size / sizeof(float);
    struct reduce_send s = { .c = c, .req = req, .mine = mine, .rc = 0 };
    pthread_t sender;
    const bool inline_send = size <= ALLREDUCE_INLINE;
    if (inline_send) {
        reduce_send_thread(&s);
    } else if (pthread_create(&sender, NULL, reduce_send_thread, &s) != 0) {
        snprintf(err, err_len, "ALLREDUCE: cannot start a thread");
        return -1;
    }
    int rc = 0;
    for (uint32_t k = 0; k < req->n && rc == 0; k++) {
        const float * part = mine;
        if (k != req->self) {
            char why[256] = "";
            rc = recv_from_peer(c->peers[req->peer_in[k] - 1].tp, part_buf, req->size, why, sizeof why);
            if (rc != 0) { snprintf(err, err_len, "ALLREDUCE: from node %s: %s", c->peers[req->peer_in[k] - 1].name, why); break; }
            tb_trace_mark(c->trace, TB_TRACE_PEER_DATA, TB_CMD_ALLREDUCE);
            part = part_buf;
        }
        if (k == 0) memcpy(acc, part, size);
        else for (size_t i = 0; i < n_floats; i++) acc[i] += part[i];
    }
    if (!inline_send) pthread_join(sender, NULL);
    if (rc == 0 && s.rc != 0) { snprintf(err, err_len, "ALLREDUCE: %s", s.err); rc = -1; }
    return rc;
}

// Ring (TB_ALLREDUCE_RING): links to the next node and from the previous
// one only, so a ring of cables carries it. The range is cut into n chunks
// (chunk k: floats [k*N/n, (k+1)*N/n), sizes differing by at most one, empty
// ones allowed). Reduce-scatter, n-1 steps: at step s node i sends chunk
// i-s and receives chunk i-s-1, adding its own partial to it; chunk k's
// sum is thus made along the ring from node k on, and after the last step
// node i holds the whole sum of chunk i+1. All-gather, n-1 steps: node i
// sends chunk i+1-s and receives chunk i-s, which replaces its own. Each
// chunk's sum is made on one node and only copied after that, so every
// node ends with the same bits (another order of additions than the mesh's:
// the two modes agree to rounding, not bitwise).
//
// No deadlock, whatever the size: every step is cut into the same number of
// pieces on every node (none larger than ALLREDUCE_INLINE; empty pieces
// still go, as empty frames), and each piece is sent, then the matching one
// received. A send returns once its frame is in the link's buffer, which
// holds at least one piece unread; so a node blocked in a send would need
// its next node to be blocked in a send with a full link too, and so on
// around the ring: each node then has sent at least one piece more than its
// next, which cannot hold all the way round. No sender thread is needed (a
// thread per step would cost more than it saves for a decoded token's 7 KiB
// chunks), and a prompt's large chunks still flow piece by piece on all
// links at once.
struct ring_span { uint64_t first, count; };

static struct ring_span ring_piece(uint64_t n_floats, uint32_t n, uint32_t chunk, uint64_t pieces, uint64_t j) {
    const uint64_t first = chunk * n_floats / n, len = (chunk + 1) * n_floats / n - first;
    return (struct ring_span) { first + j * len / pieces, (j + 1) * len / pieces - j * len / pieces };
}

// A ring node that fails tells its next node why (a PEER_SEND frame flagged
// TB_FLAG_GAVE_UP) before it goes on to its next request: the next node is
// still in this all-reduce, waiting for a piece from it, and would
// otherwise wait for the piece in vain, or take a frame of our next
// all-reduce for it. The next node then gives up too and passes the reason
// on, so every node's error names the first failure (a dead node, say).
// Only where the frame fits without waiting: a link that is not being read
// must not hold us.
static void give_up(struct node_peer * out, const char * why) {
    const size_t len = strlen(why) < TB_GAVE_UP_MAX ? strlen(why) : TB_GAVE_UP_MAX;
    pthread_mutex_lock(&out->lock);
    if (tb_room(out->tp, sizeof(struct tb_header) + len) &&
        tb_msg_send(out->tp, TB_CMD_PEER_SEND, TB_FLAG_GAVE_UP, 0, why, len, NULL, 0) == 0)
        tb_flush(out->tp);
    pthread_mutex_unlock(&out->lock);
}

// acc: our partial on entry, the sum on return; piece: room for one piece.
static int ring_exchange(struct node_conn * c, const struct tb_allreduce * req, float * acc, float * piece,
                         char * err, size_t err_len) {
    const uint32_t n = req->n, self = req->self, next = (self + 1) % n, prev = (self + n - 1) % n;
    const uint64_t n_floats = req->size / sizeof(float);
    const uint64_t biggest = (n_floats + n - 1) / n * sizeof(float);
    const uint64_t pieces = biggest > ALLREDUCE_INLINE ? (biggest + ALLREDUCE_INLINE - 1) / ALLREDUCE_INLINE : 1;
    struct node_peer * out = &c->peers[req->peer_out[next] - 1];
    struct tb_transport * in = c->peers[req->peer_in[prev] - 1].tp;
    for (uint32_t step = 0; step < 2 * (n - 1); step++) {
        const bool gather = step >= n - 1;
        const uint32_t s = gather ? step - (n - 1) : step;
        // reduce-scatter: send i-s, receive i-s-1; all-gather: send i+1-s, receive i-s
        const uint32_t send_chunk = (self + (gather ? 1 : 0) + n - s) % n;
        const uint32_t recv_chunk = (send_chunk + n - 1) % n;
        for (uint64_t j = 0; j < pieces; j++) {
            const struct ring_span snd = ring_piece(n_floats, n, send_chunk, pieces, j);
            const struct ring_span rcv = ring_piece(n_floats, n, recv_chunk, pieces, j);
            if (send_to_peer(out, acc + snd.first, snd.count * sizeof(float)) != 0) {
                snprintf(err, err_len, "ALLREDUCE (ring): sending to node %s: %s", out->name, out->tp->error);
                return -1;
            }
            char why[256] = "";
            float * dst = gather ? acc + rcv.first : piece;   // a gathered chunk is the sum: it replaces ours
            if (recv_from_peer(in, dst, rcv.count * sizeof(float), why, sizeof why) != 0) {
                snprintf(err, err_len, "ALLREDUCE (ring): from node %s: %s", c->peers[req->peer_in[prev] - 1].name, why);
                return -1;
            }
            if (!gather) for (uint64_t i = 0; i < rcv.count; i++) acc[rcv.first + i] += piece[i];
        }
        tb_trace_mark(c->trace, TB_TRACE_PEER_DATA, TB_CMD_ALLREDUCE);
    }
    return 0;
}

static int ring_allreduce(struct node_conn * c, const struct tb_allreduce * req, float * acc, float * piece,
                          char * err, size_t err_len) {
    const int rc = ring_exchange(c, req, acc, piece, err, err_len);
    if (rc != 0) give_up(&c->peers[req->peer_out[(req->self + 1) % req->n] - 1], err);
    return rc;
}

// Peer id `id` names one of this session's links in the direction asked.
static bool allreduce_link_ok(const struct node_conn * c, uint64_t id, bool outgoing) {
    return id != 0 && id <= c->n_peers && c->peers[id - 1].outgoing == outgoing;
}

static int allreduce_check(struct node_conn * c, const struct tb_allreduce * req, char * err, size_t err_len) {
    if (req->n < 2 || req->n > TB_MAX_ALLREDUCE_NODES || req->self >= req->n) {
        snprintf(err, err_len, "ALLREDUCE: node %u of %u (2 to %u nodes)", req->self, req->n, TB_MAX_ALLREDUCE_NODES);
        return -1;
    }
    if (req->type != GGML_TYPE_F32 || req->size % sizeof(float) != 0 || req->size > TB_MAX_PAYLOAD) {
        snprintf(err, err_len, "ALLREDUCE: %llu bytes of type %u (F32 up to the message limit only)",
                 (unsigned long long) req->size, req->type);
        return -1;
    }
    if (req->flags & ~(TB_ALLREDUCE_COMPUTED | TB_ALLREDUCE_RING)) {
        snprintf(err, err_len, "ALLREDUCE: unknown flags 0x%x", req->flags);
        return -1;
    }
    if (req->flags & TB_ALLREDUCE_RING) {   // only the links to the next node and from the previous one
        const uint32_t next = (req->self + 1) % req->n, prev = (req->self + req->n - 1) % req->n;
        if (!allreduce_link_ok(c, req->peer_out[next], true) || !allreduce_link_ok(c, req->peer_in[prev], false)) {
            snprintf(err, err_len, "ALLREDUCE (ring): node %u of %u has no link to the next node %u (peer id %llu) "
                     "or from the previous node %u (peer id %llu)", req->self, req->n, next,
                     (unsigned long long) req->peer_out[next], prev, (unsigned long long) req->peer_in[prev]);
            return -1;
        }
        return 0;
    }
    for (uint32_t k = 0; k < req->n; k++) {
        if (k == req->self) continue;
        if (!allreduce_link_ok(c, req->peer_out[k], true) || !allreduce_link_ok(c, req->peer_in[k], false)) {
            snprintf(err, err_len, "ALLREDUCE: no link to and from node %u (peer ids %llu, %llu)", k,
                     (unsigned long long) req->peer_out[k], (unsigned long long) req->peer_in[k]);
            return -1;
        }
    }
    return 0;
}

// The links an all-reduce receives on wait for peers that compute the same
// layer: their partials come within the imbalance between the nodes, so a
// wait spins rather than sleeps (transport.h, rendezvous). Checked links only.
static void rendezvous(struct node_conn * c, const struct tb_allreduce * req, int on) {
    for (uint32_t k = 0; k < req->n; k++) {
        if (k != req->self && allreduce_link_ok(c, req->peer_in[k], false)) c->peers[req->peer_in[k] - 1].tp->rendezvous = on;
    }
}

int handle_allreduce(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_allreduce req = *(const struct tb_allreduce *) c->payload;
    if (allreduce_check(c, &req, err, err_len) != 0) return -1;
    struct node_buffer * b = checked_range(c, req.handle, req.offset, req.size, err, err_len);
    if (!b) return -1;
    const bool ring = (req.flags & TB_ALLREDUCE_RING) != 0;
    const bool host = ggml_backend_buffer_is_host(b->buf);
    const size_t size = (size_t) req.size, n_floats = size / sizeof(float);
    // Scratch. Mesh: ours, then a peer's, then (for device memory) the sum;
    // in host memory the sum is made in the buffer itself, ours having been
    // copied out. Ring: (for device memory) the sum, then one piece; in host
    // memory the sum is made in the buffer itself, which holds ours.
    const size_t piece = ALLREDUCE_INLINE;
    const size_t need = ring ? (host ? 0 : size) + piece : (host ? 2 : 3) * size;
    if (scratch_reserve(c, need) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
    float * scratch = (float *) c->payload;
    float * mine = ring ? (host ? (float *) (b->base + req.offset) : scratch) : scratch;
    float * acc = host ? (float *) (b->base + req.offset) : ring ? scratch : scratch + 2 * n_floats;
    struct ggml_tensor t = byte_view(b, req.offset, req.size);
    if (!(req.flags & TB_ALLREDUCE_COMPUTED)) memset(mine, 0, size);
    else if (!(ring && host)) ggml_backend_tensor_get(&t, mine, 0, size);
    const int64_t started = tb_now_ns();
    set_busy(c, COMPUTING);   // peers waiting for our partial hear keepalives, as during a graph
    rendezvous(c, &req, 1);
    const int rc = ring ? ring_allreduce(c, &req, acc, (float *) ((uint8_t *) c->payload + (host ? 0 : size)), err, err_len)
                        : mesh_allreduce(c, &req, mine, scratch + n_floats, acc, err, err_len);
    rendezvous(c, &req, 0);
    set_busy(c, IDLE);
    if (rc == 0 && !host) ggml_backend_tensor_set(&t, acc, 0, size);
    count(&c->slot->allreduces, 1);
    count(&c->slot->allreduce_ns, tb_now_ns() - started);
    return rc;
}
