// node.c - the node server: listens, gives each client a worker (a forked
// or a freshly spawned process, or a thread), keeps per-client counters in
// shared memory for STATUS, and stops cleanly. One client's session is node_session.c.
#include "node_internal.h"
#include "auth.h"
#include "model_file.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <sys/socket.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char ** environ;   // what spawned workers inherit (posix_spawn needs it spelled out)

// ---- logging ----------------------------------------------------------------

void node_log(struct tb_node * node, const char * fmt, ...) {
    char when[32];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&node->lock);
    fprintf(node->log, "%s tbrpc-node %s: ", when, node->name);
    vfprintf(node->log, fmt, ap);
    fputc('\n', node->log);
    fflush(node->log);
    pthread_mutex_unlock(&node->lock);
    va_end(ap);
}

// ---- the client table ---------------------------------------------------------
// Page 0 of the shared table: which slots are in use (written by the parent only).
static int32_t * table_in_use(struct tb_node * n) { return (int32_t *) n->shared; }
// After in_use, page 0 holds the node's id, for spawned workers to answer HELLO with.
static uint8_t * table_node_id(struct tb_node * n) { return n->shared + MAX_CLIENTS * sizeof(int32_t); }
// Page 1 + i: slot i's counters (written by its own server only).
static struct client_slot * slot_counters(struct tb_node * n, int i) {
    return (struct client_slot *) (n->shared + (size_t) (i + 1) * n->page);
}

static int slot_claim(struct tb_node * n, const char * peer) {
    int found = -1;
    pthread_mutex_lock(&n->lock);
    int used = 0;
    for (int i = 0; i < MAX_CLIENTS; i++) used += n->ctl[i].in_use != 0;
    for (int i = 0; i < MAX_CLIENTS && found < 0 && used < n->max_clients; i++) {
        if (!n->ctl[i].in_use) {
            found = i;
            memset(&n->ctl[i], 0, sizeof n->ctl[i]);
            n->ctl[i].in_use = 1;
            snprintf(n->ctl[i].peer, sizeof n->ctl[i].peer, "%s", peer);
            memset(slot_counters(n, i), 0, sizeof(struct client_slot));
            __atomic_store_n(&table_in_use(n)[i], 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&n->lock);
    return found;
}

static void slot_release(struct tb_node * n, int i) {
    pthread_mutex_lock(&n->lock);
    __atomic_store_n(&table_in_use(n)[i], 0, __ATOMIC_RELEASE);
    memset(slot_counters(n, i), 0, sizeof(struct client_slot));
    memset(&n->ctl[i], 0, sizeof n->ctl[i]);
    pthread_mutex_unlock(&n->lock);
}

struct thread_start { struct tb_node * node; int fd; int slot; };

static void * conn_thread(void * arg) {
    struct thread_start st = *(struct thread_start *) arg;
    free(arg);
    node_serve_client(st.node, st.fd, slot_counters(st.node, st.slot));
    slot_release(st.node, st.slot);
    pthread_mutex_lock(&st.node->lock);
    st.node->n_threads--;
    pthread_cond_broadcast(&st.node->conn_done);
    pthread_mutex_unlock(&st.node->lock);
    return NULL;
}

static void start_thread(struct tb_node * n, int fd, int slot) {
    struct thread_start * st = malloc(sizeof *st);
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_mutex_lock(&n->lock);
    n->n_threads++;
    pthread_mutex_unlock(&n->lock);
    if (st) *st = (struct thread_start) { n, fd, slot };
    if (!st || pthread_create(&th, &attr, conn_thread, st) != 0) {
        node_log(n, "cannot start a thread for a new client");
        free(st);
        close(fd);
        slot_release(n, slot);
        pthread_mutex_lock(&n->lock);
        n->n_threads--;
        pthread_mutex_unlock(&n->lock);
    }
    pthread_attr_destroy(&attr);
}

// The worker: a forked copy of the node that serves one client and exits. A
// request that makes ggml abort (an op whose shape contract a hostile client
// broke) ends this process only; the node logs it and serves everyone else.
static int map_worker_view(struct tb_node * n, int fd, int slot, char * err, size_t err_len);

static void start_worker(struct tb_node * n, int fd, int slot) {
    const pid_t parent = getpid();
    pthread_mutex_lock(&n->lock);   // no other thread (the hasher, logging) holds it or the log across fork()
    pid_t pid = fork();
    pthread_mutex_unlock(&n->lock);
    if (pid < 0) {
        node_log(n, "cannot fork a worker for a new client: %s", strerror(errno));
        close(fd);
        slot_release(n, slot);
        return;
    }
    if (pid > 0) {
        n->ctl[slot].pid = pid;
        close(fd);
        return;
    }
    // child: only this thread exists here; never return into the caller (Python)
#ifdef __linux__
    prctl(PR_SET_PDEATHSIG, SIGKILL);   // a worker never outlives its node
    if (getppid() != parent) _exit(1);   // the node died before prctl took effect
#endif
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_IGN);       // Ctrl-C reaches the whole group; the parent ends its workers
    tb_listener_close(n->listener);
    n->listener = NULL;
    close(n->stop_pipe[0]);
    close(n->stop_pipe[1]);
    close(n->parent_pipe[0]);
    close(n->parent_pipe[1]);
    for (int i = 0; i < MAX_REFUSING; i++) if (n->refusing[i].fd >= 0) close(n->refusing[i].fd);
    // The table as a worker sees it: its own counters page writable, the rest
    // read-only, the descriptor closed (the parent's read-write mapping is gone).
    char err[256];
    munmap(n->shared, n->shared_len);
    n->shared = NULL;
    if (map_worker_view(n, n->status_fd, slot, err, sizeof err) != 0) {
        node_log(n, "worker for client %s: %s", n->ctl[slot].peer, err);
        _exit(1);
    }
    node_serve_client(n, fd, slot_counters(n, slot));
    _exit(0);
}

// A fresh process started from worker_argv: what macOS needs, where Metal does
// not survive fork(). It inherits only the client's socket, the status
// mapping and the read end of parent_pipe (everything else is close-on-exec)
// and learns their numbers from its command line.
static void start_spawned_worker(struct tb_node * n, int fd, int slot) {
    char fds[4][16], slot_no[16];
    snprintf(fds[0], sizeof fds[0], "%d", fd);
    snprintf(fds[1], sizeof fds[1], "%d", n->status_fd);
    snprintf(fds[2], sizeof fds[2], "%d", n->parent_pipe[0]);
    snprintf(slot_no, sizeof slot_no, "%d", slot);
    char * tail[] = { "--client-fd", fds[0], "--status-fd", fds[1], "--parent-fd", fds[2], "--slot", slot_no,
                      "--name", n->name, NULL };
    size_t head = 0, n_tail = sizeof tail / sizeof *tail;
    while (n->worker_argv[head]) head++;
    char ** argv = calloc(head + n_tail, sizeof *argv);
    pid_t pid = -1;
    int rc = ENOMEM;
    if (argv) {
        memcpy(argv, n->worker_argv, head * sizeof *argv);
        memcpy(argv + head, tail, n_tail * sizeof *argv);
        rc = posix_spawn(&pid, argv[0], NULL, NULL, argv, environ);
        free(argv);
    }
    close(fd);
    if (rc != 0) {
        node_log(n, "cannot start a worker (%s) for a new client: %s", n->worker_argv[0], strerror(rc));
        slot_release(n, slot);
        return;
    }
    n->ctl[slot].pid = pid;
}

static void peer_name(int fd, char * out, size_t len) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (getpeername(fd, (struct sockaddr *) &ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *) &ss)->sin_addr, host, sizeof host);
            port = ntohs(((struct sockaddr_in *) &ss)->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *) &ss)->sin6_addr, host, sizeof host);
            port = ntohs(((struct sockaddr_in6 *) &ss)->sin6_port);
        }
    }
    snprintf(out, len, "%s:%d", host, port);
}

// A client the node cannot serve hears why: a HELLO reply (id 0: its HELLO
// is not read) with status FULL, so the head raises NodeFullError rather
// than seeing a reset. The connection then stays in `refusing` until the
// head closes it or a second passes, draining what it sent: closing a socket
// with unread bytes would reset it and could lose the reply.
static void refuse_full(struct tb_node * n, int fd) {
    char text[96];
    int len = snprintf(text, sizeof text, "node %s is full (%d clients)", n->name, n->max_clients);
    struct tb_header h = { TB_MAGIC, TB_CMD_HELLO, TB_FLAG_REPLY, 0, sizeof(struct tb_reply_status) + (uint64_t) len };
    struct tb_reply_status st = { TB_STATUS_FULL, 0 };
    uint8_t msg[sizeof h + sizeof st + sizeof text];
    memcpy(msg, &h, sizeof h);
    memcpy(msg + sizeof h, &st, sizeof st);
    memcpy(msg + sizeof h + sizeof st, text, (size_t) len);
    fcntl(fd, F_SETFL, O_NONBLOCK);
    ssize_t sent = send(fd, msg, sizeof h + sizeof st + (size_t) len, MSG_NOSIGNAL);
    (void) sent;
    shutdown(fd, SHUT_WR);
    node_log(n, "refusing a client: %d clients are connected already", n->max_clients);
    for (int i = 0; i < MAX_REFUSING; i++) {
        if (n->refusing[i].fd < 0) { n->refusing[i].fd = fd; n->refusing[i].until = tb_now_ms() + 1000; return; }
    }
    close(fd);   // too many at once: no drain
}

// Read and drop what refused clients send; close each at end of file or its deadline.
// At most 64 KiB per client per pass: one that sends as fast as we read must
// not hold the accept loop (and the stop) until it tires.
static void drain_refused(struct tb_node * n) {
    const int64_t now = tb_now_ms();
    for (int i = 0; i < MAX_REFUSING; i++) {
        const int fd = n->refusing[i].fd;
        if (fd < 0) continue;
        char sink[4096];
        ssize_t got = 0;
        for (int reads = 0; reads < 16 && (got = recv(fd, sink, sizeof sink, 0)) > 0; reads++) {}
        if (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) || now >= n->refusing[i].until) {
            close(fd);
            n->refusing[i].fd = -1;
        }
    }
}

static void start_connection(struct tb_node * n, int fd) {
    char peer[96];
    peer_name(fd, peer, sizeof peer);
    int slot = slot_claim(n, peer);
    if (slot < 0) {
        refuse_full(n, fd);
        return;
    }
    switch (n->serve_mode) {
        case SERVE_FORK:   start_worker(n, fd, slot); break;
        case SERVE_SPAWN:  start_spawned_worker(n, fd, slot); break;
        case SERVE_THREAD: start_thread(n, fd, slot); break;
    }
}

// Collect finished workers; say loudly when one did not end by itself.
static void reap_workers(struct tb_node * n) {
    for (int i = 0; i < MAX_CLIENTS; i++) {
        struct slot_control * slot = &n->ctl[i];
        if (!slot->in_use || slot->pid <= 0) continue;
        int status = 0;
        pid_t pid = waitpid(slot->pid, &status, WNOHANG);
        if (pid < 0 && errno == ECHILD) {   // not ours to wait for any more: nothing left to end
            node_log(n, "worker %d for client %s is gone (already reaped)", (int) slot->pid, slot->peer);
            slot_release(n, i);
            continue;
        }
        if (pid != slot->pid) continue;
        if (WIFSIGNALED(status) && WTERMSIG(status) != SIGTERM) {
            node_log(n, "worker %d for client %s died with signal %d (%s); the node keeps serving other clients",
                     (int) pid, slot->peer, WTERMSIG(status), strsignal(WTERMSIG(status)));
        } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
            node_log(n, "worker %d for client %s exited with status %d", (int) pid, slot->peer, WEXITSTATUS(status));
        }
        slot_release(n, i);
    }
}

static bool has_workers(struct tb_node * n) {
    for (int i = 0; i < MAX_CLIENTS; i++) {
        if (n->ctl[i].in_use && n->ctl[i].pid > 0) return true;
    }
    return false;
}

// SIGTERM every worker; one still there after two seconds (stopped, or
// stuck in a device call) gets SIGKILL. Stopping the node must not hang:
// a worker that outlasts even that (stuck in the kernel) is logged and left.
static void end_workers(struct tb_node * n) {
    for (int sig = SIGTERM, round = 0; has_workers(n) && round < 200; round++) {
        if (round == 0 || round == 40) {
            for (int i = 0; i < MAX_CLIENTS; i++) {
                if (n->ctl[i].in_use && n->ctl[i].pid > 0) { kill(n->ctl[i].pid, sig); kill(n->ctl[i].pid, SIGCONT); }
            }
            sig = SIGKILL;
        }
        reap_workers(n);
        if (has_workers(n)) usleep(50 * 1000);
    }
    for (int i = 0; i < MAX_CLIENTS; i++) {
        if (n->ctl[i].in_use && n->ctl[i].pid > 0)
            node_log(n, "worker %d for client %s did not end after SIGKILL; leaving it", (int) n->ctl[i].pid, n->ctl[i].peer);
    }
}

// ---- node lifecycle ---------------------------------------------------------

static ggml_backend_dev_t pick_device(const char * wanted, char * err, size_t err_len) {
    if (wanted && *wanted) {
        ggml_backend_dev_t d = ggml_backend_dev_by_name(wanted);
        if (!d) {
            int len = snprintf(err, err_len, "no ggml device named '%s'; available:", wanted);
            for (size_t i = 0; i < ggml_backend_dev_count() && len > 0 && (size_t) len < err_len; i++)
                len += snprintf(err + len, err_len - (size_t) len, " %s", ggml_backend_dev_name(ggml_backend_dev_get(i)));
        }
        return d;
    }
    ggml_backend_dev_t d = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    if (!d) d = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_IGPU);
    if (!d) d = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!d) snprintf(err, err_len, "this machine's ggml has no usable device");
    return d;
}

// What a node and a spawned worker both need: log, device, names, model
// directories. The caller owns n (zeroed) and frees it with tb_node_free.
static int node_init(struct tb_node * n, const struct tb_node_config * cfg, char * err, size_t err_len) {
    n->cfg = *cfg;
    n->status_fd = -1;
    n->own_slot = -1;
    n->stop_pipe[0] = n->stop_pipe[1] = n->parent_pipe[0] = n->parent_pipe[1] = -1;
    for (int i = 0; i < MAX_REFUSING; i++) n->refusing[i].fd = -1;
    n->max_clients = cfg->max_clients > 0 && cfg->max_clients < MAX_CLIENTS ? cfg->max_clients : MAX_CLIENTS;
    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->conn_done, NULL);
    n->log = stderr;
    if (cfg->log_path && *cfg->log_path) {
        n->log = fopen(cfg->log_path, "a");
        if (!n->log) { snprintf(err, err_len, "cannot open log file %s: %s", cfg->log_path, strerror(errno)); n->log = stderr; return -1; }
    }
    if (cfg->secret && (cfg->secret_len == 0 || cfg->secret_len > TB_SECRET_MAX)) {
        snprintf(err, err_len, "a secret of %zu bytes: it must have 1 to %d", cfg->secret_len, TB_SECRET_MAX);
        return -1;
    }
    if (cfg->secret) { memcpy(n->secret, cfg->secret, cfg->secret_len); n->secret_len = cfg->secret_len; }
    n->dev = pick_device(cfg->device, err, err_len);
    if (!n->dev) return -1;
    if (cfg->name && *cfg->name) snprintf(n->name, sizeof n->name, "%s", cfg->name);
    snprintf(n->model_dirs, sizeof n->model_dirs, "%s", cfg->model_dirs ? cfg->model_dirs : "");
    tb_hash_cache_dir(n->hash_cache, sizeof n->hash_cache);
    snprintf(n->host, sizeof n->host, "%s", cfg->host ? cfg->host : "");
    n->cfg.host = n->cfg.device = n->cfg.name = n->cfg.log_path = n->cfg.model_dirs = NULL;   // not owned; do not keep
    n->cfg.worker_argv = NULL;
    n->cfg.secret = NULL;   // copied into n->secret
    return 0;
}

// The per-client counters, in shared memory behind a file descriptor that
// workers inherit (forked ones through the mapping, spawned ones by number).
static void table_geometry(struct tb_node * n) {
    long page = sysconf(_SC_PAGESIZE);
    n->page = page > 0 ? (size_t) page : 4096;
    while (n->page < sizeof(struct client_slot) || n->page < MAX_CLIENTS * sizeof(int32_t) + TB_NODE_ID_LEN) n->page *= 2;
    n->shared_len = (MAX_CLIENTS + 1) * n->page;
}

// The node's own view: all of it, read-write.
static int map_table(struct tb_node * n, int fd, char * err, size_t err_len) {
    table_geometry(n);
    n->shared = mmap(NULL, n->shared_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (n->shared == MAP_FAILED) { n->shared = NULL; snprintf(err, err_len, "mmap of the status memory: %s", strerror(errno)); return -1; }
    return 0;
}

// A worker process's view: the whole table read-only (STATUS sums it), its
// own counters page read-write; then the descriptor is closed, so the worker
// cannot map the table writable again.
static int map_worker_view(struct tb_node * n, int fd, int slot, char * err, size_t err_len) {
    table_geometry(n);
    n->own_slot = slot;
    n->shared = mmap(NULL, n->shared_len, PROT_READ, MAP_SHARED, fd, 0);
    if (n->shared == MAP_FAILED) { n->shared = NULL; snprintf(err, err_len, "mmap of the status memory: %s", strerror(errno)); goto fail; }
    void * own = n->shared + (size_t) (slot + 1) * n->page;
    if (mmap(own, n->page, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, (off_t) ((size_t) (slot + 1) * n->page)) != own) {
        snprintf(err, err_len, "mmap of the worker's counters: %s", strerror(errno));
        goto fail;
    }
    close(fd);
    if (fd == n->status_fd) n->status_fd = -1;
    return 0;
fail:
    close(fd);
    if (fd == n->status_fd) n->status_fd = -1;
    return -1;
}

static int create_slots(struct tb_node * n, char * err, size_t err_len) {
    char name[32];
    snprintf(name, sizeof name, "/tbrpc-%d-%lx", (int) getpid(), (unsigned long) ((uintptr_t) n >> 4) & 0xfffffful);
    n->status_fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (n->status_fd < 0) { snprintf(err, err_len, "shm_open: %s", strerror(errno)); return -1; }
    shm_unlink(name);   // only the descriptor keeps it: nothing to clean up after a crash
    fcntl(n->status_fd, F_SETFD, 0);   // shm_open sets close-on-exec; spawned workers need it
    table_geometry(n);
    if (ftruncate(n->status_fd, (off_t) n->shared_len) != 0) {
        snprintf(err, err_len, "ftruncate of the status memory: %s", strerror(errno));
        return -1;
    }
    return map_table(n, n->status_fd, err, err_len);
}

static int copy_worker_argv(struct tb_node * n, const char * const * argv, char * err, size_t err_len) {
    size_t count = 0;
    while (argv[count]) count++;
    n->worker_argv = calloc(count + 1, sizeof *n->worker_argv);
    for (size_t i = 0; n->worker_argv && i < count; i++) {
        n->worker_argv[i] = strdup(argv[i]);
        if (!n->worker_argv[i]) break;
    }
    if (!n->worker_argv || (count && !n->worker_argv[count - 1])) { snprintf(err, err_len, "out of memory"); return -1; }
    return 0;
}

static int serve_mode(const struct tb_node_config * cfg) {
    switch (cfg->isolation) {
        case 0:  return SERVE_THREAD;
        case 1:  return SERVE_FORK;
        case 2:  return SERVE_SPAWN;
        default:
#ifdef __APPLE__
            return cfg->worker_argv && cfg->worker_argv[0] ? SERVE_SPAWN : SERVE_THREAD;
#else
            return SERVE_FORK;
#endif
    }
}

struct tb_node * tb_node_create(const struct tb_node_config * cfg, char * err, size_t err_len) {
    struct tb_node * n = calloc(1, sizeof *n);
    if (!n) { snprintf(err, err_len, "out of memory"); return NULL; }
    n->serve_mode = serve_mode(cfg);
    if (n->serve_mode == SERVE_SPAWN && !(cfg->worker_argv && cfg->worker_argv[0])) {
        snprintf(err, err_len, "spawned workers need a worker command (worker_argv)");
        free(n);
        return NULL;
    }
    if (node_init(n, cfg, err, err_len) != 0 || create_slots(n, err, err_len) != 0) goto fail;
    if (tb_random(n->id, sizeof n->id) != 0) { snprintf(err, err_len, "no random bytes for the node's id"); goto fail; }
    memcpy(table_node_id(n), n->id, sizeof n->id);
    if (n->serve_mode == SERVE_SPAWN && copy_worker_argv(n, cfg->worker_argv, err, err_len) != 0) goto fail;
    n->listener = tb_listen(cfg->host, cfg->port, err, err_len);
    if (!n->listener) goto fail;
    n->port = tb_listener_port(n->listener);
    if (!n->name[0]) snprintf(n->name, sizeof n->name, "%s:%d", n->host[0] ? n->host : "*", n->port);
    if (pipe(n->stop_pipe) != 0 || pipe(n->parent_pipe) != 0) { snprintf(err, err_len, "pipe: %s", strerror(errno)); goto fail; }
    fcntl(n->stop_pipe[1], F_SETFL, O_NONBLOCK);
    // Workers inherit only parent_pipe's read end (and the status memory).
    fcntl(n->stop_pipe[0], F_SETFD, FD_CLOEXEC);
    fcntl(n->stop_pipe[1], F_SETFD, FD_CLOEXEC);
    fcntl(n->parent_pipe[1], F_SETFD, FD_CLOEXEC);
    return n;
fail:
    tb_node_free(n);
    return NULL;
}

// A spawned worker's watch on its node: the node holds parent_pipe's write
// end, so end of file here means the node is gone, and so must we be.
static void * watch_parent(void * arg) {
    const int fd = (int) (intptr_t) arg;
    char c;
    for (;;) {
        ssize_t got = read(fd, &c, 1);
        if (got == 0 || (got < 0 && errno != EINTR)) break;
    }
    _exit(0);
    return NULL;
}

int tb_node_worker_serve(const struct tb_node_config * cfg, int client_fd, int status_fd, int slot, int parent_fd,
                         char * err, size_t err_len) {
    struct tb_node * n = calloc(1, sizeof *n);
    pthread_t watcher;
    if (!n) { snprintf(err, err_len, "out of memory"); close(client_fd); return -1; }
    int rc = -1;
    if (slot < 0 || slot >= MAX_CLIENTS) { snprintf(err, err_len, "slot %d out of range", slot); goto done; }
    if (node_init(n, cfg, err, err_len) != 0) goto done;
    if (map_worker_view(n, status_fd, slot, err, err_len) != 0) { status_fd = -1; goto done; }
    memcpy(n->id, table_node_id(n), sizeof n->id);
    if (pthread_create(&watcher, NULL, watch_parent, (void *) (intptr_t) parent_fd) != 0) {
        snprintf(err, err_len, "cannot watch the node process");
        goto done;
    }
    pthread_detach(watcher);
    signal(SIGINT, SIG_IGN);   // Ctrl-C reaches the whole group; the node ends its workers
    node_serve_client(n, client_fd, slot_counters(n, slot));
    client_fd = -1;
    rc = 0;
done:
    if (client_fd >= 0) close(client_fd);
    if (n->shared) munmap(n->shared, n->shared_len);
    n->shared = NULL;
    tb_node_free(n);
    return rc;
}

int tb_node_port(const struct tb_node * n) { return n->port; }

int tb_node_serve(struct tb_node * n) {
    node_log(n, "serving %s (%s) on port %d", ggml_backend_dev_name(n->dev), ggml_backend_dev_description(n->dev), n->port);
    n->has_hasher = n->model_dirs[0] && pthread_create(&n->hasher, NULL, node_hash_model_files, n) == 0;
    struct pollfd p[2] = { { .fd = tb_listener_fd(n->listener), .events = POLLIN }, { .fd = n->stop_pipe[0], .events = POLLIN } };
    while (!n->stopping) {
        int rc = poll(p, 2, IDLE_POLL_MS);
        reap_workers(n);
        drain_refused(n);
        if (rc < 0 && errno == EINTR) continue;
        if (rc < 0 || (p[1].revents & POLLIN)) break;
        if (p[0].revents & POLLIN) {
            int fd = tb_accept_fd(n->listener);
            if (fd >= 0) start_connection(n, fd);
        }
    }
    n->stopping = 1;
    __atomic_store_n(&n->hasher_stop, 1, __ATOMIC_RELAXED);
    end_workers(n);
    if (n->has_hasher) pthread_join(n->hasher, NULL);
    n->has_hasher = false;
    pthread_mutex_lock(&n->lock);
    while (n->n_threads > 0) pthread_cond_wait(&n->conn_done, &n->lock);
    pthread_mutex_unlock(&n->lock);
    node_log(n, "stopped");
    return 0;
}

void tb_node_stop(struct tb_node * n) {
    n->stopping = 1;
    if (n->stop_pipe[1] >= 0) {
        ssize_t ignored = write(n->stop_pipe[1], "x", 1);
        (void) ignored;
    }
}

void tb_node_get_status(struct tb_node * n, struct tb_status * s) {
    memset(s, 0, sizeof *s);
    size_t free_mem = 0, total_mem = 0;
    ggml_backend_dev_memory(n->dev, &free_mem, &total_mem);
    for (int i = 0; i < MAX_CLIENTS; i++) {
        const struct client_slot * slot = slot_counters(n, i);
        if (!__atomic_load_n(&table_in_use(n)[i], __ATOMIC_ACQUIRE)) continue;
        s->clients++;
        s->buffers += __atomic_load_n(&slot->buffers, __ATOMIC_RELAXED);
        s->bytes_allocated += __atomic_load_n(&slot->bytes_allocated, __ATOMIC_RELAXED);
        s->graphs_computed += __atomic_load_n(&slot->graphs_computed, __ATOMIC_RELAXED);
        s->bytes_received += __atomic_load_n(&slot->bytes_received, __ATOMIC_RELAXED);
        s->bytes_from_files += __atomic_load_n(&slot->bytes_from_files, __ATOMIC_RELAXED);
        s->allreduces += __atomic_load_n(&slot->allreduces, __ATOMIC_RELAXED);
        s->allreduce_ns += __atomic_load_n(&slot->allreduce_ns, __ATOMIC_RELAXED);
    }
    s->mem_free = free_mem;
    s->mem_total = total_mem;
    snprintf(s->device_name, sizeof s->device_name, "%s", ggml_backend_dev_name(n->dev));
}

void tb_node_free(struct tb_node * n) {
    if (!n) return;
    tb_listener_close(n->listener);
    for (int i = 0; i < MAX_REFUSING; i++) if (n->refusing[i].fd > 0) close(n->refusing[i].fd);
    memset(n->secret, 0, sizeof n->secret);
    if (n->stop_pipe[0] >= 0) close(n->stop_pipe[0]);
    if (n->stop_pipe[1] >= 0) close(n->stop_pipe[1]);
    if (n->parent_pipe[0] >= 0) close(n->parent_pipe[0]);
    if (n->parent_pipe[1] >= 0) close(n->parent_pipe[1]);
    if (n->status_fd >= 0) close(n->status_fd);
    for (size_t i = 0; n->worker_argv && n->worker_argv[i]; i++) free(n->worker_argv[i]);
    free(n->worker_argv);
    if (n->log && n->log != stderr) fclose(n->log);
    if (n->shared) munmap(n->shared, n->shared_len);
    pthread_cond_destroy(&n->conn_done);
    pthread_mutex_destroy(&n->lock);
    free(n);
}
