// model_file.h - model files that both the head and a node have locally.
//
// When llama.cpp loads a GGUF with mmap, the bytes it hands to set_tensor
// point into the mapped file. If the node holds the same file, tbrpc sends
// "read these bytes from your copy" instead of the bytes themselves, so
// hundreds of GB of weights never cross the network. Two pieces live here:
//   - identity: size + a fingerprint of sampled bytes, the same on both sides
//     (the one `tbrpc doctor` reports: cheap, but blind to most bytes);
//   - content hash: a tree SHA-256 of every byte, computed by several threads
//     and cached on disk by (device, inode, size, mtime, ctime), so it is paid
//     once per file on each machine. A node serves a file only when its hash
//     equals the head's;
//   - proof: the head shows it holds the whole file, not just the sampled
//     bytes, by hashing blocks the node picked at random for this session
//     (otherwise a client that knew the samples could read the rest of a
//     node's file through its own buffers);
//   - mapping lookup: which file, and where in it, a head pointer lies.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TB_FINGERPRINT_LEN 16
#define TB_FILE_NAME_LEN   256
#define TB_FILE_NONCE_LEN  16
#define TB_FILE_PROOF_LEN  16
#define TB_FILE_PROOF_BLOCKS 32           // blocks of 4 KiB each proof reads
#define TB_FILE_HASH_LEN   32
#define TB_FILE_HASH_CHUNK (4u << 20)     // leaf size of the hash tree

struct tb_file_identity {
    uint64_t size;
    uint8_t  fingerprint[TB_FINGERPRINT_LEN];
};

// Size and fingerprint of an open file: two FNV-1a-64 streams over the size,
// the first and last MiB and 14 evenly spaced 64 KiB samples in between
// (fast on 50 GB shards; any re-quantisation or truncation changes it).
int tb_file_identity_fd(int fd, struct tb_file_identity * out, char * err, size_t err_len);
int tb_file_identity_path(const char * path, struct tb_file_identity * out, char * err, size_t err_len);

// Proof of holding a file of `size` bytes: a hash of the nonce and of
// TB_FILE_PROOF_BLOCKS 4 KiB blocks at offsets the nonce chooses. Someone who
// lacks a fraction f of the file passes with probability about (1-f)^32.
int tb_file_proof_fd(int fd, uint64_t size, const uint8_t nonce[TB_FILE_NONCE_LEN], uint8_t out[TB_FILE_PROOF_LEN],
                     char * err, size_t err_len);
int tb_file_proof_path(const char * path, uint64_t size, const uint8_t nonce[TB_FILE_NONCE_LEN],
                       uint8_t out[TB_FILE_PROOF_LEN], char * err, size_t err_len);

// The content hash of an open file of `size` bytes: SHA-256 (auth.h) of
// "tbrpc tree-sha256 v1", the size and the chunk size (u64 little-endian),
// then the SHA-256 of each TB_FILE_HASH_CHUNK chunk in order. Chunks are
// hashed by `n_threads` threads (0: one per online CPU, at most 8), each
// reading its own. `stop` (may be NULL), once non-zero, abandons the work.
int tb_file_hash_fd(int fd, uint64_t size, int n_threads, const int * stop, uint8_t out[TB_FILE_HASH_LEN],
                    char * err, size_t err_len);

// The directory content hashes are cached in: $TBRPC_HASH_CACHE, else
// $XDG_CACHE_HOME/tbrpc/hashes, else $HOME/.cache/tbrpc/hashes. Empty when
// none can be named (no cache then).
void tb_hash_cache_dir(char * out, size_t len);

// Whether hashes can be cached in `dir`: created (0700) if missing, then it
// must be a directory of this user that no one else may write to.
bool tb_hash_cache_usable(const char * dir);

// The content hash of an open regular file, from the cache in `cache_dir`
// (NULL or "": no cache) when an entry for the same device, inode, size,
// mtime and ctime is there; otherwise computed (holding flock(LOCK_EX) on
// the file, so two processes hash a file once between them) and written to
// the cache. *computed says which (may be NULL). Only entries this user owns,
// readable by no one else, in a directory only this user can write, are
// believed; see docs/protocol.md, Model files.
int tb_file_hash_cached(int fd, const char * cache_dir, const int * stop, uint8_t out[TB_FILE_HASH_LEN], int * computed,
                        char * err, size_t err_len);
int tb_file_hash_path(const char * path, const char * cache_dir, uint8_t out[TB_FILE_HASH_LEN], int * computed,
                      char * err, size_t err_len);

// Where [p, p+len) lies in a file mapped into this process, if it lies
// wholly inside one read-only file mapping. Fills path and the file offset
// of p. Returns 0 when found, -1 otherwise (anonymous memory, no mapping,
// or a platform without a way to ask).
int tb_find_file_mapping(const void * p, size_t len, char * path, size_t path_len, uint64_t * file_offset);

#ifdef __cplusplus
}
#endif
