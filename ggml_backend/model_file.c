// model_file.c - file identity and "which file is this pointer in".
#include "model_file.h"
#include "proto.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
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
