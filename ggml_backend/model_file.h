// model_file.h - model files that both the head and a node have locally.
//
// When llama.cpp loads a GGUF with mmap, the bytes it hands to set_tensor
// point into the mapped file. If the node holds the same file, tbrpc sends
// "read these bytes from your copy" instead of the bytes themselves, so
// hundreds of GB of weights never cross the network. Two pieces live here:
//   - identity: size + a fingerprint of sampled bytes, the same on both sides
//     (and the one `tbrpc doctor` reports);
//   - proof: the head shows it holds the whole file, not just the sampled
//     bytes, by hashing blocks the node picked at random for this session
//     (otherwise a client that knew the samples could read the rest of a
//     node's file through its own buffers);
//   - mapping lookup: which file, and where in it, a head pointer lies.
#pragma once

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

// Where [p, p+len) lies in a file mapped into this process, if it lies
// wholly inside one read-only file mapping. Fills path and the file offset
// of p. Returns 0 when found, -1 otherwise (anonymous memory, no mapping,
// or a platform without a way to ask).
int tb_find_file_mapping(const void * p, size_t len, char * path, size_t path_len, uint64_t * file_offset);

#ifdef __cplusplus
}
#endif
