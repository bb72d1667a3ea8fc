// model_file.h - model files that both the head and a node have locally.
//
// When llama.cpp loads a GGUF with mmap, the bytes it hands to set_tensor
// point into the mapped file. If the node holds the same file, tbrpc sends
// "read these bytes from your copy" instead of the bytes themselves, so
// hundreds of GB of weights never cross the network. Two pieces live here:
//   - identity: size + a fingerprint of sampled bytes, the same on both sides
//     (and the one `tbrpc doctor` reports);
//   - mapping lookup: which file, and where in it, a head pointer lies.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TB_FINGERPRINT_LEN 16
#define TB_FILE_NAME_LEN   256

struct tb_file_identity {
    uint64_t size;
    uint8_t  fingerprint[TB_FINGERPRINT_LEN];
};

// Size and fingerprint of an open file: two FNV-1a-64 streams over the size,
// the first and last MiB and 14 evenly spaced 64 KiB samples in between
// (fast on 50 GB shards; any re-quantisation or truncation changes it).
int tb_file_identity_fd(int fd, struct tb_file_identity * out, char * err, size_t err_len);
int tb_file_identity_path(const char * path, struct tb_file_identity * out, char * err, size_t err_len);

// Where [p, p+len) lies in a file mapped into this process, if it lies
// wholly inside one read-only file mapping. Fills path and the file offset
// of p. Returns 0 when found, -1 otherwise (anonymous memory, no mapping,
// or a platform without a way to ask).
int tb_find_file_mapping(const void * p, size_t len, char * path, size_t path_len, uint64_t * file_offset);

#ifdef __cplusplus
}
#endif
