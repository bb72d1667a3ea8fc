// node_files.c - a session's reads from the node's own model files: finding a
// file the head names (inside a --model-dir, a regular file, proven held by
// the head: model_file.h), and filling buffer ranges and strided rows from it.
#include "node_session.h"
#include "auth.h"
#include "model_file.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

// A plain "*.gguf" file name: no directories, nothing hidden.
static bool is_model_file_name(const char * name) {
    size_t len = strlen(name);
    return len > 5 && name[0] != '.' && strchr(name, '/') == NULL && strcmp(name + len - 5, ".gguf") == 0;
}

// Whether `real` (a resolved path) lies inside one of the node's model directories.
static bool inside_model_dirs(const struct tb_node * n, const char * real) {
    char dirs[sizeof n->model_dirs];
    snprintf(dirs, sizeof dirs, "%s", n->model_dirs);
    char * save = NULL;
    for (char * dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        char root[PATH_MAX];
        if (!realpath(dir, root)) continue;
        const size_t len = strlen(root);
        if (strncmp(real, root, len) == 0 && (real[len] == '/' || (len == 1 && root[0] == '/'))) return true;
    }
    return false;
}

// Open `dir/name` for reading if it is a regular file whose real path lies
// inside a model directory: a symlink may point to another model directory,
// never elsewhere. Opened without blocking, so a FIFO cannot stall the worker.
// Returns the fd, or -1 with why (empty when there is simply no such file).
static int open_served_file(const struct tb_node * n, const char * dir, const char * name, char * path, size_t path_len,
                            char * why, size_t why_len) {
    why[0] = '\0';
    char given[PATH_MAX];
    snprintf(given, sizeof given, "%s/%s", dir, name);
    if (!realpath(given, path)) return -1;
    if (!inside_model_dirs(n, path)) {
        snprintf(why, why_len, "%s leads to %s, outside the model directories", given, path);
        return -1;
    }
    (void) path_len;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))) {
        snprintf(why, why_len, "%s is not a regular file", path);
        close(fd);
        return -1;
    }
    if (fd >= 0) (void) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

// The node's background pass at start: the content hash of every model file
// in its directories, so that a head's first OPEN_FILE finds it cached (or
// waits on the file's lock for the pass to finish it, instead of hashing it
// a second time). At low priority; abandoned when the node stops.
void * node_hash_model_files(void * arg) {
    struct tb_node * n = arg;
#ifdef __linux__
    (void) setpriority(PRIO_PROCESS, (id_t) syscall(SYS_gettid), 10);   // its hashing threads inherit this
#endif
    if (!tb_hash_cache_usable(n->hash_cache))
        node_log(n, "no usable cache for content hashes (%s): a model file is hashed again for every session that "
                 "opens it; set TBRPC_HASH_CACHE to a directory only this user can write",
                 n->hash_cache[0] ? n->hash_cache : "no TBRPC_HASH_CACHE, XDG_CACHE_HOME or HOME");
    char dirs[sizeof n->model_dirs];
    snprintf(dirs, sizeof dirs, "%s", n->model_dirs);
    char * save = NULL;
    for (char * dir = strtok_r(dirs, ":", &save); dir && !__atomic_load_n(&n->hasher_stop, __ATOMIC_RELAXED);
         dir = strtok_r(NULL, ":", &save)) {
        DIR * d = opendir(dir);
        if (!d) continue;
        for (struct dirent * e; (e = readdir(d)) != NULL && !__atomic_load_n(&n->hasher_stop, __ATOMIC_RELAXED);) {
            if (!is_model_file_name(e->d_name)) continue;
            char path[PATH_MAX], why[PATH_MAX + 128], err[256];
            int fd = open_served_file(n, dir, e->d_name, path, sizeof path, why, sizeof why);
            if (fd < 0) continue;
            uint8_t hash[TB_FILE_HASH_LEN];
            int computed = 0;
            const int64_t started = tb_now_ns();
            if (tb_file_hash_cached(fd, n->hash_cache, &n->hasher_stop, hash, &computed, err, sizeof err) != 0)
                node_log(n, "cannot hash %s: %s", path, err);
            else if (computed)
                node_log(n, "hashed %s in %.1f s (at start)", path, (double) (tb_now_ns() - started) / 1e9);
            close(fd);
        }
        closedir(d);
    }
    return NULL;
}

// Look for the client's file in our model directories; return its id or 0.
// In order of cost: the same size; the head's proof that it holds the whole
// file (32 random blocks for this session's nonce: model_file.h); then the
// same content hash, from the cache or computed here once. The proof comes
// first, so only a head that holds the file can make the node hash it, and
// how long an answer takes tells no one else anything. The hash is what
// makes every byte the same: the proof samples, it does not cover.
static uint64_t open_model_file(struct node_conn * c, const struct tb_open_file * req) {
    for (size_t i = 0; i < c->n_files; i++) {
        if (strcmp(c->files[i].name, req->name) == 0) return i + 1;
    }
    if (c->n_files == MAX_FILES || !c->has_file_nonce) return 0;
    char dirs[sizeof c->node->model_dirs];
    snprintf(dirs, sizeof dirs, "%s", c->node->model_dirs);
    char * save = NULL;
    for (char * dir = strtok_r(dirs, ":", &save); dir; dir = strtok_r(NULL, ":", &save)) {
        char path[PATH_MAX], why[PATH_MAX + 128];
        int fd = open_served_file(c->node, dir, req->name, path, sizeof path, why, sizeof why);
        if (fd < 0) {
            if (why[0]) node_log(c->node, "client %s: refused to serve %s: %s", c->tp->peer, req->name, why);
            continue;
        }
        struct stat st;
        uint8_t proof[TB_FILE_PROOF_LEN], hash[TB_FILE_HASH_LEN];
        char read_err[256];
        const bool same_size = fstat(fd, &st) == 0 && (uint64_t) st.st_size == req->size;
        const bool proven = same_size && tb_file_proof_fd(fd, req->size, c->file_nonce, proof, read_err, sizeof read_err) == 0 &&
                            tb_equal_ct(proof, req->proof, sizeof proof);
        int computed = 0;
        int64_t hashing = 0;
        bool hashed = false;
        if (proven) {
            hashing = tb_now_ns();
            set_busy(c, COMPUTING);   // the head hears keepalives while we hash (once per file: cached)
            hashed = tb_file_hash_cached(fd, c->node->hash_cache, NULL, hash, &computed, read_err, sizeof read_err) == 0;
            set_busy(c, IDLE);
            hashing = tb_now_ns() - hashing;
            if (hashed && computed)
                node_log(c->node, "hashed %s: %llu bytes in %.1f s", path, (unsigned long long) req->size, (double) hashing / 1e9);
            else if (hashed)
                node_log(c->node, "hash of %s from the cache", path);
            else
                node_log(c->node, "client %s: cannot hash %s: %s", c->tp->peer, path, read_err);
        }
        if (hashed && tb_equal_ct(hash, req->content_hash, sizeof hash)) {
            size_t i = c->n_files++;
            c->files[i].fd = fd;
            c->files[i].size = req->size;
            snprintf(c->files[i].name, sizeof c->files[i].name, "%s", req->name);
            node_log(c->node, "client %s: weights of %s come from this node's %s", c->tp->peer, req->name, path);
            return i + 1;
        }
        if (!same_size)
            node_log(c->node, "client %s: %s differs from the head's copy (size); its weights will stream", c->tp->peer, path);
        else if (!proven)
            node_log(c->node, "client %s: %s differs from the head's copy, or the head could not prove it holds the whole "
                     "file (proof); its weights will stream", c->tp->peer, path);
        else if (hashed)
            node_log(c->node, "client %s: %s differs from the head's copy (content hash); its weights will stream",
                     c->tp->peer, path);
        close(fd);
    }
    return 0;
}

// Whether and how fast a file is found must not tell a client which files
// a node holds: every answer takes at least this long.
#define OPEN_FILE_MIN_NS (10 * 1000000ll)

int handle_open_file(struct node_conn * c, const struct tb_header * h, struct reply * r, char * err, size_t err_len) {
    const int64_t started = tb_now_ns();
    struct tb_open_file * req = (struct tb_open_file *) c->payload;
    req->name[TB_FILE_NAME_LEN - 1] = '\0';
    uint64_t id = 0;
    if (!is_model_file_name(req->name)) {
        node_log(c->node, "client %s: refused to open '%s': not a plain *.gguf name", c->tp->peer, req->name);
    } else if (c->node->model_dirs[0]) {
        id = open_model_file(c, req);
    }
    const int64_t left = OPEN_FILE_MIN_NS - (tb_now_ns() - started);
    if (left > 0) {
        struct timespec pause = { .tv_sec = (time_t) (left / 1000000000ll), .tv_nsec = (long) (left % 1000000000ll) };
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {}
    }
    return reply_u64(r, id);
}

// Fill [offset, offset+size) of a buffer from an open model file.
int handle_load_from_file(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_file_range req = *(const struct tb_file_range *) c->payload;
    if (req.file_id == 0 || req.file_id > c->n_files) {
        snprintf(err, err_len, "LOAD_FROM_FILE: unknown file id %llu", (unsigned long long) req.file_id);
        return -1;
    }
    const int fd = c->files[req.file_id - 1].fd;
    const uint64_t file_size = c->files[req.file_id - 1].size;
    if (req.file_offset > file_size || req.size > file_size - req.file_offset) {
        snprintf(err, err_len, "LOAD_FROM_FILE: [%llu, +%llu) lies outside %s (%llu bytes)", (unsigned long long) req.file_offset,
                 (unsigned long long) req.size, c->files[req.file_id - 1].name, (unsigned long long) file_size);
        return -1;
    }
    struct node_buffer * b = checked_range(c, req.handle, req.offset, req.size, err, err_len);
    if (!b) return -1;
    const bool host = ggml_backend_buffer_is_host(b->buf);
    if (!host && scratch_reserve(c, FILE_CHUNK) != 0) {   // device memory: read through the scratch buffer
        snprintf(err, err_len, "out of memory");
        return -1;
    }
    for (uint64_t done = 0; done < req.size;) {
        size_t want = req.size - done < FILE_CHUNK ? (size_t) (req.size - done) : FILE_CHUNK;
        uint8_t * dst = host ? b->base + req.offset + done : c->payload;
        ssize_t got = pread(fd, dst, want, (off_t) (req.file_offset + done));
        if (got <= 0) {
            snprintf(err, err_len, "LOAD_FROM_FILE: reading %s failed: %s", c->files[req.file_id - 1].name,
                     got == 0 ? "file is shorter than it was" : strerror(errno));
            return -1;
        }
        if (!host) {
            struct ggml_tensor t = byte_view(b, req.offset + done, (uint64_t) got);
            ggml_backend_tensor_set(&t, c->payload, 0, (size_t) got);
        }
        done += (uint64_t) got;
    }
    count(&c->slot->bytes_from_files, (int64_t) req.size);
    return 0;
}

// Rows from a model file, read in chunks that cover whole runs of rows (one
// pread of up to FILE_CHUNK, not one per row: a row of a slice may be a few
// hundred bytes).
int handle_load_from_file_2d(struct node_conn * c, const struct tb_header * h, char * err, size_t err_len) {
    const struct tb_file_range_2d req = *(const struct tb_file_range_2d *) c->payload;
    if (req.file_id == 0 || req.file_id > c->n_files) {
        snprintf(err, err_len, "LOAD_FROM_FILE_2D: unknown file id %llu", (unsigned long long) req.file_id);
        return -1;
    }
    struct node_buffer * b = checked_rows(c, req.handle, req.offset, req.size, req.n_copies, req.stride, "LOAD_FROM_FILE_2D",
                                          err, err_len);
    if (!b) return -1;
    if (req.size > FILE_CHUNK) {   // the head sends rows this large one by one (LOAD_FROM_FILE)
        snprintf(err, err_len, "LOAD_FROM_FILE_2D: rows of %llu bytes (at most %u)", (unsigned long long) req.size, FILE_CHUNK);
        return -1;
    }
    const int fd = c->files[req.file_id - 1].fd;
    const uint64_t file_size = c->files[req.file_id - 1].size;
    uint64_t file_span;
    if (req.file_stride < req.size || __builtin_mul_overflow(req.n_copies - 1, req.file_stride, &file_span) ||
        __builtin_add_overflow(file_span, req.size, &file_span) || req.file_offset > file_size ||
        file_span > file_size - req.file_offset) {
        snprintf(err, err_len, "LOAD_FROM_FILE_2D: those rows lie outside %s (%llu bytes)", c->files[req.file_id - 1].name,
                 (unsigned long long) file_size);
        return -1;
    }
    const uint64_t rows_per_read = req.file_stride >= FILE_CHUNK ? 1 : FILE_CHUNK / req.file_stride;
    const size_t chunk = (size_t) ((rows_per_read - 1) * req.file_stride + req.size);
    if (scratch_reserve(c, chunk) != 0) { snprintf(err, err_len, "out of memory"); return -1; }
    for (uint64_t first = 0; first < req.n_copies; first += rows_per_read) {
        const uint64_t rows = req.n_copies - first < rows_per_read ? req.n_copies - first : rows_per_read;
        const size_t want = (size_t) ((rows - 1) * req.file_stride + req.size);
        for (size_t done = 0; done < want;) {
            ssize_t got = pread(fd, c->payload + done, want - done, (off_t) (req.file_offset + first * req.file_stride + done));
            if (got <= 0) {
                snprintf(err, err_len, "LOAD_FROM_FILE_2D: reading %s failed: %s", c->files[req.file_id - 1].name,
                         got == 0 ? "file is shorter than it was" : strerror(errno));
                return -1;
            }
            done += (size_t) got;
        }
        write_rows(b, req.offset + first * req.stride, req.stride, c->payload, req.size, rows, req.file_stride);
    }
    count(&c->slot->bytes_from_files, (int64_t) (req.size * req.n_copies));
    return 0;
}
