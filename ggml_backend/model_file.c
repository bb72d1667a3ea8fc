// model_file.c - file identity and "which file is this pointer in".
#include "model_file.h"
#include "auth.h"
#include "proto.h"

#include <errno.h>
#include <pthread.h>
#include <sys/file.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef __APPLE__
#include <libproc.h>
#include <mach/mach.h>
#include <mach/mach_vm.h>
#endif

#define EDGE_BYTES   (1u << 20)
#define SAMPLE_BYTES (64u << 10)
#define N_SAMPLES    14

// Two lanes of FNV-1a (proto.h) from different starts: 128 bits.
struct fnv2 { uint64_t a, b; };
#define FNV2_START { TB_FNV_OFFSET, 0x84222325cbf29ce4ull }

static void fnv2_add(struct fnv2 * h, const uint8_t * p, size_t n) {
    h->a = tb_fnv1a(h->a, p, n);
    h->b = tb_fnv1a(h->b, p, n);
}

// Hash `len` bytes at `offset` (clipped to the file) into h.
static int hash_range(int fd, uint64_t size, uint64_t offset, uint64_t len, struct fnv2 * h, uint8_t * buf) {
    if (offset >= size) return 0;
    if (len > size - offset) len = size - offset;
    while (len > 0) {
        size_t want = len < EDGE_BYTES ? (size_t) len : EDGE_BYTES;
        ssize_t got = pread(fd, buf, want, (off_t) offset);
        if (got <= 0) return -1;
        fnv2_add(h, buf, (size_t) got);
        offset += (uint64_t) got;
        len -= (uint64_t) got;
    }
    return 0;
}

int tb_file_identity_fd(int fd, struct tb_file_identity * out, char * err, size_t err_len) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, err_len, "not a regular file");
        return -1;
    }
    uint8_t * buf = malloc(EDGE_BYTES);
    if (!buf) { snprintf(err, err_len, "out of memory"); return -1; }
    const uint64_t size = (uint64_t) st.st_size;
    struct fnv2 h = FNV2_START;
    fnv2_add(&h, (const uint8_t *) &size, sizeof size);
    int rc = hash_range(fd, size, 0, EDGE_BYTES, &h, buf);
    for (int i = 1; i <= N_SAMPLES && rc == 0; i++) {
        rc = hash_range(fd, size, size / (N_SAMPLES + 1) * (uint64_t) i, SAMPLE_BYTES, &h, buf);
    }
    if (rc == 0) rc = hash_range(fd, size, size > EDGE_BYTES ? size - EDGE_BYTES : 0, EDGE_BYTES, &h, buf);
    free(buf);
    if (rc != 0) { snprintf(err, err_len, "read failed: %s", strerror(errno)); return -1; }
    out->size = size;
    memcpy(out->fingerprint, &h.a, 8);
    memcpy(out->fingerprint + 8, &h.b, 8);
    return 0;
}

int tb_file_identity_path(const char * path, struct tb_file_identity * out, char * err, size_t err_len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) { snprintf(err, err_len, "%s: %s", path, strerror(errno)); return -1; }
    int rc = tb_file_identity_fd(fd, out, err, err_len);
    close(fd);
    return rc;
}

#define PROOF_BLOCK 4096u

// splitmix64: the block offsets are a pure function of the nonce, so both
// sides read the same blocks.
static uint64_t next_offset_seed(uint64_t * state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int tb_file_proof_fd(int fd, uint64_t size, const uint8_t nonce[TB_FILE_NONCE_LEN], uint8_t out[TB_FILE_PROOF_LEN],
                     char * err, size_t err_len) {
    struct fnv2 h = FNV2_START;
    fnv2_add(&h, nonce, TB_FILE_NONCE_LEN);
    fnv2_add(&h, (const uint8_t *) &size, sizeof size);
    uint64_t state;
    memcpy(&state, nonce, sizeof state);
    uint64_t mix;
    memcpy(&mix, nonce + 8, sizeof mix);
    state ^= next_offset_seed(&mix);
    const uint64_t n_blocks = size / PROOF_BLOCK + (size % PROOF_BLOCK != 0);
    uint8_t buf[PROOF_BLOCK];
    for (int i = 0; i < TB_FILE_PROOF_BLOCKS && n_blocks > 0; i++) {
        const uint64_t offset = next_offset_seed(&state) % n_blocks * PROOF_BLOCK;
        const size_t want = size - offset < PROOF_BLOCK ? (size_t) (size - offset) : PROOF_BLOCK;
        size_t got = 0;
        while (got < want) {
            ssize_t r = pread(fd, buf + got, want - got, (off_t) (offset + got));
            if (r <= 0) {
                snprintf(err, err_len, "read failed: %s", r == 0 ? "the file is shorter than it was" : strerror(errno));
                return -1;
            }
            got += (size_t) r;
        }
        fnv2_add(&h, buf, want);
    }
    memcpy(out, &h.a, 8);
    memcpy(out + 8, &h.b, 8);
    return 0;
}

int tb_file_proof_path(const char * path, uint64_t size, const uint8_t nonce[TB_FILE_NONCE_LEN],
                       uint8_t out[TB_FILE_PROOF_LEN], char * err, size_t err_len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) { snprintf(err, err_len, "%s: %s", path, strerror(errno)); return -1; }
    int rc = tb_file_proof_fd(fd, size, nonce, out, err, err_len);
    close(fd);
    return rc;
}

// ---- the content hash ----------------------------------------------------------

struct hash_job {
    int fd;
    uint64_t size, n_chunks;
    uint8_t (*leaves)[TB_SHA256_LEN];
    const int * stop;
    uint64_t next;           // next chunk to take (atomic)
    int failed;              // errno of the first failed read (atomic), or -1 for "shorter than it was", 0
};

static void * hash_worker(void * arg) {
    struct hash_job * job = arg;
    uint8_t * buf = malloc(TB_FILE_HASH_CHUNK);
    if (!buf) { __atomic_store_n(&job->failed, ENOMEM, __ATOMIC_RELAXED); return NULL; }
    for (;;) {
        if (__atomic_load_n(&job->failed, __ATOMIC_RELAXED) || (job->stop && __atomic_load_n(job->stop, __ATOMIC_RELAXED))) break;
        const uint64_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (i >= job->n_chunks) break;
        const uint64_t offset = i * TB_FILE_HASH_CHUNK;
        const size_t want = job->size - offset < TB_FILE_HASH_CHUNK ? (size_t) (job->size - offset) : TB_FILE_HASH_CHUNK;
        size_t got = 0;
        while (got < want) {
            ssize_t r = pread(job->fd, buf + got, want - got, (off_t) (offset + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) { __atomic_store_n(&job->failed, r == 0 ? -1 : errno, __ATOMIC_RELAXED); break; }
            got += (size_t) r;
        }
        if (got < want) break;
        struct tb_sha256 h;
        tb_sha256_init(&h);
        tb_sha256_update(&h, buf, want);
        tb_sha256_final(&h, job->leaves[i]);
    }
    free(buf);
    return NULL;
}

#define HASH_MAX_THREADS 8
static const char HASH_DOMAIN[] = "tbrpc tree-sha256 v1";

int tb_file_hash_fd(int fd, uint64_t size, int n_threads, const int * stop, uint8_t out[TB_FILE_HASH_LEN],
                    char * err, size_t err_len) {
    if (n_threads <= 0) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = cpus > 0 ? (int) cpus : 1;
    }
    if (n_threads > HASH_MAX_THREADS) n_threads = HASH_MAX_THREADS;
    struct hash_job job = { .fd = fd, .size = size, .n_chunks = size / TB_FILE_HASH_CHUNK + (size % TB_FILE_HASH_CHUNK != 0),
                            .stop = stop };
    if ((uint64_t) n_threads > job.n_chunks) n_threads = job.n_chunks > 0 ? (int) job.n_chunks : 1;
    job.leaves = malloc((size_t) (job.n_chunks ? job.n_chunks : 1) * TB_SHA256_LEN);
    if (!job.leaves) { snprintf(err, err_len, "out of memory for %llu chunk hashes", (unsigned long long) job.n_chunks); return -1; }
    pthread_t threads[HASH_MAX_THREADS];
    int started = 0;
    for (; started < n_threads - 1; started++) {   // this thread is the last worker
        if (pthread_create(&threads[started], NULL, hash_worker, &job) != 0) break;
    }
    hash_worker(&job);
    for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
    const int failed = job.failed;
    if (failed || (stop && __atomic_load_n(stop, __ATOMIC_RELAXED))) {
        snprintf(err, err_len, "%s", failed == -1 ? "the file is shorter than it was" : failed ? strerror(failed) : "stopped");
        free(job.leaves);
        return -1;
    }
    struct tb_sha256 root;
    tb_sha256_init(&root);
    tb_sha256_update(&root, HASH_DOMAIN, sizeof HASH_DOMAIN);
    const uint64_t le[2] = { size, TB_FILE_HASH_CHUNK };   // little-endian hosts only (as the wire)
    tb_sha256_update(&root, le, sizeof le);
    tb_sha256_update(&root, job.leaves, (size_t) job.n_chunks * TB_SHA256_LEN);
    tb_sha256_final(&root, out);
    free(job.leaves);
    return 0;
}

void tb_hash_cache_dir(char * out, size_t len) {
    const char * dir = getenv("TBRPC_HASH_CACHE");
    const char * xdg = getenv("XDG_CACHE_HOME");
    const char * home = getenv("HOME");
    if (dir && *dir) snprintf(out, len, "%s", dir);
    else if (xdg && *xdg == '/') snprintf(out, len, "%s/tbrpc/hashes", xdg);
    else if (home && *home == '/') snprintf(out, len, "%s/.cache/tbrpc/hashes", home);
    else if (len) out[0] = '\0';
}

// One cache entry: a file per (device, inode), replaced whole (rename) when
// the file changes. The check is a SHA-256 of what precedes it: a torn or
// truncated entry is ignored, never believed.
struct hash_entry {
    char     magic[16];
    uint64_t dev, ino, size;
    int64_t  mtime_ns, ctime_ns;
    uint8_t  hash[TB_FILE_HASH_LEN];
    uint8_t  check[TB_SHA256_LEN];
};
static const char ENTRY_MAGIC[16] = "tbrpc-hash-v1";

static void entry_check(const struct hash_entry * e, uint8_t out[TB_SHA256_LEN]) {
    struct tb_sha256 h;
    tb_sha256_init(&h);
    tb_sha256_update(&h, e, offsetof(struct hash_entry, check));
    tb_sha256_final(&h, out);
}

static void entry_key(const struct stat * st, struct hash_entry * e) {
    memset(e, 0, sizeof *e);
    memcpy(e->magic, ENTRY_MAGIC, sizeof e->magic);
    e->dev = (uint64_t) st->st_dev;
    e->ino = (uint64_t) st->st_ino;
    e->size = (uint64_t) st->st_size;
#ifdef __APPLE__
    e->mtime_ns = (int64_t) st->st_mtimespec.tv_sec * 1000000000 + st->st_mtimespec.tv_nsec;
    e->ctime_ns = (int64_t) st->st_ctimespec.tv_sec * 1000000000 + st->st_ctimespec.tv_nsec;
#else
    e->mtime_ns = (int64_t) st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    e->ctime_ns = (int64_t) st->st_ctim.tv_sec * 1000000000 + st->st_ctim.tv_nsec;
#endif
}

// Create `dir` (and its parents) if needed; usable only if it is a directory
// of ours that nobody else may write to (else another user could plant
// entries in it).
bool tb_hash_cache_usable(const char * dir) {
    if (!dir || !*dir) return false;
    char path[4096];
    snprintf(path, sizeof path, "%s", dir);
    for (char * p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        (void) mkdir(path, 0700);
        *p = '/';
    }
    (void) mkdir(path, 0700);
    struct stat st;
    return lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 022) == 0;
}

static void entry_path(const char * dir, const struct hash_entry * key, char * out, size_t len) {
    snprintf(out, len, "%s/%llx-%llx.hash", dir, (unsigned long long) key->dev, (unsigned long long) key->ino);
}

// The cached hash for `key`, if a believable entry is there.
static bool cache_read(const char * dir, const struct hash_entry * key, uint8_t out[TB_FILE_HASH_LEN]) {
    char path[4200];
    entry_path(dir, key, path, sizeof path);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return false;
    struct stat st;
    struct hash_entry e;
    uint8_t check[TB_SHA256_LEN];
    bool ok = fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 077) == 0 &&
              st.st_size == (off_t) sizeof e && pread(fd, &e, sizeof e, 0) == (ssize_t) sizeof e;
    close(fd);
    if (!ok) return false;
    entry_check(&e, check);
    if (!tb_equal_ct(check, e.check, sizeof check) ||
        memcmp(&e, key, offsetof(struct hash_entry, hash)) != 0) return false;   // magic and the whole key
    memcpy(out, e.hash, TB_FILE_HASH_LEN);
    return true;
}

// Write the entry beside its final name, then rename it into place: a reader
// sees the old entry, the new one, or none.
static void cache_write(const char * dir, const struct hash_entry * e) {
    char path[4200], tmp[4300];
    entry_path(dir, e, path, sizeof path);
    uint64_t r = 0;
    (void) tb_random(&r, sizeof r);
    snprintf(tmp, sizeof tmp, "%s.%d.%llx.tmp", path, (int) getpid(), (unsigned long long) r);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return;
    const bool ok = write(fd, e, sizeof *e) == (ssize_t) sizeof *e && fsync(fd) == 0;
    close(fd);
    if (!ok || rename(tmp, path) != 0) unlink(tmp);
}

int tb_file_hash_cached(int fd, const char * cache_dir, const int * stop, uint8_t out[TB_FILE_HASH_LEN], int * computed,
                        char * err, size_t err_len) {
    if (computed) *computed = 0;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) { snprintf(err, err_len, "not a regular file"); return -1; }
    struct hash_entry e;
    entry_key(&st, &e);
    const bool cache = tb_hash_cache_usable(cache_dir);
    if (cache && cache_read(cache_dir, &e, out)) return 0;
    if (flock(fd, LOCK_EX) != 0) { snprintf(err, err_len, "flock: %s", strerror(errno)); return -1; }
    int rc = 0;
    if (!(cache && cache_read(cache_dir, &e, out))) {   // another process may have hashed it while we waited
        rc = tb_file_hash_fd(fd, e.size, 0, stop, e.hash, err, err_len);
        struct hash_entry after;
        if (rc == 0 && (fstat(fd, &st) != 0 || (entry_key(&st, &after), memcmp(&after, &e, offsetof(struct hash_entry, hash)) != 0))) {
            snprintf(err, err_len, "the file changed while it was hashed");
            rc = -1;
        }
        if (rc == 0) {
            memcpy(out, e.hash, TB_FILE_HASH_LEN);
            if (computed) *computed = 1;
            if (cache) { entry_check(&e, e.check); cache_write(cache_dir, &e); }
        }
    }
    flock(fd, LOCK_UN);
    return rc;
}

int tb_file_hash_path(const char * path, const char * cache_dir, uint8_t out[TB_FILE_HASH_LEN], int * computed,
                      char * err, size_t err_len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) { snprintf(err, err_len, "%s: %s", path, strerror(errno)); return -1; }
    int rc = tb_file_hash_cached(fd, cache_dir, NULL, out, computed, err, err_len);
    close(fd);
    return rc;
}

#if defined(__linux__)
// /proc/self/maps: "start-end perms offset dev inode path". Parsing it costs
// ~100 us, paid once per weight tensor at load time only.
int tb_find_file_mapping(const void * p, size_t len, char * path, size_t path_len, uint64_t * file_offset) {
    FILE * f = fopen("/proc/self/maps", "re");
    if (!f) return -1;
    const uintptr_t lo = (uintptr_t) p, hi = lo + len;
    char line[4096 + 256];
    int found = -1;
    while (found != 0 && fgets(line, sizeof line, f)) {
        uintptr_t start = 0, end = 0;
        unsigned long long offset = 0;
        char perms[8] = "", file[4096] = "";
        if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s %llx %*s %*s %4095[^\n]", &start, &end, perms, &offset, file) < 4) continue;
        if (lo < start || hi > end || file[0] != '/') continue;
        snprintf(path, path_len, "%s", file);
        *file_offset = (uint64_t) offset + (uint64_t) (lo - start);
        found = 0;
    }
    fclose(f);
    return found;
}
#elif defined(__APPLE__)
int tb_find_file_mapping(const void * p, size_t len, char * path, size_t path_len, uint64_t * file_offset) {
    mach_vm_address_t address = (mach_vm_address_t) (uintptr_t) p;
    mach_vm_size_t size = 0;
    vm_region_basic_info_data_64_t info;
    mach_msg_type_number_t count = VM_REGION_BASIC_INFO_COUNT_64;
    mach_port_t object = MACH_PORT_NULL;
    if (mach_vm_region(mach_task_self(), &address, &size, VM_REGION_BASIC_INFO_64, (vm_region_info_t) &info, &count, &object) != KERN_SUCCESS)
        return -1;
    const uintptr_t lo = (uintptr_t) p;
    if (address > lo || lo + len > address + size) return -1;
    char buf[PROC_PIDPATHINFO_MAXSIZE];
    if (proc_regionfilename(getpid(), (uint64_t) address, buf, sizeof buf) <= 0) return -1;
    snprintf(path, path_len, "%s", buf);
    *file_offset = (uint64_t) info.offset + (uint64_t) (lo - address);
    return 0;
}
#else
int tb_find_file_mapping(const void * p, size_t len, char * path, size_t path_len, uint64_t * file_offset) {
    (void) p; (void) len; (void) path; (void) path_len; (void) file_offset;
    return -1;
}
#endif
